// FullyShardedDataParallel: the whole model at once: summon_full_params, clip_grad_norm_ over
// every shard, and the full state dict gathered on one rank.
#include <algorithm>
#include <cmath>
#include <unordered_map>
#include <unordered_set>

#include <fmt/format.h>

#include "ddp/error.h"
#include "ddp/torch/fsdp/fully_sharded_data_parallel.h"
#include "torch/fsdp/fsdp_unit.h"

namespace ddp {

void FullyShardedDataParallelImpl::summon_full_params(const std::function<void()>& body,
                                                      bool writeback) {
  const auto wrappers = tree();
  for (auto* wrapper : wrappers) {
    if (writeback && wrapper->low_precision_parameters()) {
      throw ConfigError(
          "FullyShardedDataParallel::summon_full_params: writeback with a 16-bit param_dtype would "
          "round the fp32 shards; summon without writeback, or change the shards (parameters())");
    }
    if (wrapper->finish_queued_) {
      throw ConfigError(
          "FullyShardedDataParallel::summon_full_params inside a backward pass, or after one that "
          "failed before it finished; call it between steps (after a failed backward, once a "
          "forward has dropped what it left)");
    }
  }
  // Everything gathered, as forward's first gather would (the shards may have changed).
  for (auto* wrapper : wrappers) {
    for (std::size_t u = 0; u < wrapper->units_.size(); ++u) {
      if (wrapper->options_.sharding_strategy == ShardingStrategy::kNoShard) {
        if (wrapper->low_precision_parameters()) {
          torch::NoGradGuard no_grad;
          wrapper->units_[u]->full.copy_(wrapper->units_[u]->shard.detach());
        }
        continue;
      }
      wrapper->wait_gather(u);
      wrapper->units_[u]->state = Unit::State::kFree;
      wrapper->start_gather(u);
      wrapper->wait_gather(u);
    }
  }
  const auto release = [&] {
    for (auto* wrapper : wrappers) {
      if (!wrapper->frees_full_parameters()) continue;
      for (std::size_t u = 0; u < wrapper->units_.size(); ++u)
        wrapper->free_full(u);
    }
  };
  try {
    body();
  } catch (...) {
    release();
    throw;
  }
  if (writeback) {
    torch::NoGradGuard no_grad;
    for (auto* wrapper : wrappers) {
      if (wrapper->options_.sharding_strategy == ShardingStrategy::kNoShard) continue;
      const int rank = wrapper->shard_group_->rank();
      for (auto& unit : wrapper->units_) {
        // kShardGradOp's fp32 shard is a view of `full`: written already.
        auto mine = unit->full.narrow(0, rank * unit->shard_numel, unit->shard_numel);
        if (mine.data_ptr() != unit->shard.data_ptr()) unit->shard.detach().copy_(mine);
      }
    }
  }
  release();
}

torch::Tensor FullyShardedDataParallelImpl::clip_grad_norm_(double max_norm, double norm_type) {
  return clip_grad_norm_(max_norm, norm_type, TensorParallelNorm{});
}

torch::Tensor FullyShardedDataParallelImpl::clip_grad_norm_(double max_norm, double norm_type,
                                                            const TensorParallelNorm& tp) {
  if (!(max_norm > 0) || !(norm_type > 0)) {
    throw ConfigError(fmt::format(
        "FullyShardedDataParallel::clip_grad_norm_: max_norm ({}) and norm_type ({}) must be "
        "positive (norm_type may be INFINITY)",
        max_norm, norm_type));
  }
  if (!tp.split_parameters.empty() && !tp.group) {
    throw ConfigError(
        "FullyShardedDataParallel::clip_grad_norm_: TensorParallelNorm::split_parameters given "
        "without its group (the tensor-parallel group they are split over)");
  }
  std::unordered_set<const c10::TensorImpl*> split;
  for (const auto& p : tp.split_parameters)
    split.insert(p.unsafeGetTensorImpl());
  std::size_t split_found = 0;
  torch::NoGradGuard no_grad;
  const bool infinity = std::isinf(norm_type);
  const auto combine = [infinity](double a, double b) { return infinity ? std::max(a, b) : a + b; };
  const auto contribution = [&](const torch::Tensor& g) {
    const auto g64 = g.to(torch::kFloat64);
    return infinity ? g64.abs().max().item<double>()
                    : g64.abs().pow(norm_type).sum().item<double>();
  };
  // Per wrapper: the shards' contribution (sum of |g|^p, or the max), combined over the ranks
  // that hold different shards (its shard group; NO_SHARD's and HYBRID's replicas hold the same
  // elements and are not counted twice), kept apart for the parameters split over tp (whose
  // parts on the tp ranks are different elements) and the rest (replicated over tp: the same
  // elements on every tp rank, counted once). Float64, so the sums over ranks do not round.
  double replicated_total = 0.0, split_total = 0.0;
  std::vector<torch::Tensor> gradients;
  for (auto* wrapper : tree()) {
    double replicated = 0.0, split_local = 0.0;
    const bool sharded = wrapper->options_.sharding_strategy != ShardingStrategy::kNoShard;
    const std::int64_t rank = sharded ? wrapper->shard_group_->rank() : 0;
    for (const auto& unit : wrapper->units_) {
      const auto& grad = unit->shard.grad();
      for (const auto& p : unit->params)
        split_found += split.count(p.unsafeGetTensorImpl());
      if (!grad.defined()) continue;
      gradients.push_back(grad);
      const auto g = grad.detach();
      if (split.empty()) {
        replicated = combine(replicated, contribution(g));
        continue;
      }
      // The shard holds flat elements [first, first + shard_numel): each parameter's part of it
      // counts toward its kind (the padding's gradient is zero).
      const std::int64_t first = rank * unit->shard_numel;
      for (std::size_t i = 0; i < unit->params.size(); ++i) {
        const auto lo = std::max(unit->offsets[i], first);
        const auto hi =
            std::min(unit->offsets[i] + unit->params[i].numel(), first + unit->shard_numel);
        if (lo >= hi) continue;
        const double part = contribution(g.narrow(0, lo - first, hi - lo));
        if (split.count(unit->params[i].unsafeGetTensorImpl()) != 0) {
          split_local = combine(split_local, part);
        } else {
          replicated = combine(replicated, part);
        }
      }
    }
    // On the shards' device: a nccl group reads no host memory.
    auto combined = torch::tensor({replicated, split_local}, torch::kFloat64).to(wrapper->device_);
    if (sharded) {
      all_reduce(combined, infinity ? ReduceOp::kMax : ReduceOp::kSum, *wrapper->shard_group_);
    }
    const auto host = combined.cpu();
    replicated_total = combine(replicated_total, host[0].item<double>());
    split_total = combine(split_total, host[1].item<double>());
  }
  if (split_found != split.size()) {
    throw ConfigError(fmt::format(
        "FullyShardedDataParallel::clip_grad_norm_: {} of the {} split_parameters are not "
        "parameters of this wrapper or its nested ones; pass the tensor-parallel parameters of "
        "the wrapped model (ddp::tensor_parallel_split_parameters of it)",
        split.size() - split_found, split.size()));
  }
  if (tp.group) {
    // The split parameters' parts summed over tp (collective over it, on every rank alike).
    auto over_tp = torch::tensor({split_total}, torch::kFloat64).to(device_);
    all_reduce(over_tp, infinity ? ReduceOp::kMax : ReduceOp::kSum, *tp.group);
    split_total = over_tp.cpu().item<double>();
  }
  const double total = combine(replicated_total, split_total);
  const double norm = infinity ? total : std::pow(total, 1.0 / norm_type);
  const double coefficient = max_norm / (norm + 1e-6);
  if (coefficient < 1.0) {
    for (auto& grad : gradients)
      grad.mul_(coefficient);
  }
  return torch::tensor(norm, torch::TensorOptions(storage_dtype_));
}

torch::OrderedDict<std::string, torch::Tensor> FullyShardedDataParallelImpl::full_state_dict(
    int to) {
  if (to < 0 || to >= group_->size()) {
    throw ConfigError(fmt::format(
        "FullyShardedDataParallel::full_state_dict: rank {} is not in the group of {} ranks", to,
        group_->size()));
  }
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> flats;
  for (auto& unit : units_) {
    if (options_.sharding_strategy == ShardingStrategy::kNoShard) {
      flats.push_back(unit->shard.detach());
    } else {
      auto flat =
          torch::empty({unit->padded}, torch::TensorOptions(storage_dtype_).device(device_));
      // cpu_offload's host shard goes to the device first (the group may read device memory
      // only).
      all_gather_into_tensor(flat, unit->shard.detach().to(device_), *shard_group_);
      flats.push_back(flat);
    }
  }
  // Then each nested wrapper's, in the same order on every rank (collective).
  std::vector<torch::OrderedDict<std::string, torch::Tensor>> nested_states;
  for (const auto& [path, wrapper] : nested_)
    nested_states.push_back(wrapper->full_state_dict(to));
  torch::OrderedDict<std::string, torch::Tensor> out;
  if (group_->rank() != to) return out;
  std::unordered_map<const void*, std::pair<std::size_t, std::size_t>> where;
  for (std::size_t u = 0; u < units_.size(); ++u)
    for (std::size_t i = 0; i < units_[u]->params.size(); ++i)
      where.emplace(units_[u]->params[i].unsafeGetTensorImpl(), std::make_pair(u, i));
  std::vector<bool> nested_done(nested_.size(), false);
  for (const auto& item : wrapped_->named_parameters()) {
    const auto it = where.find(item.value().unsafeGetTensorImpl());
    if (it == where.end()) {
      // A nested wrapper's shard: its whole state goes here, under its path, once.
      for (std::size_t n = 0; n < nested_.size(); ++n) {
        if (nested_done[n] || item.key().rfind(nested_[n].first + ".", 0) != 0) continue;
        nested_done[n] = true;
        for (const auto& entry : nested_states[n])
          out.insert(nested_[n].first + "." + entry.key(), entry.value());
      }
      continue;
    }
    const auto [u, i] = it->second;
    const auto& p = units_[u]->params[i];
    out.insert(item.key(),
               flats[u].narrow(0, units_[u]->offsets[i], p.numel()).view(p.sizes()).clone());
  }
  std::unordered_map<const void*, torch::ScalarType> original_dtype;
  for (const auto& [buffer, dtype] : cast_buffers_)
    original_dtype.emplace(buffer.unsafeGetTensorImpl(), dtype);
  for (std::size_t n = 0; n < nested_.size(); ++n) {
    if (nested_done[n]) continue;  // a nested wrapper of buffers only
    for (const auto& entry : nested_states[n])
      out.insert(nested_[n].first + "." + entry.key(), entry.value());
  }
  for (const auto& item : wrapped_->named_buffers()) {
    const auto it = original_dtype.find(item.value().unsafeGetTensorImpl());
    out.insert(item.key(), it == original_dtype.end() ? item.value().detach().clone()
                                                      : item.value().detach().to(it->second));
  }
  return out;
}

}  // namespace ddp
