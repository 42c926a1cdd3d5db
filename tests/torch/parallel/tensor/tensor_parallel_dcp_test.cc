// tensor_parallel_dcp_layout (ddp/torch/parallel/tensor/tensor_parallel_dcp_layout.h) with
// dcp_model_state, in real processes: a model of ddp's tensor-parallel layers (vocab-parallel
// embedding, a fused q|k|v column-parallel layer gathering its output, a column-parallel one
// feeding a row-parallel one with its replicated bias, a replicated LayerNorm) and its AdamW state
// saved at tp 2 load at tp 4 and tp 1, and saving them again writes the same tensors; the next step
// at every tp ends where tp 2's does. The fused q|k|v is saved as the nn.Linear PyTorch holds it
// ([3h, in]), so a model whose q|k|v is not fused reads the same tensor; a checkpoint saved before
// that ([3, h, in]) still loads, and where that shape does not fit, the error names both.
#include <filesystem>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "ddp/torch/api/distributed.h"
#include "ddp/torch/checkpoint/dcp_model_state.h"
#include "ddp/torch/checkpoint/distributed_checkpoint.h"
#include "ddp/torch/checkpoint/distributed_checkpoint_save.h"
#include "ddp/torch/parallel/tensor/tensor_parallel.h"
#include "ddp/torch/parallel/tensor/tensor_parallel_dcp_layout.h"
#include "support/multiprocess.h"
#include "support/temp_dir.h"
#include "support/torch/ddp_test_util.h"
#include "support/unity_namespace.h"

namespace ddp {
namespace {
namespace DDP_UNITY_ID {

using test::join_group;
using test::run_ranks;
using ::testing::AllOf;
using ::testing::HasSubstr;

struct TpModel : torch::nn::Module {
  TpModel(const std::shared_ptr<ProcessGroup>& tp, std::int64_t fused_blocks = 3) {
    constexpr auto f64 = torch::kFloat64;
    wte = register_module("wte",
                          VocabParallelEmbedding(
                              VocabParallelEmbeddingOptions{
                                  .num_embeddings = 8, .embedding_dim = 6, .seed = 1, .dtype = f64},
                              tp));
    qkv = register_module(
        "qkv", ColumnParallelLinear(ColumnParallelLinearOptions{.in_features = 6,
                                                                .out_features = 12,
                                                                .gather_output = true,
                                                                .fused_blocks = fused_blocks,
                                                                .seed = 2,
                                                                .dtype = f64},
                                    tp));
    fc = register_module("fc",
                         ColumnParallelLinear(
                             ColumnParallelLinearOptions{
                                 .in_features = 12, .out_features = 8, .seed = 3, .dtype = f64},
                             tp));
    proj = register_module(
        "proj",
        RowParallelLinear(
            RowParallelLinearOptions{.in_features = 8, .out_features = 6, .seed = 4, .dtype = f64},
            tp));
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({6})));
    norm->to(f64);
  }
  torch::Tensor forward(const torch::Tensor& ids) { return norm(proj(fc(qkv(wte(ids))))); }

  VocabParallelEmbedding wte{nullptr};
  ColumnParallelLinear qkv{nullptr}, fc{nullptr};
  RowParallelLinear proj{nullptr};
  torch::nn::LayerNorm norm{nullptr};
};

void train_step(TpModel& model, torch::optim::AdamW& optimizer) {
  const auto ids = torch::tensor({{1, 5, 7, 2}, {0, 3, 6, 4}}, torch::kInt64);
  optimizer.zero_grad();
  model.forward(ids).sin().sum().backward();
  optimizer.step();
}

void save(TpModel& model, torch::optim::AdamW& optimizer, const std::shared_ptr<ProcessGroup>& tp,
          const std::filesystem::path& folder) {
  save_dcp(dcp_model_state(model, &optimizer, tensor_parallel_dcp_layout(model)), folder,
           {.group = tp});
}

// At tp `size`: loads `from` (or trains a step from the seeds' weights where empty), saves into
// `loaded`, trains a step and saves into `stepped`.
void at_tp(int size, const std::filesystem::path& from, const std::filesystem::path& loaded,
           const std::filesystem::path& stepped) {
  const int port = test::free_port();
  EXPECT_ALL_RANKS_OK(run_ranks(size, [&](int rank) {
    auto tp = join_group(rank, size, port);
    TpModel model(tp);
    torch::optim::AdamW optimizer(model.parameters(), torch::optim::AdamWOptions(0.05));
    if (from.empty()) {
      train_step(model, optimizer);
    } else {
      optimizer.param_groups()[0].options().set_lr(0.5);  // the load brings back 0.05
      const auto report =
          load_dcp_model_state(from, model, &optimizer, {}, tensor_parallel_dcp_layout(model));
      EXPECT_TRUE(report.complete());
    }
    save(model, optimizer, tp, loaded);
    train_step(model, optimizer);
    save(model, optimizer, tp, stepped);
  }));
}

// Every tensor of `a` and `b` read whole: equal, or within `tolerance` (float64).
void expect_same_tensors(const std::filesystem::path& a, const std::filesystem::path& b,
                         double tolerance) {
  const DcpReader left(a), right(b);
  ASSERT_EQ(left.info().tensors.size(), right.info().tensors.size());
  for (const auto& [name, info] : left.info().tensors) {
    ASSERT_TRUE(right.info().tensors.contains(name)) << name;
    const at::Tensor x = left.read(name), y = right.read(name);
    if (tolerance == 0) {
      EXPECT_TRUE(torch::equal(x, y)) << name << " differs between " << a << " and " << b;
    } else {
      EXPECT_TRUE(torch::allclose(x, y, 0, tolerance)) << name << ": " << (x - y).abs().max();
    }
  }
  EXPECT_DOUBLE_EQ(right.read_value("optim.param_groups.0.lr").toDouble(), 0.05);
}

TEST(TensorParallelDcp, SavedAtTpTwoLoadsAtTpFourAndOneAndTheNextStepEndsAlike) {
  test::TempDir dir("ddp-tp-dcp");
  const auto d = dir.path();
  at_tp(2, {}, d / "tp2", d / "tp2_step");
  at_tp(4, d / "tp2", d / "tp4", d / "tp4_step");
  at_tp(1, d / "tp2", d / "tp1", d / "tp1_step");
  auto results = run_ranks(1, [&](int) {
    const DcpReader saved(d / "tp2");
    // The fused q|k|v weight is saved as one [3h, in] tensor (PyTorch's nn.Linear), each rank's
    // rows of each of the 3 blocks a chunk.
    EXPECT_EQ(saved.info().tensors.at("model.qkv.weight").shape,
              (std::vector<std::int64_t>{12, 6}));
    EXPECT_EQ(saved.info().tensors.at("model.qkv.bias").shape, (std::vector<std::int64_t>{12}));
    EXPECT_EQ(saved.info().tensors.at("optim.state.qkv.weight.exp_avg").chunks.size(), 6u);
    EXPECT_EQ(saved.info().tensors.at("model.proj.bias").chunks.size(), 1u);  // replicated
    // Loaded at tp 4 and 1 and saved again: the same tensors to the bit.
    expect_same_tensors(d / "tp2", d / "tp4", 0);
    expect_same_tensors(d / "tp2", d / "tp1", 0);
    // The next step at tp 4 and 1 ends where tp 2's does (their sums differ in order only).
    expect_same_tensors(d / "tp2_step", d / "tp4_step", 1e-12);
    expect_same_tensors(d / "tp2_step", d / "tp1_step", 1e-12);
  });
  EXPECT_ALL_RANKS_OK(results);

  // A model whose q|k|v is not fused holds the same [12, 6] tensor split into plain row
  // ranges: at tp 2, each rank reads its rows of it.
  int port = test::free_port();
  EXPECT_ALL_RANKS_OK(run_ranks(2, [&](int rank) {
    auto tp = join_group(rank, 2, port);
    TpModel unfused(tp, /*fused_blocks=*/1);
    torch::optim::AdamW optimizer(unfused.parameters(), torch::optim::AdamWOptions(0.5));
    load_dcp_model_state(d / "tp2", unfused, &optimizer, {}, tensor_parallel_dcp_layout(unfused));
    const DcpReader saved(d / "tp2");
    EXPECT_TRUE(
        torch::equal(unfused.qkv->weight, saved.read("model.qkv.weight").narrow(0, 6 * rank, 6)));
  }));

  // A checkpoint that recorded the fused q|k|v as [3, h, in] (ddp's layout before it saved
  // nn.Linear's) loads at tp 4 as the new one does; a model whose q|k|v is not fused cannot tell
  // which rows of that tensor are which: named, nothing loaded.
  port = test::free_port();
  EXPECT_ALL_RANKS_OK(run_ranks(2, [&](int rank) {
    auto tp = join_group(rank, 2, port);
    TpModel model(tp);
    torch::optim::AdamW optimizer(model.parameters(), torch::optim::AdamWOptions(0.05));
    DcpModelLayout layout = tensor_parallel_dcp_layout(model);
    load_dcp_model_state(d / "tp2", model, &optimizer, {}, layout);
    for (auto& [name, spec] : layout.shards)
      spec.saved_shape.clear();
    save_dcp(dcp_model_state(model, &optimizer, layout), d / "tp2_blocks", {.group = tp});
  }));
  at_tp(4, d / "tp2_blocks", d / "tp4_from_blocks", d / "tp4_from_blocks_step");
  EXPECT_ALL_RANKS_OK(run_ranks(1, [&](int) {
    EXPECT_EQ(DcpReader(d / "tp2_blocks").info().tensors.at("model.qkv.weight").shape,
              (std::vector<std::int64_t>{3, 4, 6}));
    expect_same_tensors(d / "tp4", d / "tp4_from_blocks", 0);
  }));
  port = test::free_port();
  EXPECT_ALL_RANKS_OK(run_ranks(1, [&](int rank) {
    auto tp = join_group(rank, 1, port);
    TpModel unfused(tp, /*fused_blocks=*/1);
    torch::optim::AdamW optimizer(unfused.parameters(), torch::optim::AdamWOptions(0.5));
    const at::Tensor before = unfused.qkv->weight.clone();
    EXPECT_THAT(
        [&] {
          load_dcp_model_state(d / "tp2_blocks", unfused, &optimizer, {},
                               tensor_parallel_dcp_layout(unfused));
        },
        ::testing::ThrowsMessage<StateDictMismatchError>(
            AllOf(HasSubstr("'model.qkv.weight' is [3, 4, 6] in the checkpoint"),
                  HasSubstr("belongs to a tensor [12, 6]"))));
    EXPECT_TRUE(torch::equal(unfused.qkv->weight, before));
  }));
}

// A layout may save a part only as its global shape or with the first two dimensions merged.
TEST(TensorParallelDcp, ASavedShapeThatIsNoMergeOfTheGlobalShapeIsRefused) {
  const int port = test::free_port();
  EXPECT_ALL_RANKS_OK(run_ranks(1, [&](int rank) {
    auto tp = join_group(rank, 1, port);
    TpModel model(tp);
    DcpModelLayout layout = tensor_parallel_dcp_layout(model);
    layout.shards.at("qkv.weight").saved_shape = {4, 18};
    EXPECT_THAT([&] { dcp_model_state(model, nullptr, layout); },
                ::testing::ThrowsMessage<ConfigError>(AllOf(
                    HasSubstr("saves 'qkv.weight' as [4, 18]"),
                    HasSubstr("global shape [3, 4, 6] with the first two dimensions merged"))));
  }));
}

}  // namespace DDP_UNITY_ID
}  // namespace
}  // namespace ddp
