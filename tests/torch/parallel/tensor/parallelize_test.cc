// ddp::parallelize_module of a Sequential by a plan (parallelize.h), real processes at tp 2,
// float64: an embedding, an MLP pair, a GptBlock, a colwise layer ahead of a LayerNorm and a head,
// split by a plan of paths, patterns and types, train 3 SGD steps to the losses and weights of the
// unsplit model (1e-12), the layer ahead of the LayerNorm gathering its output; every misuse of a
// plan is named on every rank.
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "ddp/error.h"
#include "ddp/torch/parallel/tensor/gpt_block.h"
#include "ddp/torch/parallel/tensor/parallelize.h"
#include "ddp/torch/parallel/tensor/tensor_parallel.h"
#include "support/multiprocess.h"
#include "support/torch/ddp_test_util.h"
#include "support/unity_namespace.h"

namespace ddp {
namespace {
namespace DDP_UNITY_ID {

using test::join_group;
using test::run_ranks;

constexpr std::int64_t kVocab = 16, kWidth = 8, kRows = 2, kSequence = 3;

void check(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error(what);
}

// The same numbers on every rank: a fixed seed.
torch::nn::Sequential make_model() {
  torch::manual_seed(7);
  torch::nn::Sequential model;
  model->push_back("embed", torch::nn::Embedding(kVocab, kWidth));
  model->push_back("fc", torch::nn::Linear(kWidth, 4 * kWidth));
  model->push_back("act", torch::nn::GELU());
  model->push_back("proj", torch::nn::Linear(4 * kWidth, kWidth));
  model->push_back(
      "block",
      GptBlock(GptBlockOptions{.hidden = kWidth, .heads = 2, .seed = 5, .dtype = torch::kFloat64}));
  // A colwise layer whose output meets a LayerNorm: it must gather (a part would be normalised
  // over the wrong elements).
  model->push_back("widen", torch::nn::Linear(kWidth, 2 * kWidth));
  model->push_back("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({2 * kWidth})));
  model->push_back("head", torch::nn::Linear(2 * kWidth, kVocab));
  model->to(torch::kFloat64);
  return model;
}

const ModuleParallelizePlan kPlan = {{"type:torch::nn::EmbeddingImpl", ParallelStyle::kVocab},
                                     {"fc", ParallelStyle::kColwise},
                                     {"proj", ParallelStyle::kRowwise},
                                     {"*.attn_qkv", ParallelStyle::kColwise},
                                     {"*.attn_proj", ParallelStyle::kRowwise},
                                     {"block.mlp_fc", ParallelStyle::kColwise},
                                     {"block.mlp_proj", ParallelStyle::kRowwise},
                                     {"widen", ParallelStyle::kColwise},
                                     {"head", ParallelStyle::kColwise}};

// A child by name.
std::shared_ptr<torch::nn::Module> child(const torch::nn::Sequential& model,
                                         const std::string& name) {
  for (const auto& item : model->named_children())
    if (item.key() == name) return item.value();
  throw std::runtime_error("no child " + name);
}

std::pair<torch::Tensor, torch::Tensor> batch_of(int step) {
  const auto ids = ((torch::arange(kRows * kSequence, torch::kInt64) * 5 + step * 3) % kVocab)
                       .reshape({kRows, kSequence});
  const auto target =
      torch::sin(torch::arange(kRows * kSequence * kVocab, torch::kFloat64) * 0.1 + step)
          .reshape({kRows, kSequence, kVocab});
  return {ids, target};
}

TEST(ParallelizeModule, ASequentialSplitByAPlanTrainsLikeOneProcess) {
  const int port = test::free_port();
  const auto results = run_ranks(2, [&](int rank) {
    auto tp = join_group(rank, 2, port);
    auto reference = make_model();
    auto original = make_model();
    auto split = parallelize_module(original, tp, kPlan);
    // The plan's modules are tensor-parallel now, under the same names; the rest is shared.
    check(child(split, "embed")->as<VocabParallelEmbeddingImpl>() != nullptr,
          "embed is not vocab-parallel");
    const auto* fc = child(split, "fc")->as<ColumnParallelLinearImpl>();
    check(fc != nullptr && !fc->options().gather_output,
          "fc is not colwise, or gathers though only GELU leads to its rowwise partner");
    const auto* proj = child(split, "proj")->as<RowParallelLinearImpl>();
    check(proj != nullptr && proj->options().input_is_parallel, "proj does not take fc's part");
    check(child(split, "block")->as<GptBlockImpl>()->tp_group() != nullptr,
          "the GptBlock's parts were not split");
    check(child(split, "norm").get() == child(original, "norm").get(),
          "the LayerNorm is not the original module");
    const auto* widen = child(split, "widen")->as<ColumnParallelLinearImpl>();
    check(widen != nullptr && widen->options().gather_output,
          "the colwise layer ahead of the LayerNorm does not gather its output");
    check(split->named_parameters().size() == reference->named_parameters().size(),
          "the parameter names changed");

    torch::optim::SGD reference_sgd(reference->parameters(), torch::optim::SGDOptions(0.2));
    torch::optim::SGD split_sgd(split->parameters(), torch::optim::SGDOptions(0.2));
    for (int step = 0; step < 3; ++step) {
      const auto [ids, target] = batch_of(step);
      reference_sgd.zero_grad();
      const auto want = torch::mse_loss(reference->forward(ids), target);
      want.backward();
      reference_sgd.step();
      split_sgd.zero_grad();
      // The head is colwise at the end: gathered, so the output is whole on every rank.
      const auto got = torch::mse_loss(split->forward(ids), target);
      got.backward();
      split_sgd.step();
      test::expect_close(got.detach(), want.detach(), fmt::format("loss of step {}", step), 1e-12,
                         1e-14);
    }
    const auto full = child(split, "head")->as<ColumnParallelLinearImpl>()->gather_full();
    test::expect_close(full.weight,
                       child(reference, "head")->as<torch::nn::LinearImpl>()->weight.detach(),
                       "the head's weight after 3 steps", 1e-12, 1e-14);
    const auto want_block = child(reference, "block")->as<GptBlockImpl>()->full_named_parameters();
    const auto got_block = child(split, "block")->as<GptBlockImpl>()->full_named_parameters();
    check(want_block.size() == got_block.size(), "the block's parameter lists differ");
    for (std::size_t i = 0; i < want_block.size(); ++i) {
      test::expect_close(got_block[i].second, want_block[i].second,
                         "block " + want_block[i].first + " after 3 steps", 1e-12, 1e-14);
    }
  });
  EXPECT_ALL_RANKS_OK(results);
}

// A Linear held in a field of a custom module (not a child of the Sequential).
struct HolderImpl : torch::nn::Module {
  HolderImpl() { fc = register_module("fc", torch::nn::Linear(kWidth, kWidth)); }
  torch::Tensor forward(const torch::Tensor& x) { return fc(x); }
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(Holder);

TEST(ParallelizeModule, PlansThatCannotApplyAreNamedOnEveryRank) {
  const int port = test::free_port();
  const auto results = run_ranks(2, [&](int rank) {
    auto tp = join_group(rank, 2, port);
    const auto expect = [&](const ModuleParallelizePlan& plan, const std::string& needle,
                            const std::function<torch::nn::Sequential()>& model) {
      try {
        parallelize_module(model(), tp, plan);
      } catch (const ConfigError& e) {
        check(std::string(e.what()).find(needle) != std::string::npos,
              fmt::format("the error '{}' does not say '{}'", e.what(), needle));
        return;
      }
      throw std::runtime_error("nothing was thrown for a plan that should say: " + needle);
    };
    expect({{"fc2", ParallelStyle::kColwise}}, "the plan's key \"fc2\" matches no module",
           make_model);
    expect(
        {{"fc", ParallelStyle::kColwise}, {"type:torch::nn::LinearImpl", ParallelStyle::kRowwise}},
        "\"fc\" is matched by the plan's keys \"fc\" and \"type:torch::nn::LinearImpl\"",
        make_model);
    expect({{"norm", ParallelStyle::kColwise}},
           "\"norm\" is a torch::nn::LayerNormImpl, which colwise cannot split", make_model);
    expect({{"embed", ParallelStyle::kRowwise}},
           "\"embed\" is a torch::nn::EmbeddingImpl, which rowwise cannot split", make_model);
    // GptBlock's own rule: its pairs are split together.
    expect({{"block.attn_qkv", ParallelStyle::kColwise}},
           "the plan splits \"attn_qkv\" but not \"attn_proj\"", make_model);
    const auto holding = [] {
      torch::nn::Sequential model;
      model->push_back("holder", Holder());
      return model;
    };
    expect({{"*.fc", ParallelStyle::kColwise}}, "\"holder.fc\" is held by \"holder\", a ", holding);
    expect({{"*.fc", ParallelStyle::kColwise}}, "HolderImpl, whose fields libtorch cannot swap",
           holding);
    expect({{"0", ParallelStyle::kColwise}}, "out_features 7 is not divisible by the tp group's 2",
           [] { return torch::nn::Sequential(torch::nn::Linear(kWidth, 7)); });
    // Ranks given different plans: named before any layer's collective.
    expect({{rank == 0 ? "fc" : "widen", ParallelStyle::kColwise}},
           "the ranks of the tp group were given different layers", make_model);
  });
  EXPECT_ALL_RANKS_OK(results);
}

}  // namespace DDP_UNITY_ID
}  // namespace
}  // namespace ddp
