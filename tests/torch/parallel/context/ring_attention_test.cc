// ddp::ring_attention (ring_attention.h) in real processes, float64: at cp 2 and 3 each rank's
// output and the gradients of its queries, keys and values equal their positions of one process's
// causal attention (1e-12); the load-balanced layout's positions; bad sequences named.
#include <chrono>
#include <cmath>
#include <limits>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "ddp/error.h"
#include "ddp/torch/parallel/context/ring_attention.h"
#include "ddp/torch/parallel/tensor/gpt_block.h"
#include "support/multiprocess.h"
#include "support/torch/ddp_test_util.h"
#include "support/unity_namespace.h"

namespace ddp {
namespace {
namespace DDP_UNITY_ID {

using test::join_group;
using test::run_ranks;

constexpr std::int64_t kBatch = 2, kHeads = 3, kSequence = 12, kHeadDim = 4;

torch::Tensor filled(double phase) {
  return torch::sin(torch::arange(kBatch * kHeads * kSequence * kHeadDim, torch::kFloat64) * 0.37 +
                    phase)
      .reshape({kBatch, kHeads, kSequence, kHeadDim});
}

// One process's causal attention.
torch::Tensor causal_attention(const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v) {
  auto s = torch::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(kHeadDim));
  s = s.masked_fill(torch::ones({kSequence, kSequence}, torch::kBool).triu(1),
                    -std::numeric_limits<double>::infinity());
  return torch::matmul(torch::softmax(s, -1), v);
}

void expect_ring_equals_one_process(int world) {
  const int port = test::free_port();
  const auto results = run_ranks(world, [&](int rank) {
    auto cp = join_group(rank, world, port);
    const auto weight = filled(3.0);  // the loss: sum(out * weight)
    std::vector<torch::Tensor> full;
    for (const double phase : {0.0, 1.0, 2.0})
      full.push_back(filled(phase).requires_grad_(true));
    const auto want = causal_attention(full[0], full[1], full[2]);
    (want * weight).sum().backward();

    std::vector<torch::Tensor> mine;
    for (const auto& t : full)
      mine.push_back(context_parallel_shard(t.detach(), 2, *cp).requires_grad_(true));
    const auto got = ring_attention(mine[0], mine[1], mine[2], cp);
    (got * context_parallel_shard(weight, 2, *cp)).sum().backward();
    const auto what = fmt::format("cp {} rank {}", world, rank);
    test::expect_close(got.detach(), context_parallel_shard(want.detach(), 2, *cp),
                       what + ": the output", 1e-12, 1e-13);
    const char* names[] = {"q", "k", "v"};
    for (int i = 0; i < 3; ++i) {
      test::expect_close(mine[static_cast<std::size_t>(i)].grad(),
                         context_parallel_shard(full[static_cast<std::size_t>(i)].grad(), 2, *cp),
                         fmt::format("{}: the gradient of {}", what, names[i]), 1e-12, 1e-13);
    }
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(RingAttention, TwoRanksEqualOneProcessForwardAndBackward) {
  expect_ring_equals_one_process(2);
}

TEST(RingAttention, ThreeRanksEqualOneProcessForwardAndBackward) {
  expect_ring_equals_one_process(3);
}

TEST(RingAttention, EachRankHoldsAChunkFromTheFrontAndOneFromTheBack) {
  const int port = test::free_port();
  const auto results = run_ranks(2, [&](int rank) {
    auto cp = join_group(rank, 2, port);
    const auto positions = context_parallel_positions(8, *cp);
    const auto want =
        rank == 0 ? std::vector<std::int64_t>{0, 1, 6, 7} : std::vector<std::int64_t>{2, 3, 4, 5};
    if (!torch::equal(positions, torch::tensor(want, torch::kInt64)))
      throw std::runtime_error("rank " + std::to_string(rank) + " holds other positions");
    test::expect_throws<ConfigError>([&] { context_parallel_positions(10, *cp); },
                                     "a sequence of 10 does not split into 2 x cp = 4 equal chunks",
                                     "a sequence not divisible by 2 cp");
    const auto odd = torch::zeros({1, 1, 3, 2}, torch::kFloat64);
    test::expect_throws<ConfigError>([&] { ring_attention(odd, odd, odd, cp); },
                                     "not two equal chunks", "an odd local sequence");
    // A block with dropout cannot drop probabilities the ring never holds whole.
    GptBlock dropping(GptBlockOptions{.hidden = 8, .heads = 2, .dropout = 0.1, .seed = 1});
    test::expect_throws<ConfigError>([&] { dropping->context_parallel(cp); },
                                     "the block has dropout 0.1",
                                     "a context-parallel block with dropout");
    GptBlock twice(GptBlockOptions{.hidden = 8, .heads = 2, .seed = 1});
    twice->context_parallel(cp);
    test::expect_throws<ConfigError>([&] { twice->context_parallel(cp); },
                                     "context-parallel already", "context_parallel twice");
  });
  EXPECT_ALL_RANKS_OK(results);
}

// Ranks whose local sequences differ (a caller that sharded one of them otherwise): the first
// exchange of keys fails on every rank, well within the group's timeout, never a hang.
TEST(RingAttention, RanksWithDifferentLocalSequencesFailOnEveryRank) {
  using namespace std::chrono_literals;
  const int port = test::free_port();
  const auto results = run_ranks(2, [&](int rank) {
    auto cp = join_group(rank, 2, port, 10s);
    const auto t = torch::zeros({1, 1, rank == 0 ? 4 : 6, 2}, torch::kFloat64);
    const auto start = std::chrono::steady_clock::now();
    try {
      ring_attention(t, t, t, cp);
    } catch (const std::exception& e) {
      if (std::chrono::steady_clock::now() - start > 12s)
        throw std::runtime_error(std::string("the failure took past the timeout: ") + e.what());
      return;
    }
    throw std::runtime_error("ranks with different local sequences attended without an error");
  });
  EXPECT_ALL_RANKS_OK(results);
}

}  // namespace DDP_UNITY_ID
}  // namespace
}  // namespace ddp
