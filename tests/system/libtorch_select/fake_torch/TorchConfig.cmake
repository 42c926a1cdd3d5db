# A stand-in for a libtorch's TorchConfig.cmake, set by the configure tests (-D...):
#   FAKE_TORCH_VERSION     the version its headers declare
#   FAKE_TORCH_CXX_FLAGS   what it asks users to compile with (the C++ ABI flag)
#   FAKE_TORCH_PREFIX      where its lib/libc10.so is (a library built by the test)
#   FAKE_TORCH_INCLUDE_DIRS  real libtorch headers, for the link probe
string(REPLACE "." ";" _v "${FAKE_TORCH_VERSION}")
list(GET _v 0 _major)
list(GET _v 1 _minor)
list(GET _v 2 _patch)
set(_inc "${CMAKE_CURRENT_BINARY_DIR}/fake_torch_include")
file(WRITE "${_inc}/torch/headeronly/version.h"
     "#define TORCH_VERSION_MAJOR ${_major}\n#define TORCH_VERSION_MINOR ${_minor}\n"
     "#define TORCH_VERSION_PATCH ${_patch}\n")
set(Torch_FOUND TRUE)
set(TORCH_INSTALL_PREFIX "${FAKE_TORCH_PREFIX}")
set(TORCH_INCLUDE_DIRS "${_inc}" ${FAKE_TORCH_INCLUDE_DIRS})
set(TORCH_LIBRARIES "")
set(TORCH_CXX_FLAGS "${FAKE_TORCH_CXX_FLAGS}")
