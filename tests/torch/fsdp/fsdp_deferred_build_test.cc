// fsdp_build_sharded: a model built child by child, each large child sharded before the next is
// built, on two real ranks. Its numbers are those of the model built whole with the same seed and
// auto-wrapped, before and after training; and while it is built, a rank holds its shards plus one
// child, not the whole model.
#include <gtest/gtest.h>

#include <cstdio>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "ddp/torch/fsdp/fully_sharded_data_parallel.h"
#include "support/multiprocess.h"
#include "support/resident_memory.h"
#include "support/torch/ddp_test_util.h"
#include "support/unity_namespace.h"

namespace ddp {
namespace {
namespace DDP_UNITY_ID {

// Child i of the model: Linear layers (large) with a Tanh (no parameters) after each but the last.
torch::nn::AnyModule make_child(std::size_t i, std::int64_t width, std::size_t children) {
  if (i % 2 == 1) return torch::nn::AnyModule(torch::nn::Tanh());
  const std::int64_t out = i + 1 == children ? 4 : width;
  return torch::nn::AnyModule(torch::nn::Linear(i == 0 ? 8 : width, out));
}

void expect_same_state(const torch::OrderedDict<std::string, torch::Tensor>& a,
                       const torch::OrderedDict<std::string, torch::Tensor>& b,
                       const std::string& when) {
  if (a.size() != b.size()) throw std::runtime_error(when + ": the state dicts differ in size");
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (a[i].key() != b[i].key() || !torch::equal(a[i].value(), b[i].value())) {
      throw std::runtime_error(
          fmt::format("{}: '{}' differs from '{}' built whole", when, a[i].key(), b[i].key()));
    }
  }
}

TEST(FsdpDeferredBuild, ChildByChildEqualsTheModelBuiltWholeBeforeAndAfterTraining) {
  const int port = test::free_port();
  const auto results = test::run_ranks(2, [&](int rank) {
    auto pg = test::join_group(rank, 2, port);
    constexpr std::size_t kChildren = 7;
    const FsdpOptions options{.min_num_params = 100};
    torch::manual_seed(21);
    torch::nn::Sequential whole;
    for (std::size_t i = 0; i < kChildren; ++i)
      whole->push_back(make_child(i, 16, kChildren));
    auto reference = fsdp_auto_wrap(whole, pg, options);
    torch::manual_seed(21);
    auto deferred = fsdp_build_sharded(
        kChildren, [](std::size_t i) { return make_child(i, 16, kChildren); }, pg, options);
    expect_same_state(deferred->full_state_dict(0), reference->full_state_dict(0), "built");

    torch::optim::Adam adam_a(reference->parameters(), torch::optim::AdamOptions(0.01));
    torch::optim::Adam adam_b(deferred->parameters(), torch::optim::AdamOptions(0.01));
    torch::manual_seed(50 + rank);
    for (int step = 0; step < 5; ++step) {
      auto x = torch::randn({6, 8});
      auto y = torch::randn({6, 4});
      for (auto [model, adam] : {std::pair{&reference, &adam_a}, std::pair{&deferred, &adam_b}}) {
        adam->zero_grad();
        torch::mse_loss((*model)->forward(x), y).backward();
        adam->step();
      }
    }
    expect_same_state(deferred->full_state_dict(0), reference->full_state_dict(0), "after 5 steps");
  });
  EXPECT_ALL_RANKS_OK(results);
}

constexpr std::int64_t kWidth = 1024;
constexpr std::size_t kLinears = 12;

torch::nn::AnyModule wide_linear(std::size_t) {
  return torch::nn::AnyModule(torch::nn::Linear(kWidth, kWidth));
}

// The resident memory that building the model adds at its peak on each of two ranks, in a fresh
// process per rank, after a warm-up that wraps and drops one child (the group's first collectives
// and buffers, the allocators' first pools are not the model's).
std::vector<double> peak_added_building(bool child_by_child) {
  const int port = test::free_port();
  std::vector<double> peaks(2, -1.0);
  const auto results = test::run_ranks(2, [&](int rank) {
    auto pg = test::join_group(rank, 2, port);
    const FsdpOptions options{.min_num_params = 1};
    { auto warm_up = fsdp_build_sharded(1, wide_linear, pg, options); }
    std::shared_ptr<FullyShardedDataParallelImpl> model;
    const double added = test::peak_added_mib([&] {
      if (child_by_child) {
        model = fsdp_build_sharded(kLinears, wide_linear, pg, options).ptr();
      } else {
        torch::nn::Sequential whole;
        for (std::size_t i = 0; i < kLinears; ++i)
          whole->push_back(wide_linear(i));
        model = fsdp_auto_wrap(whole, pg, options).ptr();
      }
    });
    throw std::runtime_error(fmt::format("peak_added={:.3f}", added));  // the value's way back
  });
  for (std::size_t r = 0; r < results.size(); ++r) {
    const auto at = results[r].error.find("peak_added=");
    if (at == std::string::npos) {
      ADD_FAILURE() << test::describe(results);
      return peaks;
    }
    peaks[r] = std::stod(results[r].error.substr(at + 11));
  }
  return peaks;
}

// Twelve Linear(1024, 1024) children (4 MiB each, 48 MiB in all) at world 2 under kFullShard.
// Built child by child, a rank's peak holds its 24 MiB of shards and, while a child is wrapped,
// that child's parameters (its shard is copied straight out of them, with no flat copy of the
// child): the shards and one child. Built whole and then wrapped, it holds the whole model and
// more.
TEST(FsdpDeferredBuild, ARankHoldsItsShardsAndOneChildWhileTheModelIsBuilt) {
  if (test::status_mib("VmHWM") < 0) GTEST_SKIP() << "no VmHWM in /proc/self/status";
  const double child_mib = kWidth * (kWidth + 1) * 4.0 / (1 << 20);
  const double shards_mib = child_mib * kLinears / 2;
  const auto deferred = peak_added_building(true);
  const auto whole = peak_added_building(false);
  const double bound = (shards_mib + child_mib) * 1.1 * test::kSanitizerMemoryFactor;
  for (std::size_t r = 0; r < 2; ++r) {
    std::printf(
        "rank %zu: peak added %.1f MiB child by child, %.1f built whole (shards %.1f, "
        "one child %.1f, the model %.1f)\n",
        r, deferred[r], whole[r], shards_mib, child_mib, child_mib * kLinears);
    EXPECT_LE(deferred[r], bound) << "rank " << r << ": shards and one child + 10 %";
    EXPECT_LE(deferred[r], 0.75 * whole[r]) << "rank " << r << ": against building whole";
  }
}

}  // namespace DDP_UNITY_ID
}  // namespace
}  // namespace ddp
