// FullyShardedDataParallel with low_memory_backward: each parameter's gradient reduced (to the
// ranks whose shards its span of the flat buffer touches) and freed as soon as it is ready, so
// backward never holds a unit's flat gradient.
#include <algorithm>
#include <cstdint>

#include <fmt/format.h>

#include "ddp/torch/fsdp/fully_sharded_data_parallel.h"
#include "torch/core/wrapper_phase.h"
#include "torch/fsdp/fsdp_flat_memory.h"
#include "torch/fsdp/fsdp_unit.h"

namespace ddp {

bool FullyShardedDataParallelImpl::reduces_each_gradient(const Unit& u) const {
  return options_.low_memory_backward && sync_gradients_ && !u.reduction_input.defined();
}

void FullyShardedDataParallelImpl::reduce_ready_parameters(std::size_t unit, bool finishing) {
  torch::NoGradGuard no_grad;
  auto& u = *units_[unit];
  if (u.reduced) return;
  if (u.grad_ready.empty()) u.grad_ready.assign(u.params.size(), false);
  const bool sharded = options_.sharding_strategy != ShardingStrategy::kNoShard;
  if (u.reduced_params == 0) {
    // Where the sums go: straight into the shard's .grad() where it exists and takes them as they
    // are (no shard-sized buffer beside it), else a shard-sized buffer handed over at the end.
    u.adds_into_shard_grad = u.shard.grad().defined() && !replicate_group_ &&
                             reduce_dtype() == storage_dtype_ && !offloads_shards();
    if (u.adds_into_shard_grad) check_gradient_after_failure(unit);
  }
  if (!u.adds_into_shard_grad && !u.reduction_output.defined()) {
    u.reduction_output = detail::fsdp_flat_zeros(sharded ? u.shard_numel : u.padded, reduce_dtype(),
                                                 device_, detail::FlatBufferKind::kShardSized);
  }
  // A fixed order, the same on every rank whatever order autograd produced the gradients in:
  // the collectives of different ranks must pair up. Last parameter first is backward's order.
  const std::size_t n = u.params.size();
  while (u.reduced_params < n) {
    const std::size_t param = n - 1 - u.reduced_params;
    if (!finishing && !u.grad_ready[param]) return;
    reduce_parameter_gradient(u, unit, param);
    ++u.reduced_params;
  }
  u.reduced = true;
  if (frees_full_parameters()) free_full(unit);
  if (u.adds_into_shard_grad) {
    u.holds_accumulation = false;
    return;
  }
  harvest_reduction(unit);  // the replicas' all-reduce (kHybridShard) and the shard's .grad()
}

torch::Tensor FullyShardedDataParallelImpl::reduced_slot(Unit& u, std::int64_t at,
                                                         std::int64_t count) {
  return (u.adds_into_shard_grad ? u.shard.mutable_grad() : u.reduction_output)
      .narrow(0, at, count);
}

void FullyShardedDataParallelImpl::hand_over_sum(Unit& u, torch::Tensor& sum, std::int64_t at) {
  auto slot = reduced_slot(u, at, sum.numel());
  if (!u.adds_into_shard_grad) {
    slot.copy_(sum);
    return;
  }
  // harvest_reduction's average (the sum / W, then added), element by element the same.
  sum.div_(static_cast<double>(group_->size()));
  slot.add_(sum);
}

void FullyShardedDataParallelImpl::reduce_parameter_gradient(Unit& u, std::size_t unit,
                                                             std::size_t param) {
  auto& p = u.params[param];
  const std::int64_t numel = p.numel();
  if (numel == 0) return;
  // Missing (unused in this pass): zeros, so that every rank makes the same collectives.
  torch::Tensor flat =
      p.grad().defined()
          ? p.grad().reshape(-1)
          : torch::zeros({numel}, torch::TensorOptions().dtype(compute_dtype()).device(device_));
  p.mutable_grad().reset();  // `flat` is the last reference: freed when this parameter is done
  if (flat.scalar_type() != reduce_dtype()) flat = flat.to(reduce_dtype());
  if (detail::is_16_bit(reduce_dtype())) {
    flat.div_(static_cast<double>(detail::gradient_predivide_factor(group_->size())));
  }
  const auto describe = [&] {
    return fmt::format("gradient reduction of parameter {} of {} of unit {} of {}", param + 1,
                       u.params.size(), unit + 1, units_.size());
  };
  const std::int64_t begin = u.offsets[param];
  if (options_.sharding_strategy == ShardingStrategy::kNoShard) {
    detail::in_phase(detail::kFsdpCauses, describe,
                     [&] { all_reduce(flat, ReduceOp::kSum, *group_); });
    hand_over_sum(u, flat, begin);
    return;
  }
  // Each owner's part of the span gets its sum (a reduce to that rank, in place): what the unit's
  // reduce-scatter would have given it, with no buffer beyond the gradient itself.
  const std::int64_t shard = u.shard_numel;
  const std::int64_t end = begin + numel;
  const int me = shard_group_->rank();
  for (std::int64_t owner = begin / shard; owner * shard < end; ++owner) {
    const std::int64_t from = std::max(begin, owner * shard);
    const std::int64_t to = std::min(end, (owner + 1) * shard);
    auto part = flat.narrow(0, from - begin, to - from);
    detail::in_phase(detail::kFsdpCauses, describe,
                     [&] { reduce(part, static_cast<int>(owner), ReduceOp::kSum, *shard_group_); });
    if (owner == me) hand_over_sum(u, part, from - owner * shard);
  }
}

}  // namespace ddp
