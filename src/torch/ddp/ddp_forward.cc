// DistributedDataParallel: the steps around forward: the parameter check, pre_forward (Join's
// agreement, bucket rebuild, buffer broadcast, mixed precision), post_forward, and the divergence
// guard that compares the ranks' parameters.
#include <cstdint>
#include <cstring>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "ddp/comm/trace.h"
#include "ddp/error.h"
#include "ddp/torch/core/tensor_collectives.h"
#include "ddp/torch/ddp/distributed_data_parallel.h"
#include "torch/api/rank_agreement.h"
#include "torch/core/host_values.h"
#include "torch/core/parameter_loads.h"
#include "torch/core/recomputation.h"
#include "torch/core/wrapper_phase.h"
#include "torch/ddp/distributed_data_parallel_internal.h"

namespace ddp {
namespace {

using detail::collect_trainable;
using detail::in_ddp_phase;
using detail::shape_text;
using detail::storage_of;

// A 64-bit checksum of a tensor's bytes (four independent lanes of xxHash64's round, so the
// multiplications overlap): any changed bit changes it.
std::int64_t checksum(const torch::Tensor& tensor) {
  const torch::Tensor data = tensor.detach().cpu().contiguous();
  const auto* bytes = static_cast<const unsigned char*>(data.data_ptr());
  const std::size_t size = static_cast<std::size_t>(data.numel()) * data.element_size();
  constexpr std::uint64_t kPrime1 = 11400714785074694791ull;
  constexpr std::uint64_t kPrime2 = 14029467366897019727ull;
  const auto round = [](std::uint64_t lane, std::uint64_t word) {
    lane += word * kPrime2;
    lane = (lane << 31) | (lane >> 33);
    return lane * kPrime1;
  };
  std::uint64_t lanes[4] = {kPrime1 + kPrime2, kPrime2, 0, ~kPrime1};
  std::size_t at = 0;
  for (; at + 32 <= size; at += 32) {
    std::uint64_t words[4];
    std::memcpy(words, bytes + at, sizeof words);
    for (int k = 0; k < 4; ++k)
      lanes[k] = round(lanes[k], words[k]);
  }
  std::uint64_t hash = size;
  for (const auto lane : lanes)
    hash = round(hash, lane);
  for (; at < size; ++at)
    hash = round(hash, bytes[at]);
  return static_cast<std::int64_t>(hash);
}

}  // namespace

std::size_t DistributedDataParallelBase::check_parameters() {
  std::vector<torch::Tensor> params;
  std::vector<std::string> names;
  collect_trainable(wrapped_, params, names);
  return reducer_->check_parameters(params, names);
}

void DistributedDataParallelBase::pre_forward() {
  if (detail::in_recomputation()) {
    throw ConfigError(
        "DistributedDataParallel's forward ran again inside the recomputation of a checkpointed "
        "function (ddp::checkpoint): its buffers' broadcast and the reducer's bookkeeping belong "
        "to one forward pass; checkpoint the modules it wraps (apply_activation_checkpointing on "
        "the model before DDP), not DDP itself");
  }
  if (!options_.param_dtype) {
    pre_forward_in_full_precision();
    return;
  }
  // A forward whose backward never ran (or failed) left the parameters cast: the checks below
  // compare the full-precision ones.
  restore_full_precision_parameters();
  pre_forward_in_full_precision();
  cast_parameters_for_forward();
}

void DistributedDataParallelBase::pre_forward_in_full_precision() {
  forward_started_ = std::chrono::steady_clock::now();
  const std::size_t reattached = check_parameters();
  // Only in training mode: evaluation (often on rank 0 alone) must not wait for other ranks.
  if (!is_training()) return;
  // The guard counts only forwards that a synchronised backward may follow: a training-mode
  // forward under NoGradGuard (an evaluation that forgot eval()) communicates no more than before.
  const bool guarded = torch::GradMode::is_enabled() &&
                       options_.divergence_check_every.value_or(0) > 0 && group_->size() > 1;
  const bool loaded_here = guarded && parameters_loaded_since_last_forward(reattached);
  buffers_ = wrapped_.named_buffers().values();  // a load may have replaced some
  const auto& join = join_state();
  if (join && join->options.enable) {
    const int nonjoined = in_ddp_phase([] { return std::string("Join notification"); },
                                       [&] { return Join::notify_join_context(*this); });
    const StepPlan plan = plan_join_step(/*joined=*/false, loaded_here);
    reducer_->set_gradient_scale(join_gradient_scale(*join, nonjoined));
    if (plan.rebuild) reducer_->rebuild_buckets();
    ++training_forwards_;
    // With a rank joined, its parameters are stale by design: compare only while all train.
    if (guarded) {
      ++guarded_forwards_;
      if (nonjoined == group_->size() &&
          (plan.loaded || guarded_forwards_ % *options_.divergence_check_every == 0)) {
        check_divergence_because({});
      }
    }
    if (plan.broadcast_buffers) broadcast_buffers_from(plan.buffer_root);
    return;
  }
  reducer_->set_gradient_scale(1.0);
  if (reducer_->rebuild_due()) reducer_->rebuild_buckets();
  ++training_forwards_;
  // After the forward, once the reducer has accepted the backward to come (a reducer that
  // refuses, after a failed comm hook, says so before this rank joins a collective).
  guard_after_forward_ = guarded;
  loaded_before_forward_ = loaded_here;
  if (options_.broadcast_buffers && !buffers_.empty() && group_->size() > 1) {
    broadcast_buffers_from(0);
  }
}

bool DistributedDataParallelBase::parameters_loaded_since_last_forward(std::size_t reattached) {
  std::vector<torch::Tensor> params;
  std::vector<std::string> names;
  collect_trainable(wrapped_, params, names);
  auto storage = storage_of(params);
  const auto loads = detail::parameters_loaded_count();
  const bool loaded = reattached > 0 || storage != parameter_storage_ || loads != loads_seen_;
  parameter_storage_ = std::move(storage);
  loads_seen_ = loads;
  return loaded;
}

void DistributedDataParallelBase::guard_divergence(bool loaded_here) {
  ++guarded_forwards_;
  // Every rank says whether it loaded: 4 bytes, and the ranks that did are named in the error.
  std::vector<std::int32_t> loaded(static_cast<std::size_t>(group_->size()));
  const std::int32_t mine = loaded_here ? 1 : 0;
  in_ddp_phase(
      [] { return std::string("divergence guard (did any rank load parameters?)"); },
      [&] {
        detail::HostValues(*group_)->allgather(&mine, loaded.data(), 1, DType::kInt32)->wait();
      });
  std::vector<int> loaded_ranks;
  for (int r = 0; r < group_->size(); ++r) {
    if (loaded[static_cast<std::size_t>(r)] != 0) loaded_ranks.push_back(r);
  }
  if (!loaded_ranks.empty() || guarded_forwards_ % *options_.divergence_check_every == 0) {
    check_divergence_because(loaded_ranks);
  }
}

void DistributedDataParallelBase::post_forward(const std::vector<torch::Tensor>& outputs) {
  // As PyTorch: a forward with gradients enabled prepares the synchronised backward, whatever
  // the mode (a backward after an eval-mode forward is averaged too).
  if (torch::GradMode::is_enabled()) {
    reducer_->prepare_for_backward(outputs);
  } else if (options_.param_dtype) {
    restore_full_precision_parameters();  // no backward follows
  }
  if (std::exchange(guard_after_forward_, false)) guard_divergence(loaded_before_forward_);
  const auto finished = std::chrono::steady_clock::now();
  if (is_training()) {
    ++timed_forwards_;
    forward_time_ += finished - forward_started_;
  }
  if (trace_enabled()) {
    trace_complete("forward", "ddp", trace_thread_lane(), trace_clock_ns(forward_started_),
                   trace_clock_ns(finished), {{"training", is_training()}});
  }
}

void DistributedDataParallelBase::broadcast_buffers_from(int root) {
  in_ddp_phase(
      [root] {
        return root == 0 ? std::string("buffer broadcast before forward")
                         : fmt::format("buffer broadcast before forward (from rank {})", root);
      },
      [&] { broadcast_coalesced(*group_, buffers_, root); });
}

void DistributedDataParallelBase::sync_buffers() {
  buffers_ = wrapped_.named_buffers().values();
  if (buffers_.empty() || group_->size() == 1) return;
  in_ddp_phase([] { return std::string("sync_buffers()"); },
               [&] { broadcast_coalesced(*group_, buffers_, /*root=*/0); });
}

void DistributedDataParallelBase::check_divergence_because(const std::vector<int>& loaded_ranks) {
  std::vector<torch::Tensor> params;
  std::vector<std::string> names;
  collect_trainable(wrapped_, params, names);
  std::vector<std::int64_t> mine;
  mine.reserve(params.size());
  for (const auto& p : params)
    mine.push_back(checksum(p));
  const auto world = static_cast<std::size_t>(group_->size());
  std::vector<std::int64_t> all(mine.size() * world);
  in_ddp_phase([] { return std::string("divergence check"); },
               [&] {
                 detail::HostValues(*group_)
                     ->allgather(mine.data(), all.data(), mine.size(), DType::kInt64)
                     ->wait();
               });
  std::size_t differing_params = 0;
  std::size_t first = mine.size();
  std::vector<int> ranks;
  for (std::size_t i = 0; i < mine.size(); ++i) {
    bool differs = false;
    for (std::size_t r = 1; r < world; ++r) {
      if (all[r * mine.size() + i] == all[i]) continue;
      differs = true;
      if (first == mine.size() || first == i) ranks.push_back(static_cast<int>(r));
    }
    if (!differs) continue;
    ++differing_params;
    if (first == mine.size()) first = i;
  }
  if (differing_params == 0) return;
  const std::string when =
      loaded_ranks.empty()
          ? fmt::format("divergence check after {} training forwards", guarded_forwards_)
          : fmt::format(
                "checked because rank(s) {} loaded or replaced parameters since the last "
                "forward",
                fmt::join(loaded_ranks, ", "));
  throw Error(fmt::format(
      "DistributedDataParallel: the ranks' parameters have drifted apart ({}): parameter '{}' {} "
      "differs on rank(s) {} from rank 0's ({} of {} parameters differ). Something changed "
      "parameters on some ranks only: a checkpoint loaded on one rank, an optimizer step skipped "
      "or repeated, a forward or backward outside the wrapper, or a non-deterministic update. "
      "Load checkpoints on every rank (or load before wrapping: the wrapper copies rank 0's "
      "parameters to every rank) and step the optimizer on every rank",
      when, names[first], shape_text(params[first]), fmt::join(ranks, ", "), differing_params,
      mine.size()));
}

}  // namespace ddp
