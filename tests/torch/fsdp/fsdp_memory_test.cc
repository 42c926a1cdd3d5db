// fsdp_memory.h: FullyShardedDataParallel's flat buffers beside its shards, counted where they are
// allocated, against the formula of docs/sharding.md ("CPU offload"), on the CPU at world 2
// (gpu_test.cc checks the device's count with cpu_offload on CUDA). The model has four equal
// units, so that the formula's "largest unit" is every unit.
#include <cstdint>
#include <stdexcept>
#include <string>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "ddp/torch/fsdp/fsdp_memory.h"
#include "ddp/torch/fsdp/fully_sharded_data_parallel.h"
#include "support/multiprocess.h"
#include "support/torch/ddp_test_util.h"
#include "support/unity_namespace.h"

namespace ddp {
namespace {
namespace DDP_UNITY_ID {

constexpr std::int64_t kWidth = 256;
constexpr std::int64_t kUnitParams = kWidth * kWidth + kWidth;  // one Linear: 65,792 (even)
constexpr int kUnits = 4;

// Linear, then (Tanh, Linear) three times: with min_num_params 60,000 every Linear closes a unit.
torch::nn::Sequential four_equal_units() {
  torch::manual_seed(3);
  torch::nn::Sequential model(torch::nn::Linear(kWidth, kWidth));
  for (int u = 1; u < kUnits; ++u) {
    model->push_back(torch::nn::Tanh());
    model->push_back(torch::nn::Linear(kWidth, kWidth));
  }
  return model;
}

void one_step(FullyShardedDataParallel& fsdp, torch::optim::Optimizer& opt, int rank) {
  opt.zero_grad();
  torch::manual_seed(100 + rank);
  fsdp->forward(torch::randn({8, kWidth})).pow(2).mean().backward();
  opt.step();
}

// The formula's bytes, fp32 (4 bytes), U elements in the largest unit: FULL_SHARD holds two
// gathered units (the one computing and the one prefetched) and two units' full flat gradients
// (the one filling and the one in its reduce-scatter): 4·(2U + 2U). SHARD_GRAD_OP keeps every
// unit gathered instead: 4·(ΣU + 2U).
std::int64_t formula_bytes(ShardingStrategy strategy) {
  const std::int64_t gathered =
      strategy == ShardingStrategy::kFullShard ? 2 * kUnitParams : kUnits * kUnitParams;
  return 4 * (gathered + 2 * kUnitParams);
}

TEST(FsdpMemory, FlatBuffersBesideTheShardsFollowTheFormula) {
  const int port = test::free_port();
  const auto results = test::run_ranks(2, [&](int rank) {
    auto pg = test::join_group(rank, 2, port);
    for (const auto strategy : {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp}) {
      const std::string name = to_string(strategy);
      FullyShardedDataParallel fsdp(four_equal_units(), pg,
                                    FsdpOptions{.sharding_strategy = strategy,
                                                .min_num_params = 60'000,
                                                .cpu_offload = {.offload_params = true}});
      if (fsdp->unit_count() != kUnits) throw std::runtime_error("not four units");
      torch::optim::SGD opt(fsdp->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
      one_step(fsdp, opt, rank);  // the first step allocates what later steps reuse
      // Between steps FULL_SHARD keeps nothing beside the shards; SHARD_GRAD_OP its full units.
      const std::int64_t kept =
          strategy == ShardingStrategy::kFullShard ? 0 : 4 * kUnits * kUnitParams;
      const auto between = fsdp_buffer_bytes(FsdpMemoryPlace::kHost);
      if (between.live != kept) {
        throw std::runtime_error(
            fmt::format("{}: {} bytes held between steps, expected {}", name, between.live, kept));
      }
      reset_fsdp_buffer_peak();
      one_step(fsdp, opt, rank);
      const auto step = fsdp_buffer_bytes(FsdpMemoryPlace::kHost);
      const std::int64_t formula = formula_bytes(strategy);
      // At most the formula (a buffer held longer than it says fails here), and at least 85 % of
      // it (what the formula counts is really allocated, and counted).
      if (step.peak > formula || step.peak < formula * 85 / 100 || step.live != kept) {
        throw std::runtime_error(
            fmt::format("{}: peak {} bytes, live after the step {}; formula {}", name, step.peak,
                        step.live, formula));
      }
      if (fsdp_buffer_bytes(FsdpMemoryPlace::kDevice).peak != 0) {
        throw std::runtime_error("device memory counted on the CPU");
      }
    }
  });
  EXPECT_ALL_RANKS_OK(results);
}

}  // namespace DDP_UNITY_ID
}  // namespace
}  // namespace ddp
