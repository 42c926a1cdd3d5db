// PowerSGD comm hooks on real ranks: against a direct computation of the algorithm on the
// gathered gradients, against plain averaging at full rank, error feedback over many steps, DDP
// training, checkpointing the state, bad options, a throwing hook, and PyTorch 2.x's
// powerSGD_hook on the same gradients (skipped where scripts/pytorch-python is unavailable).
#include "ddp/torch/ddp/hooks/powersgd_hook.h"

#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "ddp/comm/comm_error.h"
#include "ddp/error.h"
#include "ddp/torch/ddp/distributed_data_parallel.h"
#include "support/multiprocess.h"
#include "support/subprocess.h"
#include "support/temp_dir.h"
#include "support/test_paths.h"
#include "support/torch/comm_hook_test_util.h"
#include "support/torch/ddp_test_util.h"
#include "support/unity_namespace.h"

namespace ddp {
namespace {
namespace DDP_UNITY_ID {

using namespace std::chrono_literals;
using test::expect_close;
using test::gather_all;
using test::join_group;
using test::reduce_with;
using test::run_ranks;
using test::Shapes;

// A 16x32 matrix, a bias, a conv weight (8 x 36 as a matrix), another 16x32 (same shape group as
// the first: its Q is drawn second), and a 4x4 that does not pay to compress at rank 1.
const Shapes kShapes = {{16, 32}, {32}, {8, 4, 3, 3}, {16, 32}, {4, 4}};

torch::Tensor gradients_for(int rank, int step, std::int64_t numel) {
  torch::manual_seed(1000 * step + rank);
  return torch::randn({numel});
}

TEST(PowerSgd, NumpyRandintMatchesNumpysRandomState) {
  // numpy.random.RandomState(seed).randint(1_000_000_000), printed by numpy 1.x/2.x.
  std::mt19937 zero(0), answer(42);
  EXPECT_EQ(powersgd_detail::numpy_randint(zero, 1'000'000'000), 209652396);
  EXPECT_EQ(powersgd_detail::numpy_randint(answer, 1'000'000'000), 534895718);
}

TEST(PowerSgd, BadOptionsAreConfigErrors) {
  EXPECT_THROW(PowerSGDState({.matrix_approximation_rank = 0}), ConfigError);
  EXPECT_THROW(PowerSGDState({.start_powersgd_iter = 1}), ConfigError);
  EXPECT_NO_THROW(
      PowerSGDState({.start_powersgd_iter = 0, .use_error_feedback = false, .warm_start = false}));
  EXPECT_THROW(PowerSGDState({.min_compression_rate = -1}), ConfigError);
  EXPECT_THROW(powersgd_hook(nullptr), ConfigError);
  EXPECT_THROW(batched_powersgd_hook(nullptr), ConfigError);
}

// The algorithm written out on the gathered gradients (no error feedback, no warm start: a fresh
// random Q every step from the same seed sequence).
torch::Tensor direct_powersgd(const torch::Tensor& all, const Shapes& shapes, int r,
                              std::mt19937& rng) {
  const auto world = all.size(0);
  auto out = all.mean(0);
  std::vector<std::int64_t> offsets;
  std::int64_t at = 0;
  for (const auto& shape : shapes) {
    offsets.push_back(at);
    at += test::total_numel({shape});
  }
  // Compressed tensors in PyTorch's order: grouped by shape, shapes in order of appearance.
  std::vector<std::size_t> order;
  std::vector<std::pair<std::int64_t, std::int64_t>> seen;
  std::vector<std::vector<std::size_t>> groups;
  for (std::size_t i = 0; i < shapes.size(); ++i) {
    const auto n = shapes[i][0];
    const auto m = test::total_numel({shapes[i]}) / n;
    const auto rank = std::min<std::int64_t>({n, m, r});
    if (!((n + m) * rank * 2 < n * m)) continue;
    auto it = std::find(seen.begin(), seen.end(), std::make_pair(n, m));
    if (it == seen.end()) {
      seen.emplace_back(n, m);
      groups.emplace_back();
      it = seen.end() - 1;
    }
    groups[it - seen.begin()].push_back(i);
  }
  for (const auto& group : groups)
    order.insert(order.end(), group.begin(), group.end());
  auto generator = at::detail::createCPUGenerator(
      static_cast<std::uint64_t>(powersgd_detail::numpy_randint(rng, 1'000'000'000)));
  for (const auto i : order) {
    const auto n = shapes[i][0];
    const auto numel = test::total_numel({shapes[i]});
    const auto m = numel / n;
    const auto rank = std::min<std::int64_t>({n, m, r});
    auto q = torch::randn({1, m, rank}, generator);
    powersgd_detail::orthogonalize(q, 0);
    auto p = torch::zeros({1, n, rank});
    for (std::int64_t w = 0; w < world; ++w)
      p += torch::bmm(all[w].narrow(0, offsets[i], numel).view({1, n, m}), q);
    powersgd_detail::orthogonalize(p, 0);
    auto q2 = torch::zeros({1, m, rank});
    for (std::int64_t w = 0; w < world; ++w)
      q2 += torch::bmm(all[w].narrow(0, offsets[i], numel).view({1, n, m}).transpose(1, 2), p);
    out.narrow(0, offsets[i], numel).copy_(torch::bmm(p, q2.transpose(1, 2)).flatten() / world);
  }
  return out;
}

void check_against_direct(int world, int r) {
  const int port = test::free_port();
  const auto results = run_ranks(world, [&](int rank) {
    auto pg = join_group(rank, world, port);
    const PowerSGDOptions options{.matrix_approximation_rank = r,
                                  .start_powersgd_iter = 0,
                                  .use_error_feedback = false,
                                  .warm_start = false,
                                  .random_seed = 7};
    auto state = std::make_shared<PowerSGDState>(options);
    auto hook = powersgd_hook(state);
    std::mt19937 rng(options.random_seed);
    const auto numel = test::total_numel(kShapes);
    for (int step = 0; step < 3; ++step) {
      const auto grads = gradients_for(rank, step, numel);
      const auto got = reduce_with(hook, *pg, grads, kShapes);
      const auto want = direct_powersgd(gather_all(*pg, grads), kShapes, r, rng);
      expect_close(got, want, fmt::format("rank {} step {}", rank, step), 1e-5, 1e-5);
      // Compression must have changed the compressed tensors (not silently averaged).
      if (torch::allclose(got, gather_all(*pg, grads).mean(0), 1e-3, 1e-3)) {
        throw std::runtime_error("the hook's result equals the plain average");
      }
    }
    if (state->iteration() != 3) throw std::runtime_error("iteration not counted");
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(PowerSgd, EqualsDirectComputationOnTwoRanksRank1) {
  check_against_direct(2, 1);
}
TEST(PowerSgd, EqualsDirectComputationOnThreeRanksRank3) {
  check_against_direct(3, 3);
}

TEST(PowerSgd, FullRankEqualsPlainAverage) {
  const int port = test::free_port();
  const auto results = run_ranks(2, [&](int rank) {
    auto pg = join_group(rank, 2, port);
    const Shapes shapes = {{16, 8}, {8}, {6, 10}};
    // rank >= every min dimension and compression forced (rate 0): P Q^T is exact.
    auto state = std::make_shared<PowerSGDState>(PowerSGDOptions{
        .matrix_approximation_rank = 16, .start_powersgd_iter = 2, .min_compression_rate = 0});
    auto hook = powersgd_hook(state);
    for (int step = 0; step < 4; ++step) {
      const auto grads = gradients_for(rank, step, test::total_numel(shapes));
      const auto got = reduce_with(hook, *pg, grads, shapes);
      expect_close(got, gather_all(*pg, grads).mean(0), fmt::format("step {}", step), 1e-5, 1e-5);
    }
    if (state->numel_after_compression() <= state->numel_before_compression() / 2) {
      throw std::runtime_error("full rank should not shrink the gradients");
    }
  });
  EXPECT_ALL_RANKS_OK(results);
}

// The hook writes the new error while it decompresses where the gradients tile the bucket (as
// the reducer makes them), and otherwise keeps a copy of the corrected bucket and subtracts the
// result (a bucket with one element more than its gradients): both carry the same error from
// step to step, with and without batching by shape.
void check_fused_error_feedback(int r, bool batch) {
  const int port = test::free_port();
  const auto results = run_ranks(2, [&](int rank) {
    auto pg = join_group(rank, 2, port);
    const PowerSGDOptions options{.matrix_approximation_rank = r,
                                  .start_powersgd_iter = 2,
                                  .batch_tensors_with_same_shape = batch};
    auto tiled_state = std::make_shared<PowerSGDState>(options);
    auto padded_state = std::make_shared<PowerSGDState>(options);
    auto tiled_hook = powersgd_hook(tiled_state);
    auto padded_hook = powersgd_hook(padded_state);
    const auto numel = test::total_numel(kShapes);
    for (int step = 0; step < 6; ++step) {
      const auto grads = gradients_for(rank, step, numel);
      const auto tiled = reduce_with(tiled_hook, *pg, grads, kShapes);
      auto padded = torch::cat({grads, torch::full({1}, 5.0f)});
      auto bucket = test::make_bucket(padded, kShapes);
      auto reduction = padded_hook(*pg, bucket);
      if (reduction.work) reduction.work->wait();
      if (reduction.finish) reduction.finish();
      expect_close(tiled, padded.narrow(0, 0, numel),
                   fmt::format("rank {} step {} rank {} batch {}", rank, step, r, batch), 1e-6,
                   1e-6);
      if (padded[numel].item<float>() != 5.0f) throw std::runtime_error("padding changed");
    }
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(PowerSgd, FusedErrorFeedbackEqualsTheCopyingOneRank1) {
  check_fused_error_feedback(1, false);
}
TEST(PowerSgd, FusedErrorFeedbackEqualsTheCopyingOneRank2Batched) {
  check_fused_error_feedback(2, true);
}

// Fixed gradients of full rank, compressed at rank 1 for many steps: with error feedback the sum
// of the hook's averages approaches the sum of the true averages; without, it misses by the part
// that rank 1 cannot represent.
TEST(PowerSgd, ErrorFeedbackMakesTheAccumulatedGradientConverge) {
  const int port = test::free_port();
  const auto results = run_ranks(2, [&](int rank) {
    auto pg = join_group(rank, 2, port);
    const Shapes shapes = {{24, 24}};
    const auto grads = gradients_for(rank, 0, 24 * 24);
    const auto mean = gather_all(*pg, grads).mean(0);
    const int steps = 150;
    std::vector<double> relative;
    for (const bool feedback : {true, false}) {
      auto state = std::make_shared<PowerSGDState>(PowerSGDOptions{
          .start_powersgd_iter = 2, .use_error_feedback = feedback, .random_seed = 3});
      auto hook = powersgd_hook(state);
      auto sum = torch::zeros_like(mean);
      for (int step = 0; step < steps; ++step)
        sum += reduce_with(hook, *pg, grads, shapes);
      relative.push_back(((sum - steps * mean).norm() / (steps * mean).norm()).item<double>());
    }
    if (!(relative[0] < 0.1) || !(relative[1] > 0.5)) {
      throw std::runtime_error(fmt::format(
          "relative error of the accumulated gradient: {:g} with error feedback (want < 0.1), "
          "{:g} without (want > 0.5)",
          relative[0], relative[1]));
    }
  });
  EXPECT_ALL_RANKS_OK(results);
}

// Linear regression y = x W* with DDP and the hook: the loss falls by orders of magnitude and
// the ranks stay identical.
void check_training(CommHook (*make_hook)(std::shared_ptr<PowerSGDState>)) {
  const int port = test::free_port();
  const auto results = run_ranks(2, [&](int rank) {
    auto pg = join_group(rank, 2, port);
    auto state = std::make_shared<PowerSGDState>(
        PowerSGDOptions{.matrix_approximation_rank = 2, .start_powersgd_iter = 5});
    test::train_regression_with_hook(pg, make_hook(state));
    if (state->iteration() != 300) throw std::runtime_error("iteration count");
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(PowerSgd, DdpTrainingConverges) {
  check_training(&powersgd_hook);
}
TEST(PowerSgd, BatchedDdpTrainingConverges) {
  check_training(&batched_powersgd_hook);
}

// Many buckets with two collectives each: every rank must issue them in the same order (a
// second stage issued from a completion callback raced with the next bucket's first allreduce).
TEST(PowerSgd, ManyBucketsStayInStepAndIdenticalAcrossRanks) {
  const int port = test::free_port();
  const auto results = run_ranks(3, [&](int rank) {
    auto pg = join_group(rank, 3, port);
    torch::manual_seed(3);
    torch::nn::Sequential net(
        torch::nn::Linear(64, 64), torch::nn::ReLU(), torch::nn::Linear(64, 64), torch::nn::ReLU(),
        torch::nn::Linear(64, 64), torch::nn::ReLU(), torch::nn::Linear(64, 10));
    DistributedDataParallel model(net.ptr(), pg,
                                  {.bucket_cap_mb = 0.01, .first_bucket_cap_mb = 0.005});
    auto state = std::make_shared<PowerSGDState>(
        PowerSGDOptions{.matrix_approximation_rank = 2, .start_powersgd_iter = 2});
    model->register_comm_hook(powersgd_hook(state));
    torch::optim::SGD opt(model->parameters(), 0.05);
    torch::manual_seed(70 + rank);
    for (int step = 0; step < 30; ++step) {
      opt.zero_grad();
      torch::nn::functional::cross_entropy(model->forward(torch::randn({8, 64})),
                                           torch::randint(0, 10, {8}))
          .backward();
      opt.step();
    }
    test::expect_identical_across_ranks(*pg, model->parameters(), "after 30 steps");
    if (model->reducer().bucket_assignment().size() < 3) {
      throw std::runtime_error(fmt::format("expected several buckets, got {}",
                                           model->reducer().bucket_assignment().size()));
    }
    const auto timeline = model->reducer().last_timeline();
    if (timeline.bytes_sent == 0 || timeline.bytes_sent >= 4u * (3 * 64 * 65 + 650)) {
      throw std::runtime_error(fmt::format("bytes per step {}", timeline.bytes_sent));
    }
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(PowerSgd, SavedStateContinuesExactlyLikeTheOriginal) {
  const int port = test::free_port();
  test::TempDir dir("ddp-powersgd");
  const auto path = (dir.path() / "state.pt").string();
  const auto results = run_ranks(2, [&](int rank) {
    auto pg = join_group(rank, 2, port);
    const PowerSGDOptions options{.matrix_approximation_rank = 2, .start_powersgd_iter = 2};
    auto original = std::make_shared<PowerSGDState>(options);
    auto hook = powersgd_hook(original);
    const auto numel = test::total_numel(kShapes);
    for (int step = 0; step < 4; ++step)
      reduce_with(hook, *pg, gradients_for(rank, step, numel), kShapes);
    const auto file = path + std::to_string(rank);
    {
      torch::serialize::OutputArchive archive;
      original->save(archive);
      archive.save_to(file);
    }
    auto loaded = std::make_shared<PowerSGDState>(options);
    {
      torch::serialize::InputArchive archive;
      archive.load_from(file);
      loaded->load(archive);
    }
    if (loaded->iteration() != 4) throw std::runtime_error("iteration not restored");
    auto loaded_hook = powersgd_hook(loaded);
    for (int step = 4; step < 7; ++step) {
      const auto grads = gradients_for(rank, step, numel);
      const auto a = reduce_with(hook, *pg, grads, kShapes);
      const auto b = reduce_with(loaded_hook, *pg, grads, kShapes);
      if (!torch::equal(a, b)) throw std::runtime_error(fmt::format("step {} differs", step));
    }
    // A fresh state differs (warm start and error memory matter), so the check above can fail.
    auto fresh_hook = powersgd_hook(std::make_shared<PowerSGDState>(options));
    const auto grads = gradients_for(rank, 9, numel);
    for (int i = 0; i < 3; ++i)  // past start_powersgd_iter
      reduce_with(fresh_hook, *pg, grads, kShapes);
    if (torch::equal(reduce_with(fresh_hook, *pg, grads, kShapes),
                     reduce_with(loaded_hook, *pg, grads, kShapes))) {
      throw std::runtime_error("a fresh state gives the same numbers as a loaded one");
    }
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(PowerSgd, StateOfAnotherBucketLayoutIsAConfigError) {
  const int port = test::free_port();
  const auto results = run_ranks(2, [&](int rank) {
    auto pg = join_group(rank, 2, port);
    auto state = std::make_shared<PowerSGDState>(PowerSGDOptions{.start_powersgd_iter = 2});
    auto hook = powersgd_hook(state);
    for (int step = 0; step < 3; ++step)
      reduce_with(hook, *pg, gradients_for(rank, step, 16 * 32), {{16, 32}});
    try {
      reduce_with(hook, *pg, gradients_for(rank, 5, 8 * 32), {{8, 32}});
    } catch (const ConfigError& e) {
      if (std::string(e.what()).find("another model or bucket layout") == std::string::npos) throw;
      return;
    }
    throw std::runtime_error("no ConfigError for a bucket of another size");
  });
  EXPECT_ALL_RANKS_OK(results);
}

// A hook that throws on rank 1: rank 1's backward fails at once with an Error naming the bucket
// and the hook's message, and refuses the next forward; rank 0 fails in that bucket's collective
// (rank 1 never makes it) within the group's timeout. Nobody hangs.
TEST(PowerSgd, ThrowingHookIsANamedErrorOnEveryRank) {
  const int port = test::free_port();
  const auto start = std::chrono::steady_clock::now();
  const auto results = run_ranks(
      2,
      [&](int rank) {
        auto pg = join_group(rank, 2, port, 5s);
        torch::manual_seed(1);
        torch::nn::Linear net(8, 4);
        DistributedDataParallel model(net.ptr(), pg);
        model->register_comm_hook([rank](ProcessGroup& group, GradBucket& bucket) {
          if (rank == 1) throw std::runtime_error("hook exploded");
          return allreduce_hook()(group, bucket);
        });
        const auto x = torch::randn({4, 8});
        try {
          model->forward(x).sum().backward();
        } catch (const std::exception& e) {
          const std::string what = e.what();
          if (rank == 1) {
            if (what.find("comm hook threw") == std::string::npos ||
                what.find("hook exploded") == std::string::npos ||
                what.find("gradient bucket") == std::string::npos) {
              throw std::runtime_error("rank 1's error does not name the hook: " + what);
            }
            try {
              model->forward(x).sum().backward();
            } catch (const Error& again) {
              if (std::string(again.what()).find("refusing") == std::string::npos) throw;
              return;
            }
            throw std::runtime_error("rank 1 synchronised again after a failed hook");
          }
          if (what.find("gradient bucket") == std::string::npos) {
            throw std::runtime_error("rank 0's error does not name the bucket: " + what);
          }
          return;
        }
        throw std::runtime_error("backward succeeded on rank " + std::to_string(rank));
      },
      60s);
  EXPECT_ALL_RANKS_OK(results);
  EXPECT_LT(std::chrono::steady_clock::now() - start, 30s);
}

// Rank 0 compresses, rank 1 averages plainly: the collectives differ, and the engine's
// mismatch check turns that into a named error on both ranks instead of wrong numbers.
TEST(PowerSgd, RanksWithDifferentHooksFailWithANamedError) {
  const int port = test::free_port();
  const auto results = run_ranks(
      2,
      [&](int rank) {
        auto pg = join_group(rank, 2, port, 5s);
        torch::manual_seed(1);
        torch::nn::Linear net(torch::nn::LinearOptions(64, 32).bias(false));
        DistributedDataParallel model(net.ptr(), pg);
        if (rank == 0) {
          model->register_comm_hook(powersgd_hook(std::make_shared<PowerSGDState>(PowerSGDOptions{
              .start_powersgd_iter = 0, .use_error_feedback = false, .warm_start = false})));
        } else {
          model->register_comm_hook(allreduce_hook());
        }
        try {
          model->forward(torch::randn({4, 64})).sum().backward();
        } catch (const std::exception& e) {
          const std::string what = e.what();
          if (what.find("gradient bucket") == std::string::npos) {
            throw std::runtime_error("the error does not name the bucket: " + what);
          }
          return;
        }
        throw std::runtime_error("different hooks went unnoticed on rank " + std::to_string(rank));
      },
      60s);
  EXPECT_ALL_RANKS_OK(results);
}

// PyTorch 2.x's powerSGD_hook on the same gradients (written to files; the Python script runs
// the hook on gloo ranks with a stand-in bucket). The random initial Q is not fed in: ddp
// reproduces PyTorch's seeding (numpy RandomState(random_seed).randint(1e9) -> torch.manual_seed
// -> randn), so this also checks that.
void check_against_pytorch(int world, int r, bool batch) {
  const std::string python = test::paths::pytorch_python;
  auto probe = test::Subprocess::start(
      {python, "-c",
       "import numpy, torch, torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook as h; "
       "assert int(torch.__version__.split('.')[0]) >= 2"});
  const auto probed = probe.wait(60s);
  if (probed.exit_code != 0) {
    GTEST_SKIP() << "PyTorch 2.x is not available through scripts/pytorch-python (run "
                    "scripts/install-deps.sh): "
                 << probed.output;
  }
  const Shapes shapes = kShapes;
  const int steps = 6, start_iter = 2;
  test::TempDir dir("ddp-powersgd-pytorch");
  // Gradients, written by a rank process (the test process does not touch libtorch).
  auto written = run_ranks(1, [&](int) {
    for (int rank = 0; rank < world; ++rank) {
      for (int step = 0; step < steps; ++step) {
        const auto g = gradients_for(rank, step, test::total_numel(shapes));
        std::ofstream out(dir.path() / fmt::format("grad_r{}_s{}.bin", rank, step),
                          std::ios::binary);
        out.write(static_cast<const char*>(g.data_ptr()), g.nbytes());
      }
    }
  });
  ASSERT_TRUE(written[0].ok()) << test::describe(written);
  std::vector<std::string> shape_text;
  for (const auto& shape : shapes)
    shape_text.push_back(fmt::format("{}", fmt::join(shape, "x")));
  auto reference = test::Subprocess::start(
      {python, test::paths::powersgd_reference_script, dir.path().string(), std::to_string(world),
       std::to_string(steps), std::to_string(test::free_port()), std::to_string(r),
       std::to_string(start_iter), batch ? "1" : "0",
       fmt::format("{}", fmt::join(shape_text, ","))},
      {{"OMP_NUM_THREADS", "1"}});
  const auto done = reference.wait(180s);
  ASSERT_EQ(done.exit_code, 0) << done.output;
  const int port = test::free_port();
  const auto results = run_ranks(world, [&](int rank) {
    auto pg = join_group(rank, world, port);
    auto hook = powersgd_hook(
        std::make_shared<PowerSGDState>(PowerSGDOptions{.matrix_approximation_rank = r,
                                                        .start_powersgd_iter = start_iter,
                                                        .batch_tensors_with_same_shape = batch}));
    const auto numel = test::total_numel(shapes);
    for (int step = 0; step < steps; ++step) {
      const auto got = reduce_with(hook, *pg, gradients_for(rank, step, numel), shapes);
      auto want = torch::empty({numel});
      std::ifstream in(dir.path() / fmt::format("out_r{}_s{}.bin", rank, step), std::ios::binary);
      in.read(static_cast<char*>(want.data_ptr()), want.nbytes());
      if (!in) throw std::runtime_error("missing PyTorch output");
      expect_close(got, want, fmt::format("rank {} step {} vs PyTorch", rank, step), 1e-5, 1e-5);
    }
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(PowerSgd, EqualsPyTorchRank1TwoRanks) {
  check_against_pytorch(2, 1, false);
}
TEST(PowerSgd, EqualsPyTorchRank4QrThreeRanks) {
  check_against_pytorch(3, 4, false);
}
TEST(PowerSgd, EqualsPyTorchBatchedSameShapes) {
  check_against_pytorch(2, 2, true);
}

}  // namespace DDP_UNITY_ID
}  // namespace
}  // namespace ddp
