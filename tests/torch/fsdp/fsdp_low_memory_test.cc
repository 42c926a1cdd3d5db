// FsdpOptions::low_memory_backward: each parameter's gradient reduced to the ranks whose shards it
// spans as soon as it is ready, nothing prefetched. Trained side by side with the default
// (overlapping) wrapper of every strategy, from the same start, on ranks whose shards split
// parameters (world 3: every unit padded, most parameters spanning two or three owners), with
// no_sync() micro-batches between synchronised ones, a parameter that gets no gradient, and bf16
// mixed precision.
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "ddp/torch/fsdp/fsdp_memory.h"
#include "ddp/torch/fsdp/fully_sharded_data_parallel.h"
#include "support/multiprocess.h"
#include "support/torch/ddp_test_util.h"
#include "support/torch/deterministic_models.h"
#include "support/unity_namespace.h"

namespace ddp {
namespace {
namespace DDP_UNITY_ID {

constexpr int kSteps = 6;

// A Linear whose forward also runs `used` and never `unused`: `unused` gets no gradient in any
// pass, which the low-memory reduction counts as zero on every rank.
struct WithUnusedImpl : torch::nn::Module {
  WithUnusedImpl() {
    torch::manual_seed(11);
    used = register_module("used", torch::nn::Linear(test::kShardedIn, 5));
    unused = register_module("unused", torch::nn::Linear(5, 3));
    head = register_module("head", torch::nn::Linear(5, 2));
  }
  torch::Tensor forward(torch::Tensor x) { return head(torch::tanh(used(x))); }
  torch::nn::Linear used{nullptr}, unused{nullptr}, head{nullptr};
};
TORCH_MODULE(WithUnused);

// Steps on both wrappers: odd steps accumulate one micro-batch under no_sync() first.
void train(FullyShardedDataParallel& fsdp, torch::optim::Optimizer& opt, int rank, int world) {
  for (int step = 0; step < kSteps; ++step) {
    opt.zero_grad();
    if (step % 2 == 1) {
      auto guard = fsdp->no_sync();
      auto [x, y] = test::sharded_suite_batch(rank, world, 50 + step);
      torch::mse_loss(fsdp->forward(x).to(y.scalar_type()), y).backward();
    }
    auto [x, y] = test::sharded_suite_batch(rank, world, step);
    torch::mse_loss(fsdp->forward(x).to(y.scalar_type()), y).backward();
    opt.step();
  }
}

template <typename MakeModel>
void expect_low_memory_equals_default(int world, ShardingStrategy strategy, int rank,
                                      const std::shared_ptr<ProcessGroup>& pg,
                                      const MakeModel& make_model, const std::string& name,
                                      FsdpMixedPrecision mixed_precision = {}) {
  FsdpOptions overlapping{
      .sharding_strategy = strategy, .min_num_params = 30, .mixed_precision = mixed_precision};
  if (strategy == ShardingStrategy::kHybridShard) {
    overlapping.shard_group = split_group({{0, 1}, {2, 3}}, pg);
    overlapping.replicate_group = split_group({{0, 2}, {1, 3}}, pg);
  }
  FsdpOptions low = overlapping;
  low.low_memory_backward = true;
  FullyShardedDataParallel want(make_model(), pg, overlapping);
  FullyShardedDataParallel got(make_model(), pg, low);
  // SGD: its steps scale with the gradients (Adam's would hide a wrong scale).
  torch::optim::SGD want_opt(want->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  torch::optim::SGD got_opt(got->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  train(want, want_opt, rank, world);
  train(got, got_opt, rank, world);
  const auto want_state = want->full_state_dict(0);
  const auto got_state = got->full_state_dict(0);
  if (rank != 0) return;
  if (want_state.size() != got_state.size() || want_state.is_empty()) {
    throw std::runtime_error(name + ": the state dicts differ in size");
  }
  for (const auto& item : want_state) {
    // The sums are the same numbers added in another grouping: fp32 rounding apart.
    test::expect_close(got_state[item.key()], item.value(), name + " " + item.key(), 1e-5, 1e-6);
  }
}

TEST(FsdpLowMemoryBackward, EveryStrategyTrainsAsTheOverlappingWrapperWithNoSyncAndAnUnusedLayer) {
  for (const int world : {3, 4}) {
    const int port = test::free_port();
    const auto results = test::run_ranks(world, [&](int rank) {
      auto pg = test::join_group(rank, world, port);
      const std::vector<ShardingStrategy> strategies =
          world == 4 ? std::vector{ShardingStrategy::kHybridShard}
                     : std::vector{ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp,
                                   ShardingStrategy::kNoShard};
      for (const auto strategy : strategies) {
        const std::string name = fmt::format("{} at world {}", to_string(strategy), world);
        expect_low_memory_equals_default(
            world, strategy, rank, pg, [] { return test::sharded_suite_model(); }, name);
        expect_low_memory_equals_default(
            world, strategy, rank, pg, [] { return WithUnused(); }, name + " (unused layer)");
        // bf16 gathers and bf16 sums (pre-divided, then upcast into the fp32 shards' gradients).
        expect_low_memory_equals_default(
            world, strategy, rank, pg, [] { return test::sharded_suite_model(); },
            name + " (bf16 mixed precision)",
            {.param_dtype = torch::kBFloat16, .reduce_dtype = torch::kBFloat16});
      }
    });
    EXPECT_ALL_RANKS_OK(results);
  }
}

// Backward's flat buffers: one gathered unit at a time and no flat gradient (FULL_SHARD), every
// unit gathered and no flat gradient (SHARD_GRAD_OP): exactly, at world 2 on four equal units.
TEST(FsdpLowMemoryBackward, HoldsOneGatheredUnitAndNoFlatGradient) {
  constexpr std::int64_t kWidth = 128, kUnit = kWidth * kWidth + kWidth;  // even: no padding
  const int port = test::free_port();
  const auto results = test::run_ranks(2, [&](int rank) {
    auto pg = test::join_group(rank, 2, port);
    for (const auto strategy : {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp}) {
      torch::manual_seed(3);
      torch::nn::Sequential model(torch::nn::Linear(kWidth, kWidth));
      for (int u = 1; u < 4; ++u) {
        model->push_back(torch::nn::Tanh());
        model->push_back(torch::nn::Linear(kWidth, kWidth));
      }
      FullyShardedDataParallel fsdp(model, pg,
                                    FsdpOptions{.sharding_strategy = strategy,
                                                .min_num_params = 10'000,
                                                .low_memory_backward = true});
      torch::optim::SGD opt(fsdp->parameters(), torch::optim::SGDOptions(0.01));
      for (int step = 0; step < 2; ++step) {
        if (step == 1) reset_fsdp_buffer_peak();
        opt.zero_grad();
        torch::manual_seed(100 + rank);
        fsdp->forward(torch::randn({8, kWidth})).pow(2).mean().backward();
        opt.step();
      }
      const std::int64_t want = strategy == ShardingStrategy::kFullShard ? 4 * kUnit : 16 * kUnit;
      const auto peak = fsdp_buffer_bytes(FsdpMemoryPlace::kHost).peak;
      if (peak != want) {
        throw std::runtime_error(fmt::format("{}: a step's flat buffers peaked at {} bytes, not {}",
                                             to_string(strategy), peak, want));
      }
    }
  });
  EXPECT_ALL_RANKS_OK(results);
}

}  // namespace DDP_UNITY_ID
}  // namespace
}  // namespace ddp
