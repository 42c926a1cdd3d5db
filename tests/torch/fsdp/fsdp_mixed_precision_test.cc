// FullyShardedDataParallel with FsdpOptions::mixed_precision (PyTorch's FSDP MixedPrecision), in
// real processes. The shards' fp32 gradients, and the fp32 weights SGD steps with them, equal
// what each rank computes on its own 16-bit copy of the model, upcast and averaged (reduced in
// fp32, or in bf16 to bf16's precision); the gathered parameters take 2 bytes per element; a
// buffer_dtype casts the buffers and full_state_dict returns them as they were; bad dtypes and
// ranks that disagree are named on every rank.
#include <cstdint>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "ddp/error.h"
#include "ddp/torch/fsdp/fully_sharded_data_parallel.h"
#include "support/multiprocess.h"
#include "support/torch/ddp_test_util.h"
#include "support/unity_namespace.h"

namespace ddp {
namespace {
namespace DDP_UNITY_ID {

using test::join_group;
using test::run_ranks;
using ::testing::HasSubstr;

// Children: Linear(6, 9) 63 parameters, Tanh, Linear(9, 5) 50, Tanh, Linear(5, 2) 12. With
// min_num_params 30: units [0, 1), [1, 3), [3, 5), none a multiple of 2 or 3 (padded shards).
torch::nn::Sequential make_net() {
  torch::manual_seed(5);
  return torch::nn::Sequential(torch::nn::Linear(6, 9), torch::nn::Tanh(), torch::nn::Linear(9, 5),
                               torch::nn::Tanh(), torch::nn::Linear(5, 2));
}

torch::Tensor batch_of(int rank, int step) {
  torch::manual_seed(200 + 10 * rank + step);
  return torch::randn({4, 6});
}

// This rank's fp32 gradients of `master` computed on a copy of it in `dtype`, upcast.
std::vector<torch::Tensor> local_low_precision_gradients(const torch::nn::Sequential& master,
                                                         const torch::Tensor& x,
                                                         torch::ScalarType dtype) {
  auto copy = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(master->clone());
  copy->to(dtype);
  copy->forward(x.to(dtype)).pow(2).sum().backward();
  std::vector<torch::Tensor> grads;
  for (const auto& p : copy->parameters())
    grads.push_back(p.grad().to(torch::kFloat));
  return grads;
}

// This rank's part of `per_parameter` laid out as FSDP's units are: unit u's parameters
// flattened, padded to padded_numel, and the rank's shard_numel elements of it.
std::vector<torch::Tensor> shards_of(const FullyShardedDataParallel& fsdp,
                                     const std::vector<torch::Tensor>& per_parameter, int rank) {
  std::vector<torch::Tensor> out;
  std::size_t next = 0;
  for (std::size_t u = 0; u < fsdp->unit_count(); ++u) {
    const auto info = fsdp->unit_info(u);
    std::vector<torch::Tensor> pieces;
    std::int64_t numel = 0;
    while (numel < info.numel) {
      pieces.push_back(per_parameter.at(next).reshape(-1));
      numel += per_parameter.at(next++).numel();
    }
    auto flat = torch::zeros({info.padded_numel}, torch::kFloat);
    flat.narrow(0, 0, numel).copy_(torch::cat(pieces));
    const auto mine = info.shard_numel == info.padded_numel ? 0 : rank * info.shard_numel;
    out.push_back(flat.narrow(0, mine, info.shard_numel));
  }
  return out;
}

// Throws unless `got` is fp32 and within rtol/atol of `want`.
void expect_fp32_close(const torch::Tensor& got, const torch::Tensor& want, double rtol,
                       double atol, const std::string& what) {
  if (got.scalar_type() != torch::kFloat) {
    throw std::runtime_error(what + " is " + std::string(c10::toString(got.scalar_type())) +
                             ", not fp32");
  }
  test::expect_close(got, want, what, rtol, atol);
}

// For each strategy at world `size`: three SGD steps of an FSDP model with `mp` against a
// reference fp32 master model stepped with the averaged low-precision gradients.
void expect_mixed_precision_equals_reference(int size, FsdpMixedPrecision mp,
                                             std::vector<ShardingStrategy> strategies, double rtol,
                                             double atol) {
  const int port = test::free_port();
  const auto results = run_ranks(size, [&](int rank) {
    auto pg = join_group(rank, size, port);
    const auto compute = mp.param_dtype.value_or(torch::kFloat);
    for (const auto strategy : strategies) {
      const std::string name = to_string(strategy);
      auto reference = make_net();
      FullyShardedDataParallel fsdp(
          make_net(), pg,
          FsdpOptions{.sharding_strategy = strategy, .min_num_params = 30, .mixed_precision = mp});
      torch::optim::SGD opt(fsdp->parameters(), 0.1);
      torch::optim::SGD reference_opt(reference->parameters(), 0.1);
      for (int step = 0; step < 3; ++step) {
        const auto x = batch_of(rank, step);
        const auto want =
            test::averaged_over_ranks(*pg, local_low_precision_gradients(reference, x, compute));
        opt.zero_grad();
        const auto out = fsdp->forward(x);
        if (out.scalar_type() != compute) {
          throw std::runtime_error(name + ": the output is " +
                                   std::string(c10::toString(out.scalar_type())));
        }
        out.pow(2).sum().backward();
        const auto want_shards = shards_of(fsdp, want, rank);
        for (std::size_t u = 0; u < want_shards.size(); ++u) {
          const auto shard = fsdp->parameters()[u];
          if (shard.scalar_type() != torch::kFloat) throw std::runtime_error(name + ": shard");
          expect_fp32_close(shard.grad(), want_shards[u], rtol, atol,
                            fmt::format("{} step {} unit {} gradient", name, step, u));
          // At world 2 a 16-bit reduction is pre-divided by 2 and not divided after: the fp32
          // gradient is the 16-bit sum itself, so it survives a round trip through that dtype.
          if (size == 2 && mp.reduce_dtype && *mp.reduce_dtype != torch::kFloat &&
              !torch::equal(shard.grad().to(*mp.reduce_dtype).to(torch::kFloat), shard.grad())) {
            throw std::runtime_error(name + ": the gradient was not reduced in reduce_dtype");
          }
        }
        opt.step();
        reference_opt.zero_grad();
        const auto params = reference->parameters();
        for (std::size_t i = 0; i < params.size(); ++i)
          params[i].mutable_grad() = want[i];
        reference_opt.step();
      }
      // The gathered parameters take the 16-bit dtype's bytes: SHARD_GRAD_OP keeps them all.
      if (strategy == ShardingStrategy::kShardGradOp) {
        std::int64_t padded = 0;
        for (std::size_t u = 0; u < fsdp->unit_count(); ++u)
          padded += fsdp->unit_info(u).padded_numel;
        const auto expected = padded * static_cast<std::int64_t>(c10::elementSize(compute));
        if (fsdp->gathered_parameter_bytes() != expected) {
          throw std::runtime_error(fmt::format("{}: {} gathered bytes, expected {}", name,
                                               fsdp->gathered_parameter_bytes(), expected));
        }
      }
      const auto state = fsdp->full_state_dict(0);
      if (rank != 0) continue;
      const auto want_state = reference->named_parameters();
      for (const auto& item : want_state) {
        expect_fp32_close(state[item.key()], item.value().detach(), rtol, atol,
                          name + " parameter " + item.key() + " after 3 steps");
      }
    }
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(FsdpMixedPrecision, Bf16ParametersReducedInFp32EqualTheUpcastAverageForEveryStrategy) {
  expect_mixed_precision_equals_reference(
      2, {.param_dtype = torch::kBFloat16, .reduce_dtype = torch::kFloat},
      {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp, ShardingStrategy::kNoShard},
      1e-5, 1e-6);
}

TEST(FsdpMixedPrecision, Bf16ParametersReducedInFp16AtWorldThreeEqualTheAverageToFp16Precision) {
  // World 3: PyTorch's pre-divide factor is 2 and the post-divide 1.5. (Compute in fp16 needs a
  // libtorch whose CPU matmul takes Half, which 1.13's does not.)
  expect_mixed_precision_equals_reference(
      3, {.param_dtype = torch::kBFloat16, .reduce_dtype = torch::kHalf},
      {ShardingStrategy::kFullShard, ShardingStrategy::kNoShard}, 2e-3, 2e-4);
}

TEST(FsdpMixedPrecision, Fp32ParametersReducedInBf16EqualTheAverageToBf16Precision) {
  expect_mixed_precision_equals_reference(2, {.reduce_dtype = torch::kBFloat16},
                                          {ShardingStrategy::kShardGradOp}, 1e-2, 1e-3);
}

TEST(FsdpMixedPrecision, BufferDtypeCastsTheBuffersAndTheFullStateDictReturnsThemAsTheyWere) {
  const int size = 2;
  const int port = test::free_port();
  const auto results = run_ranks(size, [&](int rank) {
    auto pg = join_group(rank, size, port);
    torch::manual_seed(1);
    torch::nn::Sequential net(torch::nn::Linear(6, 4), torch::nn::BatchNorm1d(4),
                              torch::nn::Linear(4, 2));
    FullyShardedDataParallel fsdp(
        net, pg,
        FsdpOptions{.min_num_params = 1,
                    .mixed_precision = {.param_dtype = torch::kBFloat16,
                                        .buffer_dtype = torch::kBFloat16}});
    for (const auto& b : net->named_buffers()) {
      const auto want = b.value().is_floating_point() ? torch::kBFloat16 : torch::kLong;
      if (b.value().scalar_type() != want) throw std::runtime_error(b.key() + " was not cast");
    }
    fsdp->forward(batch_of(rank, 0)).pow(2).sum().backward();
    // Each rank's statistics moved with its own batch (buffers are not reduced).
    const auto state = fsdp->full_state_dict(0);
    if (rank != 0) return;
    const auto& mean = state["1.running_mean"];
    if (mean.scalar_type() != torch::kFloat) throw std::runtime_error("running_mean not fp32");
    const auto x = batch_of(0, 0);
    // 0.1 of the batch mean of the first layer's output (bf16 compute: to bf16's precision).
    const auto first = state["0.weight"];
    const auto want = 0.1 * torch::addmm(state["0.bias"], x, first.t()).mean(0);
    expect_fp32_close(mean, want, 2e-2, 2e-3, "running_mean");
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(FsdpMixedPrecision, ADtypeItCannotComputeOrReduceInIsNamedOnEveryRank) {
  const int size = 2;
  const int port = test::free_port();
  const auto results = run_ranks(size, [&](int rank) {
    auto pg = join_group(rank, size, port);
    // Rank 1 alone asks for int32 compute: every rank names it.
    FsdpMixedPrecision bad_on_one;
    if (rank == 1) bad_on_one.param_dtype = torch::kInt;
    test::expect_throws<ConfigError>(
        [&] {
          FullyShardedDataParallel(
              make_net(), pg, FsdpOptions{.min_num_params = 30, .mixed_precision = bad_on_one});
        },
        "FsdpMixedPrecision::param_dtype is Int", "int32 param_dtype on rank 1");
    test::expect_throws<ConfigError>(
        [&] {
          FullyShardedDataParallel(
              make_net(), pg,
              FsdpOptions{.min_num_params = 30,
                          .mixed_precision = {.reduce_dtype = torch::kDouble}});
        },
        "FsdpMixedPrecision::reduce_dtype is Double", "float64 reduce_dtype");
    test::expect_throws<ConfigError>(
        [&] {
          FullyShardedDataParallel(
              make_net(), pg,
              FsdpOptions{.min_num_params = 30, .mixed_precision = {.buffer_dtype = torch::kLong}});
        },
        "FsdpMixedPrecision::buffer_dtype is Long", "int64 buffer_dtype");
    // Valid on each rank, different across them: named as a difference.
    FsdpMixedPrecision differs;
    differs.param_dtype = rank == 0 ? torch::kBFloat16 : torch::kHalf;
    test::expect_throws<Error>(
        [&] {
          FullyShardedDataParallel(make_net(), pg,
                                   FsdpOptions{.min_num_params = 30, .mixed_precision = differs});
        },
        "mixed precision: param", "param_dtype that differs across ranks");
  });
  EXPECT_ALL_RANKS_OK(results);
}

}  // namespace DDP_UNITY_ID
}  // namespace
}  // namespace ddp
