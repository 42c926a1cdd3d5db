// ddp::wrap_c10d over libtorch's c10d::ProcessGroupGloo (built over a c10d::FileStore): every
// ProcessGroup operation against values worked out here, at world 2 and 3; the errors (a dtype
// gloo refuses, bad arguments, new_group without a factory, a deadline); and the issue's
// acceptance test, DistributedDataParallel (and ZeRO) trained over the wrapped group equal to the
// same over ddp's ring group.
//
// Building a ProcessGroupGloo needs gloo's headers (tests/torch/CMakeLists.txt says where they
// come from); without them (PyPI's libtorch) the tests that need one skip, saying why.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "ddp/error.h"
#include "ddp/torch/api/join.h"
#include "ddp/torch/c10d/c10d_process_group.h"
#include "ddp/torch/ddp/distributed_data_parallel.h"
#include "ddp/torch/ddp/sync_batch_norm.h"
#include "ddp/torch/zero/zero_redundancy_optimizer.h"
#include "support/multiprocess.h"
#include "support/temp_dir.h"
#include "support/torch/c10d_wrap_checks.h"
#include "support/torch/ddp_test_util.h"
#include "support/unity_namespace.h"

#include <torch/csrc/distributed/c10d/Backend.hpp>
#if DDP_TEST_C10D_GLOO
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#endif

namespace ddp {
namespace {
namespace DDP_UNITY_ID {

using namespace std::chrono_literals;
using test::run_ranks;

#if DDP_TEST_C10D_GLOO
#define REQUIRE_GLOO()
#else
#define REQUIRE_GLOO()                                                                           \
  GTEST_SKIP()                                                                                   \
      << "no gloo headers for this libtorch (PyPI's libtorch ships ProcessGroupGloo.hpp "        \
         "but not the gloo headers it includes), so no c10d::ProcessGroupGloo can be "           \
         "built here; the Debian build (libgloo-dev) runs this test, and python.wrap_c10d_gloo " \
         "runs its checks over the gloo group PyTorch's Python builds"
#endif

#if DDP_TEST_C10D_GLOO
// A ProcessGroupGloo of `size` ranks over the FileStore at `store_path`, on loopback, with
// c10d's own timeout `gloo_timeout`.
c10::intrusive_ptr<c10d::ProcessGroupGloo> make_gloo(const std::string& store_path, int rank,
                                                     int size,
                                                     std::chrono::milliseconds gloo_timeout = 30s) {
  auto store = c10::make_intrusive<c10d::FileStore>(store_path, size);
  auto options = c10d::ProcessGroupGloo::Options::create(gloo_timeout);
  options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
  return c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, options);
}

std::shared_ptr<ProcessGroup> wrap_gloo(const std::string& store_path, int rank, int size,
                                        C10dWrapOptions options = {}) {
  torch::set_num_threads(1);
  return wrap_c10d(make_gloo(store_path, rank, size), std::move(options));
}
#endif

using test::expect_equal;

[[maybe_unused]] std::string store_file(const test::TempDir& dir) {
  return (dir.path() / "store").string();
}

// A c10d collectives class that runs every call over a ddp ring group: a stand-in for gloo where
// no ProcessGroupGloo can be built (PyPI's libtorch), so the adapter's mapping of each operation
// onto c10d's calls (the tensor lists, views and options it passes, the Works it waits for) is
// checked in both builds. A c10d::Backend in 2.x, a c10d::ProcessGroup in 1.13, as gloo is.
#if TORCH_VERSION_MAJOR >= 2
using C10dBase = c10d::Backend;
#else
using C10dBase = c10d::ProcessGroup;
#endif

class DoneWork : public c10d::Work {
 public:
  DoneWork() { finish(); }
};

// A c10d Work for a ddp Work still running (point to point).
class ForwardingWork : public c10d::Work {
 public:
  explicit ForwardingWork(std::shared_ptr<ddp::Work> work) : work_(std::move(work)) {}
  bool isCompleted() override { return work_->is_completed(); }
  bool wait(std::chrono::milliseconds timeout) override {
    if (!work_->wait_for(timeout.count() == 0 ? std::chrono::milliseconds(60'000) : timeout)) {
      TORCH_CHECK(false, "ForwardingWork: timed out");
    }
    if (auto error = work_->error()) std::rethrow_exception(error);
    return true;
  }

 private:
  std::shared_ptr<ddp::Work> work_;  // ddp's, not c10d's (this class's base)
};

class RingBackedC10d final : public C10dBase {
 public:
  explicit RingBackedC10d(std::shared_ptr<ddp::ProcessGroup> ring)
      : C10dBase(ring->rank(), ring->size()), ring_(std::move(ring)) {}
  const std::string getBackendName() const override { return "ring-double"; }

  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override {
    auto& t = single(tensors);
    ring_->allreduce(t.data_ptr(), n(t), dtype(t), op(opts.reduceOp), blocking())->wait();
    return done();
  }
  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override {
    auto& t = single(tensors);
    ring_->broadcast(t.data_ptr(), n(t), dtype(t), static_cast<int>(opts.rootRank), blocking())
        ->wait();
    return done();
  }
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                        const c10d::ReduceOptions& opts) override {
    auto& t = single(tensors);
    auto result = t.clone();
    ring_
        ->reduce(t.data_ptr(), result.data_ptr(), n(t), dtype(t), op(opts.reduceOp),
                 static_cast<int>(opts.rootRank), blocking())
        ->wait();
    if (getRank() == opts.rootRank) t.copy_(result);
    return done();
  }
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions&) override {
    auto& in = single(inputs);
    auto all = torch::empty({getSize() * in.numel()}, in.options());
    ring_->allgather(in.data_ptr(), all.data_ptr(), n(in), dtype(in), blocking())->wait();
    unpack(all, outputs.at(0));
    return done();
  }
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override {
    auto& in = single(inputs);
    const bool root = getRank() == opts.rootRank;
    if (root != (outputs.size() == 1)) TORCH_CHECK(false, "gather: outputs at the root only");
    auto all = torch::empty({getSize() * in.numel()}, in.options());
    ring_
        ->gather(in.data_ptr(), all.data_ptr(), n(in), dtype(in), static_cast<int>(opts.rootRank),
                 blocking())
        ->wait();
    if (root) unpack(all, outputs[0]);
    return done();
  }
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override {
    auto& out = single(outputs);
    const bool root = getRank() == opts.rootRank;
    if (root != (inputs.size() == 1)) TORCH_CHECK(false, "scatter: inputs at the root only");
    auto all = root ? torch::cat(inputs[0]) : torch::empty({0}, out.options());
    ring_
        ->scatter(root ? all.data_ptr() : nullptr, out.data_ptr(), n(out), dtype(out),
                  static_cast<int>(opts.rootRank), blocking())
        ->wait();
    return done();
  }
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override {
    auto& out = single(outputs);
    auto all = torch::cat(inputs.at(0));
    ring_
        ->reduce_scatter(all.data_ptr(), out.data_ptr(), n(out), dtype(out), op(opts.reduceOp),
                         blocking())
        ->wait();
    return done();
  }
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& output_splits,
                                               std::vector<int64_t>& input_splits,
                                               const c10d::AllToAllOptions&) override {
    if (!output_splits.empty() || !input_splits.empty()) TORCH_CHECK(false, "equal splits only");
    ring_
        ->alltoall(input.data_ptr(), output.data_ptr(), n(input) / getSize(), dtype(input),
                   blocking())
        ->wait();
    return done();
  }
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions&) override {
    ring_->barrier(blocking())->wait();
    return done();
  }
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst, int tag) override {
    auto& t = single(tensors);
    return c10::make_intrusive<ForwardingWork>(ring_->send(t.data_ptr(), n(t), dtype(t), dst, tag));
  }
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src, int tag) override {
    auto& t = single(tensors);
    return c10::make_intrusive<ForwardingWork>(ring_->recv(t.data_ptr(), n(t), dtype(t), src, tag));
  }

 private:
  static at::Tensor& single(std::vector<at::Tensor>& tensors) {
    if (tensors.size() != 1 || !tensors[0].is_contiguous()) {
      TORCH_CHECK(false, "RingBackedC10d: one contiguous tensor per call");
    }
    return tensors[0];
  }
  static std::size_t n(const at::Tensor& t) { return static_cast<std::size_t>(t.numel()); }
  static DType dtype(const at::Tensor& t) { return to_dtype(t.scalar_type()); }
  static CallOptions blocking() { return {.blocking = true}; }
  static ReduceOp op(const c10d::ReduceOp& op) {
    const auto type = static_cast<c10d::ReduceOp::RedOpType>(op);
    if (type == c10d::ReduceOp::SUM) return ReduceOp::kSum;
    if (type == c10d::ReduceOp::MIN) return ReduceOp::kMin;
    if (type == c10d::ReduceOp::MAX) return ReduceOp::kMax;
    if (type == c10d::ReduceOp::PRODUCT) return ReduceOp::kProduct;
    if (type == c10d::ReduceOp::BAND) return ReduceOp::kBand;
    if (type == c10d::ReduceOp::BOR) return ReduceOp::kBor;
    if (type == c10d::ReduceOp::BXOR) return ReduceOp::kBxor;
    throw std::invalid_argument("RingBackedC10d: reduce op not mapped");
  }
  static void unpack(const at::Tensor& all, std::vector<at::Tensor>& outputs) {
    auto pieces = all.chunk(static_cast<int64_t>(outputs.size()));
    for (std::size_t r = 0; r < outputs.size(); ++r)
      outputs[r].copy_(pieces[r]);
  }
  static c10::intrusive_ptr<c10d::Work> done() { return c10::make_intrusive<DoneWork>(); }

  std::shared_ptr<ddp::ProcessGroup> ring_;
};

// The wrapped double over a fresh ring group. 2.x: through a c10d::ProcessGroup holding it as
// its CPU backend when `through_group`, else the Backend itself.
std::shared_ptr<ProcessGroup> wrap_double(int rank, int size, int port, bool through_group) {
  auto ring = test::join_group(rank, size, port);
  auto double_ = c10::make_intrusive<RingBackedC10d>(ring);
#if TORCH_VERSION_MAJOR >= 2
  if (through_group) {
    auto group = c10::make_intrusive<c10d::ProcessGroup>(rank, size);
    group->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::CUSTOM,
                      c10::intrusive_ptr<c10d::Backend>(double_));
    return wrap_c10d(group, {.name = "double"});
  }
#else
  static_cast<void>(through_group);  // 1.13: the double is a c10d::ProcessGroup already
#endif
  return wrap_c10d(double_, {.name = "double"});
}

class C10dDoubleWorld : public ::testing::TestWithParam<std::tuple<int, bool>> {};

TEST_P(C10dDoubleWorld, EveryOperationGivesTheExpectedValues) {
  const auto [world, through_group] = GetParam();
  const int port = test::free_port();
  const auto results = run_ranks(world, [&](int rank) {
    auto pg = wrap_double(rank, world, port, through_group);
    if (pg->backend() != "c10d:ring-double") throw std::runtime_error(std::string(pg->backend()));
    test::check_every_operation(*pg);
  });
  EXPECT_ALL_RANKS_OK(results);
}

INSTANTIATE_TEST_SUITE_P(World, C10dDoubleWorld,
                         ::testing::Combine(::testing::Values(2, 3), ::testing::Bool()));

class C10dGlooWorld : public ::testing::TestWithParam<int> {};

TEST_P(C10dGlooWorld, EveryOperationGivesTheExpectedValues) {
  REQUIRE_GLOO();
#if DDP_TEST_C10D_GLOO
  const int world = GetParam();
  test::TempDir dir("ddp-c10d");
  const auto results = run_ranks(world, [&](int rank) {
    auto pg = wrap_gloo(store_file(dir), rank, world, {.name = "gloo", .timeout = 30s});
    if (pg->backend() != "c10d:gloo") throw std::runtime_error(std::string(pg->backend()));
    test::check_every_operation(*pg);
  });
  EXPECT_ALL_RANKS_OK(results);
#endif
}

INSTANTIATE_TEST_SUITE_P(World, C10dGlooWorld, ::testing::Values(2, 3));

TEST(C10dGloo, NewGroupBuildsTheSubgroupThroughTheFactory) {
  REQUIRE_GLOO();
#if DDP_TEST_C10D_GLOO
  test::TempDir dir("ddp-c10d");
  const auto results = run_ranks(3, [&](int rank) {
    const auto path = store_file(dir);
    C10dWrapOptions options{.name = "world"};
    options.new_group = [&](const std::vector<int>& ranks) -> std::shared_ptr<ProcessGroup> {
      const int index =
          static_cast<int>(std::find(ranks.begin(), ranks.end(), rank) - ranks.begin());
      // A store of its own: a FileStore removes its file once its `size` users are done.
      return wrap_c10d(make_gloo(path + ".sub02", index, static_cast<int>(ranks.size())),
                       {.name = "world/sub02"});
    };
    auto pg = wrap_c10d(make_gloo(path, rank, 3), std::move(options));
    auto sub = pg->new_group({0, 2});
    if ((sub != nullptr) != (rank != 1)) throw std::runtime_error("membership");
    if (sub) {
      auto t = torch::full({3}, rank + 1.0);
      sub->allreduce(t.data_ptr(), 3, DType::kFloat32, ReduceOp::kSum)->wait();
      expect_equal(t, torch::full({3}, 4.0), "allreduce in {0, 2}");
      if (sub->size() != 2 || sub->rank() != rank / 2) throw std::runtime_error("numbering");
    }
    pg->barrier()->wait();
  });
  EXPECT_ALL_RANKS_OK(results);
#endif
}

TEST(C10dGloo, RefusalsAndBadArgumentsAreConfigErrorsNamingTheCall) {
  REQUIRE_GLOO();
#if DDP_TEST_C10D_GLOO
  test::TempDir dir("ddp-c10d");
  const auto results = run_ranks(2, [&](int rank) {
    auto pg = wrap_gloo(store_file(dir), rank, 2);
    auto t = torch::ones({4});
    const auto expect_config_error = [](const std::function<void()>& call,
                                        const std::vector<std::string>& words) {
      try {
        call();
      } catch (const ConfigError& e) {
        for (const auto& word : words) {
          if (std::string(e.what()).find(word) == std::string::npos) {
            throw std::runtime_error(fmt::format("'{}' lacks '{}'", e.what(), word));
          }
        }
        return;
      }
      throw std::runtime_error(fmt::format("no ConfigError (expected one naming {})", words[0]));
    };
    expect_config_error([&] { pg->broadcast(t.data_ptr(), 4, DType::kFloat32, 2); },
                        {"broadcast", "root"});
    expect_config_error([&] { pg->allreduce(nullptr, 4, DType::kFloat32, ReduceOp::kSum); },
                        {"allreduce"});
    expect_config_error([&] { pg->send(t.data_ptr(), 4, DType::kFloat32, 1 - rank, -1); },
                        {"send", "tag -1", "c10d:gloo"});
    expect_config_error([&] { pg->new_group({0}); },
                        {"new_group", "c10d:gloo", "C10dWrapOptions::new_group"});
    auto bf16 = torch::ones({4}, torch::kBFloat16);
    if (TORCH_VERSION_MAJOR < 2) {
      // 1.13's gloo refuses bfloat16: a ConfigError from the call, nothing issued.
      expect_config_error(
          [&] { pg->allreduce(bf16.data_ptr(), 4, DType::kBFloat16, ReduceOp::kSum); },
          {"allreduce", "c10d:gloo", "bfloat16"});
    } else {
      pg->allreduce(bf16.data_ptr(), 4, DType::kBFloat16, ReduceOp::kSum)->wait();
      expect_equal(bf16, torch::full({4}, 2.0), "bfloat16 allreduce");
    }
    // The group still works after the refusals.
    pg->allreduce(t.data_ptr(), 4, DType::kFloat32, ReduceOp::kSum)->wait();
    expect_equal(t, torch::full({4}, 2.0), "allreduce after the refusals");
  });
  EXPECT_ALL_RANKS_OK(results);
#endif
}

TEST(C10dGloo, NullGroupIsAConfigError) {
  EXPECT_THROW(wrap_c10d(c10::intrusive_ptr<c10d::ProcessGroup>()), ConfigError);
  EXPECT_THROW(wrap_c10d(c10::intrusive_ptr<c10d::Backend>()), ConfigError);
}

TEST(C10dGloo, DeadlineIsACommErrorOfKindTimeoutAndPoisonsTheGroup) {
  REQUIRE_GLOO();
#if DDP_TEST_C10D_GLOO
  test::TempDir dir("ddp-c10d");
  const auto results = run_ranks(2, [&](int rank) {
    torch::set_num_threads(1);
    // The flight recorder dumps on the failure: into the test's directory, not the cwd.
    ::setenv("DDP_DUMP_DIR", dir.path().c_str(), 1);
    // gloo's own timeout short too: 1.13's gloo does not take a per-operation timeout.
    auto pg = wrap_c10d(make_gloo(store_file(dir), rank, 2, 3s), {.name = "g", .timeout = 1s});
    if (rank == 1) {  // never joins the allreduce
      std::this_thread::sleep_for(4s);
      return;
    }
    auto t = torch::ones({4});
    const auto start = std::chrono::steady_clock::now();
    try {
      pg->allreduce(t.data_ptr(), 4, DType::kFloat32, ReduceOp::kSum)->wait();
      throw std::runtime_error("the allreduce completed without its peer");
    } catch (const CommError& e) {
      if (e.kind() != CommErrorKind::kTimeout) {
        throw std::runtime_error(fmt::format("kind {}: {}", to_string(e.kind()), e.what()));
      }
      const std::string what = e.what();
      if (what.find("allreduce") == std::string::npos ||
          what.find("c10d:gloo") == std::string::npos || e.group() != "g") {
        throw std::runtime_error("message: " + what);
      }
    }
    if (std::chrono::steady_clock::now() - start > 2500ms) throw std::runtime_error("too late");
    try {  // poisoned: the next call fails at once with the first error
      pg->barrier()->wait();
      throw std::runtime_error("the barrier ran on a poisoned group");
    } catch (const CommError& e) {
      if (e.kind() != CommErrorKind::kTimeout) throw;
    }
  });
  EXPECT_ALL_RANKS_OK(results);
#endif
}

// The acceptance test: the same training over the wrapped gloo group and over ddp's ring
// group gives the same parameters.
using Training = test::C10dTraining;

// Trains on 2 ranks over the group `make_group` builds; returns rank 0's parameters and buffers
// (every rank checks that all hold the same parameters).
std::vector<at::Tensor> train(
    const std::function<std::shared_ptr<ProcessGroup>(int rank)>& make_group, Training training,
    const std::string& out_file) {
  const auto results = run_ranks(2, [&](int rank) {
    const auto state = test::train_c10d_check_model(make_group(rank), training);
    if (rank == 0) torch::save(state, out_file);
  });
  for (const auto& r : results) {
    if (!r.ok()) throw std::runtime_error(test::describe(results));
  }
  std::vector<at::Tensor> state;
  torch::load(state, out_file);
  return state;
}

// The same training over the wrapped group and over a ring group of ddp's own.
void expect_same_training(const std::function<std::shared_ptr<ProcessGroup>(int rank)>& wrapped,
                          Training training) {
  test::TempDir dir("ddp-c10d-train");
  const auto a = train(wrapped, training, (dir.path() / "wrapped.pt").string());
  const int port = test::free_port();
  const auto b = train([&](int rank) { return test::join_group(rank, 2, port); }, training,
                       (dir.path() / "ring.pt").string());
  ASSERT_EQ(a.size(), b.size());
  for (std::size_t i = 0; i < a.size(); ++i) {
    EXPECT_LE((a[i].to(torch::kFloat64) - b[i].to(torch::kFloat64)).abs().max().item<double>(),
              1e-6)
        << "tensor " << i;
  }
  // And training moved them (the comparison is not of two untouched models).
  const auto initial =
      test::make_c10d_check_model(training == Training::kSyncBatchNorm)->parameters();
  double moved = 0;
  for (std::size_t i = 0; i < initial.size(); ++i) {
    moved = std::max(moved, (a[i] - initial[i]).abs().max().item<double>());
  }
  EXPECT_GT(moved, 1e-3);
}

class C10dGlooTraining : public ::testing::TestWithParam<Training> {};

TEST_P(C10dGlooTraining, OverGlooEqualsRingGroup) {
  REQUIRE_GLOO();
#if DDP_TEST_C10D_GLOO
  test::TempDir dir("ddp-c10d");
  expect_same_training([&](int rank) { return wrap_gloo(store_file(dir), rank, 2); }, GetParam());
#endif
}

std::string training_name(const ::testing::TestParamInfo<Training>& info) {
  switch (info.param) {
    case Training::kDdp:
      return "DistributedDataParallel";
    case Training::kZero:
      return "ZeroRedundancyOptimizer";
    case Training::kSyncBatchNorm:
      return "SyncBatchNorm";
    case Training::kJoin:
      return "Join";
  }
  return "unknown";
}

INSTANTIATE_TEST_SUITE_P(Training, C10dGlooTraining,
                         ::testing::Values(Training::kDdp, Training::kZero,
                                           Training::kSyncBatchNorm, Training::kJoin),
                         training_name);

// DDP over the wrapped ring-backed double: the adapter under DDP in both builds.
TEST(C10dDouble, DistributedDataParallelEqualsRingGroup) {
  const int port = test::free_port();
  expect_same_training([&](int rank) { return wrap_double(rank, 2, port, /*through_group=*/true); },
                       Training::kDdp);
}

#undef REQUIRE_GLOO  // not into the next source of a unity batch

}  // namespace DDP_UNITY_ID
}  // namespace
}  // namespace ddp
