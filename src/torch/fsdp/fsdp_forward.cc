// FullyShardedDataParallel: forward: gathering (unsharding) and freeing the units' full
// parameters, and dropping what a failed backward left.
#include <fmt/format.h>

#include "ddp/error.h"
#include "ddp/torch/fsdp/fully_sharded_data_parallel.h"
#include "torch/core/recomputation.h"
#include "torch/core/wrapper_phase.h"
#include "torch/fsdp/fsdp_flat_memory.h"
#include "torch/fsdp/fsdp_unit.h"

namespace ddp {

void FullyShardedDataParallelImpl::start_gather(std::size_t unit) {
  if (options_.sharding_strategy == ShardingStrategy::kNoShard) return;
  auto& u = *units_[unit];
  if (u.state != Unit::State::kFree) return;
  if (!detail::fsdp_storage_allocated(u.full)) detail::allocate_fsdp_storage(u.full);
  // param_dtype: the shard is cast before it travels (half the bytes), and kept until gathered.
  // cpu_offload: copied to the device first (from pinned memory, ordered on the current stream,
  // which the collective follows).
  u.gather_source = u.shard.detach();
  if (offloads_shards()) u.gather_source = u.gather_source.to(device_, /*non_blocking=*/true);
  if (low_precision_parameters()) u.gather_source = u.gather_source.to(compute_dtype());
  u.gather = all_gather_into_tensor_async(u.full, u.gather_source, *shard_group_);
  u.state = Unit::State::kGathering;
  ++all_gather_count_;
}

void FullyShardedDataParallelImpl::wait_gather(std::size_t unit) {
  auto& u = *units_[unit];
  if (u.state != Unit::State::kGathering) return;
  detail::in_phase(
      detail::kFsdpCauses,
      [&] { return fmt::format("parameter all-gather of unit {} of {}", unit + 1, units_.size()); },
      [&] { u.gather->wait(); });
  u.gather.reset();
  u.gather_source = torch::Tensor();
  u.state = Unit::State::kGathered;
}

void FullyShardedDataParallelImpl::free_full(std::size_t unit) {
  wait_gather(unit);
  auto& u = *units_[unit];
  detail::release_fsdp_storage(u.full);
  u.state = Unit::State::kFree;
}

torch::Tensor FullyShardedDataParallelImpl::cast_tensor_input(const torch::Tensor& input) const {
  if (low_precision_parameters() && input.defined() && input.is_floating_point()) {
    return input.to(compute_dtype());
  }
  return input;
}

void FullyShardedDataParallelImpl::throw_not_a(const char* type_name) const {
  throw ConfigError(fmt::format(
      "FullyShardedDataParallel::forward_as<{}>: the wrapped module is a {}; name its own type",
      c10::demangle(type_name), wrapped_->name()));
}

// A backward that threw inside autograd (out of memory, a hook that failed) never ran
// finish_backward: the units' ready counts and reductions are stale, so the next backward would
// reduce none of those units and leave their gradients undefined. That pass is dropped here, before
// anything is gathered: its in-flight reductions are waited for (on every rank that failed alike
// they complete; a rank that did not fail is left waiting, which the group's timeout names), and
// its partial gradients freed. What it may already have added to a shard's .grad() is marked: a
// reduction that would add to it unchanged is refused by name (harvest_reduction), so the partial
// pass is never silently part of a step; zero the gradients and it is gone. Gradients accumulated
// under no_sync() are lost with it: that is an error here, once, naming what to redo.
void FullyShardedDataParallelImpl::drop_unfinished_backward() {
  if (!finish_queued_) return;
  finish_queued_ = false;
  torch::NoGradGuard no_grad;
  bool lost_accumulation = false;
  for (std::size_t unit = 0; unit < units_.size(); ++unit) {
    auto& u = *units_[unit];
    if (u.reduction) {
      detail::in_phase(
          detail::kFsdpCauses,
          [&] {
            return fmt::format(
                "gradient reduce-scatter of unit {} of {} (of a backward that failed)", unit + 1,
                units_.size());
          },
          [&] { u.reduction->wait(); });
    }
    lost_accumulation = lost_accumulation || u.holds_accumulation;
    u.holds_accumulation = false;
    u.reduction.reset();
    u.reduction_input = torch::Tensor();
    u.reduction_output = torch::Tensor();
    u.ready = 0;
    u.reduced = false;
    u.grad_ready.clear();
    u.reduced_params = 0;
    for (auto& p : u.params)
      p.mutable_grad().reset();
    const auto& grad = u.shard.grad();
    u.grad_at_failure = grad.defined() ? grad.unsafeGetTensorImpl() : nullptr;
    u.grad_version_at_failure = grad.defined() ? grad._version() : 0;
    if (frees_full_parameters()) free_full(unit);
  }
  forget_own_reductions();
  if (lost_accumulation) {
    throw Error(
        "FullyShardedDataParallel: the last backward failed before it finished, and the gradients "
        "accumulated under no_sync() went with it; start this step's accumulation again (zero the "
        "gradients first)");
  }
}

void FullyShardedDataParallelImpl::begin_forward(bool tensor_forward) {
  if (detail::in_recomputation()) {
    throw ConfigError(
        "FullyShardedDataParallel's forward ran again inside the recomputation of a "
        "checkpointed function (ddp::checkpoint): its gathers and gradient bookkeeping belong to "
        "one forward pass; checkpoint the modules it wraps (apply_activation_checkpointing on "
        "the model before FSDP), not FSDP itself");
  }
  drop_unfinished_backward();
  if (!shadowing_ && join_state()) {
    if (!tensor_forward) {
      throw ConfigError(
          "FullyShardedDataParallel under ddp::Join runs forward(Tensor) only (a joined rank "
          "replays it with an empty batch); forward_as cannot be replayed");
    }
    check_join_setup();
    Join::notify_join_context(*this);  // this rank trains in this step (a no-op unless first)
  }
  release_free_heap();  // the optimizer step's temporaries, before the units are gathered
  const bool sharded = options_.sharding_strategy != ShardingStrategy::kNoShard;
  // The optimizer may have changed the shards since the last gather: gather at every forward.
  if (sharded) {
    for (std::size_t u = 0; u < units_.size(); ++u) {
      wait_gather(u);
      units_[u]->state = Unit::State::kFree;
    }
  } else if (low_precision_parameters()) {
    torch::NoGradGuard no_grad;
    for (auto& unit : units_)
      unit->full.copy_(unit->shard.detach());  // kNoShard's "gather": the cast master
  }
  if (module_.is_empty() && !units_.empty()) {
    start_gather(0);
    wait_gather(0);
  }
}

void FullyShardedDataParallelImpl::end_forward(const std::vector<torch::Tensor>& outputs) {
  if (units_.empty()) return;
  if (torch::GradMode::is_enabled()) {
    for (const auto& output : outputs) {
      if (output.defined() && output.requires_grad()) {
        auto hooked = output;  // register_hook is not const in libtorch 1.13
        hooked.register_hook([this](const torch::Tensor&) { before_unit_backward(0); });
      }
    }
  }
  if (frees_full_parameters()) free_full(0);
}

torch::Tensor FullyShardedDataParallelImpl::forward(torch::Tensor input) {
  if (input.defined()) {
    last_input_sizes_ = input.sizes().vec();
    last_input_dtype_ = input.scalar_type();
    last_input_device_ = input.device();
  }
  if (module_.is_empty() && !tensor_forward_) {
    throw ConfigError(
        fmt::format("FullyShardedDataParallel::forward(Tensor): the wrapped {} was given as a "
                    "std::shared_ptr<torch::nn::Module>, so its forward is unknown; call "
                    "forward_as<ItsImplType>(args...), or wrap the module's holder",
                    wrapped_->name()));
  }
  begin_forward(/*tensor_forward=*/true);
  input = cast_tensor_input(input);
  if (module_.is_empty()) {
    auto output = tensor_forward_(input);
    end_forward({output});
    return output;
  }
  const bool build_graph = torch::GradMode::is_enabled();
  torch::Tensor x = std::move(input);
  std::ptrdiff_t current = -1;
  for (std::size_t c = 0; c < module_->size(); ++c) {
    if (unit_starting_at_[c] >= 0) {
      current = unit_starting_at_[c];
      const auto u = static_cast<std::size_t>(current);
      start_gather(u);
      wait_gather(u);
      // Overlaps this unit's compute (low_memory_backward: one unit's parameters at a time).
      if (u + 1 < units_.size() && !options_.low_memory_backward) start_gather(u + 1);
    }
    x = (module_->begin() + static_cast<std::ptrdiff_t>(c))->forward(x);
    if (current >= 0 && units_[static_cast<std::size_t>(current)]->end == c + 1) {
      const auto u = static_cast<std::size_t>(current);
      if (build_graph && x.requires_grad()) {
        x.register_hook([this, u](const torch::Tensor&) { before_unit_backward(u); });
      }
      if (frees_full_parameters()) free_full(u);
      current = -1;
    }
  }
  return x;
}

}  // namespace ddp
