// Private to ZeroRedundancyOptimizer's sources (zero_redundancy_optimizer.cc, zero_step.cc,
// zero_state_dict.cc): its broadcast bucket.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include <torch/torch.h>

#include "ddp/torch/zero/zero_redundancy_optimizer.h"

namespace ddp {

// Parameters of one owner and one dtype broadcast together: a slice of the owner's flat buffer
// (parameters_as_bucket_view), a parameter broadcast in place, or several packed into staging.
struct ZeroRedundancyOptimizer::Bucket {
  int owner = 0;
  torch::ScalarType dtype = torch::kFloat;
  std::vector<torch::Tensor> params;
  std::int64_t numel = 0;
  torch::Tensor direct;     // defined: broadcast this tensor itself (no packing)
  std::size_t staging = 0;  // else: index of the first of this dtype's two staging buffers
};

}  // namespace ddp
