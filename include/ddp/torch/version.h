// Which libtorch ddp::torch was built against.
#pragma once

#include <string>

namespace ddp {

// libtorch's version string, e.g. "1.13.1".
std::string libtorch_version();

}  // namespace ddp
