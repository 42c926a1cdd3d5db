// ddp::MoeLayer (mixture_of_experts.h) in real processes, float64: at ep 2 and at dp 2 x ep 2 the
// layer trains 5 SGD steps to one process's losses, routing and weights (1e-9), with the capacity
// large enough that nothing drops and with one so small that most assignments drop (dropped alike
// on every layout); the uneven all-to-all's backward returns each row's gradient to its sender;
// every misuse is named on every rank, and so are DDP and a Pipeline that would average a gradient
// over other ranks than its own.
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "ddp/error.h"
#include "ddp/torch/api/distributed.h"
#include "ddp/torch/ddp/distributed_data_parallel.h"
#include "ddp/torch/parallel/expert/mixture_of_experts.h"
#include "ddp/torch/parallel/mesh/device_mesh.h"
#include "ddp/torch/parallel/pipeline/pipeline.h"
#include "support/multiprocess.h"
#include "support/torch/ddp_test_util.h"
#include "support/unity_namespace.h"

namespace ddp {
namespace {
namespace DDP_UNITY_ID {

using test::join_group;
using test::run_ranks;

constexpr std::int64_t kHidden = 6, kRowsPerRank = 5, kSequence = 3, kSteps = 5;
constexpr double kAuxWeight = 0.05, kLr = 0.2;

void check(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error(what);
}

MoeOptions options(double capacity_factor) {
  return MoeOptions{.hidden = kHidden,
                    .ffn_hidden = 10,
                    .experts = 4,
                    .top_k = 2,
                    .capacity_factor = capacity_factor,
                    .seed = 11,
                    .dtype = torch::kFloat64};
}

// The whole batch of step `step` for `ranks` row blocks: [ranks * rows, sequence, hidden].
std::pair<torch::Tensor, torch::Tensor> batch_of(int step, int ranks) {
  const auto n = ranks * kRowsPerRank * kSequence * kHidden;
  const auto x = torch::sin(torch::arange(n, torch::kFloat64) * 0.37 + step)
                     .reshape({ranks * kRowsPerRank, kSequence, kHidden});
  const auto target = torch::cos(torch::arange(n, torch::kFloat64) * 0.11 - step)
                          .reshape({ranks * kRowsPerRank, kSequence, kHidden});
  return {x, target};
}

torch::Tensor loss_of(MoeLayer& moe, const torch::Tensor& x, const torch::Tensor& target) {
  const auto y = moe->forward(x);  // before aux_loss(), which it sets
  return torch::mse_loss(x + y, target) + kAuxWeight * moe->aux_loss();
}

struct Trained {
  std::vector<double> losses;
  std::vector<std::int64_t> dropped;
  torch::Tensor router, w1, b1, w2, b2;  // every expert's
};

// One process on the whole batch of `ranks` blocks.
Trained one_process(double capacity_factor, int ranks) {
  MoeLayer moe(options(capacity_factor));
  torch::optim::SGD sgd(moe->parameters(), torch::optim::SGDOptions(kLr));
  Trained out;
  for (int step = 0; step < kSteps; ++step) {
    const auto [x, target] = batch_of(step, ranks);
    sgd.zero_grad();
    const auto loss = loss_of(moe, x, target);
    loss.backward();
    sgd.step();
    out.losses.push_back(loss.item<double>());
    out.dropped.push_back(moe->last_routing().dropped);
  }
  out.router = moe->router.detach().clone();
  out.w1 = moe->w1.detach().clone();
  out.b1 = moe->b1.detach().clone();
  out.w2 = moe->w2.detach().clone();
  out.b2 = moe->b2.detach().clone();
  return out;
}

// The layer at ep x dp on `world` (its ranks hold the batch's row blocks in rank order): the
// router's gradient averaged over every rank, the experts' over the dp replicas; checked against
// one process after every step and at the end.
void train_and_compare(ProcessGroup& world, const DeviceMesh& mesh, double capacity_factor) {
  const auto want = one_process(capacity_factor, world.size());
  const auto& dp = mesh.group("dp");
  MoeLayer moe(options(capacity_factor),
               MoeGroups{.ep = mesh.group("ep"),
                         .tokens = std::shared_ptr<ProcessGroup>(&world, [](ProcessGroup*) {})});
  check(moe->local_experts() == 4 / mesh.size("ep"), "wrong number of local experts");
  torch::optim::SGD sgd(moe->parameters(), torch::optim::SGDOptions(kLr));
  for (int step = 0; step < kSteps; ++step) {
    const auto [x, target] = batch_of(step, world.size());
    const auto mine = x.narrow(0, world.rank() * kRowsPerRank, kRowsPerRank);
    sgd.zero_grad();
    const auto loss =
        loss_of(moe, mine, target.narrow(0, world.rank() * kRowsPerRank, kRowsPerRank));
    loss.backward();
    test::averaged_over_ranks(world, {moe->router.grad()});
    if (dp->size() > 1) {
      for (const auto& p : moe->expert_parameters())
        test::averaged_over_ranks(*dp, {p.grad()});
    }
    sgd.step();
    auto mean_loss = loss.detach().clone();
    test::averaged_over_ranks(world, {mean_loss});
    check(std::abs(mean_loss.item<double>() - want.losses[step]) <=
              1e-9 * std::abs(want.losses[step]),
          fmt::format("step {}: the loss {} is not one process's {}", step,
                      mean_loss.item<double>(), want.losses[step]));
    check(moe->last_routing().dropped == want.dropped[step],
          fmt::format("step {}: {} assignments dropped, one process dropped {}", step,
                      moe->last_routing().dropped, want.dropped[step]));
  }
  const auto first = moe->first_expert(), local = moe->local_experts();
  test::expect_close(moe->router.detach(), want.router, "the router after 5 steps", 1e-9, 1e-12);
  test::expect_close(moe->w1.detach(), want.w1.narrow(0, first, local), "w1", 1e-9, 1e-12);
  test::expect_close(moe->b1.detach(), want.b1.narrow(0, first, local), "b1", 1e-9, 1e-12);
  test::expect_close(moe->w2.detach(), want.w2.narrow(0, first, local), "w2", 1e-9, 1e-12);
  test::expect_close(moe->b2.detach(), want.b2.narrow(0, first, local), "b2", 1e-9, 1e-12);
}

TEST(MixtureOfExperts, ExpertParallelTwoTrainsLikeOneProcessWithAndWithoutDrops) {
  const int port = test::free_port();
  const auto results = run_ranks(2, [&](int rank) {
    auto world = join_group(rank, 2, port);
    DeviceMesh mesh({{"dp", 1}, {"ep", 2}}, world);
    train_and_compare(*world, mesh, 0.0);
    // Capacity ceil(0.25 * 30 * 2 / 4) = 4 of 60 assignments per expert: most drop.
    const auto tight = one_process(0.25, 2);
    check(tight.dropped[0] >= 30,
          fmt::format("only {} dropped at capacity factor 0.25", tight.dropped[0]));
    train_and_compare(*world, mesh, 0.25);
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(MixtureOfExperts, DataTwoByExpertTwoTrainsLikeOneProcessWithAndWithoutDrops) {
  const int port = test::free_port();
  const auto results = run_ranks(4, [&](int rank) {
    auto world = join_group(rank, 4, port);
    DeviceMesh mesh({{"dp", 2}, {"ep", 2}}, world);
    train_and_compare(*world, mesh, 0.0);
    train_and_compare(*world, mesh, 0.5);
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(MixtureOfExperts, AllToAllRowsReturnsEachGradientToItsSender) {
  const int port = test::free_port();
  const auto results = run_ranks(3, [&](int rank) {
    auto world = join_group(rank, 3, port);
    // Rank r sends (r + j) % 3 rows of value 10 r + j to rank j.
    std::vector<std::int64_t> send, receive;
    std::vector<torch::Tensor> parts;
    for (int j = 0; j < 3; ++j) {
      send.push_back((rank + j) % 3);
      receive.push_back((j + rank) % 3);
      parts.push_back(torch::full({send.back(), 2}, 10.0 * rank + j, torch::kFloat64));
    }
    const auto input = torch::cat(parts).requires_grad_(true);
    const auto output = all_to_all_rows(input, receive, send, world);
    std::int64_t row = 0;
    for (int j = 0; j < 3; ++j) {
      const auto block = output.narrow(0, row, receive[j]);
      row += receive[j];
      check(block.numel() == 0 || block.eq(10.0 * j + rank).all().item<bool>(),
            fmt::format("rows from rank {} hold the wrong values", j));
    }
    // d(sum(output * (rank + 1))) / d input = the receiver's rank + 1, on each sent row.
    (output * (rank + 1.0)).sum().backward();
    row = 0;
    for (int j = 0; j < 3; ++j) {
      const auto block = input.grad().narrow(0, row, send[j]);
      row += send[j];
      check(block.numel() == 0 || block.eq(j + 1.0).all().item<bool>(),
            fmt::format("the gradient of the rows sent to rank {} is not its", j));
    }
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(MixtureOfExperts, MisuseIsNamedOnEveryRank) {
  const int port = test::free_port();
  const auto results = run_ranks(2, [&](int rank) {
    auto world = join_group(rank, 2, port);
    const auto build = [&](MoeOptions o) { MoeLayer moe(o, MoeGroups{.ep = world}); };
    auto o = options(0.0);
    o.top_k = 5;
    test::expect_throws<ConfigError>([&] { build(o); },
                                     "top_k 5 must be between 1 and the expert count 4",
                                     "a top-k above the expert count");
    o = options(0.0);
    o.experts = 3;
    o.top_k = 1;
    test::expect_throws<ConfigError>([&] { build(o); },
                                     "the expert count 3 is not divisible by the ep group's 2",
                                     "experts not divisible by ep");
    o = options(rank == 0 ? 1.0 : 2.0);
    test::expect_throws<ConfigError>([&] { build(o); }, "capacity_factor",
                                     "ranks built with different capacity factors");
    MoeLayer moe(options(1.0), MoeGroups{.ep = world});
    test::expect_throws<ConfigError>([&] { moe->aux_loss(); }, "no forward has run yet",
                                     "aux_loss before forward");
    // Only rank 1's input is wrong: both ranks name it at the routing's all-gather.
    const auto x = torch::ones({2, rank == 1 ? 5 : kHidden}, torch::kFloat64);
    test::expect_throws<ConfigError>(
        [&] { moe->forward(x); },
        "rank 1 of the token group passed an input whose last dimension is 5, not hidden=6",
        "a wrong hidden size on one rank");
    test::expect_throws<ConfigError>(
        [&] {
          moe->forward(torch::ones({2, kHidden}, torch::kFloat32));
        },
        "passed a Float input to a layer of another dtype", "a float32 input to a float64 layer");
    moe->set_capacity_factor(rank == 0 ? 1.0 : 1.5);
    test::expect_throws<ConfigError>(
        [&] {
          moe->forward(torch::ones({2, kHidden}, torch::kFloat64));
        },
        "disagree on the capacity factor", "ranks routing with different capacities");
    // The layer still works after every refusal.
    moe->set_capacity_factor(1.0);
    const auto y = moe->forward(torch::ones({2, kHidden}, torch::kFloat64));
    check(y.sizes() == torch::IntArrayRef({2, kHidden}), "the output has the wrong shape");
  });
  EXPECT_ALL_RANKS_OK(results);
}

// Averaging experts over ranks that hold other experts, or a gradient over other ranks than the
// ones whose rows it learnt from, would train a silently wrong model: DDP around a layer split over
// ep (no one group is right for both the router and the experts), DDP over other ranks than the
// token group, and a Pipeline whose dp_group holds several replicas of each expert without an
// expert_dp_group of exactly those replicas, are refused on every rank; the right groups work.
TEST(MixtureOfExperts, WrappersThatWouldAverageOverTheWrongRanksAreRefusedOnEveryRank) {
  const int port = test::free_port();
  const auto results = run_ranks(4, [&](int rank) {
    auto world = join_group(rank, 4, port);
    DeviceMesh mesh({{"pp", 1}, {"dp", 2}, {"ep", 2}}, world);
    const auto layer = [&] {
      return torch::nn::Sequential(
          MoeLayer(options(1.0), MoeGroups{.ep = mesh.group("ep"), .tokens = world}));
    };
    test::expect_throws<ConfigError>([&] { DistributedDataParallel ddp(layer(), world); },
                                     "must have its gradient averaged over 2 ranks, but the group "
                                     "has 4",
                                     "DDP over ranks that hold other experts");
    test::expect_throws<ConfigError>(
        [&] { DistributedDataParallel ddp(layer(), mesh.group("dp")); },
        "router, trained on its token group's rows) must have its "
        "gradient averaged over 4 ranks, but the group has 2",
        "DDP over fewer ranks than the router learns from");
    // Experts replicated (no ep) and the batch split over dp: DDP over dp is right, over more is
    // not.
    const auto replicated = [&] {
      return torch::nn::Sequential(MoeLayer(options(1.0), MoeGroups{.tokens = mesh.group("dp")}));
    };
    DistributedDataParallel over_dp(replicated(), mesh.group("dp"));
    test::expect_throws<ConfigError>(
        [&] { DistributedDataParallel ddp(replicated(), world); },
        "must have its gradient averaged over 2 ranks, but the group has 4",
        "DDP over more ranks than the token group");
    const auto loss = [](const torch::Tensor& out, const torch::Tensor& target) {
      return torch::mse_loss(out, target);
    };
    const auto pipeline = [&](std::shared_ptr<ProcessGroup> experts) {
      Pipeline p(PipelineStageModule{layer()}, mesh.group("pp"), loss,
                 PipelineOptions{
                     .micro_batches = 1, .dp_group = world, .expert_dp_group = std::move(experts)});
    };
    test::expect_throws<ConfigError>([&] { pipeline(nullptr); },
                                     "so each expert has 2 replicas, but "
                                     "PipelineOptions::expert_dp_group is not set",
                                     "a pipeline that never averages the expert replicas");
    test::expect_throws<ConfigError>([&] { pipeline(world); }, "but expert_dp_group has 4 ranks",
                                     "an expert_dp_group of the wrong size");
    test::expect_throws<ConfigError>([&] { pipeline(mesh.group("ep")); },
                                     "the ranks of PipelineOptions::expert_dp_group hold "
                                     "different experts",
                                     "the ep group given as expert_dp_group");
    test::expect_throws<ConfigError>(
        [&] {
          Pipeline p(PipelineStageModule{layer()}, mesh.group("pp"), loss,
                     PipelineOptions{.micro_batches = 1, .dp_group = mesh.group("dp")});
        },
        "must have its gradient averaged over 4 ranks, but PipelineOptions::dp_group has 2",
        "a pipeline averaging the router over fewer ranks than its token group");
    pipeline(mesh.group("dp"));
  });
  EXPECT_ALL_RANKS_OK(results);
}

}  // namespace DDP_UNITY_ID
}  // namespace
}  // namespace ddp
