// One unit of FullyShardedDataParallel: its children, flat buffers, shard and backward state.
// Internal to ddp_torch (fully_sharded_data_parallel.cc, the phases in fsdp_sharding.cc,
// fsdp_forward.cc, fsdp_backward.cc and fsdp_full_params.cc, and fsdp_sharded_checkpoint.cc).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include <torch/torch.h>

#include "ddp/comm/work.h"
#include "ddp/torch/fsdp/fully_sharded_data_parallel.h"
#include "torch/core/libtorch_compat.h"

namespace ddp {

struct FullyShardedDataParallelImpl::Unit {
  enum class State { kFree, kGathering, kGathered };
  std::size_t begin = 0, end = 0;
  std::vector<torch::Tensor> params;  // the wrapped module's parameters, in flat order
  std::vector<std::int64_t> offsets;  // of each parameter in the flat buffer
  std::int64_t numel = 0, padded = 0, shard_numel = 0;
  torch::Tensor full;   // the padded flat buffer the parameters are views of (in param_dtype)
  torch::Tensor shard;  // this rank's fp32 leaf (fp32 kNoShard: `full` itself)
  State state = State::kGathered;
  std::shared_ptr<Work> gather;
  torch::Tensor gather_source;  // what the all-gather in flight sends (the shard, or its cast)
  std::vector<std::unique_ptr<libtorch_compat::GradReadyHook>> hooks;
  std::size_t ready = 0;  // parameters whose gradient arrived in this backward pass
  // low_memory_backward: which parameters' gradients arrived in this pass, and how many have been
  // reduced (they are reduced last parameter first, the order backward produces them in).
  std::vector<bool> grad_ready;
  std::size_t reduced_params = 0;
  // low_memory_backward: this pass adds each parameter's average straight into the shard's .grad().
  bool adds_into_shard_grad = false;
  bool reduced = false;
  std::shared_ptr<Work> reduction;
  torch::Tensor reduction_input, reduction_output;
  // Whether reduction_input holds gradients of finished no_sync() passes (kept for the next
  // synchronised one).
  bool holds_accumulation = false;
  // The shard's .grad() when a failed backward was dropped (it may hold part of that pass), and
  // its version then: a reduction may not add to it unchanged.
  const c10::TensorImpl* grad_at_failure = nullptr;
  std::int64_t grad_version_at_failure = 0;
};

namespace detail {

// bf16 and fp16: the 16-bit dtypes FSDP may compute and reduce in (fp32 is the other).
inline bool is_16_bit(torch::ScalarType dtype) {
  return dtype == torch::kBFloat16 || dtype == torch::kHalf;
}

// PyTorch FSDP's gradient_predivide_factor (DefaultState._get_gradient_predivide_factor): doubled
// while it divides the world and is below world/factor. A low-precision sum is divided by it
// before it is reduced (exact: a power of two) and by world/factor after, in fp32, so that the
// sum does not leave fp16's range.
inline std::int64_t gradient_predivide_factor(std::int64_t world) {
  std::int64_t factor = 1;
  while (world % factor == 0 && world / factor > factor)
    factor *= 2;
  return factor;
}

}  // namespace detail

}  // namespace ddp
