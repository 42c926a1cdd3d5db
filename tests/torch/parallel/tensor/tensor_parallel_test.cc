// Tensor parallelism across real processes, in float64 against one process computed in each rank:
// the region functions (forward and backward), the layers, a small GPT (vocab-parallel
// embedding, a parallelised GptBlock, a column-parallel head, vocab-parallel cross-entropy)
// trained 5 SGD steps with TP=2 and with DP=2 x TP=2, parameter memory per rank, the RNG
// tracker, and bad input refused on every rank.
#include <chrono>
#include <cmath>
#include <cstdint>
#include <functional>
#include <numeric>
#include <stdexcept>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "ddp/comm/comm_error.h"
#include "ddp/error.h"
#include "ddp/torch/api/distributed.h"
#include "ddp/torch/ddp/distributed_data_parallel.h"
#include "ddp/torch/parallel/mesh/device_mesh.h"
#include "ddp/torch/parallel/tensor/gpt_block.h"
#include "ddp/torch/parallel/tensor/tensor_parallel.h"
#include "support/multiprocess.h"
#include "support/torch/ddp_test_util.h"
#include "support/torch/deterministic_models.h"
#include "support/unity_namespace.h"

namespace ddp {
namespace {
namespace DDP_UNITY_ID {

using namespace std::chrono_literals;
using test::expect_close;
using test::join_group;
using test::run_ranks;

constexpr auto kF64 = torch::kFloat64;

void check(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error(what);
}

template <class F>
void expect_config_error(F&& expression, const std::string& needle, const std::string& what) {
  try {
    expression();
  } catch (const ConfigError& error) {
    if (std::string(error.what()).find(needle) == std::string::npos) {
      throw std::runtime_error(
          fmt::format("{}: the error \"{}\" does not say \"{}\"", what, error.what(), needle));
    }
    return;
  }
  throw std::runtime_error(what + ": no ConfigError");
}

// A deterministic tensor that differs with `salt` (a rank, a step, a name).
torch::Tensor pattern(std::vector<std::int64_t> shape, double salt) {
  const auto n =
      std::accumulate(shape.begin(), shape.end(), std::int64_t{1}, std::multiplies<std::int64_t>());
  return torch::sin(torch::arange(n, kF64) * 0.37 + salt * 1.7).reshape(shape);
}

torch::Tensor leaf(const torch::Tensor& t) {
  return t.clone().requires_grad_(true);
}

// ---- The region functions ------------------------------------------------------------------
// Each rank holds rank-specific inputs and upstream gradients, computable on every rank, so the
// one-process result (what a single process holding every rank's part would compute) is checked
// locally.
TEST(TensorParallel, RegionFunctionsMatchOneProcessForwardAndBackward) {
  const int port = test::free_port();
  const auto results = run_ranks(2, [&](int rank) {
    auto tp = join_group(rank, 2, port);
    const int size = 2;
    const auto of_rank = [&](auto make) {
      std::vector<torch::Tensor> all;
      for (int r = 0; r < size; ++r)
        all.push_back(make(r));
      return all;
    };

    {  // copy_to: identity forward; backward sums the ranks' gradients.
      auto x = leaf(pattern({4, 6}, 0));
      auto y = copy_to_tensor_parallel_region(x, tp);
      expect_close(y, x.detach(), "copy_to forward", 1e-12, 1e-12);
      y.backward(pattern({4, 6}, 10 + rank));
      const auto grads = of_rank([](int r) { return pattern({4, 6}, 10 + r); });
      expect_close(x.grad(), grads[0] + grads[1], "copy_to backward", 1e-12, 1e-12);
    }
    {  // reduce_from: forward sums the ranks' parts; identity backward.
      auto x = leaf(pattern({4, 6}, 20 + rank));
      auto y = reduce_from_tensor_parallel_region(x, tp);
      const auto parts = of_rank([](int r) { return pattern({4, 6}, 20 + r); });
      expect_close(y, parts[0] + parts[1], "reduce_from forward", 1e-12, 1e-12);
      y.backward(pattern({4, 6}, 30));
      expect_close(x.grad(), pattern({4, 6}, 30), "reduce_from backward", 1e-12, 1e-12);
    }
    {  // scatter_to (last dim): keep own part; backward gathers the parts' gradients.
      auto x = leaf(pattern({4, 6}, 40));
      auto y = scatter_to_tensor_parallel_region(x, tp);
      expect_close(y, pattern({4, 6}, 40).narrow(1, 3 * rank, 3), "scatter_to forward", 1e-12,
                   1e-12);
      y.backward(pattern({4, 3}, 50 + rank));
      const auto grads = of_rank([](int r) { return pattern({4, 3}, 50 + r); });
      expect_close(x.grad(), torch::cat(grads, 1), "scatter_to backward", 1e-12, 1e-12);
    }
    {  // gather_from (last dim): concatenation; backward keeps own part of the whole gradient.
      auto x = leaf(pattern({4, 3}, 60 + rank));
      auto y = gather_from_tensor_parallel_region(x, tp);
      const auto parts = of_rank([](int r) { return pattern({4, 3}, 60 + r); });
      expect_close(y, torch::cat(parts, 1), "gather_from forward", 1e-12, 1e-12);
      y.backward(pattern({4, 6}, 70));
      expect_close(x.grad(), pattern({4, 6}, 70).narrow(1, 3 * rank, 3), "gather_from backward",
                   1e-12, 1e-12);
    }
    {  // scatter_to_sequence (dim 1 of [batch, sequence, hidden]).
      auto x = leaf(pattern({2, 4, 3}, 80));
      auto y = scatter_to_sequence_parallel_region(x, tp, 1);
      expect_close(y, pattern({2, 4, 3}, 80).narrow(1, 2 * rank, 2), "scatter_to_sequence forward",
                   1e-12, 1e-12);
      y.backward(pattern({2, 2, 3}, 90 + rank));
      const auto grads = of_rank([](int r) { return pattern({2, 2, 3}, 90 + r); });
      expect_close(x.grad(), torch::cat(grads, 1), "scatter_to_sequence backward", 1e-12, 1e-12);
    }
    {  // gather_from_sequence (dim 0): concatenation; backward reduce-scatters partial gradients.
      auto x = leaf(pattern({2, 5}, 100 + rank));
      auto y = gather_from_sequence_parallel_region(x, tp, 0);
      const auto parts = of_rank([](int r) { return pattern({2, 5}, 100 + r); });
      expect_close(y, torch::cat(parts, 0), "gather_from_sequence forward", 1e-12, 1e-12);
      y.backward(pattern({4, 5}, 110 + rank));
      const auto grads = of_rank([](int r) { return pattern({4, 5}, 110 + r); });
      expect_close(x.grad(), (grads[0] + grads[1]).narrow(0, 2 * rank, 2),
                   "gather_from_sequence backward", 1e-12, 1e-12);
    }
    {  // reduce_scatter_to_sequence (dim 0): own part of the sum; backward gathers.
      auto x = leaf(pattern({4, 5}, 120 + rank));
      auto y = reduce_scatter_to_sequence_parallel_region(x, tp, 0);
      const auto parts = of_rank([](int r) { return pattern({4, 5}, 120 + r); });
      expect_close(y, (parts[0] + parts[1]).narrow(0, 2 * rank, 2),
                   "reduce_scatter_to_sequence forward", 1e-12, 1e-12);
      y.backward(pattern({2, 5}, 130 + rank));
      const auto grads = of_rank([](int r) { return pattern({2, 5}, 130 + r); });
      expect_close(x.grad(), torch::cat(grads, 0), "reduce_scatter_to_sequence backward", 1e-12,
                   1e-12);
    }
    // Not divisible: refused on every rank, and the group goes on.
    expect_config_error(
        [&] {
          scatter_to_tensor_parallel_region(pattern({4, 5}, 0), tp);
        },
        "not divisible by the group's 2 ranks", "scatter 5 over 2");
    expect_config_error(
        [&] {
          reduce_scatter_to_sequence_parallel_region(pattern({3, 2}, 0), tp, 0);
        },
        "has size 3", "reduce-scatter 3 over 2");
    auto probe = torch::ones({2}, kF64);
    all_reduce(probe, ReduceOp::kSum, *tp);
    check(probe.sum().item<double>() == 4.0, "the group after the refusals");
  });
  EXPECT_ALL_RANKS_OK(results);
}

// ---- The layers ----------------------------------------------------------------------------
TEST(TensorParallel, LayersMatchOneProcessForwardAndBackward) {
  const int port = test::free_port();
  const auto results = run_ranks(2, [&](int rank) {
    auto tp = join_group(rank, 2, port);
    const auto x_full = pattern({3, 4, 6}, 1);  // [batch, sequence, in]

    for (const std::int64_t fused : {1, 3}) {
      for (const bool gather : {false, true}) {
        const auto name = fmt::format("ColumnParallelLinear fused={} gather={}", fused, gather);
        ColumnParallelLinear column(ColumnParallelLinearOptions{.in_features = 6,
                                                                .out_features = 12,
                                                                .gather_output = gather,
                                                                .fused_blocks = fused,
                                                                .seed = 7,
                                                                .dtype = kF64},
                                    tp);
        const auto full = initial_linear_parameters(6, 12, true, 7, kF64);
        auto x = leaf(x_full);
        auto y = column(x);
        auto x_ref = leaf(x_full);
        auto w_ref = leaf(full.weight);
        auto b_ref = leaf(full.bias);
        auto y_ref = torch::linear(x_ref, w_ref, b_ref);
        // This rank's output columns in the full layer's order: rows r of each fused block.
        auto mine = y_ref.reshape({3, 4, fused, 2, -1}).select(3, rank).reshape({3, 4, -1});
        expect_close(y, gather ? y_ref : mine, name + " forward", 1e-12, 1e-12);
        const auto upstream = pattern({3, 4, 12}, 5);
        if (gather) {
          y.backward(upstream);
        } else {  // each rank gives its part of the upstream gradient
          y.backward(upstream.reshape({3, 4, fused, 2, -1}).select(3, rank).reshape({3, 4, -1}));
        }
        y_ref.backward(upstream);
        expect_close(x.grad(), x_ref.grad(), name + " input gradient", 1e-12, 1e-12);
        const auto gathered = column->gather_full();
        expect_close(gathered.weight, full.weight, name + " gathered weight", 0, 0);
        // The shard's gradient is its slice of the full weight's gradient.
        auto grad_w = torch::empty_like(column->weight);
        grad_w.copy_(column->weight.grad());
        auto all_grads = torch::empty({2, 6, 6}, kF64);
        all_gather_into_tensor(all_grads, grad_w, *tp);
        const auto full_grad =
            all_grads.reshape({2, fused, -1, 6}).transpose(0, 1).reshape({12, 6});
        expect_close(full_grad, w_ref.grad(), name + " weight gradient", 1e-12, 1e-12);
      }
    }

    for (const bool parallel_input : {true, false}) {
      const auto name = fmt::format("RowParallelLinear input_is_parallel={}", parallel_input);
      RowParallelLinear row(RowParallelLinearOptions{.in_features = 6,
                                                     .out_features = 5,
                                                     .input_is_parallel = parallel_input,
                                                     .seed = 8,
                                                     .dtype = kF64},
                            tp);
      const auto full = initial_linear_parameters(6, 5, true, 8, kF64);
      auto x = leaf(parallel_input ? x_full.narrow(2, 3 * rank, 3) : x_full);
      auto y = row(x);
      auto x_ref = leaf(x_full);
      auto w_ref = leaf(full.weight);
      auto y_ref = torch::linear(x_ref, w_ref, full.bias);
      expect_close(y, y_ref, name + " forward", 1e-12, 1e-12);
      y.backward(pattern({3, 4, 5}, 6));
      y_ref.backward(pattern({3, 4, 5}, 6));
      expect_close(x.grad(), parallel_input ? x_ref.grad().narrow(2, 3 * rank, 3) : x_ref.grad(),
                   name + " input gradient", 1e-12, 1e-12);
      expect_close(row->weight.grad(), w_ref.grad().narrow(1, 3 * rank, 3),
                   name + " weight gradient", 1e-12, 1e-12);
      expect_close(row->gather_full().weight, full.weight, name + " gathered weight", 0, 0);
    }

    {
      VocabParallelEmbedding embedding(
          VocabParallelEmbeddingOptions{
              .num_embeddings = 10, .embedding_dim = 3, .seed = 9, .dtype = kF64},
          tp);
      const auto table = initial_embedding_weight(10, 3, 9, kF64);
      const auto ids = torch::tensor({0, 4, 5, 9, 5, 2}, torch::kInt64).reshape({2, 3});
      auto y = embedding(ids);
      auto table_ref = leaf(table);
      auto y_ref = torch::embedding(table_ref, ids);
      expect_close(y, y_ref, "VocabParallelEmbedding forward", 1e-12, 1e-12);
      y.backward(pattern({2, 3, 3}, 11));
      y_ref.backward(pattern({2, 3, 3}, 11));
      expect_close(embedding->weight.grad(), table_ref.grad().narrow(0, 5 * rank, 5),
                   "VocabParallelEmbedding weight gradient", 1e-12, 1e-12);
      expect_close(embedding->gather_full(), table, "VocabParallelEmbedding gathered", 0, 0);
      expect_config_error(
          [&] {
            embedding(torch::tensor({3, 10}, torch::kInt64));
          },
          "outside the vocabulary [0, 10)", "id out of range");
    }

    {
      const auto logits_full = pattern({3, 4, 10}, 12) * 3.0;
      const auto target =
          torch::tensor({0, 9, 4, 5, 1, 8, 2, 7, 3, 6, 5, 4}, torch::kInt64).reshape({3, 4});
      auto logits = leaf(logits_full.narrow(2, 5 * rank, 5));
      auto loss = vocab_parallel_cross_entropy(logits, target, tp);
      auto logits_ref = leaf(logits_full);
      auto loss_ref = torch::nn::functional::cross_entropy(
          logits_ref.reshape({12, 10}), target.reshape({12}),
          torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kNone));
      expect_close(loss, loss_ref.reshape({3, 4}), "vocab_parallel_cross_entropy forward", 1e-12,
                   1e-12);
      loss.mean().backward();
      loss_ref.mean().backward();
      expect_close(logits.grad(), logits_ref.grad().narrow(2, 5 * rank, 5),
                   "vocab_parallel_cross_entropy gradient", 1e-12, 1e-12);
      expect_config_error(
          [&] {
            vocab_parallel_cross_entropy(logits, torch::full({3, 4}, 10, torch::kInt64), tp);
          },
          "outside the vocabulary [0, 10)", "target out of range");
    }
  });
  EXPECT_ALL_RANKS_OK(results);
}

// ---- A small GPT, trained ------------------------------------------------------------------
constexpr std::int64_t kVocab = 16, kHidden = 8, kHeads = 4, kSequence = 6, kBatch = 4;
constexpr int kSteps = 5;

GptBlockOptions block_options() {
  return {.hidden = kHidden, .heads = kHeads, .seed = 20, .dtype = kF64};
}

// Token ids and next-token targets of `step` for the whole batch.
std::pair<torch::Tensor, torch::Tensor> batch_of(int step) {
  return test::token_batch(step, kBatch, kSequence, kVocab);
}

// One process: embedding, GptBlock, linear head, cross-entropy, all whole.
struct ReferenceGpt : torch::nn::Module {
  ReferenceGpt() {
    wte = register_parameter("wte", initial_embedding_weight(kVocab, kHidden, 10, kF64));
    block = register_module("block", GptBlock(block_options()));
    head = register_parameter("head",
                              initial_linear_parameters(kHidden, kVocab, false, 30, kF64).weight);
  }
  torch::Tensor loss(const torch::Tensor& ids, const torch::Tensor& targets) {
    const auto logits = torch::linear(block(torch::embedding(wte, ids)), head);
    return torch::nn::functional::cross_entropy(logits.reshape({-1, kVocab}),
                                                targets.reshape({-1}));
  }
  std::vector<std::pair<std::string, torch::Tensor>> full_parameters() {
    std::vector<std::pair<std::string, torch::Tensor>> out = {{"wte", wte.detach()}};
    for (auto& [name, value] : block->full_named_parameters())
      out.emplace_back("block." + name, value);
    out.emplace_back("head", head.detach());
    return out;
  }
  torch::Tensor wte, head;
  GptBlock block{nullptr};
};

// The same model split over `tp`: vocab-parallel embedding, the block parallelised by Megatron's
// plan, a column-parallel head (split over the vocabulary) and vocab-parallel cross-entropy.
struct ParallelGpt : torch::nn::Module {
  explicit ParallelGpt(const std::shared_ptr<ProcessGroup>& tp) : tp(tp) {
    wte = register_module(
        "wte",
        VocabParallelEmbedding(
            VocabParallelEmbeddingOptions{
                .num_embeddings = kVocab, .embedding_dim = kHidden, .seed = 10, .dtype = kF64},
            tp));
    block = register_module("block", GptBlock(block_options()));
    parallelize_module(block, tp, gpt_block_tensor_parallel_plan());
    head = register_module("head",
                           ColumnParallelLinear(ColumnParallelLinearOptions{.in_features = kHidden,
                                                                            .out_features = kVocab,
                                                                            .bias = false,
                                                                            .seed = 30,
                                                                            .dtype = kF64},
                                                tp));
  }
  // The vocabulary-split logits (this rank's columns).
  torch::Tensor forward(const torch::Tensor& ids) { return head(block(wte(ids))); }
  torch::Tensor loss(const torch::Tensor& ids, const torch::Tensor& targets) {
    return vocab_parallel_cross_entropy(forward(ids), targets, tp).mean();
  }
  std::vector<std::pair<std::string, torch::Tensor>> full_parameters() {
    std::vector<std::pair<std::string, torch::Tensor>> out = {{"wte", wte->gather_full()}};
    for (auto& [name, value] : block->full_named_parameters())
      out.emplace_back("block." + name, value);
    out.emplace_back("head", head->gather_full().weight);
    return out;
  }
  std::shared_ptr<ProcessGroup> tp;
  VocabParallelEmbedding wte{nullptr};
  GptBlock block{nullptr};
  ColumnParallelLinear head{nullptr};
};

std::int64_t parameter_bytes(torch::nn::Module& module) {
  std::int64_t bytes = 0;
  for (const auto& p : module.parameters())
    bytes += p.numel() * static_cast<std::int64_t>(p.element_size());
  return bytes;
}

// Trains the reference (whole batch) and the parallel model (this dp rank's rows of the batch,
// gradients averaged over `dp` when given) 5 SGD steps; throws unless every step's loss and every
// final parameter agree to 1e-5. Returns the parallel model's parameter bytes on this rank.
std::int64_t train_and_compare(const std::shared_ptr<ProcessGroup>& tp,
                               const std::shared_ptr<ProcessGroup>& dp) {
  const int dp_size = dp ? dp->size() : 1;
  const int dp_rank = dp ? dp->rank() : 0;
  ReferenceGpt reference;
  ParallelGpt parallel(tp);
  torch::optim::SGD reference_sgd(reference.parameters(), torch::optim::SGDOptions(0.5));
  torch::optim::SGD parallel_sgd(parallel.parameters(), torch::optim::SGDOptions(0.5));
  for (int step = 0; step < kSteps; ++step) {
    const auto [ids, targets] = batch_of(step);
    reference_sgd.zero_grad();
    const auto want = reference.loss(ids, targets);
    want.backward();
    reference_sgd.step();

    const auto rows = kBatch / dp_size;
    parallel_sgd.zero_grad();
    const auto loss =
        parallel.loss(ids.narrow(0, rows * dp_rank, rows), targets.narrow(0, rows * dp_rank, rows));
    loss.backward();
    auto mean_loss = loss.detach().clone();
    if (dp) {
      all_reduce(mean_loss, ReduceOp::kSum, *dp);
      mean_loss /= dp_size;
      for (auto& p : parallel.parameters()) {
        all_reduce(p.grad(), ReduceOp::kSum, *dp);
        p.grad().div_(dp_size);
      }
    }
    parallel_sgd.step();
    expect_close(mean_loss, want.detach(), fmt::format("loss of step {}", step), 1e-5, 1e-12);
  }
  const auto want = reference.full_parameters();
  const auto got = parallel.full_parameters();
  check(want.size() == got.size(), "the models have different parameter lists");
  for (std::size_t i = 0; i < want.size(); ++i) {
    check(want[i].first == got[i].first,
          fmt::format("parameter {}: {} vs {}", i, want[i].first, got[i].first));
    expect_close(got[i].second, want[i].second, "parameter " + want[i].first + " after 5 steps",
                 1e-5, 1e-12);
    // Training moved it: the comparison is not of the initial weights alone.
  }
  check(!torch::allclose(reference.block->full_named_parameters()[2].second,
                         GptBlock(block_options())->full_named_parameters()[2].second),
        "the reference did not train");
  return parameter_bytes(parallel);
}

TEST(TensorParallel, SmallGptWithTpTwoTrainsLikeOneProcessInLessMemoryPerRank) {
  const int port = test::free_port();
  const auto results = run_ranks(2, [&](int rank) {
    auto world = join_group(rank, 2, port);
    DeviceMesh mesh({{"tp", 2}}, world);
    const auto bytes = train_and_compare(mesh.group("tp"), nullptr);

    // Memory: the split layers' full bytes / tp, plus what stays replicated (the LayerNorms and
    // the row-parallel biases).
    ReferenceGpt whole;
    const std::int64_t f64 = 8;
    const std::int64_t replicated = (4 * kHidden + 2 * kHidden) * f64;
    const std::int64_t split_full = parameter_bytes(whole) - replicated;
    const std::int64_t bound = split_full / 2 + replicated;
    if (rank == 0) {
      fmt::print(
          "tensor-parallel parameter bytes: one process {}, per rank at tp=2 {} (bound {} "
          "= split layers {} / 2 + replicated {})\n",
          parameter_bytes(whole), bytes, bound, split_full, replicated);
    }
    check(bytes <= bound,
          fmt::format("{} parameter bytes on rank {} exceed {}", bytes, rank, bound));
    check(bytes < parameter_bytes(whole), "no memory saved");
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(TensorParallel, SmallGptWithDpTwoByTpTwoTrainsLikeOneProcess) {
  const int port = test::free_port();
  const auto results = run_ranks(4, [&](int rank) {
    auto world = join_group(rank, 4, port);
    DeviceMesh mesh({{"dp", 2}, {"tp", 2}}, world);
    train_and_compare(mesh.group("tp"), mesh.group("dp"));
  });
  EXPECT_ALL_RANKS_OK(results);
}

// Composition: DistributedDataParallel over the mesh's dp group, around a model whose layers are
// split over its tp group. DDP averages the gradients over dp only (its reducer's buckets, during
// backward) while the tensor-parallel layers' own collectives run on tp; 5 SGD steps equal one
// process on the whole batch.
TEST(TensorParallel, DdpOverTheDpDimensionOfADpByTpMeshTrainsLikeOneProcess) {
  const int port = test::free_port();
  const auto results = run_ranks(4, [&](int rank) {
    auto world = join_group(rank, 4, port);
    DeviceMesh mesh({{"dp", 2}, {"tp", 2}}, world);
    const auto dp = mesh.group("dp");
    ReferenceGpt reference;
    auto parallel = std::make_shared<ParallelGpt>(mesh.group("tp"));
    DistributedDataParallel ddp(parallel, dp);
    torch::optim::SGD reference_sgd(reference.parameters(), torch::optim::SGDOptions(0.5));
    torch::optim::SGD ddp_sgd(ddp->parameters(), torch::optim::SGDOptions(0.5));
    const auto rows = kBatch / dp->size();
    for (int step = 0; step < kSteps; ++step) {
      const auto [ids, targets] = batch_of(step);
      reference_sgd.zero_grad();
      const auto want = reference.loss(ids, targets);
      want.backward();
      reference_sgd.step();

      ddp_sgd.zero_grad();
      const auto logits = ddp->forward(ids.narrow(0, rows * dp->rank(), rows));
      const auto loss = vocab_parallel_cross_entropy(
                            logits, targets.narrow(0, rows * dp->rank(), rows), mesh.group("tp"))
                            .mean();
      loss.backward();
      ddp_sgd.step();
      auto mean_loss = loss.detach().clone();
      all_reduce(mean_loss, ReduceOp::kSum, *dp);
      expect_close(mean_loss / dp->size(), want.detach(), fmt::format("loss of step {}", step),
                   1e-5, 1e-12);
    }
    const auto want = reference.full_parameters();
    const auto got = parallel->full_parameters();
    check(want.size() == got.size(), "the models have different parameter lists");
    for (std::size_t i = 0; i < want.size(); ++i) {
      expect_close(got[i].second, want[i].second, "parameter " + want[i].first + " after 5 steps",
                   1e-5, 1e-12);
    }
  });
  EXPECT_ALL_RANKS_OK(results);
}

// ---- Dropout and the RNG tracker -----------------------------------------------------------
TEST(TensorParallel, DropoutMasksAreEqualWhereReplicatedAndDifferWhereSplit) {
  const int port = test::free_port();
  const auto results = run_ranks(2, [&](int rank) {
    auto tp = join_group(rank, 2, port);
    TensorParallelRng rng(5, tp->rank());
    const auto ones = torch::ones({64}, kF64);
    const auto replicated = rng.dropout(ones, 0.5, true, TensorParallelRng::Region::kReplicated);
    const auto split = rng.dropout(ones, 0.5, true, TensorParallelRng::Region::kSplit);
    check(replicated.eq(0).any().item<bool>() && replicated.eq(2).any().item<bool>(),
          "dropout drops some and scales the rest by 1/(1-p)");
    auto replicated_all = torch::empty({2, 64}, kF64);
    all_gather_into_tensor(replicated_all, replicated, *tp);
    auto split_all = torch::empty({2, 64}, kF64);
    all_gather_into_tensor(split_all, split, *tp);
    check(torch::equal(replicated_all[0], replicated_all[1]), "replicated masks differ");
    check(!torch::equal(split_all[0], split_all[1]), "split masks are equal across tp ranks");
    check(!torch::equal(replicated, split), "the two regions draw the same mask");
    check(torch::equal(rng.dropout(ones, 0.5, false, TensorParallelRng::Region::kSplit), ones),
          "dropout in evaluation changes the input");

    // A parallelised block with dropout: its replicated output stays identical on the tp ranks.
    auto options = block_options();
    options.dropout = 0.3;
    GptBlock block(options);
    parallelize_module(block, tp, gpt_block_tensor_parallel_plan());
    block->train();
    const auto out = block(pattern({2, kSequence, kHidden}, 3)).detach().contiguous();
    test::expect_identical_across_ranks(*tp, {out}, "block output under dropout");
    block->eval();
    GptBlock whole(options);
    whole->eval();
    expect_close(block(pattern({2, kSequence, kHidden}, 3)),
                 whole(pattern({2, kSequence, kHidden}, 3)), "block in evaluation", 1e-12, 1e-12);
  });
  EXPECT_ALL_RANKS_OK(results);
}

// ---- Bad input -----------------------------------------------------------------------------
TEST(TensorParallel, BadSizesAndPlansAreNamedOnEveryRank) {
  const int port = test::free_port();
  const auto results = run_ranks(2, [&](int rank) {
    auto tp = join_group(rank, 2, port, 20s);
    expect_config_error(
        [&] {
          ColumnParallelLinear(ColumnParallelLinearOptions{.in_features = 4, .out_features = 7},
                               tp);
        },
        "out_features 7 is not divisible by the tp group's 2 ranks", "column 7");
    expect_config_error(
        [&] {
          ColumnParallelLinear(
              ColumnParallelLinearOptions{.in_features = 4, .out_features = 9, .fused_blocks = 3},
              tp);
        },
        "x 3 fused blocks", "fused 6 over 2 x 3");
    expect_config_error(
        [&] {
          RowParallelLinear(RowParallelLinearOptions{.in_features = 7, .out_features = 4}, tp);
        },
        "in_features 7 is not divisible", "row 7");
    expect_config_error(
        [&] {
          VocabParallelEmbedding(
              VocabParallelEmbeddingOptions{.num_embeddings = 7, .embedding_dim = 4}, tp);
        },
        "vocabulary size (num_embeddings) 7 is not divisible", "vocabulary 7");
    expect_config_error(
        [&] {
          GptBlock block(GptBlockOptions{.hidden = 6, .heads = 3});
          parallelize_module(block, tp, gpt_block_tensor_parallel_plan());
        },
        "3 attention heads do not divide among the tp group's 2 ranks", "heads 3");
    expect_config_error(
        [&] {
          GptBlock block(GptBlockOptions{.hidden = 8, .heads = 2, .mlp_hidden = 9});
          parallelize_module(block, tp, gpt_block_tensor_parallel_plan());
        },
        "MLP size 9 is not divisible", "mlp 9");
    expect_config_error([&] { GptBlock(GptBlockOptions{.hidden = 7, .heads = 2}); },
                        "hidden size 7 is not divisible by the 2 heads", "hidden 7 / heads 2");
    expect_config_error(
        [&] {
          GptBlock block(GptBlockOptions{.hidden = 8, .heads = 2});
          parallelize_module(block, tp, {{"attn_qkv", ParallelStyle::kColwise}});
        },
        "splits \"attn_qkv\" but not \"attn_proj\"", "half a pair");
    expect_config_error(
        [&] {
          GptBlock block(GptBlockOptions{.hidden = 8, .heads = 2});
          parallelize_module(block, tp, {{"attn_out", ParallelStyle::kRowwise}});
        },
        "\"attn_out\", which is not a part", "unknown part");
    expect_config_error(
        [&] {
          GptBlock block(GptBlockOptions{.hidden = 8, .heads = 2});
          parallelize_module(
              block, tp,
              {{"mlp_fc", ParallelStyle::kRowwise}, {"mlp_proj", ParallelStyle::kColwise}});
        },
        "\"mlp_fc\" can only be colwise", "wrong style");
    // The group is intact after every refusal.
    auto probe = torch::ones({2}, kF64);
    all_reduce(probe, ReduceOp::kSum, *tp);
    check(probe.sum().item<double>() == 4.0, "the group after the refusals");
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(TensorParallel, RanksThatDisagreeOnAShapeGetAnErrorNotAHang) {
  const int port = test::free_port();
  const auto results = run_ranks(2, [&](int rank) {
    auto tp = join_group(rank, 2, port, 10s);
    // At construction: the layers compare what each rank was given.
    expect_config_error(
        [&] {
          ColumnParallelLinear(
              ColumnParallelLinearOptions{.in_features = 4, .out_features = rank == 0 ? 8 : 12},
              tp);
        },
        "were given different layers", "column sizes differ");
    // In a region function: the engine's fingerprint check names the mismatch.
    try {
      reduce_from_tensor_parallel_region(torch::ones({rank == 0 ? 4 : 6}, kF64), tp);
    } catch (const CommError& error) {
      check(error.kind() == CommErrorKind::kMismatch,
            fmt::format("the mismatch's kind: {}", error.what()));
      return;
    }
    throw std::runtime_error("reduce_from with different shapes did not fail");
  });
  EXPECT_ALL_RANKS_OK(results);
}

}  // namespace DDP_UNITY_ID
}  // namespace
}  // namespace ddp
