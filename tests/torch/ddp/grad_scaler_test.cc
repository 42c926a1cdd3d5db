// GradScaler (PyTorch's dynamic loss scaling, agreed across ranks) and AutocastGuard.
#include "ddp/torch/ddp/grad_scaler.h"

#include <gtest/gtest.h>

#include <limits>

#include "ddp/error.h"
#include "ddp/torch/core/version.h"
#include "ddp/torch/ddp/distributed_data_parallel.h"
#include "support/multiprocess.h"
#include "support/torch/ddp_test_models.h"
#include "support/torch/ddp_test_util.h"
#include "support/unity_namespace.h"

namespace ddp {
namespace {
namespace DDP_UNITY_ID {

using test::expect_identical_across_ranks;
using test::join_group;
using test::Mlp;
using test::run_ranks;

// One parameter whose gradient is set directly.
struct OneParameter {
  torch::Tensor weight = torch::ones({4}).requires_grad_(true);
  torch::optim::SGD optimizer{std::vector<torch::Tensor>{weight}, torch::optim::SGDOptions(1.0)};
  void set_grad(const torch::Tensor& grad) { weight.mutable_grad() = grad.clone(); }
};

TEST(GradScaler, ScalesTheLossAndUnscalesTheGradientsBeforeTheStep) {
  torch::set_num_threads(1);
  OneParameter p;
  GradScaler scaler({.init_scale = 1024.0});
  auto loss = (p.weight * torch::tensor({1.f, 2.f, 3.f, 4.f})).sum();
  auto scaled = scaler.scale(loss);
  EXPECT_FLOAT_EQ(scaled.item<float>(), loss.item<float>() * 1024.f);
  scaled.backward();
  EXPECT_TRUE(torch::equal(p.weight.grad(), torch::tensor({1.f, 2.f, 3.f, 4.f}) * 1024));
  EXPECT_TRUE(scaler.step(p.optimizer));
  // The step used the true gradient: w = 1 - 1.0 * g.
  EXPECT_TRUE(torch::allclose(p.weight.detach(), torch::tensor({0.f, -1.f, -2.f, -3.f})));
  scaler.update();
  EXPECT_EQ(scaler.get_scale(), 1024.0);
  EXPECT_EQ(scaler.growth_tracker(), 1);
}

TEST(GradScaler, AnInfOrNanSkipsTheStepAndBacksOffTheScale) {
  for (const float bad :
       {std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()}) {
    OneParameter p;
    GradScaler scaler({.init_scale = 8.0, .backoff_factor = 0.25});
    p.set_grad(torch::tensor({1.f, bad, 1.f, 1.f}));
    EXPECT_FALSE(scaler.step(p.optimizer));
    EXPECT_TRUE(scaler.found_inf(p.optimizer));
    EXPECT_TRUE(torch::equal(p.weight.detach(), torch::ones({4}))) << "the step was not skipped";
    scaler.update();
    EXPECT_EQ(scaler.get_scale(), 2.0);
    EXPECT_EQ(scaler.growth_tracker(), 0);
  }
}

TEST(GradScaler, TheScaleGrowsAfterGrowthIntervalCleanSteps) {
  OneParameter p;
  GradScaler scaler({.init_scale = 4.0, .growth_factor = 3.0, .growth_interval = 3});
  const std::vector<double> expected{4, 4, 12, 12, 12, 36};
  for (std::size_t i = 0; i < expected.size(); ++i) {
    p.set_grad(torch::ones({4}));
    EXPECT_TRUE(scaler.step(p.optimizer));
    scaler.update();
    EXPECT_EQ(scaler.get_scale(), expected[i]) << "after clean step " << i + 1;
  }
  // An overflow resets the count: growth needs three clean steps again.
  p.set_grad(torch::full({4}, std::numeric_limits<float>::infinity()));
  EXPECT_FALSE(scaler.step(p.optimizer));
  scaler.update();
  EXPECT_EQ(scaler.get_scale(), 18.0);
  EXPECT_EQ(scaler.growth_tracker(), 0);
}

TEST(GradScaler, CallsOutOfOrderAndBadOptionsAreNamed) {
  OneParameter p;
  GradScaler scaler;
  p.set_grad(torch::ones({4}));
  scaler.unscale_(p.optimizer);
  EXPECT_THROW(
      {
        try {
          scaler.unscale_(p.optimizer);
        } catch (const Error& e) {
          EXPECT_NE(std::string(e.what()).find("already been called"), std::string::npos);
          throw;
        }
      },
      Error);
  scaler.step(p.optimizer);
  EXPECT_THROW(scaler.step(p.optimizer), Error);
  scaler.update();
  EXPECT_THROW(scaler.update(), Error) << "update() with nothing unscaled since the last one";
  EXPECT_THROW(scaler.update(-1.0), ConfigError);

  const auto message_of = [](GradScalerOptions options) {
    try {
      GradScaler bad(options);
    } catch (const ConfigError& e) {
      return std::string(e.what());
    }
    return std::string("(accepted)");
  };
  EXPECT_NE(message_of({.init_scale = 0}).find("init_scale"), std::string::npos);
  EXPECT_NE(message_of({.init_scale = std::numeric_limits<double>::infinity()}).find("init_scale"),
            std::string::npos);
  EXPECT_NE(message_of({.growth_factor = 1.0}).find("growth_factor"), std::string::npos);
  EXPECT_NE(message_of({.backoff_factor = 1.0}).find("backoff_factor"), std::string::npos);
  EXPECT_NE(message_of({.growth_interval = 0}).find("growth_interval"), std::string::npos);
}

TEST(GradScaler, DisabledIsAPlainStep) {
  OneParameter p;
  GradScaler scaler({.enabled = false});
  auto loss = p.weight.sum();
  EXPECT_TRUE(torch::equal(scaler.scale(loss), loss));
  p.set_grad(torch::full({4}, std::numeric_limits<float>::infinity()));
  EXPECT_TRUE(scaler.step(p.optimizer));
  scaler.update();
  EXPECT_EQ(scaler.get_scale(), 1.0);
}

TEST(GradScaler, SavedStateLoadsIntoAFreshScaler) {
  OneParameter p;
  GradScaler scaler({.init_scale = 16.0, .growth_interval = 10});
  for (int i = 0; i < 3; ++i) {
    p.set_grad(torch::ones({4}));
    scaler.step(p.optimizer);
    scaler.update();
  }
  torch::serialize::OutputArchive out;
  scaler.save(out);
  std::ostringstream bytes;
  out.save_to(bytes);
  torch::serialize::InputArchive in;
  std::istringstream source(bytes.str());
  in.load_from(source);
  GradScaler restored;
  restored.load(in);
  EXPECT_EQ(restored.get_scale(), 16.0);
  EXPECT_EQ(restored.growth_tracker(), 3);
}

// Rank 1 alone overflows: with the group, both ranks skip and back off together; the parameters
// and scales stay identical.
TEST(GradScaler, AnOverflowOnOneRankSkipsTheStepOnEveryRank) {
  const int port = test::free_port();
  const auto results = run_ranks(2, [&](int rank) {
    auto pg = join_group(rank, 2, port);
    OneParameter p;
    GradScaler scaler({.init_scale = 8.0}, pg);
    for (int step = 0; step < 4; ++step) {
      const bool overflow_here = step == 2 && rank == 1;
      p.set_grad(overflow_here ? torch::full({4}, std::numeric_limits<float>::infinity())
                               : torch::full({4}, 8.0f));
      const bool stepped = scaler.step(p.optimizer);
      if (stepped == (step == 2)) {
        throw std::runtime_error(fmt::format("rank {} step {}: stepped={}", rank, step, stepped));
      }
      scaler.update();
    }
    if (scaler.get_scale() != 4.0) {
      throw std::runtime_error(fmt::format("rank {}: scale {}", rank, scaler.get_scale()));
    }
    expect_identical_across_ranks(*pg, {p.weight}, "parameters");
  });
  EXPECT_ALL_RANKS_OK(results);
}

// DDP with a scale so large that the first gradients overflow: the ranks skip the same steps,
// back off to a working scale, then train, and stay bit-identical throughout.
TEST(GradScaler, DdpTrainingWithAutocastRecoversFromAnOverflowingScale) {
  const int port = test::free_port();
  const auto results = run_ranks(2, [&](int rank) {
    auto pg = join_group(rank, 2, port);
    torch::manual_seed(5);
    Mlp net;
    DistributedDataParallel model(net.ptr(), pg);
    torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.05));
    // fc3's bias gets a gradient of 2 from the extra term (which shifts every logit alike, so it
    // does not change the cross entropy): 2 x 3e38 overflows float, so the first step must.
    GradScaler scaler({.init_scale = 3e38, .backoff_factor = 1e-30}, pg);
    torch::manual_seed(11 + rank);
    const auto x = torch::randn({16, 20});
    const auto y = torch::randint(0, 4, {16});
    int skipped = 0;
    double first_loss = 0, last_loss = 0;
    for (int step = 0; step < 30; ++step) {
      optimizer.zero_grad();
      torch::Tensor loss;
      {
        AutocastGuard autocast(torch::kBFloat16);
        auto out = model->forward(x);
        if (out.scalar_type() != torch::kBFloat16) {
          throw std::runtime_error("a Linear under AutocastGuard did not run in bfloat16");
        }
        loss = torch::nn::functional::cross_entropy(out.to(torch::kFloat32), y);
      }
      scaler.scale(loss + 2 * net->fc3->bias.sum()).backward();
      if (!scaler.step(optimizer)) ++skipped;
      scaler.update();
      expect_identical_across_ranks(*pg, model->parameters(), fmt::format("step {}", step));
      if (step == 0) first_loss = loss.item<double>();
      last_loss = loss.item<double>();
    }
    if (skipped < 1 || skipped > 3) {
      throw std::runtime_error(
          fmt::format("rank {}: {} steps skipped, expected 1 to 3", rank, skipped));
    }
    if (!(last_loss < first_loss)) {
      throw std::runtime_error(fmt::format("loss {} -> {}: no training", first_loss, last_loss));
    }
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(AutocastGuard, RunsLinearInBfloat16AndRestoresTheState) {
  torch::nn::Linear linear(8, 4);
  const auto x = torch::randn({2, 8});
  {
    AutocastGuard autocast(torch::kBFloat16);
    EXPECT_EQ(linear(x).scalar_type(), torch::kBFloat16);
    {
      AutocastGuard off(torch::kBFloat16, /*enabled=*/false);
      EXPECT_EQ(linear(x).scalar_type(), torch::kFloat32);
    }
    EXPECT_EQ(linear(x).scalar_type(), torch::kBFloat16);
  }
  EXPECT_EQ(linear(x).scalar_type(), torch::kFloat32);
  EXPECT_THROW(AutocastGuard bad(torch::kFloat64), ConfigError);
  if (libtorch_version().rfind("1.", 0) == 0) {
    EXPECT_THROW(AutocastGuard half(torch::kFloat16), ConfigError)
        << "1.13 would silently use fp32";
  } else {
    AutocastGuard half(torch::kFloat16);
    EXPECT_EQ(linear(x).scalar_type(), torch::kFloat16);
  }
}

}  // namespace DDP_UNITY_ID
}  // namespace
}  // namespace ddp
