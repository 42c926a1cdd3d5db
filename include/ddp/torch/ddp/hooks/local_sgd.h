// Post-local SGD (PyTorch's ddp_comm_hooks.post_localSGD_hook and
// torch.distributed.algorithms.model_averaging.averagers.PeriodicModelAverager): DDP averages
// gradients over the whole group for the first `start_local_sgd_iter` iterations, then only inside
// a subgroup (by default the ranks of this host), and every `period` steps a
// PeriodicModelAverager averages the parameters over the whole group (HierarchicalModelAverager:
// over nested subgroups at several periods).
//
//   auto state = std::make_shared<ddp::PostLocalSgdState>(ddp::PostLocalSgdOptions{
//       .start_local_sgd_iter = 100});
//   model->register_comm_hook(ddp::post_local_sgd_hook(state), "post_local_sgd");
//   ddp::PeriodicModelAverager averager({.period = 4, .warmup_steps = 100});
//   for (...) { loss.backward(); optimizer.step(); averager.average_parameters(params); }
//
// As in PyTorch: the iteration count advances when the last bucket of a backward pass is hooked,
// and only until local SGD starts; the subgroup is made (collectively, by new_subgroups over the
// DDP model's group) at the first local iteration unless one is given;
// post_local_gradient_allreduce = false skips even the subgroup's allreduce (pure local SGD).
// The averager counts its calls: it averages at call `step` when step >= warmup_steps and
// (step - warmup_steps) % period == 0, which every rank of the group must call alike.
#pragma once

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "ddp/comm/process_group.h"
#include "ddp/torch/ddp/hooks/comm_hooks.h"

// Exported by ddp's shared libraries, which hide the rest (src/CMakeLists.txt).
#pragma GCC visibility push(default)
namespace ddp {

struct PostLocalSgdOptions {
  // Iterations of global gradient averaging before local SGD starts (PyTorch's
  // start_localSGD_iter); >= 0.
  std::int64_t start_local_sgd_iter = 0;
  // Averaged over after the start; null: this host's ranks (new_subgroups(0) over the hooked
  // model's group, made at the first local iteration).
  std::shared_ptr<ProcessGroup> subgroup;
  // false: after the start, gradients stay local (no allreduce at all).
  bool post_local_gradient_allreduce = true;
};

class PostLocalSgdState {
 public:
  // ConfigError for a negative start_local_sgd_iter.
  explicit PostLocalSgdState(PostLocalSgdOptions options);
  // Backward passes hooked so far, up to start_local_sgd_iter (PyTorch's state.iter).
  std::int64_t iteration() const { return iteration_; }
  bool local() const { return iteration_ >= options_.start_local_sgd_iter; }
  // The subgroup in use after the start (null before it was made).
  const std::shared_ptr<ProcessGroup>& subgroup() const { return options_.subgroup; }

 private:
  friend CommHook post_local_sgd_hook(std::shared_ptr<PostLocalSgdState> state);
  PostLocalSgdOptions options_;
  std::int64_t iteration_ = 0;
};

// ConfigError when `state` is null.
CommHook post_local_sgd_hook(std::shared_ptr<PostLocalSgdState> state);

struct PeriodicModelAveragerOptions {
  std::int64_t period = 1;        // >= 1
  std::int64_t warmup_steps = 0;  // >= 0
  // null: the default process group, looked up at each averaging.
  std::shared_ptr<ProcessGroup> group;
};

class PeriodicModelAverager {
 public:
  // ConfigError for period < 1 or warmup_steps < 0.
  explicit PeriodicModelAverager(PeriodicModelAveragerOptions options);
  // Averages `parameters` (dense CPU tensors, one dtype each; grouped into one allreduce per
  // dtype) over the group when this call is an averaging step; returns whether it was.
  // Collective on those steps.
  bool average_parameters(const std::vector<torch::Tensor>& parameters);
  // Calls so far (PyTorch's averager.step).
  std::int64_t step() const { return step_; }

 private:
  PeriodicModelAveragerOptions options_;
  std::int64_t step_ = 0;
};

struct HierarchicalModelAveragerOptions {
  // (period, group size) pairs, periods strictly ascending (PyTorch's period_group_size_dict): at
  // each call from warmup_steps on, the parameters are averaged over this rank's subgroup of the
  // largest period that divides the call's step (none: not averaged). Each size divides the
  // group's size (the subgroups are new_subgroups(size) of the group); the largest period's size
  // is the group's size. E.g. {{2, 2}, {8, 4}} at world 4: pairs every 2 steps, all every 8.
  std::vector<std::pair<std::int64_t, int>> period_group_sizes;
  std::int64_t warmup_steps = 0;  // >= 0
  // null: the default process group, looked up at construction.
  std::shared_ptr<ProcessGroup> group;
};

// PyTorch's HierarchicalModelAverager: averaging at several periods over nested subgroups (e.g.
// often inside a host, rarely across hosts).
class HierarchicalModelAverager {
 public:
  // Collective over the group: makes the subgroups. ConfigError for an empty list, periods that
  // are not >= 1 and strictly ascending, a size that does not divide the group's, a largest
  // period's size other than the group's, or warmup_steps < 0.
  explicit HierarchicalModelAverager(HierarchicalModelAveragerOptions options);
  // Averages `parameters` (as PeriodicModelAverager) when this call is an averaging step; returns
  // the size of the subgroup averaged over (0: not averaged). Collective over that subgroup.
  int average_parameters(const std::vector<torch::Tensor>& parameters);
  std::int64_t step() const { return step_; }

 private:
  HierarchicalModelAveragerOptions options_;
  std::vector<std::shared_ptr<ProcessGroup>> subgroups_;  // per period: this rank's subgroup
  std::int64_t step_ = 0;
};

}  // namespace ddp
#pragma GCC visibility pop
