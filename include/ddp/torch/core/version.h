// Which libtorch ddp::torch was built against.
#pragma once

#include <string>

// Exported by ddp's shared libraries, which hide the rest (src/CMakeLists.txt).
#pragma GCC visibility push(default)
namespace ddp {

// libtorch's version string, e.g. "1.13.1".
std::string libtorch_version();

}  // namespace ddp
#pragma GCC visibility pop
