// ddp::checkpoint and apply_activation_checkpointing in one process: gradients and parameters bit
// for bit those of the run without checkpointing (float64, with dropout), and every misuse named.
#include "ddp/torch/recompute/activation_checkpoint.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "ddp/error.h"
#include "ddp/torch/parallel/tensor/gpt_block.h"
#include "support/error_of.h"
#include "support/unity_namespace.h"

namespace ddp {
namespace {
namespace DDP_UNITY_ID {

using test::error_of;

torch::nn::Sequential make_mlp() {
  torch::manual_seed(7);
  torch::nn::Sequential model(torch::nn::Linear(8, 32), torch::nn::Tanh(), torch::nn::Dropout(0.3),
                              torch::nn::Linear(32, 32), torch::nn::Tanh(), torch::nn::Dropout(0.3),
                              torch::nn::Linear(32, 4));
  model->to(torch::kFloat64);
  return model;
}

// Five SGD steps with dropout; the parameters after them.
std::vector<torch::Tensor> train(torch::nn::Sequential model) {
  torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  torch::manual_seed(11);
  for (int step = 0; step < 5; ++step) {
    auto x = torch::randn({16, 8}, torch::kFloat64);
    auto y = torch::randn({16, 4}, torch::kFloat64);
    sgd.zero_grad();
    torch::mse_loss(model->forward(x), y).backward();
    sgd.step();
  }
  std::vector<torch::Tensor> params;
  for (const auto& p : model->parameters())
    params.push_back(p.detach().clone());
  return params;
}

TEST(ActivationCheckpoint, ParametersAfterFiveStepsWithDropoutAreBitForBitThoseWithout) {
  const auto plain = train(make_mlp());
  auto wrapped = apply_activation_checkpointing(make_mlp(), checkpoint_every_child());
  const auto checkpointed = train(wrapped);
  ASSERT_EQ(plain.size(), checkpointed.size());
  for (std::size_t i = 0; i < plain.size(); ++i)
    EXPECT_TRUE(torch::equal(plain[i], checkpointed[i])) << "parameter " << i;
  // Chosen by type: only the Linear layers; the same numbers again.
  auto by_type = apply_activation_checkpointing(
      make_mlp(), checkpoint_children_named({"torch::nn::LinearImpl"}));
  const auto linear_only = train(by_type);
  for (std::size_t i = 0; i < plain.size(); ++i)
    EXPECT_TRUE(torch::equal(plain[i], linear_only[i])) << "parameter " << i;
}

// GptBlock's dropout draws from the tensor-parallel RNG tracker's generators, not the default one:
// the recomputation replays them too (without, the masks differ and the gradients are wrong).
TEST(ActivationCheckpoint, GptBlockDropoutOnTheTensorParallelGeneratorsIsBitForBitTheRunWithout) {
  const auto train = [](bool checkpointed) {
    torch::nn::Sequential model(
        GptBlock(GptBlockOptions{
            .hidden = 16, .heads = 2, .dropout = 0.3, .seed = 4, .dtype = torch::kFloat64}),
        GptBlock(GptBlockOptions{
            .hidden = 16, .heads = 2, .dropout = 0.3, .seed = 8, .dtype = torch::kFloat64}));
    auto run =
        checkpointed ? apply_activation_checkpointing(model, checkpoint_every_child()) : model;
    torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.1));
    torch::manual_seed(2);
    for (int step = 0; step < 3; ++step) {
      auto x = torch::randn({2, 5, 16}, torch::kFloat64);
      sgd.zero_grad();
      run->forward(x).pow(2).mean().backward();
      sgd.step();
    }
    std::vector<torch::Tensor> params;
    for (const auto& p : model->parameters())
      params.push_back(p.detach().clone());
    return params;
  };
  const auto plain = train(false);
  const auto checkpointed = train(true);
  ASSERT_EQ(plain.size(), checkpointed.size());
  for (std::size_t i = 0; i < plain.size(); ++i)
    EXPECT_TRUE(torch::equal(plain[i], checkpointed[i])) << "parameter " << i;
}

TEST(ActivationCheckpoint, TheWrappedSequentialKeepsTheNamesAndTheModules) {
  auto model = make_mlp();
  auto wrapped = apply_activation_checkpointing(model, checkpoint_every_child());
  const auto before = model->named_parameters();
  const auto after = wrapped->named_parameters();
  ASSERT_EQ(before.size(), after.size());
  for (std::size_t i = 0; i < before.size(); ++i) {
    EXPECT_EQ(before[i].key(), after[i].key());
    EXPECT_TRUE(before[i].value().is_same(after[i].value())) << before[i].key();
  }
  wrapped->eval();  // reaches the children: dropout off, two forwards agree
  auto x = torch::randn({4, 8}, torch::kFloat64);
  EXPECT_TRUE(torch::equal(wrapped->forward(x), wrapped->forward(x)));
  EXPECT_FALSE(model->ptr(2)->is_training());
}

TEST(ActivationCheckpoint, GradientsOfSeveralInputsAndACapturedLeafEqualPlainAutograd) {
  torch::manual_seed(3);
  auto w = torch::randn({5, 5}, torch::dtype(torch::kFloat64).requires_grad(true));
  auto a0 = torch::randn({3, 5}, torch::dtype(torch::kFloat64).requires_grad(true));
  auto b0 = torch::randn({3, 5}, torch::dtype(torch::kFloat64).requires_grad(true));
  auto f = [&](const torch::Tensor& a, const torch::Tensor& b) {
    return torch::tanh(a.matmul(w)) * torch::sigmoid(b) + a;
  };
  auto a = a0 * 2;  // inputs that are not leaves: their gradients go on through the outer graph
  auto b = b0 + 1;
  f(a, b).pow(2).sum().backward();
  const auto want =
      std::vector<torch::Tensor>{w.grad().clone(), a0.grad().clone(), b0.grad().clone()};
  w.mutable_grad().reset();
  a0.mutable_grad().reset();
  b0.mutable_grad().reset();
  checkpoint(f, a0 * 2, b0 + 1).pow(2).sum().backward();
  EXPECT_TRUE(torch::equal(w.grad(), want[0]));
  EXPECT_TRUE(torch::equal(a0.grad(), want[1]));
  EXPECT_TRUE(torch::equal(b0.grad(), want[2]));
}

TEST(ActivationCheckpoint, AParameterTheFunctionDoesNotUseGetsNoGradient) {
  torch::nn::Linear used(4, 4), unused(4, 4);
  auto x = torch::randn({2, 4});
  checkpoint([&](const torch::Tensor& in) { return used->forward(in); }, x).sum().backward();
  EXPECT_TRUE(used->weight.grad().defined());
  EXPECT_FALSE(unused->weight.grad().defined());
  EXPECT_FALSE(x.grad().defined());  // an input that needs no gradient gets none
}

TEST(ActivationCheckpoint, WithoutGradientModeTheFunctionJustRuns) {
  torch::nn::Linear layer(4, 4);
  torch::NoGradGuard no_grad;
  auto y =
      checkpoint([&](const torch::Tensor& in) { return layer->forward(in); }, torch::randn({2, 4}));
  EXPECT_FALSE(y.requires_grad());
}

TEST(ActivationCheckpoint, ARecomputationThatDiffersFromItsForwardIsNamed) {
  torch::nn::Linear layer(4, 4);
  int calls = 0;
  auto shape = [&](const torch::Tensor& in) {  // a counter changes the output's shape
    return ++calls == 1 ? layer->forward(in) : layer->forward(in).narrow(0, 0, 1);
  };
  auto y = checkpoint(shape, torch::randn({2, 4}));
  EXPECT_NE(error_of([&] { y.sum().backward(); }).find("output 0 of the recomputation"),
            std::string::npos);

  calls = 0;
  torch::nn::Linear other(4, 4);
  auto leaves = [&](const torch::Tensor& in) {  // other parameters the second time
    return ++calls == 1 ? layer->forward(in) : other->forward(in);
  };
  auto z = checkpoint(leaves, torch::randn({2, 4}));
  EXPECT_NE(error_of([&] { z.sum().backward(); }).find("used other tensors"), std::string::npos);
}

TEST(ActivationCheckpoint, ACapturedActivationAnInPlaceEditAndASecondBackwardAreNamed) {
  torch::nn::Linear layer(4, 4);
  auto outside = layer->forward(torch::randn({2, 4}));  // not a leaf, made outside
  const std::string captured = error_of([&] {
    checkpoint([&](const torch::Tensor& in) { return in + outside; }, torch::randn({2, 4}));
  });
  EXPECT_NE(captured.find("pass it as an input"), std::string::npos) << captured;

  auto x = torch::randn({2, 4}, torch::requires_grad());
  auto input = x * 1;
  auto y = checkpoint([&](const torch::Tensor& in) { return layer->forward(in); }, input);
  {
    torch::NoGradGuard no_grad;
    input.add_(1);
  }
  const std::string edited = error_of([&] { y.sum().backward(); });
  EXPECT_NE(edited.find("modified in place"), std::string::npos) << edited;

  auto z =
      checkpoint([&](const torch::Tensor& in) { return layer->forward(in); }, torch::randn({2, 4}));
  z.sum().backward();
  const std::string again = error_of([&] { z.sum().backward(); });
  EXPECT_NE(again.find("retain_graph"), std::string::npos) << again;
}

TEST(ActivationCheckpoint, AFunctionThatModifiesItsInputInPlaceIsNamed) {
  // An input that needs no gradient (libtorch itself refuses in-place ops on one that does).
  torch::nn::Linear layer(4, 4);
  const std::string error = error_of([&] {
    checkpoint(
        [&](const torch::Tensor& in) {
          auto doubled = in;
          doubled.mul_(2);  // what a collective that reduces its input in place does too
          return layer->forward(doubled);
        },
        torch::randn({2, 4}));
  });
  EXPECT_NE(error.find("modified its input 0 in place"), std::string::npos) << error;
}

TEST(ActivationCheckpoint, APredicateThatChoosesNothingIsNamed) {
  EXPECT_THROW(apply_activation_checkpointing(make_mlp(), checkpoint_children_named({"Nope"})),
               ConfigError);
}

}  // namespace DDP_UNITY_ID
}  // namespace
}  // namespace ddp
