// int8_quantize_hook on real ranks: its error bound, identical results on every rank, error
// feedback over many steps, DDP training, checkpointing its state, bytes sent.
#include "ddp/torch/ddp/hooks/quantized_hook.h"

#include <gtest/gtest.h>

#include "ddp/error.h"
#include "ddp/torch/ddp/distributed_data_parallel.h"
#include "support/multiprocess.h"
#include "support/temp_dir.h"
#include "support/torch/comm_hook_test_util.h"
#include "support/torch/ddp_test_util.h"
#include "support/unity_namespace.h"

namespace ddp {
namespace {
namespace DDP_UNITY_ID {

using test::gather_all;
using test::join_group;
using test::reduce_with;
using test::run_ranks;
using test::Shapes;

torch::Tensor gradients_for(int rank, int step, std::int64_t numel) {
  torch::manual_seed(1000 * step + rank);
  return torch::randn({numel}) * (rank + 1);
}

void check_error_bound(int world) {
  const int port = test::free_port();
  const auto results = run_ranks(world, [&](int rank) {
    auto pg = join_group(rank, world, port);
    const Shapes shapes = {{64, 33}, {33}};
    const auto numel = test::total_numel(shapes);
    auto hook = int8_quantize_hook(
        std::make_shared<Int8QuantizeState>(Int8QuantizeOptions{.use_error_feedback = false}));
    for (int step = 0; step < 3; ++step) {
      const auto grads = gradients_for(rank, step, numel);
      std::size_t bytes = 0;
      const auto got = reduce_with(hook, *pg, grads, shapes, &bytes);
      if (bytes != static_cast<std::size_t>(numel) + 4) {
        throw std::runtime_error(fmt::format("bytes sent {} != {}", bytes, numel + 4));
      }
      const auto all = gather_all(*pg, grads);
      // Per element: |avg_hook - avg| <= sum_r (scale_r / 2) / world, scale_r = max|g_r| / 127.
      const auto bound = (all.abs().amax(1) / 127.0 / 2.0).sum().item<double>() / world;
      const auto error = (got - all.mean(0)).abs().max().item<double>();
      if (!(error <= bound * 1.001 + 1e-7) || !(error > 0)) {
        throw std::runtime_error(
            fmt::format("step {}: max error {:g}, bound {:g}", step, error, bound));
      }
      test::expect_identical_across_ranks(*pg, {got}, "the int8 average");
    }
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(Int8Hook, ErrorWithinHalfAScaleOnTwoRanks) {
  check_error_bound(2);
}
TEST(Int8Hook, ErrorWithinHalfAScaleOnThreeRanks) {
  check_error_bound(3);
}

TEST(Int8Hook, ErrorFeedbackMakesTheAccumulatedGradientConverge) {
  const int port = test::free_port();
  const auto results = run_ranks(2, [&](int rank) {
    auto pg = join_group(rank, 2, port);
    const Shapes shapes = {{500}};
    // Mostly small values and one large one: the small ones are below half a scale step, so
    // plain quantisation rounds them to zero every step.
    auto grads = gradients_for(rank, 0, 500) * 1e-3;
    grads[0] = 10.0;
    const auto mean = gather_all(*pg, grads).mean(0);
    const int steps = 2000;
    std::vector<double> relative;
    for (const bool feedback : {true, false}) {
      auto hook = int8_quantize_hook(
          std::make_shared<Int8QuantizeState>(Int8QuantizeOptions{.use_error_feedback = feedback}));
      auto sum = torch::zeros_like(mean);
      for (int step = 0; step < steps; ++step)
        sum += reduce_with(hook, *pg, grads, shapes);
      const auto small = torch::indexing::Slice(1, torch::indexing::None);
      relative.push_back(((sum.index({small}) - steps * mean.index({small})).norm() /
                          (steps * mean.index({small})).norm())
                             .item<double>());
    }
    if (!(relative[0] < 0.05) || !(relative[1] > 0.5)) {
      throw std::runtime_error(fmt::format(
          "relative error of the accumulated small gradients: {:g} with error feedback (want "
          "< 0.05), {:g} without (want > 0.5)",
          relative[0], relative[1]));
    }
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(Int8Hook, DdpTrainingConvergesAndReportsBytes) {
  const int port = test::free_port();
  const auto results = run_ranks(2, [&](int rank) {
    auto pg = join_group(rank, 2, port);
    auto state = std::make_shared<Int8QuantizeState>();
    auto model = test::train_regression_with_hook(pg, int8_quantize_hook(state));
    const auto timeline = model->reducer().last_timeline();
    if (timeline.bytes_sent != 32 * 16 + 4 || state->bytes_sent() != 300u * (32 * 16 + 4)) {
      throw std::runtime_error(
          fmt::format("bytes: last step {}, state {}", timeline.bytes_sent, state->bytes_sent()));
    }
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(Int8Hook, SavedStateContinuesExactlyLikeTheOriginal) {
  const int port = test::free_port();
  test::TempDir dir("ddp-int8");
  const auto results = run_ranks(2, [&](int rank) {
    auto pg = join_group(rank, 2, port);
    const Shapes shapes = {{40, 10}};
    auto original = std::make_shared<Int8QuantizeState>();
    auto hook = int8_quantize_hook(original);
    for (int step = 0; step < 3; ++step)
      reduce_with(hook, *pg, gradients_for(rank, step, 400), shapes);
    const auto file = (dir.path() / fmt::format("state{}.pt", rank)).string();
    {
      torch::serialize::OutputArchive archive;
      original->save(archive);
      archive.save_to(file);
    }
    auto loaded = std::make_shared<Int8QuantizeState>();
    {
      torch::serialize::InputArchive archive;
      archive.load_from(file);
      loaded->load(archive);
    }
    auto loaded_hook = int8_quantize_hook(loaded);
    auto fresh_hook = int8_quantize_hook();
    const auto grads = gradients_for(rank, 7, 400);
    const auto a = reduce_with(hook, *pg, grads, shapes);
    const auto b = reduce_with(loaded_hook, *pg, grads, shapes);
    const auto c = reduce_with(fresh_hook, *pg, grads, shapes);
    if (!torch::equal(a, b)) throw std::runtime_error("loaded state differs");
    if (torch::equal(a, c)) throw std::runtime_error("the error memory made no difference");
    if (loaded->bytes_sent() != original->bytes_sent()) throw std::runtime_error("bytes");
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(Int8Hook, NullStateIsAConfigError) {
  EXPECT_THROW(int8_quantize_hook(nullptr), ConfigError);
}

}  // namespace DDP_UNITY_ID
}  // namespace
}  // namespace ddp
