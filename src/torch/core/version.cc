#include "ddp/torch/core/version.h"

#include <torch/version.h>

namespace ddp {

std::string libtorch_version() {
  return TORCH_VERSION;
}

}  // namespace ddp
