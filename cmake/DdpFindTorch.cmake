# Defines the imported target ddp::libtorch, and DDP_LIBTORCH_VERSION.
#
# DDP_LIBTORCH picks which libtorch (scripts/train.sh and scripts/test.sh set it from the
# environment variable of the same name):
#   debian   Debian's libtorch-dev (1.13): its TorchConfig.cmake in the system folders, or, where
#            a libtorch ships none, its headers and libraries where Debian installs them.
#   pytorch  PyTorch's current release from PyPI, in the virtual environment that
#            scripts/install-deps.sh makes (DDP_PYTORCH_VENV), or wherever Torch_DIR points.
# Configuration stops with a named error for another DDP_LIBTORCH, a libtorch version ddp does not
# support, and a libtorch built with the other C++ ABI than ddp's other dependencies.
include_guard(GLOBAL)

if(TARGET ddp::libtorch)
  return()
endif()

set(DDP_LIBTORCH "debian" CACHE STRING "Which libtorch to build against: debian or pytorch")
set_property(CACHE DDP_LIBTORCH PROPERTY STRINGS debian pytorch)
set(DDP_PYTORCH_VENV "/opt/ddp/pytorch-2.15.0-venv" CACHE PATH
    "The PyTorch virtual environment that DDP_LIBTORCH=pytorch builds against")

if(DDP_LIBTORCH STREQUAL "debian")
  # Only the system folders: a Torch_DIR or CMAKE_PREFIX_PATH left pointing at another libtorch
  # must not turn a debian build into a mixed one.
  find_package(Torch CONFIG QUIET NO_CMAKE_PATH NO_CMAKE_ENVIRONMENT_PATH NO_PACKAGE_ROOT_PATH)
elseif(DDP_LIBTORCH STREQUAL "pytorch")
  file(GLOB _ddp_venv_torch_dirs
       "${DDP_PYTORCH_VENV}/lib/python3*/site-packages/torch/share/cmake/Torch")
  set(_ddp_torch_dir "${Torch_DIR}")
  if(NOT EXISTS "${_ddp_torch_dir}/TorchConfig.cmake" AND _ddp_venv_torch_dirs)
    list(GET _ddp_venv_torch_dirs 0 _ddp_torch_dir)
  endif()
  if(EXISTS "${_ddp_torch_dir}/TorchConfig.cmake")
    # TorchConfig.cmake looks for its Caffe2 package and its libraries in the system folders
    # before its own (PATHS, not HINTS): beside Debian's libtorch-dev it would take 1.13's
    # libraries for 2.x's headers. Point each of those searches at its own folder.
    get_filename_component(_ddp_torch_prefix "${_ddp_torch_dir}/../../.." ABSOLUTE)
    set(Caffe2_DIR "${_ddp_torch_prefix}/share/cmake/Caffe2" CACHE PATH "" FORCE)
    foreach(_lib torch c10 c10_cuda kineto)
      string(TOUPPER "${_lib}" _up)
      set(_var ${_lib}_LIBRARY)
      if(_lib STREQUAL "torch" OR _lib STREQUAL "c10_cuda")
        set(_var ${_up}_LIBRARY)
      endif()
      if(EXISTS "${_ddp_torch_prefix}/lib/lib${_lib}.so")
        set(${_var} "${_ddp_torch_prefix}/lib/lib${_lib}.so" CACHE FILEPATH "" FORCE)
      endif()
    endforeach()
  endif()
  # PyPI's libtorch is CUDA-enabled: its Caffe2Config.cmake finds the CUDA toolkit and, without
  # an architecture list, compiles and runs a probe for installed GPUs (which fails where there
  # is none, and under CMake 3.25 fails to configure at all). ddp compiles no CUDA kernels (its
  # CUDA code is host C++ over c10's streams and events, DDP_TORCH_CUDA below), so the list only
  # needs to be valid; 9.0 is Hopper.
  if(NOT DEFINED TORCH_CUDA_ARCH_LIST AND NOT DEFINED ENV{TORCH_CUDA_ARCH_LIST})
    set(TORCH_CUDA_ARCH_LIST "9.0")
  endif()
  find_package(Torch CONFIG QUIET HINTS ${_ddp_venv_torch_dirs} NO_SYSTEM_ENVIRONMENT_PATH
               NO_CMAKE_SYSTEM_PATH NO_CMAKE_SYSTEM_PACKAGE_REGISTRY NO_CMAKE_PACKAGE_REGISTRY)
  if(NOT Torch_FOUND)
    message(FATAL_ERROR
      "ddp: DDP_LIBTORCH=pytorch, but no PyTorch libtorch (TorchConfig.cmake) was found in the "
      "virtual environment ${DDP_PYTORCH_VENV}. Run scripts/install-deps.sh (it installs the pinned "
      "PyTorch there), or set -DDDP_PYTORCH_VENV=<venv> or -DTorch_DIR=<site-packages>/torch/share/"
      "cmake/Torch.")
  endif()
else()
  message(FATAL_ERROR
    "ddp: DDP_LIBTORCH is '${DDP_LIBTORCH}', which names no libtorch ddp knows. Use 'debian' "
    "(Debian's libtorch-dev, the default) or 'pytorch' (PyTorch's release from PyPI, installed by "
    "scripts/install-deps.sh).")
endif()

add_library(ddp::libtorch INTERFACE IMPORTED)
if(Torch_FOUND AND DDP_LIBTORCH STREQUAL "pytorch")
  # Nothing of another libtorch may come in: the libraries must be this one's.
  get_filename_component(_ddp_torch_prefix "${Torch_DIR}/../../.." ABSOLUTE)
  foreach(_file "${TORCH_LIBRARY}" "${c10_LIBRARY}" "${Caffe2_DIR}")
    if(_file AND NOT _file MATCHES "^${_ddp_torch_prefix}/")
      message(FATAL_ERROR
        "ddp: the libtorch in ${_ddp_torch_prefix} resolved a part of itself to ${_file}, outside "
        "its folder (another libtorch on this machine). Remove the build folder's CMakeCache.txt "
        "and configure again; if it persists, set Torch_DIR to ${_ddp_torch_prefix}/share/cmake/"
        "Torch.")
    endif()
  endforeach()
endif()
if(Torch_FOUND AND DDP_LIBTORCH STREQUAL "pytorch")
  # The wheel's CUDA libraries are other wheels (nvidia-*), found at run time through libtorch's
  # RPATH ($ORIGIN/../../nvidia/...), which GNU ld does not expand when it checks libtorch_cuda's
  # own dependencies at link time: it would take the system's older libnccl and fail. And
  # TorchConfig adds the CUDA toolkit's libcudart and libnvrtc (13.0 here) to every link, though
  # ddp calls neither (its CUDA code goes through c10's streams and events and ATen's copies, never
  # the runtime API itself: keep it so); as DT_NEEDED entries they would load instead of the wheel's own (13.2)
  # and run libtorch_cuda against an older runtime than it was built with. --as-needed drops
  # them, so libtorch loads the CUDA it ships.
  get_filename_component(_ddp_site "${Torch_DIR}/../../../.." ABSOLUTE)
  file(GLOB _ddp_nvidia_libs LIST_DIRECTORIES true "${_ddp_site}/nvidia/*/lib")
  string(REPLACE ";" ":" _ddp_nvidia_libs "${_ddp_nvidia_libs}")
  target_link_options(ddp::libtorch INTERFACE "LINKER:--as-needed"
                      "LINKER:-rpath-link,${_ddp_torch_prefix}/lib:${_ddp_nvidia_libs}")
endif()
# libstdc++ before libtorch. PyPI's libtorch.so of PyTorch 2.11 defines and exports its own copy
# of std::filesystem (64 functions), whose remove_all(path, error_code&) calls through a null
# pointer; a program whose calls bind to that copy crashes in them (docs/gpu.md). Two places, for
# the two ways a compiler links libstdc++:
#  - shared (Debian's g++): a link option, so libstdc++.so comes first among the program's
#    NEEDED libraries and every object of the process finds std::filesystem there;
#  - static (the GPU machine's g++ found only libstdc++.a: its test programs had no libstdc++ in
#    NEEDED and bound remove_all to libtorch.so, which the driver's -lstdc++ came after): the same
#    flags as the first of ddp::libtorch's libraries, where the archive's members are pulled in
#    before the linker reaches libtorch.so. An option before the objects pulls nothing.
# Tested by tests/system/libtorch_select (LibstdcxxComesBefore...); scripts/gpu_link_probe.sh
# shows the bindings on the GPU machine.
target_link_options(ddp::libtorch INTERFACE "LINKER:--push-state,--no-as-needed,-lstdc++,--pop-state")
target_link_libraries(ddp::libtorch INTERFACE "-Wl,--push-state,--no-as-needed,-lstdc++,--pop-state")
if(Torch_FOUND)
  # TORCH_LIBRARIES holds the torch target (with TORCH_CXX_FLAGS as its compile options) and,
  # for a CUDA-enabled libtorch, the CUDA libraries that TorchConfig.cmake found.
  target_link_libraries(ddp::libtorch INTERFACE ${TORCH_LIBRARIES})
  target_include_directories(ddp::libtorch INTERFACE ${TORCH_INCLUDE_DIRS})
  set(DDP_TORCH_SOURCE "Torch CMake package (${Torch_DIR})")
  set(_ddp_torch_includes ${TORCH_INCLUDE_DIRS})
  # PyPI's libtorch carries its own fmt headers (12.x; its libraries keep fmt's symbols hidden)
  # in its include folder, ahead of the system's: ddp's sources would then compile against fmt 12
  # and link Debian's libfmt 9 (a missing fmt::join is the mild outcome). A folder holding only
  # the system's fmt, searched first, keeps ddp on the fmt it links.
  list(GET TORCH_INCLUDE_DIRS 0 _ddp_torch_include0)
  if(EXISTS "${_ddp_torch_include0}/fmt/format.h")
    find_package(fmt REQUIRED)
    get_target_property(_ddp_fmt_includes fmt::fmt INTERFACE_INCLUDE_DIRECTORIES)
    find_path(_ddp_fmt_dir NAMES fmt/format.h PATHS ${_ddp_fmt_includes} /usr/include
              NO_DEFAULT_PATH NO_CACHE)
    set(_ddp_fmt_shim "${CMAKE_BINARY_DIR}/ddp_system_fmt")
    file(MAKE_DIRECTORY "${_ddp_fmt_shim}")
    file(CREATE_LINK "${_ddp_fmt_dir}/fmt" "${_ddp_fmt_shim}/fmt" SYMBOLIC)
    target_include_directories(ddp::libtorch BEFORE INTERFACE "${_ddp_fmt_shim}")
  endif()
  find_library(_ddp_c10 NAMES c10 PATHS "${TORCH_INSTALL_PREFIX}/lib" NO_DEFAULT_PATH NO_CACHE)
  if(NOT _ddp_c10)
    find_library(_ddp_c10 NAMES c10 NO_CACHE)
  endif()
else()
  find_path(DDP_TORCH_INCLUDE_DIR NAMES torch/csrc/api/include/torch/torch.h)
  find_library(DDP_TORCH_LIBRARY NAMES torch)
  find_library(DDP_TORCH_CPU_LIBRARY NAMES torch_cpu)
  find_library(DDP_C10_LIBRARY NAMES c10)
  if(NOT DDP_TORCH_INCLUDE_DIR OR NOT DDP_TORCH_LIBRARY OR NOT DDP_C10_LIBRARY)
    message(FATAL_ERROR
      "ddp: libtorch not found. Install Debian's libtorch-dev (scripts/install-deps.sh does), "
      "or build with DDP_LIBTORCH=pytorch.")
  endif()
  set(_ddp_torch_includes
      "${DDP_TORCH_INCLUDE_DIR}" "${DDP_TORCH_INCLUDE_DIR}/torch/csrc/api/include")
  target_include_directories(ddp::libtorch INTERFACE ${_ddp_torch_includes})
  target_link_libraries(ddp::libtorch INTERFACE
    "${DDP_TORCH_LIBRARY}" "${DDP_TORCH_CPU_LIBRARY}" "${DDP_C10_LIBRARY}")
  set(DDP_TORCH_SOURCE "system headers (${DDP_TORCH_INCLUDE_DIR})")
  set(_ddp_c10 "${DDP_C10_LIBRARY}")
endif()

# DDP_TORCH_CUDA: the torch layer's CUDA sources (streams, events, pinned host twins; see
# src/torch/core/device_staging.h) are compiled when this libtorch has CUDA: its TorchConfig then lists
# the CUDA libraries (libc10_cuda among them) in TORCH_CUDA_LIBRARIES, or defines torch_cuda.
set(DDP_TORCH_CUDA OFF)
if(Torch_FOUND AND (TORCH_CUDA_LIBRARIES OR TARGET torch_cuda))
  set(DDP_TORCH_CUDA ON)
endif()

# The version, from the headers (what the code is compiled against).
# 2.x keeps the numbers in torch/headeronly/version.h, which torch/version.h includes.
find_file(_ddp_torch_version_h NAMES torch/headeronly/version.h torch/version.h
          PATHS ${_ddp_torch_includes} NO_DEFAULT_PATH NO_CACHE)
if(NOT _ddp_torch_version_h)
  message(FATAL_ERROR "ddp: found libtorch (${DDP_TORCH_SOURCE}) but not its torch/version.h "
                      "in ${_ddp_torch_includes}; the installation is incomplete")
endif()
file(STRINGS "${_ddp_torch_version_h}" _ddp_v REGEX "#define TORCH_VERSION_(MAJOR|MINOR|PATCH) ")
string(REGEX REPLACE ".*MAJOR ([0-9]+).*MINOR ([0-9]+).*PATCH ([0-9]+).*" "\\1.\\2.\\3"
       DDP_LIBTORCH_VERSION "${_ddp_v}")
# 1.13: Debian's. 2.1 and later 2.x: Tensor::register_post_accumulate_grad_hook exists (the
# reducer's gradient-ready hook); tested with 2.15 (scripts/pytorch-env.sh pins the release).
if(NOT DDP_LIBTORCH_VERSION MATCHES "^(1\\.13|2\\.([1-9]|[1-9][0-9]))\\.")
  message(FATAL_ERROR
    "ddp: libtorch ${DDP_LIBTORCH_VERSION} (${DDP_TORCH_SOURCE}) is not supported, ddp builds "
    "against libtorch 1.13 (Debian's libtorch-dev) and 2.1 or later 2.x (tested: 2.15). Select one "
    "with DDP_LIBTORCH=debian|pytorch, or point Torch_DIR at a supported libtorch.")
endif()

# The C++ ABI: ddp's other dependencies (fmt, GoogleTest, OpenSSL's users...) are Debian's, built
# with the C++11 ABI, so a libtorch built with the old one (_GLIBCXX_USE_CXX11_ABI=0, older
# PyPI wheels and archives) can't be mixed in: its std::string is another type. Read from the
# flags that libtorch asks its users to compile with, and, as TorchConfig's flags may be absent,
# proven by linking a call that passes a std::string into libc10.
set(_ddp_abi "")
if(TORCH_CXX_FLAGS MATCHES "_GLIBCXX_USE_CXX11_ABI=([01])")
  set(_ddp_abi ${CMAKE_MATCH_1})
endif()
if(_ddp_abi STREQUAL "0")
  message(FATAL_ERROR
    "ddp: libtorch ${DDP_LIBTORCH_VERSION} (${DDP_TORCH_SOURCE}) was built with the pre-C++11 "
    "ABI (its TORCH_CXX_FLAGS say -D_GLIBCXX_USE_CXX11_ABI=0), but ddp and its dependencies use "
    "the C++11 ABI (=1). Use a libtorch built with the C++11 ABI: PyPI's torch wheels from 2.7 on, "
    "the 'cxx11 ABI' libtorch archive, or Debian's libtorch-dev (DDP_LIBTORCH=debian|pytorch).")
endif()
# Cached per library file, so that pointing an existing build folder at another libtorch checks again.
string(MD5 _ddp_abi_key "${_ddp_c10}")
set(_ddp_abi_ok DDP_LIBTORCH_ABI_OK_${_ddp_abi_key})
if(_ddp_c10 AND NOT DEFINED CACHE{${_ddp_abi_ok}})
  include(CheckCXXSourceCompiles)
  set(CMAKE_REQUIRED_INCLUDES ${_ddp_torch_includes})
  set(CMAKE_REQUIRED_LIBRARIES ${_ddp_c10})
  set(CMAKE_REQUIRED_QUIET ON)
  check_cxx_source_compiles([[
    #include <c10/core/Device.h>
    #include <string>
    int main() { return c10::Device(std::string("cpu")).is_cpu() ? 0 : 1; }
  ]] ${_ddp_abi_ok})
  unset(CMAKE_REQUIRED_INCLUDES)
  unset(CMAKE_REQUIRED_LIBRARIES)
  unset(CMAKE_REQUIRED_QUIET)
endif()
if(_ddp_c10 AND NOT ${_ddp_abi_ok})
  unset(${_ddp_abi_ok} CACHE)  # try again after a fix
  message(FATAL_ERROR
    "ddp: a program passing a std::string to libtorch ${DDP_LIBTORCH_VERSION} (${_ddp_c10}) "
    "does not link with the C++11 ABI that ddp and its dependencies use: that libtorch was built "
    "with the other C++ ABI (_GLIBCXX_USE_CXX11_ABI=0). Use a libtorch built with the C++11 ABI "
    "(PyPI's torch wheels from 2.7 on, the 'cxx11 ABI' archive, Debian's libtorch-dev).")
endif()
message(STATUS "ddp: libtorch ${DDP_LIBTORCH_VERSION} (DDP_LIBTORCH=${DDP_LIBTORCH}) from "
               "${DDP_TORCH_SOURCE}")
if(DDP_TORCH_CUDA)
  message(STATUS "ddp: torch layer with CUDA (libtorch ${DDP_LIBTORCH_VERSION} has it)")
else()
  message(STATUS "ddp: torch layer without CUDA (libtorch ${DDP_LIBTORCH_VERSION} has none)")
endif()
