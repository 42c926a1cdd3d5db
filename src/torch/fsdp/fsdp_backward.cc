// FullyShardedDataParallel: backward: the flat gradients, their reduce-scatter (all-reduce for
// NO_SHARD) into the shards' .grad(), the end of backward, and no_sync.
#include <fmt/format.h>

#include "ddp/error.h"
#include "ddp/torch/fsdp/fully_sharded_data_parallel.h"
#include "torch/core/libtorch_compat.h"
#include "torch/core/wrapper_phase.h"
#include "torch/fsdp/fsdp_flat_memory.h"
#include "torch/fsdp/fsdp_unit.h"

namespace ddp {

void FullyShardedDataParallelImpl::queue_finish_backward() {
  if (finish_queued_) return;
  finish_queued_ = true;
  libtorch_compat::at_end_of_backward([this] { finish_backward(); });
}

void FullyShardedDataParallelImpl::attach_flat_gradient(Unit& u) const {
  torch::NoGradGuard no_grad;
  u.reduction_input = flat_zeros(u.padded, compute_dtype());
  for (std::size_t i = 0; i < u.params.size(); ++i) {
    auto& p = u.params[i];
    auto view = u.reduction_input.narrow(0, u.offsets[i], p.numel()).view(p.sizes());
    if (p.grad().defined()) view.copy_(p.grad());
    p.mutable_grad() = view;
  }
}

void FullyShardedDataParallelImpl::before_unit_backward(std::size_t unit) {
  queue_finish_backward();
  auto& u = *units_[unit];
  if (!u.reduced && !u.reduction_input.defined() && !reduces_each_gradient(u)) {
    // The unit's gradients accumulate in place into views of one flat buffer (autograd adds into
    // a defined .grad), which is then reduced as it is: no copy, and no full-size gradient
    // allocated per parameter.
    attach_flat_gradient(u);
  }
  if (!frees_full_parameters()) return;
  start_gather(unit);
  wait_gather(unit);
  // Overlaps this unit's backward (low_memory_backward: one unit's parameters at a time).
  if (unit > 0 && !options_.low_memory_backward) start_gather(unit - 1);
}

void FullyShardedDataParallelImpl::on_grad_ready(std::size_t unit, std::size_t param) {
  queue_finish_backward();
  auto& u = *units_[unit];
  ++u.ready;
  if (reduces_each_gradient(u)) {
    if (u.grad_ready.empty()) u.grad_ready.assign(u.params.size(), false);
    u.grad_ready[param] = true;
    reduce_ready_parameters(unit, /*finishing=*/false);
    return;
  }
  if (u.ready == u.params.size()) reduce_gradients(unit);
}

void FullyShardedDataParallelImpl::reduce_gradients(std::size_t unit) {
  torch::NoGradGuard no_grad;
  auto& u = *units_[unit];
  if (u.reduced) return;
  if (reduces_each_gradient(u)) {
    reduce_ready_parameters(unit, /*finishing=*/true);
    return;
  }
  u.reduced = true;
  if (!sync_gradients_) {
    // no_sync: the gradients stay in the unit's flat buffer, whose views are the parameters'
    // .grad(), so the next passes accumulate into it and the first synced one reduces the sum.
    if (!u.reduction_input.defined()) attach_flat_gradient(u);
    if (frees_full_parameters()) free_full(unit);
    return;
  }
  const bool in_place = u.reduction_input.defined();
  // No hook ran before the unit.
  if (!in_place) u.reduction_input = flat_zeros(u.padded, compute_dtype());
  for (std::size_t i = 0; i < u.params.size(); ++i) {
    auto& p = u.params[i];
    const auto& grad = p.grad();
    if (!grad.defined()) continue;  // unused in this pass: zero
    auto slot = u.reduction_input.narrow(0, u.offsets[i], p.numel());
    // Autograd may have replaced the view (e.g. a gradient of another layout): copy it then.
    if (!in_place || grad.data_ptr() != slot.data_ptr()) slot.copy_(grad.reshape(-1));
    p.mutable_grad().reset();  // the full gradient is not kept
  }
  if (reduce_dtype() != compute_dtype()) {
    auto converted = flat_zeros(u.padded, reduce_dtype());
    converted.copy_(u.reduction_input);
    u.reduction_input = converted;
  }
  if (detail::is_16_bit(reduce_dtype())) {
    u.reduction_input.div_(static_cast<double>(detail::gradient_predivide_factor(group_->size())));
  }
  if (options_.sharding_strategy == ShardingStrategy::kNoShard) {
    u.reduction_output = u.reduction_input;
    u.reduction = all_reduce_async(u.reduction_input, ReduceOp::kSum, *group_);
  } else {
    // Mapped, as the flat buffers: freed at once when harvested (after the first backward).
    u.reduction_output = detail::fsdp_flat_zeros(u.shard_numel, reduce_dtype(), device_,
                                                 detail::FlatBufferKind::kShardSized);
    u.reduction = reduce_scatter_tensor_async(u.reduction_output, u.reduction_input, ReduceOp::kSum,
                                              *shard_group_);
  }
  if (frees_full_parameters()) free_full(unit);
  // Bound the memory of gradients in flight: every reduction that has completed hands its result
  // to its shard now (freeing its full flat gradient), and only the newest kReductionsInFlight
  // stay outstanding, so backward holds one unit's full gradient in flight while the next unit
  // computes (waiting only at the end would keep every unit's until then).
  // kHybridShard's harvest is itself a collective (the replicas' all-reduce, blocking): it must
  // run at the same point of backward on every rank, never when a reduction happens to have
  // completed. Otherwise it lands between other groups' collectives (a tensor-parallel layer's
  // backward all-reduce) in a different order on different ranks, and ranks blocked in one group
  // wait for ranks blocked in the other (seen: FSDP over dp 4 x tp 2, 1 run in 6).
  auto& queue = *in_flight_;  // the whole tree's
  queue.push_back({this, unit});
  for (auto it = queue.begin(); it != queue.end();) {
    auto* owner = it->wrapper;
    const bool done =
        !owner->replicate_group_ && owner->units_[it->unit]->reduction->is_completed();
    if (done || queue.size() > kReductionsInFlight) {
      const std::size_t harvested = it->unit;
      it = queue.erase(it);
      owner->harvest_reduction(harvested);
    } else {
      ++it;
    }
  }
}

void FullyShardedDataParallelImpl::harvest_own_reductions() {
  auto& queue = *in_flight_;
  for (auto it = queue.begin(); it != queue.end();) {
    if (it->wrapper != this) {
      ++it;
      continue;
    }
    const std::size_t unit = it->unit;
    it = queue.erase(it);
    harvest_reduction(unit);
  }
}

void FullyShardedDataParallelImpl::forget_own_reductions() {
  std::erase_if(*in_flight_, [this](const PendingReduction& p) { return p.wrapper == this; });
}

void FullyShardedDataParallelImpl::harvest_reduction(std::size_t unit) {
  torch::NoGradGuard no_grad;
  auto& u = *units_[unit];
  detail::in_phase(
      detail::kFsdpCauses,
      [&] {
        return fmt::format("gradient reduce-scatter of unit {} of {}", unit + 1, units_.size());
      },
      [&] {
        if (u.reduction) u.reduction->wait();  // none: low_memory_backward reduced synchronously
        // kHybridShard: the shard group's sum, summed over the replicas of this shard.
        if (replicate_group_) all_reduce(u.reduction_output, ReduceOp::kSum, *replicate_group_);
      });
  // The shard's gradient is in the parameters' dtype whatever the reduction's: the upcast, then
  // the rest of the average (a 16-bit sum was pre-divided).
  torch::Tensor average = u.reduction_output;
  auto divisor = static_cast<double>(group_->size());
  if (detail::is_16_bit(average.scalar_type())) {
    divisor /= static_cast<double>(detail::gradient_predivide_factor(group_->size()));
    average = average.to(storage_dtype_);
  }
  if (divisor != 1.0) average.div_(divisor);
  // cpu_offload: only the shard's averaged gradient leaves the device, to the host shard's .grad().
  if (offloads_shards()) average = average.to(torch::kCPU);
  check_gradient_after_failure(unit);
  auto& grad = u.shard.mutable_grad();
  if (grad.defined()) {
    grad.add_(average);
  } else {
    grad = average;
  }
  u.reduction.reset();
  u.reduction_input = torch::Tensor();
  u.reduction_output = torch::Tensor();
  u.holds_accumulation = false;
}

void FullyShardedDataParallelImpl::check_gradient_after_failure(std::size_t unit) {
  auto& u = *units_[unit];
  if (u.grad_at_failure == nullptr) return;
  const auto& grad = u.shard.grad();
  const bool unchanged = grad.defined() && grad.unsafeGetTensorImpl() == u.grad_at_failure &&
                         grad._version() == u.grad_version_at_failure;
  u.grad_at_failure = nullptr;
  if (unchanged) {
    throw Error(fmt::format(
        "FullyShardedDataParallel: unit {} of {}: its shard's gradient has not changed since a "
        "backward failed before it finished, so it may hold part of that backward; zero the "
        "gradients (optimizer.zero_grad()) after a failed step, then run the step again",
        unit + 1, units_.size()));
  }
}

void FullyShardedDataParallelImpl::finish_backward() {
  if (!finish_queued_) return;
  // A unit some of whose parameters got no gradient in this pass is reduced now (the missing
  // gradients count as zero), in unit order on every rank. Units no gradient reached are left.
  for (std::size_t u = 0; u < units_.size(); ++u) {
    if (units_[u]->ready > 0) reduce_gradients(u);
  }
  harvest_own_reductions();
  for (auto& unit : units_) {
    unit->ready = 0;
    unit->reduced = false;
    unit->grad_ready.clear();
    unit->reduced_params = 0;
    unit->holds_accumulation = unit->reduction_input.defined();  // no_sync's, for the next pass
  }
  if (frees_full_parameters()) {
    for (std::size_t u = 0; u < units_.size(); ++u)
      free_full(u);
  }
  finish_queued_ = false;
  release_free_heap();
}

FsdpNoSyncGuard FullyShardedDataParallelImpl::no_sync() {
  std::vector<std::pair<FullyShardedDataParallelImpl*, bool>> previous;
  for (auto* wrapper : tree()) {
    previous.emplace_back(wrapper, wrapper->sync_gradients_);
    wrapper->sync_gradients_ = false;
  }
  return FsdpNoSyncGuard([previous = std::move(previous)] {
    for (const auto& [wrapper, sync] : previous)
      wrapper->sync_gradients_ = sync;
  });
}

}  // namespace ddp
