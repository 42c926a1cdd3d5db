# Defines the imported target ddp::libtorch.
#
# Looks for libtorch's own CMake package first (Torch_DIR, as shipped in the official archive and
# in the Python wheel). Debian's libtorch-dev ships no TorchConfig.cmake, so otherwise the headers
# and libraries are found where Debian installs them.
include_guard(GLOBAL)

if(TARGET ddp::libtorch)
  return()
endif()

find_package(Torch CONFIG QUIET)
add_library(ddp::libtorch INTERFACE IMPORTED)

if(Torch_FOUND)
  target_link_libraries(ddp::libtorch INTERFACE ${TORCH_LIBRARIES})
  target_include_directories(ddp::libtorch INTERFACE ${TORCH_INCLUDE_DIRS})
  if(TORCH_CXX_FLAGS)
    separate_arguments(_ddp_torch_flags UNIX_COMMAND "${TORCH_CXX_FLAGS}")
    target_compile_options(ddp::libtorch INTERFACE ${_ddp_torch_flags})
  endif()
  set(DDP_TORCH_SOURCE "Torch CMake package (${Torch_DIR})")
else()
  find_path(DDP_TORCH_INCLUDE_DIR NAMES torch/csrc/api/include/torch/torch.h)
  find_library(DDP_TORCH_LIBRARY NAMES torch)
  find_library(DDP_TORCH_CPU_LIBRARY NAMES torch_cpu)
  find_library(DDP_C10_LIBRARY NAMES c10)
  if(NOT DDP_TORCH_INCLUDE_DIR OR NOT DDP_TORCH_LIBRARY OR NOT DDP_C10_LIBRARY)
    message(FATAL_ERROR
      "ddp: libtorch not found. Install Debian's libtorch-dev (scripts/install-deps.sh does), "
      "or point Torch_DIR at the share/cmake/Torch folder of a libtorch archive.")
  endif()
  target_include_directories(ddp::libtorch INTERFACE
    "${DDP_TORCH_INCLUDE_DIR}" "${DDP_TORCH_INCLUDE_DIR}/torch/csrc/api/include")
  target_link_libraries(ddp::libtorch INTERFACE
    "${DDP_TORCH_LIBRARY}" "${DDP_TORCH_CPU_LIBRARY}" "${DDP_C10_LIBRARY}")
  set(DDP_TORCH_SOURCE "system headers (${DDP_TORCH_INCLUDE_DIR})")
endif()
message(STATUS "ddp: libtorch from ${DDP_TORCH_SOURCE}")
