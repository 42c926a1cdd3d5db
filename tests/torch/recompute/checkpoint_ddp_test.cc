// Activation checkpointing under the data-parallel wrappers on two real ranks: with every child of
// the model checkpointed, the parameters after five steps (with dropout) are bit for bit those of
// the same run without it: DistributedDataParallel (float64) in one bucket and in many, with
// unused parameters found and with static_graph; ZeroRedundancyOptimizer over DDP; and
// FullyShardedDataParallel (float32, its parameters' dtype) in every strategy, one unit per child,
// whose units are gathered again for the recomputation.
#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "ddp/torch/ddp/distributed_data_parallel.h"
#include "ddp/torch/fsdp/fully_sharded_data_parallel.h"
#include "ddp/torch/recompute/activation_checkpoint.h"
#include "ddp/torch/zero/zero_redundancy_optimizer.h"
#include "support/multiprocess.h"
#include "support/torch/ddp_test_util.h"
#include "support/unity_namespace.h"

namespace ddp {
namespace {
namespace DDP_UNITY_ID {

// A layer with a second Linear that its forward never uses (for find_unused_parameters).
struct HalfUsedImpl : torch::nn::Module {
  HalfUsedImpl()
      : used(register_module("used", torch::nn::Linear(16, 16))),
        unused(register_module("unused", torch::nn::Linear(16, 16))) {}
  torch::Tensor forward(const torch::Tensor& x) { return torch::tanh(used->forward(x)); }
  torch::nn::Linear used, unused;
};
TORCH_MODULE(HalfUsed);

torch::nn::Sequential make_model(bool with_unused, torch::Dtype dtype) {
  torch::manual_seed(5);
  torch::nn::Sequential model(torch::nn::Linear(8, 16), torch::nn::Tanh(), torch::nn::Dropout(0.2));
  if (with_unused) model->push_back(HalfUsed());
  model->push_back(torch::nn::Linear(16, 16));
  model->push_back(torch::nn::Tanh());
  model->push_back(torch::nn::Linear(16, 4));
  model->to(dtype);
  return model;
}

// Five steps of `forward` and `optimizer` on this rank's batches (the same in every run).
void five_steps(int rank, const std::function<torch::Tensor(const torch::Tensor&)>& forward,
                torch::optim::Optimizer& optimizer, torch::Dtype dtype) {
  torch::manual_seed(100 + rank);
  for (int step = 0; step < 5; ++step) {
    auto x = torch::randn({8, 8}, dtype);
    auto y = torch::randn({8, 4}, dtype);
    optimizer.zero_grad();
    torch::mse_loss(forward(x), y).backward();
    optimizer.step();
  }
}

// The parameters, or -1 for one without a gradient (never used).
std::vector<torch::Tensor> parameters_after(const std::vector<torch::Tensor>& parameters) {
  std::vector<torch::Tensor> values;
  for (const auto& p : parameters)
    values.push_back(p.grad().defined() ? p.detach().clone() : torch::full({1}, -1.0));
  return values;
}

using TrainModel = std::function<std::vector<torch::Tensor>(
    int rank, const std::shared_ptr<ProcessGroup>&, torch::nn::Sequential)>;

// Runs `train_model` on two ranks over the plain model and over the checkpointed one; the values
// it returns must be equal bit for bit.
void check_same_parameters(const TrainModel& train_model, bool with_unused, torch::Dtype dtype) {
  const int port = test::free_port();
  const auto results = test::run_ranks(2, [&](int rank) {
    auto pg = test::join_group(rank, 2, port);
    const auto plain = train_model(rank, pg, make_model(with_unused, dtype));
    const auto checkpointed = train_model(
        rank, pg,
        apply_activation_checkpointing(make_model(with_unused, dtype), checkpoint_every_child()));
    if (plain.size() != checkpointed.size()) throw std::runtime_error("parameter counts differ");
    for (std::size_t i = 0; i < plain.size(); ++i) {
      if (!torch::equal(plain[i], checkpointed[i])) {
        throw std::runtime_error(
            fmt::format("rank {}: parameter {} differs with checkpointing (max difference {})",
                        rank, i, (plain[i] - checkpointed[i]).abs().max().item<double>()));
      }
    }
  });
  EXPECT_ALL_RANKS_OK(results);
}

void check_under_ddp(const DdpOptions& options, bool with_unused, bool zero = false) {
  check_same_parameters(
      [&](int rank, const std::shared_ptr<ProcessGroup>& pg, torch::nn::Sequential model) {
        DistributedDataParallel<torch::nn::SequentialImpl> ddp_model(model.ptr(), pg, options);
        auto forward = [&](const torch::Tensor& x) { return ddp_model->forward(x); };
        if (zero) {
          ZeroRedundancyOptimizer adam(ddp_model->parameters(), torch::optim::AdamOptions(0.01),
                                       pg);
          five_steps(rank, forward, adam, torch::kFloat64);
        } else {
          torch::optim::SGD sgd(ddp_model->parameters(),
                                torch::optim::SGDOptions(0.05).momentum(0.9));
          five_steps(rank, forward, sgd, torch::kFloat64);
        }
        return parameters_after(model->parameters());
      },
      with_unused, torch::kFloat64);
}

TEST(ActivationCheckpointUnderDdp, OneBucketEqualsTheRunWithout) {
  check_under_ddp(DdpOptions{}, false);
}

TEST(ActivationCheckpointUnderDdp, ManySmallBucketsEqualTheRunWithout) {
  DdpOptions options;
  options.bucket_cap_mb = 0.001;
  options.first_bucket_cap_mb = 0.001;
  check_under_ddp(options, false);
}

TEST(ActivationCheckpointUnderDdp, UnusedParametersAreFoundAndLeftWithoutAGradient) {
  DdpOptions options;
  options.find_unused_parameters = true;
  check_under_ddp(options, true);
}

TEST(ActivationCheckpointUnderDdp, StaticGraphEqualsTheRunWithout) {
  DdpOptions options;
  options.static_graph = true;
  check_under_ddp(options, false);
}

TEST(ActivationCheckpointUnderDdp, ZeroRedundancyOptimizerEqualsTheRunWithout) {
  check_under_ddp(DdpOptions{}, false, /*zero=*/true);
}

// FSDP with one unit per child: each unit's parameters are freed after its forward (kFullShard)
// and gathered again before its backward, which is where the checkpointed child is recomputed.
void check_under_fsdp(ShardingStrategy strategy) {
  check_same_parameters(
      [strategy](int rank, const std::shared_ptr<ProcessGroup>& pg, torch::nn::Sequential model) {
        FullyShardedDataParallel fsdp(
            model, pg, FsdpOptions{.sharding_strategy = strategy, .min_num_params = 1});
        torch::optim::SGD sgd(fsdp->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
        five_steps(
            rank, [&](const torch::Tensor& x) { return fsdp->forward(x); }, sgd, torch::kFloat32);
        return parameters_after(fsdp->parameters());
      },
      false, torch::kFloat32);
}

TEST(ActivationCheckpointUnderFsdp, FullShardEqualsTheRunWithout) {
  check_under_fsdp(ShardingStrategy::kFullShard);
}

TEST(ActivationCheckpointUnderFsdp, ShardGradOpEqualsTheRunWithout) {
  check_under_fsdp(ShardingStrategy::kShardGradOp);
}

TEST(ActivationCheckpointUnderFsdp, NoShardEqualsTheRunWithout) {
  check_under_fsdp(ShardingStrategy::kNoShard);
}

// A wrapper inside a checkpointed function: its forward would run again in backward (its
// broadcasts and gathers out of step with the other ranks' backward). Named on every rank.
TEST(ActivationCheckpointUnderDdp, CheckpointingTheWrapperItselfIsNamedOnEveryRank) {
  const int port = test::free_port();
  const auto results = test::run_ranks(2, [&](int rank) {
    auto pg = test::join_group(rank, 2, port);
    auto model = make_model(false, torch::kFloat32);
    DistributedDataParallel<torch::nn::SequentialImpl> ddp_model(model.ptr(), pg);
    FullyShardedDataParallel fsdp(make_model(false, torch::kFloat32), pg,
                                  FsdpOptions{.min_num_params = 1});
    const std::vector<std::pair<std::string, std::function<torch::Tensor(const torch::Tensor&)>>>
        wrappers{
            {"DistributedDataParallel",
             [&](const torch::Tensor& x) { return ddp_model->forward(x); }},
            {"FullyShardedDataParallel", [&](const torch::Tensor& x) { return fsdp->forward(x); }}};
    for (const auto& [name, forward] : wrappers) {
      auto y = checkpoint(forward, torch::randn({4, 8}));
      try {
        y.sum().backward();
      } catch (const std::exception& e) {
        if (std::string(e.what()).find(name + "'s forward ran again inside the recomputation") !=
            std::string::npos) {
          continue;
        }
        throw std::runtime_error(
            fmt::format("rank {}: {}: another error: {}", rank, name, e.what()));
      }
      throw std::runtime_error(
          fmt::format("rank {}: {} inside a checkpoint was not refused", rank, name));
    }
  });
  EXPECT_ALL_RANKS_OK(results);
}

}  // namespace DDP_UNITY_ID
}  // namespace
}  // namespace ddp
