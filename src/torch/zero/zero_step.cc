// ZeroRedundancyOptimizer: the step: each rank steps the shard it owns, then every shard is
// broadcast from its owner in buckets (laid out by build_buckets); and Join's hooks.
#include <algorithm>
#include <utility>

#include <fmt/format.h>

#include "ddp/error.h"
#include "ddp/torch/zero/zero_redundancy_optimizer.h"
#include "torch/core/wrapper_phase.h"
#include "torch/zero/zero_redundancy_optimizer_internal.h"

namespace ddp {

void ZeroRedundancyOptimizer::build_buckets() {
  torch::NoGradGuard no_grad;
  const auto cap = std::max<std::int64_t>(
      1, static_cast<std::int64_t>(options_.bucket_cap_mb * 1024.0 * 1024.0));
  std::vector<std::pair<torch::ScalarType, std::int64_t>> staging_sizes;  // dtype, elements
  for (int owner = 0; owner < group_->size(); ++owner) {
    // Dtypes in order of first appearance in the shard.
    std::vector<torch::ScalarType> dtypes;
    for (const std::size_t i : shard_order_[static_cast<std::size_t>(owner)]) {
      if (std::find(dtypes.begin(), dtypes.end(), params_[i].scalar_type()) == dtypes.end()) {
        dtypes.push_back(params_[i].scalar_type());
      }
    }
    for (const auto dtype : dtypes) {
      std::vector<torch::Tensor> mine;
      for (const std::size_t i : shard_order_[static_cast<std::size_t>(owner)]) {
        if (params_[i].scalar_type() == dtype) mine.push_back(params_[i]);
      }
      torch::Tensor flat;
      if (options_.parameters_as_bucket_view) {
        std::int64_t total = 0;
        for (const auto& p : mine)
          total += p.numel();
        flat = torch::empty({total}, torch::TensorOptions().dtype(dtype).device(device_));
        std::int64_t offset = 0;
        for (auto& p : mine) {
          auto view = flat.narrow(0, offset, p.numel()).view(p.sizes());
          view.copy_(p.detach());
          p.set_data(view);
          offset += p.numel();
        }
        flat_.push_back(flat);
      }
      const std::int64_t element = static_cast<std::int64_t>(c10::elementSize(dtype));
      std::int64_t offset = 0;
      for (std::size_t i = 0; i < mine.size();) {
        Bucket bucket;
        bucket.owner = owner;
        bucket.dtype = dtype;
        do {
          bucket.params.push_back(mine[i]);
          bucket.numel += mine[i].numel();
          ++i;
        } while (i < mine.size() && (bucket.numel + mine[i].numel()) * element <= cap);
        if (flat.defined()) {
          bucket.direct = flat.narrow(0, offset, bucket.numel);
        } else if (bucket.params.size() == 1 && bucket.params[0].is_contiguous()) {
          bucket.direct = bucket.params[0].detach();
        } else {
          auto it = std::find_if(staging_sizes.begin(), staging_sizes.end(),
                                 [&](const auto& s) { return s.first == dtype; });
          if (it == staging_sizes.end()) {
            staging_sizes.emplace_back(dtype, 0);
            it = staging_sizes.end() - 1;
          }
          it->second = std::max(it->second, bucket.numel);
          bucket.staging = 2 * static_cast<std::size_t>(it - staging_sizes.begin());
        }
        offset += bucket.numel;
        buckets_.push_back(std::move(bucket));
      }
    }
  }
  for (const auto& [dtype, numel] : staging_sizes) {
    for (int copy = 0; copy < 2; ++copy) {
      staging_.push_back(
          torch::empty({numel}, torch::TensorOptions().dtype(dtype).device(device_)));
    }
  }
}

torch::Tensor ZeroRedundancyOptimizer::step(LossClosure closure) {
  if (options_.overlap_with_ddp) {
    if (closure) {
      throw ConfigError(
          "ZeroRedundancyOptimizer with overlap_with_ddp: step() takes no closure (the step ran "
          "in DDP's comm hook during backward)");
    }
    if (join_state()) {
      throw ConfigError(
          "ZeroRedundancyOptimizer with overlap_with_ddp cannot run under ddp::Join (a joined "
          "rank has no backward to step in); construct it without overlap_with_ddp");
    }
    if (!overlap_stepped_) {
      throw ConfigError(
          "ZeroRedundancyOptimizer with overlap_with_ddp: no backward ran hook_with_zero_step "
          "since the last step(); register it on the DDP model (model->register_comm_hook("
          "ddp::hook_with_zero_step(ddp::allreduce_hook(), optimizer))) and run backward first");
    }
    detail::in_phase(
        detail::kZeroCauses, [] { return std::string("shard broadcast of the overlapped step"); },
        [&] { finish_overlap_broadcasts(/*all=*/true); });
    overlap_stepped_ = false;
    return {};
  }
  // A no-op unless this optimizer is the first joinable of a Join (with DDP, DDP's forward
  // announced this rank's step already).
  Join::notify_join_context(*this);
  return step_shard(std::move(closure));
}

torch::Tensor ZeroRedundancyOptimizer::step_shard(LossClosure closure) {
  // Options changed on the full groups (a scheduler's lr) reach the local optimizer.
  for (std::size_t g = 0; g < param_groups_.size(); ++g) {
    local_->param_groups()[g].set_options(param_groups_[g].options().clone());
  }
  torch::Tensor loss = local_->step(std::move(closure));
  detail::in_phase(
      detail::kZeroCauses, [] { return std::string("shard broadcast after step()"); },
      [&] { broadcast_shards(); });
  return loss;
}

// The ranks still training step and broadcast; this joined rank does the same with the gradients
// the shadowed backward left in its parameters (DistributedDataParallel's join_main_hook, which
// runs first), so the shards it owns are updated exactly as if it were still training.
void ZeroRedundancyOptimizer::join_main_hook() {
  step_shard(nullptr);
}

// Every step broadcast every shard, so the parameters agree already.
void ZeroRedundancyOptimizer::join_post_hook(bool /*is_last_joiner*/) {}

std::string ZeroRedundancyOptimizer::join_description() const {
  return fmt::format("ZeroRedundancyOptimizer({}, {} parameters)", kind_, params_.size());
}

// Each bucket is one broadcast from its owner. Buckets that need packing alternate between two
// staging buffers of their dtype: bucket k+1 is packed while bucket k is on the wire, and a
// buffer is reused only once the broadcast that used it has completed (and been unpacked).
void ZeroRedundancyOptimizer::broadcast_shards() {
  torch::NoGradGuard no_grad;
  const int rank = group_->rank();
  struct Pending {
    const Bucket* bucket;
    torch::Tensor buffer;  // the staging slice, or undefined
    std::shared_ptr<Work> work;
  };
  std::vector<Pending> pending;
  std::size_t done = 0;
  std::vector<std::size_t> last_user(staging_.size(), SIZE_MAX);  // slot -> pending index
  std::vector<int> next_copy(staging_.size() / 2 + 1, 0);
  auto finish = [&](std::size_t upto) {
    for (; done < upto; ++done) {
      auto& p = pending[done];
      p.work->wait();
      if (p.buffer.defined() && p.bucket->owner != rank) {
        std::int64_t offset = 0;
        for (const auto& param : p.bucket->params) {
          param.detach().copy_(p.buffer.narrow(0, offset, param.numel()).view(param.sizes()));
          offset += param.numel();
        }
      }
    }
  };
  if (group_->size() == 1) return;
  for (const auto& bucket : buckets_) {
    if (bucket.direct.defined()) {
      pending.push_back({&bucket, {}, broadcast_async(bucket.direct, bucket.owner, *group_)});
      continue;
    }
    const std::size_t slot =
        bucket.staging + static_cast<std::size_t>(next_copy[bucket.staging / 2]);
    next_copy[bucket.staging / 2] ^= 1;
    if (last_user[slot] != SIZE_MAX) finish(last_user[slot] + 1);
    auto buffer = staging_[slot].narrow(0, 0, bucket.numel);
    if (bucket.owner == rank) {
      std::int64_t offset = 0;
      for (const auto& param : bucket.params) {
        buffer.narrow(0, offset, param.numel()).view(param.sizes()).copy_(param.detach());
        offset += param.numel();
      }
    }
    last_user[slot] = pending.size();
    pending.push_back({&bucket, buffer, broadcast_async(buffer, bucket.owner, *group_)});
  }
  finish(pending.size());
}

std::size_t ZeroRedundancyOptimizer::bucket_count() const {
  return buckets_.size();
}

}  // namespace ddp
