// ZeroRedundancyOptimizer's overlap_with_ddp: hook_with_zero_step and the step of one bucket.
//
// The reducer runs a hook's finish step at the end of backward, bucket by bucket in launch order,
// after waiting for that bucket's reduction (so that the collectives a finish step starts pair
// identically on every rank). The step of bucket k therefore runs while buckets k+1.. are still
// being reduced, and its broadcasts are on the wire while the next buckets are stepped; step()
// only collects them.
#include <unordered_map>

#include <fmt/format.h>

#include "ddp/error.h"
#include "ddp/torch/core/tensor_collectives.h"
#include "ddp/torch/zero/zero_redundancy_optimizer.h"

namespace ddp {

CommHook hook_with_zero_step(CommHook hook, ZeroRedundancyOptimizer& zero) {
  if (!hook) throw ConfigError("ddp::hook_with_zero_step: the comm hook to wrap is empty");
  if (!zero.options().overlap_with_ddp) {
    throw ConfigError(
        "ddp::hook_with_zero_step: the ZeroRedundancyOptimizer was built without overlap_with_ddp; "
        "construct it with ZeroOptions{.overlap_with_ddp = true} (its step() then only waits for "
        "the steps the hook made)");
  }
  return [hook = std::move(hook), zero = &zero](ProcessGroup& group, GradBucket& bucket) {
    if (group.size() != zero->process_group().size() ||
        group.rank() != zero->process_group().rank()) {
      throw ConfigError(fmt::format(
          "ddp::hook_with_zero_step: DDP's group (rank {} of {}) is not the "
          "ZeroRedundancyOptimizer's (rank {} of {}); give both the same group",
          group.rank(), group.size(), zero->process_group().rank(), zero->process_group().size()));
    }
    BucketReduction reduction = hook(group, bucket);
    reduction.finish = [inner = std::move(reduction.finish), zero, params = bucket.parameters,
                        gradients = bucket.gradients] {
      if (inner) inner();  // the bucket holds the average from here on
      zero->step_bucket(params, gradients);
    };
    return reduction;
  };
}

void ZeroRedundancyOptimizer::step_bucket(const std::vector<torch::Tensor>& params,
                                          const std::vector<torch::Tensor>& gradients) {
  torch::NoGradGuard no_grad;
  finish_overlap_broadcasts(/*all=*/false);  // bounds the memory of broadcasts in flight
  std::unordered_map<const void*, std::size_t> index_of;
  for (std::size_t i = 0; i < params_.size(); ++i)
    index_of.emplace(params_[i].unsafeGetTensorImpl(), i);
  const int world = group_->size();
  const int rank = group_->rank();
  std::vector<std::vector<std::size_t>> by_owner(static_cast<std::size_t>(world));
  for (std::size_t k = 0; k < params.size(); ++k) {
    const auto it = index_of.find(params[k].unsafeGetTensorImpl());
    if (it == index_of.end()) {
      throw Error(fmt::format(
          "ddp::hook_with_zero_step: DDP's bucket holds a parameter of shape [{}] that the "
          "ZeroRedundancyOptimizer does not optimize; build it over the DDP model's parameters()",
          fmt::join(params[k].sizes(), ", ")));
    }
    by_owner[static_cast<std::size_t>(owner_[it->second])].push_back(k);
  }

  auto& mine = by_owner[static_cast<std::size_t>(rank)];
  if (!mine.empty()) {
    // Options changed on the full groups (a scheduler's lr) reach the local optimizer.
    for (std::size_t g = 0; g < param_groups_.size(); ++g)
      local_->param_groups()[g].set_options(param_groups_[g].options().clone());
    // The local optimizer steps every parameter that has a gradient: only this bucket's get one
    // for the step (the averaged views), the others' are set aside and put back.
    std::vector<torch::Tensor> set_aside;
    for (auto& group : local_->param_groups()) {
      for (auto& p : group.params()) {
        set_aside.push_back(p.grad());
        p.mutable_grad() = torch::Tensor();
      }
    }
    for (const auto k : mine) {
      auto p = params[k];
      const auto& g = gradients[k];
      p.mutable_grad() = g.scalar_type() == p.scalar_type() ? g.view(p.sizes())
                                                            : g.to(p.scalar_type()).view(p.sizes());
    }
    local_->step();
    std::size_t next = 0;
    for (auto& group : local_->param_groups())
      for (auto& p : group.params())
        p.mutable_grad() = set_aside[next++];
  }

  if (world == 1) {
    overlap_stepped_ = true;
    return;
  }
  for (int owner = 0; owner < world; ++owner) {
    const auto& owned = by_owner[static_cast<std::size_t>(owner)];
    if (owned.empty()) continue;
    std::int64_t numel = 0;
    for (const auto k : owned)
      numel += params[k].numel();
    OverlapBroadcast broadcast;
    const auto dtype = params[owned.front()].scalar_type();
    const auto& first = params[owned.front()];
    if (owned.size() == 1 && first.is_contiguous()) {
      // One parameter: broadcast in place, from the owner's and into the others' (backward is
      // over when finish steps run, so nothing reads it until step() has waited).
      broadcast.buffer = first.detach().view(-1);
    } else if (owner == rank) {
      std::vector<torch::Tensor> flat;
      for (const auto k : owned)
        flat.push_back(params[k].detach().reshape(-1).to(dtype));
      broadcast.buffer = torch::cat(flat);
    } else {
      broadcast.buffer = torch::empty({numel}, first.options().dtype(dtype));
      for (const auto k : owned)
        broadcast.params.push_back(params[k]);
    }
    broadcast.work = broadcast_async(broadcast.buffer, owner, *group_);
    overlap_pending_.push_back(std::move(broadcast));
  }
  overlap_stepped_ = true;
}

void ZeroRedundancyOptimizer::finish_overlap_broadcasts(bool all) {
  torch::NoGradGuard no_grad;
  std::size_t done = 0;
  for (; done < overlap_pending_.size(); ++done) {
    auto& broadcast = overlap_pending_[done];
    if (!all && !broadcast.work->is_completed()) break;
    broadcast.work->wait();
    std::int64_t offset = 0;
    for (auto& p : broadcast.params) {
      p.detach().copy_(broadcast.buffer.narrow(0, offset, p.numel()).view(p.sizes()));
      offset += p.numel();
    }
  }
  overlap_pending_.erase(overlap_pending_.begin(),
                         overlap_pending_.begin() + static_cast<std::ptrdiff_t>(done));
}

}  // namespace ddp
