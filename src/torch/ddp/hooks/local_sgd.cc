#include "ddp/torch/ddp/hooks/local_sgd.h"

#include <map>
#include <utility>

#include <fmt/format.h>

#include "ddp/error.h"
#include "ddp/runtime/init.h"
#include "ddp/torch/api/distributed.h"
#include "ddp/torch/core/tensor_collectives.h"

namespace ddp {

PostLocalSgdState::PostLocalSgdState(PostLocalSgdOptions options) : options_(std::move(options)) {
  if (options_.start_local_sgd_iter < 0) {
    throw ConfigError(fmt::format(
        "PostLocalSgdOptions::start_local_sgd_iter = {} is negative; give the number of "
        "iterations of global averaging before local SGD starts (0: at once)",
        options_.start_local_sgd_iter));
  }
}

CommHook post_local_sgd_hook(std::shared_ptr<PostLocalSgdState> state) {
  if (!state) throw ConfigError("post_local_sgd_hook: the state is null; pass a PostLocalSgdState");
  return [state](ProcessGroup& group, GradBucket& bucket) -> BucketReduction {
    if (!state->local()) {
      if (bucket.is_last) ++state->iteration_;
      return {allreduce_tensor(group, bucket.buffer, ReduceOp::kAvg), {}, bucket.buffer.nbytes()};
    }
    if (!state->options_.post_local_gradient_allreduce) return {nullptr, {}, 0};
    // Made here, at the first local bucket, as PyTorch does: new_subgroups is collective over
    // the model's group, and every rank reaches this bucket in the same order.
    if (!state->options_.subgroup) state->options_.subgroup = new_subgroups(0, group).mine;
    return {allreduce_tensor(*state->options_.subgroup, bucket.buffer, ReduceOp::kAvg),
            {},
            bucket.buffer.nbytes()};
  };
}

namespace {

// Averages `parameters` over `group` in place: one flat buffer per dtype, in the parameters'
// order (the same on every rank): few collectives, as PyTorch's average_parameters flattens them.
void average_over(ProcessGroup& group, const std::vector<torch::Tensor>& parameters,
                  const char* who) {
  std::map<torch::ScalarType, std::vector<torch::Tensor>> by_dtype;
  for (std::size_t i = 0; i < parameters.size(); ++i) {
    check_collective_tensor(parameters[i], fmt::format("{} parameter {}", who, i));
    by_dtype[parameters[i].scalar_type()].push_back(parameters[i]);
  }
  torch::NoGradGuard no_grad;
  for (auto& [dtype, tensors] : by_dtype) {
    std::vector<torch::Tensor> flat_parts;
    flat_parts.reserve(tensors.size());
    for (const auto& t : tensors)
      flat_parts.push_back(t.detach().reshape({-1}));
    torch::Tensor flat = torch::cat(flat_parts);
    allreduce_tensor(group, flat, ReduceOp::kAvg)->wait();
    std::int64_t offset = 0;
    for (auto& t : tensors) {
      t.detach().copy_(flat.narrow(0, offset, t.numel()).view_as(t));
      offset += t.numel();
    }
  }
}

}  // namespace

PeriodicModelAverager::PeriodicModelAverager(PeriodicModelAveragerOptions options)
    : options_(std::move(options)) {
  if (options_.period < 1) {
    throw ConfigError(fmt::format(
        "PeriodicModelAveragerOptions::period = {} must be at least 1 (average every N steps)",
        options_.period));
  }
  if (options_.warmup_steps < 0) {
    throw ConfigError(fmt::format(
        "PeriodicModelAveragerOptions::warmup_steps = {} is negative; use 0 or more steps",
        options_.warmup_steps));
  }
}

bool PeriodicModelAverager::average_parameters(const std::vector<torch::Tensor>& parameters) {
  const std::int64_t step = step_++;
  if (step < options_.warmup_steps || (step - options_.warmup_steps) % options_.period != 0) {
    return false;
  }
  std::shared_ptr<ProcessGroup> group = options_.group ? options_.group : default_process_group();
  if (!group) {
    throw ConfigError(
        "PeriodicModelAverager: no process group; call ddp::init_process_group() first or set "
        "PeriodicModelAveragerOptions::group");
  }
  average_over(*group, parameters, "PeriodicModelAverager");
  return true;
}

HierarchicalModelAverager::HierarchicalModelAverager(HierarchicalModelAveragerOptions options)
    : options_(std::move(options)) {
  const auto& pairs = options_.period_group_sizes;
  if (pairs.empty()) {
    throw ConfigError(
        "HierarchicalModelAveragerOptions::period_group_sizes is empty; give (period, group size) "
        "pairs, e.g. {{2, 2}, {8, world size}}");
  }
  if (options_.warmup_steps < 0) {
    throw ConfigError(fmt::format(
        "HierarchicalModelAveragerOptions::warmup_steps = {} is negative; use 0 or more steps",
        options_.warmup_steps));
  }
  if (!options_.group) options_.group = default_process_group();
  if (!options_.group) {
    throw ConfigError(
        "HierarchicalModelAverager: no process group; call ddp::init_process_group() first or "
        "set HierarchicalModelAveragerOptions::group");
  }
  const int world = options_.group->size();
  for (std::size_t i = 0; i < pairs.size(); ++i) {
    const auto [period, size] = pairs[i];
    if (period < 1 || (i > 0 && period <= pairs[i - 1].first)) {
      throw ConfigError(fmt::format(
          "HierarchicalModelAveragerOptions::period_group_sizes: period {} (pair {}) must be at "
          "least 1 and larger than the one before",
          period, i));
    }
    if (size < 1 || world % size != 0) {
      throw ConfigError(fmt::format(
          "HierarchicalModelAveragerOptions::period_group_sizes: group size {} (pair {}) does not "
          "divide the group's {} ranks",
          size, i, world));
    }
  }
  if (pairs.back().second != world) {
    throw ConfigError(fmt::format(
        "HierarchicalModelAveragerOptions::period_group_sizes: the largest period's group size is "
        "{}; it must be the whole group's ({}), as PyTorch requires",
        pairs.back().second, world));
  }
  for (const auto& [period, size] : pairs) {
    subgroups_.push_back(size == world ? options_.group : new_subgroups(size, options_.group).mine);
  }
}

int HierarchicalModelAverager::average_parameters(const std::vector<torch::Tensor>& parameters) {
  const std::int64_t step = step_++;
  if (step < options_.warmup_steps) return 0;
  for (std::size_t i = options_.period_group_sizes.size(); i-- > 0;) {
    if (step % options_.period_group_sizes[i].first != 0) continue;
    average_over(*subgroups_[i], parameters, "HierarchicalModelAverager");
    return subgroups_[i]->size();
  }
  return 0;
}

}  // namespace ddp
