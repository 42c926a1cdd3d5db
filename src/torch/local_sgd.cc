#include "ddp/torch/local_sgd.h"

#include <map>
#include <utility>

#include <fmt/format.h>

#include "ddp/error.h"
#include "ddp/init.h"
#include "ddp/torch/distributed.h"
#include "ddp/torch/tensor_collectives.h"

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
  // One flat buffer per dtype, in the parameters' order (the same on every rank): few
  // collectives, as PyTorch's average_parameters flattens them.
  std::map<torch::ScalarType, std::vector<torch::Tensor>> by_dtype;
  for (std::size_t i = 0; i < parameters.size(); ++i) {
    check_collective_tensor(parameters[i], fmt::format("PeriodicModelAverager parameter {}", i));
    by_dtype[parameters[i].scalar_type()].push_back(parameters[i]);
  }
  torch::NoGradGuard no_grad;
  for (auto& [dtype, tensors] : by_dtype) {
    std::vector<torch::Tensor> flat_parts;
    flat_parts.reserve(tensors.size());
    for (const auto& t : tensors)
      flat_parts.push_back(t.detach().reshape({-1}));
    torch::Tensor flat = torch::cat(flat_parts);
    allreduce_tensor(*group, flat, ReduceOp::kAvg)->wait();
    std::int64_t offset = 0;
    for (auto& t : tensors) {
      t.detach().copy_(flat.narrow(0, offset, t.numel()).view_as(t));
      offset += t.numel();
    }
  }
  return true;
}

}  // namespace ddp
