// An optimizer that steps another one on the caller's behalf (ZeRO's ZeroRedundancyOptimizer
// steps a local optimizer over its shard). Checkpoints and optimizer-state files describe and
// check the wrapped optimizer through this interface, so they need not know the wrappers.
#pragma once

#include <torch/torch.h>

// Exported by ddp's shared libraries, which hide the rest (src/CMakeLists.txt).
#pragma GCC visibility push(default)

namespace ddp {

class OptimizerWrapper {
 public:
  virtual ~OptimizerWrapper() = default;
  // The optimizer whose kind and options the state has (e.g. the Adam ZeRO steps its shard with).
  virtual const torch::optim::Optimizer& wrapped_optimizer() const = 0;
};

}  // namespace ddp

#pragma GCC visibility pop
