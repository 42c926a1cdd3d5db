// Post-local SGD, the noop hook and the compress wrappers (local_sgd.h, comm_hooks.h), in real
// processes: which iterations average the gradients over which ranks, and what the periodic model
// averager averages, against values each rank computes on its own.
#include "ddp/torch/ddp/hooks/local_sgd.h"

#include <gtest/gtest.h>

#include "ddp/error.h"
#include "ddp/torch/api/distributed.h"
#include "ddp/torch/ddp/distributed_data_parallel.h"
#include "support/multiprocess.h"
#include "support/torch/ddp_test_util.h"
#include "support/unity_namespace.h"

namespace ddp {
namespace {
namespace DDP_UNITY_ID {

using test::join_group;
using test::run_ranks;

// Both ranks' values of `t`, stacked (row r = rank r's).
torch::Tensor gathered(ProcessGroup& group, const torch::Tensor& t) {
  auto mine = t.detach().reshape({-1}).contiguous().to(torch::kFloat64);
  auto all = torch::empty({group.size(), mine.numel()}, torch::kFloat64);
  group
      .allgather(mine.data_ptr(), all.data_ptr(), static_cast<std::size_t>(mine.numel()),
                 DType::kFloat64)
      ->wait();
  return all;
}

// Trains a Linear under `hook` for `steps` backward passes on rank-dependent data and returns,
// per step, whether the two ranks' gradients were equal after backward (averaged) and whether
// each equals this rank's local gradient (not averaged).
struct StepOutcome {
  bool equal_across_ranks;
  bool equals_local;
};
std::vector<StepOutcome> run_steps(ProcessGroup& group, const std::shared_ptr<ProcessGroup>& pg,
                                   const CommHook& hook, int steps) {
  torch::manual_seed(1);
  torch::nn::Linear net(6, 3);
  torch::nn::Linear local(6, 3);  // the same weights, without DDP: the local gradient
  {
    torch::NoGradGuard no_grad;
    local->weight.copy_(net->weight);
    local->bias.copy_(net->bias);
  }
  DistributedDataParallel model(net.ptr(), pg);
  model->register_comm_hook(hook, "under test");
  std::vector<StepOutcome> outcomes;
  for (int step = 0; step < steps; ++step) {
    model->zero_grad();
    local->zero_grad();
    const auto x = torch::full({4, 6}, 1.0 + group.rank() + step);
    model->forward(x).pow(2).sum().backward();
    local->forward(x).pow(2).sum().backward();
    const auto both = gathered(group, net->weight.grad());
    outcomes.push_back(
        {torch::equal(both[0], both[1]), torch::equal(net->weight.grad(), local->weight.grad())});
  }
  return outcomes;
}

TEST(NoopHook, LeavesEachRanksOwnGradientsAndSendsNothing) {
  const int port = test::free_port();
  const auto results = run_ranks(2, [&](int rank) {
    auto pg = join_group(rank, 2, port);
    for (const auto& outcome : run_steps(*pg, pg, noop_hook(), 2)) {
      if (outcome.equal_across_ranks || !outcome.equals_local)
        throw std::runtime_error("noop_hook averaged the gradients");
    }
  });
  EXPECT_ALL_RANKS_OK(results);
}

// fp16/bf16_compress_wrapper: allreduce on the 16-bit copy is the compress hook itself, bit for
// bit; the noop hook on it leaves this rank's gradient rounded to 16 bits.
TEST(CompressWrapper, OfAllreduceIsTheCompressHookAndOfNoopRoundsTheLocalGradient) {
  const int port = test::free_port();
  const auto results = run_ranks(2, [&](int rank) {
    auto pg = join_group(rank, 2, port);
    auto gradient_under = [&](const CommHook& hook) {
      torch::manual_seed(1);
      torch::nn::Linear net(6, 3);
      DistributedDataParallel model(net.ptr(), pg);
      model->register_comm_hook(hook, "under test");
      model->forward(torch::full({4, 6}, 0.3 + rank)).pow(2).sum().backward();
      return net->weight.grad().clone();
    };
    for (const auto wire : {torch::kHalf, torch::kBFloat16}) {
      const bool half = wire == torch::kHalf;
      const auto wrapped = gradient_under(half ? fp16_compress_wrapper(allreduce_hook())
                                               : bf16_compress_wrapper(allreduce_hook()));
      const auto direct = gradient_under(half ? fp16_compress_hook() : bf16_compress_hook());
      if (!torch::equal(wrapped, direct)) {
        throw std::runtime_error("the wrapper of allreduce differs from the compress hook");
      }
      const auto local = gradient_under(noop_hook());
      const auto rounded = gradient_under(half ? fp16_compress_wrapper(noop_hook())
                                               : bf16_compress_wrapper(noop_hook()));
      if (!torch::equal(rounded, local.to(wire).to(torch::kFloat32)) ||
          torch::equal(rounded, local)) {
        throw std::runtime_error("the wrapper of noop did not leave the local gradient in 16 bits");
      }
    }
    test::expect_throws<ConfigError>([&] { fp16_compress_wrapper(CommHook{}); },
                                     "the hook to wrap is empty", "wrapping an empty hook");
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(PostLocalSgd, AveragesGloballyUntilTheStartThenInsideTheSubgroup) {
  const int port = test::free_port();
  const auto results = run_ranks(2, [&](int rank) {
    auto pg = join_group(rank, 2, port);
    // Subgroups of one rank each: after the start, gradients stay local.
    auto state = std::make_shared<PostLocalSgdState>(
        PostLocalSgdOptions{.start_local_sgd_iter = 2, .subgroup = new_subgroups(1, pg).mine});
    const auto outcomes = run_steps(*pg, pg, post_local_sgd_hook(state), 4);
    for (int step = 0; step < 4; ++step) {
      const bool global = step < 2;
      if (outcomes[step].equal_across_ranks != global || outcomes[step].equals_local == global) {
        throw std::runtime_error(
            fmt::format("step {}: expected {} averaging", step, global ? "global" : "no"));
      }
    }
    if (state->iteration() != 2 || !state->local())
      throw std::runtime_error(fmt::format("iteration() = {}", state->iteration()));

    // No subgroup given: this host's ranks (both here), made at the first local iteration.
    auto host = std::make_shared<PostLocalSgdState>(PostLocalSgdOptions{.start_local_sgd_iter = 1});
    for (const auto& outcome : run_steps(*pg, pg, post_local_sgd_hook(host), 3)) {
      if (!outcome.equal_across_ranks)
        throw std::runtime_error("the host subgroup did not average");
    }
    if (!host->subgroup() || host->subgroup()->size() != 2)
      throw std::runtime_error("no host subgroup of both ranks was made");

    // Pure local SGD after the start.
    auto pure = std::make_shared<PostLocalSgdState>(
        PostLocalSgdOptions{.start_local_sgd_iter = 1, .post_local_gradient_allreduce = false});
    const auto pure_outcomes = run_steps(*pg, pg, post_local_sgd_hook(pure), 2);
    if (!pure_outcomes[0].equal_across_ranks || pure_outcomes[1].equal_across_ranks)
      throw std::runtime_error("post_local_gradient_allreduce = false still averaged");
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(PeriodicModelAverager, AveragesEveryPeriodAfterTheWarmUp) {
  const int port = test::free_port();
  const auto results = run_ranks(2, [&](int rank) {
    auto pg = join_group(rank, 2, port);
    PeriodicModelAverager averager({.period = 2, .warmup_steps = 1, .group = pg});
    auto weight = torch::full({3, 2}, 1.0 + rank, torch::kFloat32);
    auto counter = torch::full({2}, 10 * (rank + 1), torch::kFloat64);
    const std::vector<bool> expected{false, true, false, true, false};
    for (std::size_t step = 0; step < expected.size(); ++step) {
      // Diverge between averagings, as local SGD steps do.
      weight.add_(static_cast<double>(rank + 1));
      counter.add_(1.0);
      const auto before_weight = gathered(*pg, weight);
      const auto before_counter = gathered(*pg, counter);
      const bool averaged = averager.average_parameters({weight, counter});
      if (averaged != expected[step])
        throw std::runtime_error(fmt::format("step {}: averaged = {}", step, averaged));
      const auto want_weight = averaged ? before_weight.mean(0) : before_weight[rank];
      const auto want_counter = averaged ? before_counter.mean(0) : before_counter[rank];
      test::expect_close(weight.reshape({-1}).to(torch::kFloat64), want_weight, "weight");
      test::expect_close(counter, want_counter, "counter");
    }
    if (averager.step() != 5) throw std::runtime_error("step() does not count the calls");
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(HierarchicalModelAverager, AveragesOverTheSubgroupOfTheLargestPeriodDividingTheStep) {
  const int size = 4;
  const int port = test::free_port();
  const auto results = run_ranks(size, [&](int rank) {
    auto pg = join_group(rank, size, port);
    // Pairs of ranks every 2 steps, all 4 every 4 steps, from step 1 on.
    HierarchicalModelAverager averager(
        {.period_group_sizes = {{2, 2}, {4, 4}}, .warmup_steps = 1, .group = pg});
    auto weight = torch::full({3}, 1.0 + rank, torch::kFloat64);
    const std::vector<int> expected{0, 0, 2, 0, 4, 0, 2};
    for (std::size_t step = 0; step < expected.size(); ++step) {
      weight.add_(static_cast<double>(rank * rank + 1));  // diverge between averagings
      const auto before = gathered(*pg, weight);
      const int averaged = averager.average_parameters({weight});
      if (averaged != expected[step])
        throw std::runtime_error(fmt::format("step {}: averaged over {}", step, averaged));
      const int first = averaged == 0 ? rank : rank / averaged * averaged;
      const auto want = before.narrow(0, first, std::max(averaged, 1)).mean(0);
      test::expect_close(weight, want, fmt::format("weight after step {}", step), 1e-12, 1e-12);
    }
    using Pairs = std::vector<std::pair<std::int64_t, int>>;
    auto refused = [&](Pairs pairs, std::int64_t warmup, const std::string& words) {
      test::expect_throws<ConfigError>(
          [&] {
            HierarchicalModelAverager bad(
                {.period_group_sizes = std::move(pairs), .warmup_steps = warmup, .group = pg});
          },
          words, "bad HierarchicalModelAverager options");
    };
    refused({}, 0, "is empty");
    refused({{4, 2}, {2, 4}}, 0, "larger than the one before");
    refused({{2, 3}, {4, 4}}, 0, "group size 3 (pair 0) does not divide");
    refused({{2, 2}}, 0, "must be the whole group's (4)");
    refused({{2, 4}}, -1, "negative");
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(PostLocalSgd, BadOptionsAreConfigErrors) {
  EXPECT_THROW(PostLocalSgdState({.start_local_sgd_iter = -1}), ConfigError);
  EXPECT_THROW(post_local_sgd_hook(nullptr), ConfigError);
  EXPECT_THROW(PeriodicModelAverager({.period = 0}), ConfigError);
  EXPECT_THROW(PeriodicModelAverager({.period = 2, .warmup_steps = -1}), ConfigError);
}

}  // namespace DDP_UNITY_ID
}  // namespace
}  // namespace ddp
