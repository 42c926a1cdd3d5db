// Activation checkpointing under DistributedDataParallel on two real ranks: with every child of
// the model checkpointed, the parameters after five steps (float64, with dropout) are bit for bit
// those of the same DDP run without it, in one bucket and in many, with unused parameters found,
// and with static_graph.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include <fmt/format.h>

#include "ddp/torch/ddp/distributed_data_parallel.h"
#include "ddp/torch/recompute/activation_checkpoint.h"
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

torch::nn::Sequential make_model(bool with_unused) {
  torch::manual_seed(5);
  torch::nn::Sequential model(torch::nn::Linear(8, 16), torch::nn::Tanh(), torch::nn::Dropout(0.2));
  if (with_unused) model->push_back(HalfUsed());
  model->push_back(torch::nn::Linear(16, 16));
  model->push_back(torch::nn::Tanh());
  model->push_back(torch::nn::Linear(16, 4));
  model->to(torch::kFloat64);
  return model;
}

std::vector<torch::Tensor> train(int rank, const std::shared_ptr<ProcessGroup>& pg,
                                 torch::nn::Sequential model, const DdpOptions& options) {
  DistributedDataParallel<torch::nn::SequentialImpl> ddp_model(model.ptr(), pg, options);
  torch::optim::SGD sgd(ddp_model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  torch::manual_seed(100 + rank);
  for (int step = 0; step < 5; ++step) {
    auto x = torch::randn({8, 8}, torch::kFloat64);
    auto y = torch::randn({8, 4}, torch::kFloat64);
    sgd.zero_grad();
    torch::mse_loss(ddp_model->forward(x), y).backward();
    sgd.step();
  }
  std::vector<torch::Tensor> params;
  for (const auto& p : model->parameters())
    params.push_back(p.grad().defined() ? p.detach().clone() : torch::full({1}, -1.0));
  return params;
}

void check_under_ddp(const DdpOptions& options, bool with_unused) {
  const int port = test::free_port();
  const auto results = test::run_ranks(2, [&](int rank) {
    auto pg = test::join_group(rank, 2, port);
    const auto plain = train(rank, pg, make_model(with_unused), options);
    const auto checkpointed = train(
        rank, pg, apply_activation_checkpointing(make_model(with_unused), checkpoint_every_child()),
        options);
    if (plain.size() != checkpointed.size()) throw std::runtime_error("parameter counts differ");
    for (std::size_t i = 0; i < plain.size(); ++i) {
      if (!torch::equal(plain[i], checkpointed[i])) {
        throw std::runtime_error(
            fmt::format("rank {}: parameter {} differs with checkpointing "
                        "(max difference {})",
                        rank, i, (plain[i] - checkpointed[i]).abs().max().item<double>()));
      }
    }
  });
  EXPECT_ALL_RANKS_OK(results);
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

}  // namespace DDP_UNITY_ID
}  // namespace
}  // namespace ddp
