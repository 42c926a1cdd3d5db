#include "ddp/torch/ddp/sync_batch_norm.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <numeric>
#include <thread>

#include "ddp/error.h"
#include "ddp/torch/ddp/distributed_data_parallel.h"
#include "support/multiprocess.h"
#include "support/torch/ddp_test_util.h"
#include "support/unity_namespace.h"

namespace ddp {
namespace {
namespace DDP_UNITY_ID {

using namespace std::chrono_literals;
using test::expect_close;
using test::expect_identical_across_ranks;
using test::join_group;
using test::run_ranks;

// A deterministic batch of `total` samples of `sample_shape` (channels first), off centre.
// (Larger offsets make float32 BatchNorm itself inexact; see LargeOffsetsStayExact.)
torch::Tensor make_input(int64_t total, const std::vector<int64_t>& sample_shape, int seed,
                         double scale = 2, double offset = 5,
                         torch::ScalarType type = torch::kFloat) {
  torch::manual_seed(seed);
  std::vector<int64_t> shape{total};
  shape.insert(shape.end(), sample_shape.begin(), sample_shape.end());
  return torch::randn(shape, type) * scale + offset;
}

// One layer configuration of the exactness check.
struct Case {
  std::vector<int64_t> sample_shape;  // (C) or (C, L) or (C, H, W) or (C, D, H, W)
  c10::optional<double> momentum = 0.1;
  bool affine = true;
};

// `sizes[r]` samples on member r of `group` (its ranks in group order). Two training steps, then
// checks on every rank that the output, input gradient, summed weight and bias gradients and the
// running statistics equal torch::nn::BatchNorm on the concatenated batch to 1e-5.
void check_exact(const std::shared_ptr<ProcessGroup>& group, const std::vector<int64_t>& sizes,
                 const Case& c) {
  const int rank = group->rank();
  const int64_t total = std::accumulate(sizes.begin(), sizes.end(), int64_t{0});
  const int64_t offset = std::accumulate(sizes.begin(), sizes.begin() + rank, int64_t{0});
  const int64_t channels = c.sample_shape[0];
  const auto bn_options =
      torch::nn::BatchNormOptions(channels).momentum(c.momentum).eps(1e-5).affine(c.affine);
  // The reference: a BatchNorm of the right dimensionality over the whole batch.
  torch::nn::AnyModule reference;
  const auto dims = c.sample_shape.size() + 1;
  if (dims <= 3) reference = torch::nn::AnyModule(torch::nn::BatchNorm1d(bn_options));
  if (dims == 4) reference = torch::nn::AnyModule(torch::nn::BatchNorm2d(bn_options));
  if (dims == 5) reference = torch::nn::AnyModule(torch::nn::BatchNorm3d(bn_options));
  SyncBatchNorm sync(
      SyncBatchNormOptions(channels).momentum(c.momentum).affine(c.affine).process_group(group));
  if (c.affine) {
    torch::NoGradGuard no_grad;
    torch::manual_seed(3);
    const auto w = torch::randn({channels}) + 1;
    const auto b = torch::randn({channels});
    sync->weight.copy_(w);
    sync->bias.copy_(b);
    reference.ptr()->named_parameters()["weight"].copy_(w);
    reference.ptr()->named_parameters()["bias"].copy_(b);
  }
  const auto ref_params = reference.ptr()->named_parameters();
  const auto ref_buffers = reference.ptr()->named_buffers();
  for (int step = 0; step < 2; ++step) {
    const auto what = [&](const char* name) {
      return fmt::format("{} (rank {}, shape {}, step {})", name, rank,
                         fmt::join(c.sample_shape, "x"), step);
    };
    const auto full = make_input(total, c.sample_shape, 10 + step);
    const auto upstream = make_input(total, c.sample_shape, 20 + step, 1, 0);

    auto full_input = full.clone().requires_grad_(true);
    for (auto& p : ref_params) {
      if (p.value().defined()) p.value().mutable_grad() = torch::Tensor();
    }
    auto ref_out = reference.forward(full_input);
    (ref_out * upstream).sum().backward();

    auto input = full.narrow(0, offset, sizes[rank]).clone().requires_grad_(true);
    sync->zero_grad();
    auto out = sync(input);
    (out * upstream.narrow(0, offset, sizes[rank])).sum().backward();

    expect_close(out, ref_out.narrow(0, offset, sizes[rank]), what("output"), 1e-5, 1e-5);
    expect_close(input.grad(), full_input.grad().narrow(0, offset, sizes[rank]),
                 what("input gradient"), 1e-5, 1e-5);
    // Each rank holds its share of the parameter gradients; their sum is the whole batch's.
    if (c.affine) {
      auto grad_weight = sync->weight.grad().clone();
      auto grad_bias = sync->bias.grad().clone();
      allreduce_tensor(*group, grad_weight, ReduceOp::kSum)->wait();
      allreduce_tensor(*group, grad_bias, ReduceOp::kSum)->wait();
      expect_close(grad_weight, ref_params["weight"].grad(), what("weight gradient"), 1e-5, 1e-4);
      expect_close(grad_bias, ref_params["bias"].grad(), what("bias gradient"), 1e-5, 1e-4);
    }
    expect_close(sync->running_mean, ref_buffers["running_mean"], what("running mean"));
    expect_close(sync->running_var, ref_buffers["running_var"], what("running var"));
    if (!torch::equal(sync->num_batches_tracked, ref_buffers["num_batches_tracked"])) {
      throw std::runtime_error(what("num_batches_tracked"));
    }
  }
}

const std::vector<Case> kAllShapes = {
    {{3}}, {{3, 7}}, {{4, 5, 6}}, {{2, 3, 4, 5}}, {{5, 6}, c10::nullopt}, {{3, 4}, 0.2, false}};

void check_world(const std::vector<int64_t>& sizes) {
  const int world = static_cast<int>(sizes.size());
  const int port = test::free_port();
  const auto results = run_ranks(world, [&](int rank) {
    auto pg = join_group(rank, world, port);
    for (const auto& c : kAllShapes)
      check_exact(pg, sizes, c);
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(SyncBatchNorm, TwoRanksWithUnevenBatchesEqualOneBatchNormOnTheConcatenation) {
  check_world({3, 5});
}

TEST(SyncBatchNorm, ThreeRanksWithUnevenBatchesEqualOneBatchNorm) {
  check_world({1, 4, 2});
}

TEST(SyncBatchNorm, FourRanksIncludingOneWithoutSamplesEqualOneBatchNorm) {
  check_world({2, 0, 3, 1});
}

TEST(SyncBatchNorm, OneSampleOnEachOfTwoRanksIsAValidBatchOfTwo) {
  check_world({1, 1});
}

// Statistics are combined from per-rank means and deviations (never raw sums of squares): with
// values around 1e8 and a spread of 1, float64 sums of squares would lose every digit of the
// variance; the output still equals float64 BatchNorm on the concatenated batch.
TEST(SyncBatchNorm, LargeOffsetsStayExact) {
  const int port = test::free_port();
  const std::vector<int64_t> sizes{5, 2, 9};
  const auto results = run_ranks(3, [&](int rank) {
    auto pg = join_group(rank, 3, port);
    const auto full = make_input(16, {4, 3}, 1, 1.0, 1e8, torch::kDouble);
    SyncBatchNorm sync(SyncBatchNormOptions(4).process_group(pg));
    sync->to(torch::kDouble);
    torch::nn::BatchNorm1d reference(4);
    reference->to(torch::kDouble);
    const int64_t offset = rank == 0 ? 0 : rank == 1 ? 5 : 7;
    const auto out = sync(full.narrow(0, offset, sizes[rank]));
    const auto want = reference(full).narrow(0, offset, sizes[rank]);
    expect_close(out, want, "output at offset 1e8", 1e-6, 1e-6);
    expect_close(sync->running_var, reference->running_var, "running var at offset 1e8", 1e-6);
    expect_close(sync->running_mean, reference->running_mean, "running mean at offset 1e8", 1e-12);
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(SyncBatchNorm, ASubgroupNormalisesOverItsOwnMembersOnly) {
  const int port = test::free_port();
  const auto results = run_ranks(4, [&](int rank) {
    auto pg = join_group(rank, 4, port);
    auto sub = pg->new_group({0, 2, 3});
    if (!sub) return;  // rank 1 is not a member and takes no part
    for (const auto& c : kAllShapes)
      check_exact(sub, {2, 5, 3}, c);
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(SyncBatchNorm, EvalModeUsesRunningStatisticsAndCommunicatesNothing) {
  const int port = test::free_port();
  const auto results = run_ranks(2, [&](int rank) {
    auto pg = join_group(rank, 2, port, 3s);
    if (rank == 1) {
      // Only this rank runs these forwards: any collective in them would fail or time out.
      SyncBatchNorm sync(SyncBatchNormOptions(4).process_group(pg));
      torch::nn::BatchNorm2d reference(4);
      {
        torch::NoGradGuard no_grad;
        for (auto* bn : {&sync->running_mean, &reference->running_mean})
          bn->fill_(0.5);
        for (auto* bn : {&sync->running_var, &reference->running_var})
          bn->fill_(2.0);
      }
      sync->eval();
      reference->eval();
      const auto x = make_input(3, {4, 5, 5}, 1);
      expect_close(sync(x), reference(x), "eval output with running statistics");
      // Without running statistics eval uses this rank's batch, as torch does.
      SyncBatchNorm untracked(SyncBatchNormOptions(4).track_running_stats(false).process_group(pg));
      torch::nn::BatchNorm2d untracked_reference(
          torch::nn::BatchNormOptions(4).track_running_stats(false));
      untracked->eval();
      untracked_reference->eval();
      expect_close(untracked(x), untracked_reference(x), "eval output without running stats");
    }
    pg->barrier()->wait();  // the first collective of both ranks: nothing came before it
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(SyncBatchNorm, OneRankGroupIsPlainBatchNorm) {
  const int port = test::free_port();
  const auto results = run_ranks(1, [&](int rank) {
    auto pg = join_group(rank, 1, port);
    check_exact(pg, {6}, {{3, 4, 4}});
  });
  EXPECT_ALL_RANKS_OK(results);
}

// --- convert_sync_batchnorm -------------------------------------------------------------------

struct BlockImpl : torch::nn::Module {
  BlockImpl() {
    features = register_module(
        "features",
        torch::nn::Sequential(torch::nn::Conv2d(torch::nn::Conv2dOptions(2, 3, 3).padding(1)),
                              torch::nn::BatchNorm2d(torch::nn::BatchNormOptions(3).eps(1e-3)),
                              torch::nn::ReLU()));
    heads = register_module(
        "heads",
        torch::nn::ModuleList(
            torch::nn::BatchNorm1d(torch::nn::BatchNormOptions(3).momentum(c10::nullopt)),
            torch::nn::BatchNorm3d(torch::nn::BatchNormOptions(2).affine(false)),
            torch::nn::BatchNorm1d(torch::nn::BatchNormOptions(5).track_running_stats(false))));
  }
  torch::Tensor forward(torch::Tensor x) { return features->forward(x); }
  torch::nn::Sequential features{nullptr};
  torch::nn::ModuleList heads{nullptr};
};
TORCH_MODULE(Block);

TEST(ConvertSyncBatchnorm, KeepsEveryStateAndTheSequentialCallsTheReplacement) {
  Block block;
  {
    torch::NoGradGuard no_grad;
    for (auto& p : block->named_parameters()) {
      if (p.value().defined()) p.value().copy_(torch::randn_like(p.value()));
    }
    for (auto& b : block->named_buffers()) {
      if (!b.value().defined()) continue;
      if (b.key().find("num_batches") != std::string::npos) {
        b.value().fill_(7);
      } else {
        b.value().copy_(torch::rand_like(b.value()) + 0.5);
      }
    }
  }
  block->eval();
  block->heads[1]->train();  // a mixed state, kept per layer
  const auto x = torch::randn({2, 2, 5, 5});
  const auto before = block->forward(x);
  const auto params_before = block->named_parameters();
  const auto buffers_before = block->named_buffers();

  auto root = convert_sync_batchnorm(block.ptr());
  EXPECT_EQ(root, block.ptr());

  const auto children = block->features->named_children();
  auto bn = std::dynamic_pointer_cast<SyncBatchNormImpl>(children["1"]);
  ASSERT_NE(bn, nullptr);
  EXPECT_EQ(bn->options.eps(), 1e-3);
  EXPECT_EQ(bn->options.momentum(), c10::optional<double>(0.1));
  EXPECT_EQ(bn->options.name(), "features.1");
  EXPECT_FALSE(bn->is_training());
  // The Sequential dispatches to the replacement (its forward is used, and eval communicates
  // nothing, so no process group is needed).
  EXPECT_TRUE(block->features->ptr(1) == bn);
  EXPECT_TRUE(torch::allclose(block->forward(x), before));

  auto head0 = std::dynamic_pointer_cast<SyncBatchNormImpl>(block->heads[0]);
  auto head1 = std::dynamic_pointer_cast<SyncBatchNormImpl>(block->heads[1]);
  auto head2 = std::dynamic_pointer_cast<SyncBatchNormImpl>(block->heads[2]);
  ASSERT_TRUE(head0 && head1 && head2);
  EXPECT_EQ(head0->options.momentum(), c10::nullopt);
  EXPECT_FALSE(head1->options.affine());
  EXPECT_TRUE(head1->is_training());
  EXPECT_FALSE(head0->is_training());
  EXPECT_FALSE(head2->options.track_running_stats());
  EXPECT_EQ(block->heads->named_children()["1"], head1);

  // The very same tensors: an optimizer built before the conversion keeps working.
  const auto params_after = block->named_parameters();
  const auto buffers_after = block->named_buffers();
  ASSERT_EQ(params_after.size(), params_before.size());
  ASSERT_EQ(buffers_after.size(), buffers_before.size());
  for (const auto& p : params_before) {
    EXPECT_TRUE(params_after[p.key()].is_same(p.value())) << p.key();
  }
  for (const auto& b : buffers_before) {
    EXPECT_TRUE(buffers_after[b.key()].is_same(b.value())) << b.key();
  }
  EXPECT_EQ(head0->num_batches_tracked.item<int64_t>(), 7);
}

TEST(ConvertSyncBatchnorm, ARootBatchNormIsReturnedConverted) {
  torch::nn::BatchNorm3d bn(torch::nn::BatchNormOptions(6).momentum(0.3));
  auto converted = std::dynamic_pointer_cast<SyncBatchNormImpl>(convert_sync_batchnorm(bn.ptr()));
  ASSERT_NE(converted, nullptr);
  EXPECT_EQ(converted->options.num_features(), 6);
  EXPECT_EQ(converted->options.momentum(), c10::optional<double>(0.3));
  EXPECT_TRUE(converted->weight.is_same(bn->weight));
  EXPECT_TRUE(converted->running_var.is_same(bn->running_var));
}

struct MemberNetImpl : torch::nn::Module {
  MemberNetImpl() {
    seq = register_module("seq", torch::nn::Sequential(torch::nn::BatchNorm1d(4)));
    bn = register_module("bn", torch::nn::BatchNorm1d(4));
  }
  torch::Tensor forward(torch::Tensor x) { return bn(seq->forward(x)); }
  torch::nn::Sequential seq{nullptr};
  torch::nn::BatchNorm1d bn{nullptr};
};
TORCH_MODULE(MemberNet);

TEST(ConvertSyncBatchnorm, ABatchNormHeldByATypedMemberIsRefusedAndNothingChanges) {
  MemberNet net;
  try {
    convert_sync_batchnorm(net.ptr());
    FAIL() << "expected a ConfigError";
  } catch (const ConfigError& error) {
    EXPECT_THAT(error.what(), testing::HasSubstr("'bn'"));
    EXPECT_THAT(error.what(), testing::HasSubstr("ddp::SyncBatchNorm"));
  }
  EXPECT_NE(std::dynamic_pointer_cast<torch::nn::BatchNorm1dImpl>(net->seq->ptr(0)), nullptr);
  EXPECT_TRUE(net->named_children()["bn"] == net->bn.ptr());
}

// --- bad input: a named error on every rank, within the timeout ---------------------------------

// Runs `body` on every rank of a `world`-rank group with a short timeout, and checks that each
// rank throws an error whose message contains `expected[rank]` (and "SyncBatchNorm") in time.
void expect_error_on_every_rank(int world, const std::function<void(int, ProcessGroup&)>& body,
                                const std::vector<std::string>& expected) {
  const int port = test::free_port();
  const auto timeout = 5s;
  const auto results = run_ranks(world, [&](int rank) {
    auto pg = join_group(rank, world, port, timeout);
    const auto start = std::chrono::steady_clock::now();
    try {
      body(rank, *pg);
    } catch (const Error& error) {
      const std::string message = error.what();
      if (message.find("SyncBatchNorm") == std::string::npos ||
          message.find(expected[static_cast<std::size_t>(rank)]) == std::string::npos) {
        throw std::runtime_error("unexpected message: " + message);
      }
      if (std::chrono::steady_clock::now() - start > timeout + 2s) {
        throw std::runtime_error("the error came after the timeout: " + message);
      }
      return;
    }
    throw std::runtime_error("no error");
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(SyncBatchNormBadInput, ChannelCountsThatDifferAcrossRanksAreNamedOnEveryRank) {
  expect_error_on_every_rank(3,
                             [](int rank, ProcessGroup& pg) {
                               const int64_t channels = rank == 2 ? 5 : 4;
                               SyncBatchNorm bn(SyncBatchNormOptions(channels)
                                                    .name("block.bn")
                                                    .process_group(std::shared_ptr<ProcessGroup>(
                                                        &pg, [](ProcessGroup*) {})));
                               bn(torch::randn({3, channels, 2}));
                             },
                             {"num_features 4", "num_features 4", "num_features 5"});
}

TEST(SyncBatchNormBadInput, OneSampleInTheWholeGroupFailsOnEveryRankLikeTorch) {
  expect_error_on_every_rank(2,
                             [](int rank, ProcessGroup& pg) {
                               SyncBatchNorm bn(SyncBatchNormOptions(3).process_group(
                                   std::shared_ptr<ProcessGroup>(&pg, [](ProcessGroup*) {})));
                               bn(torch::randn({rank == 0 ? 1 : 0, 3}));
                             },
                             {"expected more than 1 value per channel when training",
                              "expected more than 1 value per channel when training"});
}

TEST(SyncBatchNormBadInput, OneSampleOnAOneRankGroupFailsLikeTorch) {
  expect_error_on_every_rank(1,
                             [](int, ProcessGroup& pg) {
                               SyncBatchNorm bn(SyncBatchNormOptions(3).process_group(
                                   std::shared_ptr<ProcessGroup>(&pg, [](ProcessGroup*) {})));
                               bn(torch::randn({1, 3, 1, 1}));
                             },
                             {"expected more than 1 value per channel when training"});
}

TEST(SyncBatchNormBadInput, AWrongInputOnOneRankIsNamedThereAndReportedByTheOthers) {
  expect_error_on_every_rank(
      3,
      [](int rank, ProcessGroup& pg) {
        SyncBatchNorm bn(SyncBatchNormOptions(4).name("head").process_group(
            std::shared_ptr<ProcessGroup>(&pg, [](ProcessGroup*) {})));
        if (rank == 1) bn(torch::randn({4}));
        if (rank == 2) bn(torch::randn({2, 3, 5}));
        if (rank == 0) bn(torch::randn({2, 4, 5}));
      },
      {"input of rank(s) 1, 2", "expected an input of shape (N, C)", "expected 4 channels"});
}

TEST(SyncBatchNormBadInput, ATrainingForwardOnOneRankOnlyFailsNamingTheLayerInTime) {
  const int port = test::free_port();
  const auto timeout = 3s;
  const auto results = run_ranks(2, [&](int rank) {
    auto pg = join_group(rank, 2, port, timeout);
    if (rank == 1) {
      std::this_thread::sleep_for(timeout + 3s);  // alive, but never joins the collective
      return;
    }
    SyncBatchNorm bn(SyncBatchNormOptions(3).name("lonely").process_group(pg));
    const auto start = std::chrono::steady_clock::now();
    try {
      bn(torch::randn({4, 3}));
    } catch (const Error& error) {
      const std::string message = error.what();
      if (message.find("SyncBatchNorm 'lonely'") == std::string::npos) {
        throw std::runtime_error("unexpected message: " + message);
      }
      if (std::chrono::steady_clock::now() - start > 2 * timeout + 2s) {
        throw std::runtime_error("the error came late: " + message);
      }
      return;
    }
    throw std::runtime_error("no error");
  });
  EXPECT_ALL_RANKS_OK(results);
}

// --- inside DistributedDataParallel, with no_sync ----------------------------------------------

struct BnNetImpl : torch::nn::Module {
  BnNetImpl() {
    layers = register_module(
        "layers",
        torch::nn::Sequential(torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 4, 3).padding(1)),
                              torch::nn::BatchNorm2d(4), torch::nn::ReLU(), torch::nn::Flatten(),
                              torch::nn::Linear(4 * 6 * 6, 8), torch::nn::BatchNorm1d(8),
                              torch::nn::ReLU(), torch::nn::Linear(8, 3)));
  }
  torch::Tensor forward(torch::Tensor x) { return layers->forward(x); }
  torch::nn::Sequential layers{nullptr};
};
TORCH_MODULE(BnNet);

// Two micro-batches under no_sync and one that synchronises, for 2 steps, on 2 ranks with equal
// batches: the same parameters and running statistics as one process with BatchNorm over the
// concatenated micro-batches. SyncBatchNorm keeps synchronising statistics under no_sync.
TEST(SyncBatchNorm, InsideDdpWithNoSyncEqualsOneProcessOnTheConcatenatedBatches) {
  const int port = test::free_port();
  const int world = 2, batch = 3, micro = 3, steps = 2;
  const auto results = run_ranks(world, [&](int rank) {
    auto pg = join_group(rank, world, port);
    torch::manual_seed(5);
    BnNet net;
    torch::manual_seed(5);
    BnNet reference;
    convert_sync_batchnorm(net.ptr(), pg);
    DistributedDataParallel model(net.ptr(), pg);
    torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
    torch::optim::SGD ref_opt(reference->parameters(), torch::optim::SGDOptions(0.1));
    torch::manual_seed(9);
    const auto inputs = torch::randn({steps, micro, world * batch, 1, 6, 6});
    const auto targets = torch::randint(0, 3, {steps, micro, world * batch});
    for (int step = 0; step < steps; ++step) {
      opt.zero_grad();
      ref_opt.zero_grad();
      for (int m = 0; m < micro; ++m) {
        const auto x = inputs[step][m].narrow(0, rank * batch, batch);
        const auto y = targets[step][m].narrow(0, rank * batch, batch);
        const auto loss = [&] {
          return torch::nn::functional::cross_entropy(model->forward(x), y) / micro;
        };
        if (m + 1 < micro) {
          auto guard = model->no_sync();
          loss().backward();
        } else {
          loss().backward();
        }
        (torch::nn::functional::cross_entropy(reference->forward(inputs[step][m]),
                                              targets[step][m]) /
         micro)
            .backward();
      }
      opt.step();
      ref_opt.step();
    }
    expect_identical_across_ranks(*pg, model->parameters(), "parameters");
    const auto got = net->named_parameters();
    for (const auto& p : reference->named_parameters()) {
      expect_close(got[p.key()], p.value(), p.key(), 1e-5, 1e-5);
    }
    const auto got_buffers = net->named_buffers();
    for (const auto& b : reference->named_buffers()) {
      if (b.value().is_floating_point()) expect_close(got_buffers[b.key()], b.value(), b.key());
    }
  });
  EXPECT_ALL_RANKS_OK(results);
}

}  // namespace DDP_UNITY_ID
}  // namespace
}  // namespace ddp
