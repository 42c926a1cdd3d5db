// FSDP in float64, and FSDP x TP: FullyShardedDataParallel over the dp dimension of a DeviceMesh
// whose tp dimension splits the layers (PyTorch's 2-D FSDP + tensor parallel). Every test forks
// real ranks. In float64 FSDP equals DDP, and FSDP x TP equals one process (5 AdamW steps with the
// gradient norm clipped over the whole model) to 1e-9 at dp 2 x tp 2 (FULL_SHARD, SHARD_GRAD_OP)
// and dp 4 x tp 2 (HYBRID_SHARD); each rank holds at most 1/4 of the split layers and 1/2 of the
// replicated rest. Wrapping over the tp dimension instead, and a clip that names parameters the
// wrapper does not hold, are named on every rank.
#include <cmath>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "ddp/error.h"
#include "ddp/torch/ddp/distributed_data_parallel.h"
#include "ddp/torch/fsdp/fully_sharded_data_parallel.h"
#include "ddp/torch/parallel/mesh/device_mesh.h"
#include "ddp/torch/parallel/tensor/gpt_block.h"
#include "ddp/torch/parallel/tensor/tensor_parallel.h"
#include "support/multiprocess.h"
#include "support/temp_dir.h"
#include "support/torch/ddp_test_util.h"
#include "support/torch/deterministic_models.h"
#include "support/unity_namespace.h"

namespace ddp {
namespace {
namespace DDP_UNITY_ID {

using test::join_group;
using test::run_ranks;

constexpr auto kF64 = torch::kFloat64;

void check(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error(what);
}

// Throws unless `body` throws an exception of type E whose text holds `needle`.
template <class E>
void expect_throws(const std::function<void()>& body, const std::string& needle,
                   const std::string& what) {
  try {
    body();
  } catch (const E& e) {
    check(std::string(e.what()).find(needle) != std::string::npos,
          fmt::format("{}: the error '{}' does not say '{}'", what, e.what(), needle));
    return;
  } catch (const std::exception& e) {
    throw std::runtime_error(fmt::format("{}: unexpected error type: {}", what, e.what()));
  }
  throw std::runtime_error(what + ": nothing was thrown");
}

// ---- FSDP in float64 -------------------------------------------------------------------------

torch::nn::Sequential float64_model() {
  auto model = test::sharded_suite_model();
  model->to(kF64);
  return model;
}

std::pair<torch::Tensor, torch::Tensor> float64_batch(int rank, int world, int step) {
  auto [x, y] = test::sharded_suite_batch(rank, world, step);
  return {x.to(kF64), y.to(kF64)};
}

template <class Model>
void train(Model& model, torch::optim::Optimizer& opt, int rank, int world, int steps) {
  for (int step = 0; step < steps; ++step) {
    auto [x, y] = float64_batch(rank, world, step);
    opt.zero_grad();
    torch::mse_loss(model->forward(x), y).backward();
    opt.step();
  }
}

// Every strategy keeps float64 shards and gradients and trains as DDP does in float64: at world
// 2 each gradient is the same sum of two in either, so to the last bit but for Adam's rounding in
// another order of elements (1e-13).
TEST(FsdpFloat64, EveryStrategyKeepsFloat64AndEqualsDdp) {
  const int port = test::free_port();
  const auto results = run_ranks(2, [&](int rank) {
    auto pg = join_group(rank, 2, port);
    auto net = float64_model();
    DistributedDataParallel ddp(net, pg);
    torch::optim::Adam ddp_adam(ddp->parameters(), torch::optim::AdamOptions(0.01));
    train(ddp, ddp_adam, rank, 2, 10);
    for (const auto strategy : {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp,
                                ShardingStrategy::kNoShard}) {
      const std::string name = to_string(strategy);
      FullyShardedDataParallel fsdp(
          float64_model(), pg, FsdpOptions{.sharding_strategy = strategy, .min_num_params = 30});
      for (const auto& shard : fsdp->parameters())
        check(shard.scalar_type() == kF64, name + ": a shard is not float64");
      torch::optim::Adam adam(fsdp->parameters(), torch::optim::AdamOptions(0.01));
      train(fsdp, adam, rank, 2, 10);
      for (const auto& shard : fsdp->parameters())
        check(shard.grad().scalar_type() == kF64, name + ": a gradient is not float64");
      const auto state = fsdp->full_state_dict(0);
      if (rank != 0) continue;
      for (const auto& item : net->named_parameters()) {
        const auto* got = state.find(item.key());
        check(got != nullptr && got->scalar_type() == kF64, name + ": no float64 " + item.key());
        test::expect_close(*got, item.value().detach(), name + " " + item.key(), 1e-13, 1e-15);
      }
    }
  });
  EXPECT_ALL_RANKS_OK(results);
}

// A float64 sharded checkpoint resumes in float64 at another world size; into the float32 model
// it is named (every value would be rounded), and nothing is loaded.
TEST(FsdpFloat64, ShardedCheckpointKeepsFloat64AndRefusesTheFloat32Model) {
  test::TempDir dir("ddp-fsdp-f64");
  const int save_port = test::free_port();
  auto saved = run_ranks(2, [&](int rank) {
    auto pg = join_group(rank, 2, save_port);
    FullyShardedDataParallel fsdp(float64_model(), pg, FsdpOptions{.min_num_params = 30});
    torch::optim::Adam adam(fsdp->parameters(), torch::optim::AdamOptions(0.01));
    train(fsdp, adam, rank, 2, 3);
    fsdp->save_sharded_checkpoint(dir.path(), adam);
  });
  EXPECT_ALL_RANKS_OK(saved);
  const int load_port = test::free_port();
  auto loaded = run_ranks(3, [&](int rank) {
    auto pg = join_group(rank, 3, load_port);
    FullyShardedDataParallel fsdp(float64_model(), pg, FsdpOptions{.min_num_params = 30});
    torch::optim::Adam adam(fsdp->parameters(), torch::optim::AdamOptions(0.01));
    fsdp->load_sharded_checkpoint(dir.path(), adam);
    FullyShardedDataParallel narrow(test::sharded_suite_model(), pg,
                                    FsdpOptions{.min_num_params = 30});
    torch::optim::Adam narrow_adam(narrow->parameters(), torch::optim::AdamOptions(0.01));
    const auto before = narrow->parameters()[0].detach().clone();
    expect_throws<Error>([&] { narrow->load_sharded_checkpoint(dir.path(), narrow_adam); },
                         "parameters in Double, but this model's are Float",
                         "a float64 checkpoint into the float32 model");
    check(torch::equal(before, narrow->parameters()[0].detach()),
          "the refused load changed the float32 model");
  });
  EXPECT_ALL_RANKS_OK(loaded);
}

TEST(FsdpFloat64, TwoDtypesInOneWrapperAndMixedPrecisionOverFloat64AreNamed) {
  const int port = test::free_port();
  const auto results = run_ranks(2, [&](int rank) {
    auto pg = join_group(rank, 2, port);
    expect_throws<ConfigError>(
        [&] {
          auto model = test::sharded_suite_model();
          model[2]->to(kF64);
          FullyShardedDataParallel(model, pg);
        },
        "is Double, but the first parameter is Float; one wrapper flattens one dtype",
        "two dtypes");
    expect_throws<ConfigError>(
        [&] {
          FullyShardedDataParallel(
              float64_model(), pg,
              FsdpOptions{.mixed_precision = {.param_dtype = torch::kBFloat16}});
        },
        "mixed_precision with Double parameters", "mixed precision over float64");
  });
  EXPECT_ALL_RANKS_OK(results);
}

// ---- FSDP x TP --------------------------------------------------------------------------------
constexpr std::int64_t kVocab = 16, kHidden = 8, kHeads = 4, kSequence = 6, kBatch = 4;
constexpr int kSteps = 5;
constexpr double kMaxNorm = 0.05;  // below every step's norm: each step clips

GptBlockOptions block_options(int layer) {
  return {.hidden = kHidden,
          .heads = kHeads,
          .seed = 20 + 10 * static_cast<std::uint64_t>(layer),
          .dtype = kF64};
}

std::pair<torch::Tensor, torch::Tensor> batch_of(int step) {
  return test::token_batch(step, kBatch, kSequence, kVocab);
}

// One process: embedding, two GptBlocks, linear head; the same seeds as the split model.
struct ReferenceGpt : torch::nn::Module {
  ReferenceGpt() {
    wte = register_parameter("wte", initial_embedding_weight(kVocab, kHidden, 10, kF64));
    block0 = register_module("block0", GptBlock(block_options(0)));
    block1 = register_module("block1", GptBlock(block_options(1)));
    head = register_parameter("head",
                              initial_linear_parameters(kHidden, kVocab, false, 30, kF64).weight);
  }
  torch::Tensor loss(const torch::Tensor& ids, const torch::Tensor& targets) {
    const auto logits = torch::linear(block1(block0(torch::embedding(wte, ids))), head);
    return torch::nn::functional::cross_entropy(logits.reshape({-1, kVocab}),
                                                targets.reshape({-1}));
  }
  std::vector<torch::Tensor> full_parameters() {
    std::vector<torch::Tensor> out = {wte.detach()};
    for (auto* block : {&block0, &block1})
      for (auto& [name, value] : (*block)->full_named_parameters())
        out.push_back(value);
    out.push_back(head.detach());
    return out;
  }
  torch::Tensor wte, head;
  GptBlock block0{nullptr}, block1{nullptr};
};

// The model split over `tp`, as a Sequential that FSDP runs child by child (one unit each).
torch::nn::Sequential parallel_gpt(const std::shared_ptr<ProcessGroup>& tp) {
  torch::nn::Sequential model;
  model->push_back(
      "wte", VocabParallelEmbedding(
                 VocabParallelEmbeddingOptions{
                     .num_embeddings = kVocab, .embedding_dim = kHidden, .seed = 10, .dtype = kF64},
                 tp));
  for (int layer = 0; layer < 2; ++layer) {
    GptBlock block(block_options(layer));
    parallelize_module(block, tp, gpt_block_tensor_parallel_plan());
    model->push_back(fmt::format("block{}", layer), block);
  }
  model->push_back("head", ColumnParallelLinear(ColumnParallelLinearOptions{.in_features = kHidden,
                                                                            .out_features = kVocab,
                                                                            .bias = false,
                                                                            .seed = 30,
                                                                            .dtype = kF64},
                                                tp));
  return model;
}

// The full parameters of the split model, in ReferenceGpt's order (collective over tp).
std::vector<torch::Tensor> full_parameters(torch::nn::Sequential& model) {
  std::vector<torch::Tensor> out = {model[0]->as<VocabParallelEmbeddingImpl>()->gather_full()};
  for (std::size_t layer = 1; layer <= 2; ++layer)
    for (auto& [name, value] : model[layer]->as<GptBlockImpl>()->full_named_parameters())
      out.push_back(value);
  out.push_back(model[3]->as<ColumnParallelLinearImpl>()->gather_full().weight);
  return out;
}

std::int64_t parameter_bytes(const std::vector<torch::Tensor>& parameters) {
  std::int64_t bytes = 0;
  for (const auto& p : parameters)
    bytes += p.numel() * static_cast<std::int64_t>(p.element_size());
  return bytes;
}

// dp x tp 2, FSDP over dp in `strategy`: 5 AdamW steps with clipping, against one process. dp is
// 2, or 4 for kHybridShard: sharded over pairs of dp ranks, replicated over the pairs (a dp group
// laid out as a 2 x 2 mesh of its own, as two hosts of two would be).
void expect_fsdp_by_tp_equals_one_process(ShardingStrategy strategy) {
  const bool hybrid = strategy == ShardingStrategy::kHybridShard;
  const int dp_size = hybrid ? 4 : 2;
  const int port = test::free_port();
  const auto results = run_ranks(2 * dp_size, [&](int rank) {
    auto world = join_group(rank, 2 * dp_size, port);
    DeviceMesh mesh({{"dp", dp_size}, {"tp", 2}}, world);
    const auto dp = mesh.group("dp");
    const auto tp = mesh.group("tp");
    const std::string name = to_string(strategy);
    FsdpOptions options{.sharding_strategy = strategy, .units = {{0, 1}, {1, 2}, {2, 3}, {3, 4}}};
    std::optional<DeviceMesh> dp_mesh;
    if (hybrid) {
      dp_mesh.emplace(std::vector<MeshDimension>{{"replicate", 2}, {"shard", 2}}, dp);
      options.shard_group = dp_mesh->group("shard");
      options.replicate_group = dp_mesh->group("replicate");
    }

    ReferenceGpt reference;
    torch::optim::AdamW reference_adam(reference.parameters(), torch::optim::AdamWOptions(0.01));
    auto model = parallel_gpt(tp);
    const auto split = tensor_parallel_split_parameters(*model);
    check(split.size() == 1 + 2 * 6 + 1,
          fmt::format("{} split parameters, expected 14 (embedding, 6 per block, head)",
                      split.size()));
    FullyShardedDataParallel fsdp(model, dp, options);
    torch::optim::AdamW adam(fsdp->parameters(), torch::optim::AdamWOptions(0.01));
    const auto rows = kBatch / dp->size();
    for (int step = 0; step < kSteps; ++step) {
      const auto [ids, targets] = batch_of(step);
      reference_adam.zero_grad();
      const auto want = reference.loss(ids, targets);
      want.backward();
      const double want_norm = torch::nn::utils::clip_grad_norm_(reference.parameters(), kMaxNorm);
      reference_adam.step();

      adam.zero_grad();
      const auto logits = fsdp->forward(ids.narrow(0, rows * dp->rank(), rows));
      const auto loss =
          vocab_parallel_cross_entropy(logits, targets.narrow(0, rows * dp->rank(), rows), tp)
              .mean();
      loss.backward();
      const auto norm = fsdp->clip_grad_norm_(kMaxNorm, 2.0, TensorParallelNorm{tp, split});
      adam.step();
      check(want_norm > kMaxNorm, "the reference's step did not clip");
      test::expect_close(norm, torch::tensor(want_norm, kF64),
                         fmt::format("{}: gradient norm of step {}", name, step), 1e-9, 1e-12);
      auto mean_loss = loss.detach().clone();
      all_reduce(mean_loss, ReduceOp::kSum, *dp);
      test::expect_close(mean_loss / dp->size(), want.detach(),
                         fmt::format("{}: loss of step {}", name, step), 1e-9, 1e-12);
    }
    std::vector<torch::Tensor> got;
    fsdp->summon_full_params([&] { got = full_parameters(model); });
    const auto want = reference.full_parameters();
    check(got.size() == want.size(), "the models have different parameter lists");
    for (std::size_t i = 0; i < want.size(); ++i) {
      test::expect_close(got[i], want[i], fmt::format("{}: parameter {} after 5 steps", name, i),
                         1e-9, 1e-12);
    }

    // Memory: FULL_SHARD holds 1/dp of what tensor parallelism leaves this rank, so at most a
    // quarter of the split layers plus half of the replicated rest (plus each unit's padding).
    if (strategy == ShardingStrategy::kFullShard) {
      auto whole = parallel_gpt(tp);  // this tp rank's part, unsharded
      const auto split_here = tensor_parallel_split_parameters(*whole);
      const std::int64_t split_part = parameter_bytes(split_here);
      const std::int64_t all_here = parameter_bytes(whole->parameters());
      const std::int64_t replicated = all_here - split_part;
      const std::int64_t split_full = split_part * tp->size();
      const std::int64_t padding = static_cast<std::int64_t>(fsdp->unit_count()) * 8;
      const std::int64_t bound = split_full / 4 + replicated / 2 + padding;
      const std::int64_t bytes = parameter_bytes(fsdp->parameters());
      if (rank == 0) {
        fmt::print(
            "FSDP x TP parameter bytes per rank {} (bound {} = split layers {} / 4 + "
            "replicated {} / 2 + padding {}; one process {})\n",
            bytes, bound, split_full, replicated, padding, parameter_bytes(reference.parameters()));
      }
      check(bytes <= bound, fmt::format("{} parameter bytes exceed {}", bytes, bound));
    }
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(FsdpTensorParallel, FullShardOverDpOfADpByTpMeshEqualsOneProcessWithClipping) {
  expect_fsdp_by_tp_equals_one_process(ShardingStrategy::kFullShard);
}

TEST(FsdpTensorParallel, ShardGradOpOverDpOfADpByTpMeshEqualsOneProcessWithClipping) {
  expect_fsdp_by_tp_equals_one_process(ShardingStrategy::kShardGradOp);
}

TEST(FsdpTensorParallel, HybridShardOverDpFourByTpTwoEqualsOneProcessWithClipping) {
  expect_fsdp_by_tp_equals_one_process(ShardingStrategy::kHybridShard);
}

// FSDP over the tp dimension would flatten different parts of the same split weights as if they
// were one parameter's replicas; a clip given parameters outside the wrapper would count them
// nowhere. Both are named on every rank.
TEST(FsdpTensorParallel, WrappingOverTheTpDimensionAndAForeignSplitParameterAreNamed) {
  const int port = test::free_port();
  const auto results = run_ranks(4, [&](int rank) {
    auto world = join_group(rank, 4, port);
    DeviceMesh mesh({{"dp", 2}, {"tp", 2}}, world);
    const auto tp = mesh.group("tp");
    expect_throws<Error>([&] { FullyShardedDataParallel(parallel_gpt(tp), tp); },
                         "tensor-parallel part", "FSDP over the tp dimension");
    auto model = parallel_gpt(tp);
    FullyShardedDataParallel fsdp(model, mesh.group("dp"));
    auto other = parallel_gpt(tp);
    expect_throws<ConfigError>(
        [&] {
          fsdp->clip_grad_norm_(1.0, 2.0,
                                TensorParallelNorm{tp, tensor_parallel_split_parameters(*other)});
        },
        "14 of the 14 split_parameters are not parameters of this wrapper",
        "a clip over another model's parameters");
  });
  EXPECT_ALL_RANKS_OK(results);
}

}  // namespace DDP_UNITY_ID
}  // namespace
}  // namespace ddp
