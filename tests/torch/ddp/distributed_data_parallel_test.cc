#include "ddp/torch/ddp/distributed_data_parallel.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <string>

#include "ddp/comm/ring_process_group.h"
#include "ddp/error.h"
#include "support/forwarding_group.h"
#include "support/multiprocess.h"
#include "support/resident_memory.h"
#include "support/torch/ddp_test_models.h"
#include "support/torch/ddp_test_util.h"
#include "support/torch/refusing_allocator.h"
#include "support/unity_namespace.h"

namespace ddp {
namespace {
namespace DDP_UNITY_ID {

using namespace std::chrono_literals;
using test::Batches;
using test::expect_close;
using test::expect_identical_across_ranks;
using test::join_group;
using test::make_batches;
using test::make_sgd;
using test::Mlp;
using test::peak_added_mib;
using test::run_ranks;
using test::SmallCnn;
using test::status_mib;

// Trains `Model` for `steps` steps on `world` ranks with per-rank batch `batch` and checks, after
// every step, that all ranks hold bit-identical parameters, and at the end (on rank 0) that they
// equal one process trained on the combined batches.
template <typename Model>
void check_equivalence(
    int world, int batch, std::vector<std::int64_t> sample_shape, DdpOptions options,
    double tolerance = 1e-5,
    std::function<void(DistributedDataParallel<typename Model::ContainedType>&)> setup = nullptr) {
  const int port = test::free_port();
  const int steps = 5;
  const auto results = run_ranks(world, [&](int rank) {
    auto pg = join_group(rank, world, port);
    torch::manual_seed(100 + rank);  // different on every rank: construction must broadcast
    Model net;
    DistributedDataParallel ddp_model(net.ptr(), pg, options);
    if (setup) setup(ddp_model);
    auto opt = make_sgd(ddp_model->parameters());
    const auto data = make_batches(steps, world * batch, sample_shape);
    for (int step = 0; step < steps; ++step) {
      opt.zero_grad();
      auto x = data.inputs[step].narrow(0, rank * batch, batch);
      auto y = data.targets[step].narrow(0, rank * batch, batch);
      torch::nn::functional::cross_entropy(ddp_model->forward(x), y).backward();
      opt.step();
      expect_identical_across_ranks(*pg, ddp_model->parameters(),
                                    fmt::format("parameters after step {}", step));
    }
    if (rank != 0) return;
    torch::manual_seed(100);
    Model reference;
    auto ref_opt = make_sgd(reference->parameters());
    for (int step = 0; step < steps; ++step) {
      ref_opt.zero_grad();
      torch::nn::functional::cross_entropy(reference->forward(data.inputs[step]),
                                           data.targets[step])
          .backward();
      ref_opt.step();
    }
    const auto got = ddp_model->parameters();
    const auto want = reference->parameters();
    for (std::size_t i = 0; i < got.size(); ++i) {
      expect_close(got[i], want[i], fmt::format("parameter {}", i), tolerance,
                   std::max(1e-6, tolerance * 0.1));
    }
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(DistributedDataParallel, MlpOnTwoRanksEqualsOneProcessWithTheCombinedBatch) {
  check_equivalence<Mlp>(2, 8, {20}, {});
}

TEST(DistributedDataParallel, MlpOnThreeRanksEqualsOneProcess) {
  check_equivalence<Mlp>(3, 4, {20}, {});
}

TEST(DistributedDataParallel, CnnOnTwoRanksEqualsOneProcess) {
  check_equivalence<SmallCnn>(2, 6, {1, 12, 12}, {});
}

TEST(DistributedDataParallel, ManySmallBucketsAndRebuildKeepEquivalence) {
  check_equivalence<Mlp>(2, 8, {20}, {.bucket_cap_mb = 0.001, .first_bucket_cap_mb = 0.0005});
}

TEST(DistributedDataParallel, GradientAsBucketViewEqualsOneProcess) {
  check_equivalence<Mlp>(2, 8, {20}, {.gradient_as_bucket_view = true});
}

// gradient_as_bucket_view on one host (ring over shared memory): the buckets, and so the
// gradients, live in a buffer the ranks map into each other, and each large bucket's allreduce
// reads the peers' buckets where they lie (issue 28). World 3, through the bucket rebuild: the
// same bits as the copying path (DDP_SHM_SHARED_BUFFERS=0) on the same data, and every rank
// identical; logging_data says which path each model took and why.
TEST(DistributedDataParallel, SharedBucketsOnOneHostGiveTheCopyingPathsBits) {
  const int port = test::free_port();
  constexpr int kWorld = 3, kBatch = 4, kSteps = 4;
  const auto results = run_ranks(kWorld, [&](int rank) {
    auto pg = join_group(rank, kWorld, port);
    auto make_model = [] {
      torch::manual_seed(5);
      return torch::nn::Sequential(torch::nn::Linear(32, 256), torch::nn::ReLU(),
                                   torch::nn::Linear(256, 256), torch::nn::ReLU(),
                                   torch::nn::Linear(256, 4));
    };
    const auto data = make_batches(kSteps, kWorld * kBatch, {32});
    auto train = [&](bool shared) {
      if (!shared) ::setenv("DDP_SHM_SHARED_BUFFERS", "0", 1);
      auto net = make_model();
      DistributedDataParallel model(net.ptr(), pg,
                                    {.bucket_cap_mb = 0.1, .gradient_as_bucket_view = true});
      auto opt = make_sgd(model->parameters());
      const long long before = ring_shared_buffer_allreduces_of(*pg);
      for (int step = 0; step < kSteps; ++step) {
        opt.zero_grad();
        auto x = data.inputs[step].narrow(0, rank * kBatch, kBatch);
        auto y = data.targets[step].narrow(0, rank * kBatch, kBatch);
        torch::nn::functional::cross_entropy(model->forward(x), y).backward();
        opt.step();
      }
      const auto logged = model->logging_data();
      const long long zero_copy = ring_shared_buffer_allreduces_of(*pg) - before;
      if (shared) {
        if (!logged.shared_buckets || !logged.shared_buckets_why_not.empty())
          throw std::runtime_error("buckets not shared: " + logged.shared_buckets_why_not);
        if (!logged.has_rebuilt_buckets) throw std::runtime_error("buckets not rebuilt");
        // At least the 256 x 256 weight's bucket (256 KiB) on every step.
        if (zero_copy < kSteps) {
          throw std::runtime_error(
              fmt::format("{} zero-copy allreduces in {} steps", zero_copy, kSteps));
        }
      } else {
        if (logged.shared_buckets || zero_copy != 0) {
          throw std::runtime_error("DDP_SHM_SHARED_BUFFERS=0 still shared the buckets");
        }
        if (logged.shared_buckets_why_not.find("DDP_SHM_SHARED_BUFFERS=0") == std::string::npos)
          throw std::runtime_error("why not: " + logged.shared_buckets_why_not);
      }
      ::unsetenv("DDP_SHM_SHARED_BUFFERS");  // read at each allocation: here and the rebuild
      expect_identical_across_ranks(*pg, model->parameters(), "parameters");
      return model->parameters();
    };
    const auto shared = train(true);
    const auto copied = train(false);
    for (std::size_t i = 0; i < shared.size(); ++i) {
      if (!torch::equal(shared[i], copied[i])) {
        throw std::runtime_error(fmt::format("parameter {} differs from the copying path's", i));
      }
    }
  });
  EXPECT_ALL_RANKS_OK(results);
}

// The rebuild tests' model: a 16 MiB weight, then a small one.
torch::nn::Sequential make_model() {
  torch::manual_seed(3);
  return torch::nn::Sequential(torch::nn::Linear(2048, 2048), torch::nn::Tanh(),
                               torch::nn::Linear(2048, 8));
}

// Runs `body(group, input)` on two ranks whose buckets are private copies
// (DDP_SHM_SHARED_BUFFERS=0), with an input for make_model().
void on_two_ranks_with_copying_buckets(
    const std::function<void(const std::shared_ptr<ProcessGroup>&, const torch::Tensor&)>& body) {
  const int port = test::free_port();
  constexpr int kWorld = 2;
  const auto results = run_ranks(kWorld, [&](int rank) {
    ::setenv("DDP_SHM_SHARED_BUFFERS", "0", 1);
    auto pg = join_group(rank, kWorld, port);
    body(pg, torch::randn({4, 2048}));
    ::unsetenv("DDP_SHM_SHARED_BUFFERS");
  });
  EXPECT_ALL_RANKS_OK(results);
}

// The bucket rebuild (at the second forward) holds one set of buckets at a time, and keeps every
// gradient's values. World 2, a 16 MiB weight in copying buckets (DDP_SHM_SHARED_BUFFERS=0: a
// shared bucket's pages would count in both ranks' resident sets), with and without
// gradient_as_bucket_view: with zeroed gradients (zero_grad) the rebuilding forward adds less than
// half a bucket at its peak (two sets of buckets, and the copies of the gradients it once made,
// added one or two buckets); gradients that hold values (accumulated without zero_grad) keep them
// through the rebuild, and the next synchronised step equals the same training without a rebuild
// in between.
TEST(DistributedDataParallel, BucketRebuildHoldsOneSetOfBucketsAndKeepsTheGradients) {
  if (status_mib("VmHWM") < 0) GTEST_SKIP() << "no VmHWM in /proc/self/status";
  on_two_ranks_with_copying_buckets([](const std::shared_ptr<ProcessGroup>& pg,
                                       const torch::Tensor& x) {
    const double bucket_mib = 2048.0 * 2049 * 4 / (1 << 20);
    for (const bool as_view : {false, true}) {
      const std::string mode = as_view ? "gradient_as_bucket_view" : "copying gradients";
      // Zeroed gradients: the rebuilding forward's peak, against a forward's after it (the
      // forward's own temporaries, e.g. a packed copy of the weight for the matrix product).
      {
        auto net = make_model();
        DistributedDataParallel model(net.ptr(), pg, {.gradient_as_bucket_view = as_view});
        auto zero_gradients = [&] {
          torch::NoGradGuard no_grad;
          for (auto& p : model->parameters())
            p.mutable_grad().zero_();
        };
        auto forward_peak = [&] { return peak_added_mib([&] { auto out = model->forward(x); }); };
        model->forward(x).sum().backward();
        zero_gradients();
        const double rebuilding = forward_peak();
        if (!model->reducer().buckets_rebuilt()) throw std::runtime_error("buckets not rebuilt");
        for (auto& p : model->parameters()) {
          if (!p.grad().defined() || p.grad().any().item<bool>())
            throw std::runtime_error(mode + ": a zeroed gradient did not stay zero");
        }
        model->forward(x).sum().backward();
        zero_gradients();
        const double plain = forward_peak();
        if (rebuilding - plain > bucket_mib / 2) {
          throw std::runtime_error(
              fmt::format("{}: the rebuilding forward added {:.1f} MiB at its peak, a forward "
                          "after it {:.1f} (a bucket is {:.1f})",
                          mode, rebuilding, plain, bucket_mib));
        }
      }
      // Gradients holding values: kept through the rebuild, and the step after it equals the
      // same step of a model whose buckets were rebuilt before the values accumulated.
      std::vector<torch::Tensor> rebuilt_now, rebuilt_before;
      for (const bool rebuild_with_values : {true, false}) {
        auto net = make_model();
        DistributedDataParallel model(net.ptr(), pg, {.gradient_as_bucket_view = as_view});
        if (!rebuild_with_values) {
          model->forward(x).sum().backward();
          model->zero_grad();
          model->forward(x * 0);  // the rebuild, on zero gradients
        }
        model->forward(x).sum().backward();
        std::vector<torch::Tensor> held;
        for (auto& p : model->parameters())
          held.push_back(p.grad().clone());
        auto out = model->forward(x * 2);
        if (!model->reducer().buckets_rebuilt()) throw std::runtime_error("buckets not rebuilt");
        for (std::size_t i = 0; i < held.size(); ++i) {
          if (!torch::equal(model->parameters()[i].grad(), held[i]))
            throw std::runtime_error(
                fmt::format("{}: gradient {} changed in the rebuild", mode, i));
        }
        out.sum().backward();  // accumulates onto the held values
        auto& target = rebuild_with_values ? rebuilt_now : rebuilt_before;
        for (auto& p : model->parameters())
          target.push_back(p.grad().clone());
      }
      for (std::size_t i = 0; i < rebuilt_now.size(); ++i) {
        if (!torch::allclose(rebuilt_now[i], rebuilt_before[i], 1e-6, 1e-6))
          throw std::runtime_error(fmt::format(
              "{}: gradient {} after the rebuild differs from the model rebuilt earlier", mode, i));
      }
    }
  });
}

// A rebuild that cannot allocate its new buckets (the CPU allocator refusing 8 MiB and more, on
// both ranks) fails that forward by name, and every later synchronisation is refused naming the
// rebuild: there are no buckets left to reduce into, and going on would leave the ranks waiting on
// each other. The model still evaluates as the module it wraps. With and without
// gradient_as_bucket_view.
TEST(DistributedDataParallel, AFailedBucketRebuildIsNamedAndRefusesEveryLaterSynchronisation) {
  on_two_ranks_with_copying_buckets(
      [](const std::shared_ptr<ProcessGroup>& pg, const torch::Tensor& x) {
        for (const bool as_view : {false, true}) {
          const std::string mode = as_view ? "gradient_as_bucket_view" : "copying gradients";
          auto net = make_model();
          DistributedDataParallel model(net.ptr(), pg, {.gradient_as_bucket_view = as_view});
          model->forward(x).sum().backward();
          model->zero_grad();
          std::string rebuild_error;
          try {
            test::RefusingLargeAllocations refusing(8 << 20);  // the weight's new bucket is 16 MiB
            model->forward(x);
          } catch (const std::exception& e) {
            rebuild_error = e.what();
          }
          if (rebuild_error.find("rebuilding the gradient buckets failed") == std::string::npos ||
              rebuild_error.find("no buckets left") == std::string::npos) {
            throw std::runtime_error(mode +
                                     ": the rebuilding forward with large allocations refused: " +
                                     (rebuild_error.empty() ? "no error" : rebuild_error));
          }
          for (int attempt = 0; attempt < 2; ++attempt) {
            std::string refusal;
            try {
              model->forward(x).sum().backward();
            } catch (const std::exception& e) {
              refusal = e.what();
            }
            if (refusal.find("refusing to synchronise gradients after an earlier failure") ==
                    std::string::npos ||
                refusal.find("rebuilding the gradient buckets failed") == std::string::npos) {
              throw std::runtime_error(mode + ": a step after the failed rebuild: " +
                                       (refusal.empty() ? "no error" : refusal));
            }
          }
          // Nothing is lost: the model still evaluates (and so can be saved) as the module it
          // wraps.
          model->eval();
          torch::NoGradGuard no_grad;
          if (!torch::equal(model->forward(x), net->forward(x)))
            throw std::runtime_error(mode + ": evaluation after the failed rebuild differs");
        }
      });
}

// A backward that throws inside autograd after DDP's hooks ran (here a hook on the input, the
// last gradient computed: every bucket launched) never reaches DDP's end of backward. The next
// forward drops that pass (before: the next backward failed with "received a gradient twice"), and
// after zero_grad the step equals the same step of a model that never failed, with and without
// gradient_as_bucket_view.
TEST(DistributedDataParallel, ABackwardThatFailedInsideAutogradIsDroppedAtTheNextForward) {
  const int port = test::free_port();
  const auto results = run_ranks(2, [&](int rank) {
    auto pg = join_group(rank, 2, port, 10s);
    torch::manual_seed(5 + rank);
    const auto x = torch::randn({8, 20});
    for (const bool as_view : {false, true}) {
      const std::string mode = as_view ? "gradient_as_bucket_view" : "copying gradients";
      torch::manual_seed(1);
      Mlp failing_net;
      torch::manual_seed(1);
      Mlp clean_net;
      DistributedDataParallel model(failing_net.ptr(), pg, {.gradient_as_bucket_view = as_view});
      DistributedDataParallel clean(clean_net.ptr(), pg, {.gradient_as_bucket_view = as_view});
      auto failing_input = x.clone().requires_grad_(true);
      failing_input.register_hook(
          [](const torch::Tensor&) -> torch::Tensor { throw std::runtime_error("a hook failed"); });
      for (const bool fail : {false, true}) {  // the second pass fails (after the rebuild)
        model->zero_grad();
        try {
          model->forward(fail ? failing_input : x).sum().backward();
          if (fail) throw std::runtime_error(mode + ": the failing hook did not fail backward");
        } catch (const std::runtime_error& e) {
          if (!fail || std::string(e.what()).find("a hook failed") == std::string::npos) throw;
        }
        clean->zero_grad();
        clean->forward(x).sum().backward();
      }
      model->zero_grad();
      clean->zero_grad();
      model->forward(x).sum().backward();
      clean->forward(x).sum().backward();
      for (std::size_t i = 0; i < clean->parameters().size(); ++i) {
        if (!torch::equal(model->parameters()[i].grad(), clean->parameters()[i].grad())) {
          throw std::runtime_error(
              fmt::format("{}: gradient {} after the failed backward differs", mode, i));
        }
      }
    }
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(DistributedDataParallel, Fp16CompressionIsCloseToOneProcess) {
  check_equivalence<Mlp>(2, 8, {20}, {}, 1e-2,
                         [](auto& model) { model->register_comm_hook(fp16_compress_hook()); });
}

TEST(DistributedDataParallel, ReduceDtypeBf16IsCloseToOneProcess) {
  check_equivalence<Mlp>(2, 8, {20}, {.reduce_dtype = torch::kBFloat16}, 5e-2);
}

TEST(DistributedDataParallel, ReduceDtypeOtherThanBf16OrHalfIsRefused) {
  const int port = test::free_port();
  const auto results = run_ranks(1, [&](int rank) {
    auto pg = join_group(rank, 1, port);
    Mlp net;
    try {
      DistributedDataParallel model(net.ptr(), pg, {.reduce_dtype = torch::kFloat64});
    } catch (const ConfigError& e) {
      if (std::string(e.what()).find("reduce_dtype") != std::string::npos) return;
      throw;
    }
    throw std::runtime_error("reduce_dtype = kFloat64 was accepted");
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(DistributedDataParallel, Bf16CompressionIsCloseToOneProcess) {
  check_equivalence<Mlp>(2, 8, {20}, {}, 5e-2,
                         [](auto& model) { model->register_comm_hook(bf16_compress_hook()); });
}

void check_no_sync(bool as_view) {
  const int port = test::free_port();
  const int world = 2, batch = 8, micro = 4;
  const auto results = run_ranks(world, [&](int rank) {
    auto pg = join_group(rank, world, port);
    torch::manual_seed(100 + rank);
    Mlp net;
    DistributedDataParallel ddp_model(net.ptr(), pg, {.gradient_as_bucket_view = as_view});
    auto opt = make_sgd(ddp_model->parameters());
    const auto data = make_batches(1, world * batch, {20});
    auto x = data.inputs[0].narrow(0, rank * batch, batch).chunk(micro);
    auto y = data.targets[0].narrow(0, rank * batch, batch).chunk(micro);
    opt.zero_grad();
    for (int m = 0; m < micro; ++m) {
      auto loss = torch::nn::functional::cross_entropy(ddp_model->forward(x[m]), y[m]) / micro;
      if (m + 1 < micro) {
        auto guard = ddp_model->no_sync();
        loss.backward();
      } else {
        loss.backward();
      }
    }
    opt.step();
    expect_identical_across_ranks(*pg, ddp_model->parameters(), "after the synced step");
    if (rank != 0) return;
    torch::manual_seed(100);
    Mlp reference;
    auto ref_opt = make_sgd(reference->parameters());
    torch::nn::functional::cross_entropy(reference->forward(data.inputs[0]), data.targets[0])
        .backward();
    ref_opt.step();
    for (std::size_t i = 0; i < reference->parameters().size(); ++i) {
      expect_close(ddp_model->parameters()[i], reference->parameters()[i],
                   fmt::format("parameter {}", i));
    }
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(DistributedDataParallel, NoSyncMicroStepsEqualOneStepOnTheCombinedBatch) {
  check_no_sync(/*as_view=*/false);
}

TEST(DistributedDataParallel, NoSyncWithGradientAsBucketView) {
  check_no_sync(/*as_view=*/true);
}

// fc_unused is registered but never used in forward.
struct WithUnusedImpl : torch::nn::Module {
  WithUnusedImpl() {
    fc = register_module("fc", torch::nn::Linear(20, 4));
    fc_unused = register_module("fc_unused", torch::nn::Linear(20, 4));
  }
  torch::Tensor forward(torch::Tensor x) { return fc(x); }
  torch::nn::Linear fc{nullptr}, fc_unused{nullptr};
};
TORCH_MODULE(WithUnused);

// `steps` SGD steps of `model` (over `net`) on this rank's half of 16-sample batches; then the
// ranks must hold the same parameters and the unused layer no gradient.
template <typename Model>
void train_with_unused(Model& model, WithUnusedImpl& net, ProcessGroup& pg, int rank, int steps) {
  auto opt = make_sgd(model->parameters());
  const auto data = make_batches(steps, 16, {20});
  for (int step = 0; step < steps; ++step) {
    opt.zero_grad();
    auto x = data.inputs[step].narrow(0, rank * 8, 8);
    auto y = data.targets[step].narrow(0, rank * 8, 8);
    torch::nn::functional::cross_entropy(model->forward(x), y).backward();
    opt.step();
  }
  expect_identical_across_ranks(pg, model->parameters(), "parameters");
  if (net.fc_unused->weight.grad().defined()) {
    throw std::runtime_error("a parameter unused on every rank must keep no gradient");
  }
}

TEST(DistributedDataParallel, UnusedParametersTrainWithFindUnusedParameters) {
  const int port = test::free_port();
  const auto results = run_ranks(2, [&](int rank) {
    auto pg = join_group(rank, 2, port);
    torch::manual_seed(100 + rank);
    WithUnused net;
    DistributedDataParallel model(net.ptr(), pg, {.find_unused_parameters = true});
    train_with_unused(model, *net, *pg, rank, 3);
    if (!net->fc->weight.grad().defined()) throw std::runtime_error("used parameter has no grad");
  });
  EXPECT_ALL_RANKS_OK(results);
}

// static_graph: the same training as find_unused_parameters on a model with a parameter no
// forward uses (bit-identical parameters), with one autograd-graph walk in all instead of one per
// step (PyTorch's static_graph skips the search once the graph is known).
TEST(DistributedDataParallel, StaticGraphTrainsLikeFindUnusedAndSearchesTheGraphOnce) {
  const int steps = 4;
  const int port = test::free_port();
  const auto results = run_ranks(2, [&](int rank) {
    auto pg = join_group(rank, 2, port);
    std::vector<std::vector<torch::Tensor>> trained;
    for (const bool static_graph : {false, true}) {
      torch::manual_seed(100);
      WithUnused net;
      DistributedDataParallel model(
          net.ptr(), pg, {.find_unused_parameters = !static_graph, .static_graph = static_graph});
      train_with_unused(model, *net, *pg, rank, steps);
      const auto data_log = model->logging_data();
      const std::int64_t want_searches = static_graph ? 1 : steps;
      if (data_log.iteration != steps || data_log.unused_parameter_searches != want_searches ||
          data_log.static_graph != static_graph) {
        throw std::runtime_error(fmt::format(
            "static_graph={}: {} iterations, {} graph searches (want {} and {})", static_graph,
            data_log.iteration, data_log.unused_parameter_searches, steps, want_searches));
      }
      auto names = data_log.unused_parameter_names;
      std::sort(names.begin(), names.end());
      if (names != std::vector<std::string>{"fc_unused.bias", "fc_unused.weight"}) {
        throw std::runtime_error(
            fmt::format("static_graph={}: {} unused parameters named, not "
                        "fc_unused.weight and fc_unused.bias",
                        static_graph, names.size()));
      }
      std::vector<torch::Tensor> params;
      for (const auto& p : net->parameters())
        params.push_back(p.detach().clone());
      trained.push_back(params);
    }
    for (std::size_t i = 0; i < trained[0].size(); ++i) {
      if (!torch::equal(trained[0][i], trained[1][i])) {
        throw std::runtime_error(
            fmt::format("parameter {} differs between find_unused_parameters "
                        "and static_graph",
                        i));
      }
    }
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(DistributedDataParallel, UnusedParametersWithoutTheOptionNameTheParameterAndNeverHang) {
  const int port = test::free_port();
  const auto results = run_ranks(
      2,
      [&](int rank) {
        auto pg = join_group(rank, 2, port, 10s);
        WithUnused net;
        DistributedDataParallel model(net.ptr(), pg);
        for (int attempt = 0; attempt < 2; ++attempt) {
          try {
            model->forward(torch::randn({4, 20})).sum().backward();
            throw std::runtime_error("backward should have failed");
          } catch (const ddp::Error& e) {
            const std::string message = e.what();
            if (message.find("fc_unused.weight") == std::string::npos ||
                message.find("find_unused_parameters") == std::string::npos) {
              throw std::runtime_error("unhelpful message: " + message);
            }
          }
        }
      },
      60s);
  EXPECT_ALL_RANKS_OK(results);
}

TEST(DistributedDataParallel, DifferentModelsAcrossRanksAreNamedAtConstruction) {
  const int port = test::free_port();
  const auto results = run_ranks(
      2,
      [&](int rank) {
        auto pg = join_group(rank, 2, port, 10s);
        Mlp net(rank == 0 ? 32 : 33);
        try {
          DistributedDataParallel model(net.ptr(), pg);
        } catch (const ddp::Error& e) {
          const std::string message = e.what();
          // Every rank names the first parameter that differs, as rank 0 and rank 1 have it.
          if (message.find("rank 0 has parameter 'fc1.weight' [32, 20] Float on cpu but rank 1 "
                           "has parameter 'fc1.weight' [33, 20] Float on cpu") ==
              std::string::npos) {
            throw std::runtime_error("message does not name the parameter and ranks: " + message);
          }
          return;
        }
        throw std::runtime_error("construction should have failed");
      },
      60s);
  EXPECT_ALL_RANKS_OK(results);
}

struct WithBatchNormImpl : torch::nn::Module {
  WithBatchNormImpl() {
    fc = register_module("fc", torch::nn::Linear(20, 8));
    bn = register_module("bn", torch::nn::BatchNorm1d(8));
  }
  torch::Tensor forward(torch::Tensor x) { return bn(fc(x)); }
  torch::nn::Linear fc{nullptr};
  torch::nn::BatchNorm1d bn{nullptr};
};
TORCH_MODULE(WithBatchNorm);

TEST(DistributedDataParallel, BuffersComeFromRankZero) {
  const int port = test::free_port();
  const auto results = run_ranks(2, [&](int rank) {
    auto pg = join_group(rank, 2, port);
    WithBatchNorm net;
    torch::NoGradGuard no_grad;
    net->bn->running_mean.fill_(static_cast<float>(rank + 1));
    DistributedDataParallel model(net.ptr(), pg);
    if (!torch::equal(net->bn->running_mean, torch::full({8}, 1.0f))) {
      throw std::runtime_error("construction did not broadcast rank 0's buffers");
    }
    // Diverge, then a training forward must start from rank 0's buffers again: with the same
    // input on both ranks the running statistics then agree exactly.
    net->bn->running_var.fill_(static_cast<float>(rank + 3));
    torch::manual_seed(3);
    model->forward(torch::randn({6, 20}));
    expect_identical_across_ranks(*pg, model->buffers(), "buffers after forward");
  });
  EXPECT_ALL_RANKS_OK(results);
}

// broadcast_buffers = false: each rank keeps its own running statistics (its batches differ),
// while the parameters stay identical; with the default every training forward starts from rank
// 0's buffers.
TEST(DistributedDataParallel, BroadcastBuffersFalseKeepsEachRanksBuffers) {
  const int port = test::free_port();
  const auto results = run_ranks(2, [&](int rank) {
    auto pg = join_group(rank, 2, port);
    for (const bool broadcast : {true, false}) {
      torch::manual_seed(7);
      WithBatchNorm net;
      DistributedDataParallel model(net.ptr(), pg, {.broadcast_buffers = broadcast});
      auto opt = make_sgd(model->parameters());
      const auto data = make_batches(3, 16, {20});
      for (int step = 0; step < 3; ++step) {
        opt.zero_grad();
        auto x = data.inputs[step].narrow(0, rank * 8, 8);
        model->forward(x).pow(2).mean().backward();
        opt.step();
      }
      expect_identical_across_ranks(*pg, model->parameters(), "parameters");
      // One more training forward on the same input on both ranks: it starts from rank 0's
      // buffers when they are broadcast, so the statistics then agree; else from each rank's own.
      model->forward(data.inputs[0].narrow(0, 0, 8));
      // Both ranks' running means, side by side (expect_identical_across_ranks would throw).
      auto gathered = torch::empty({2, net->bn->running_mean.numel()});
      pg->allgather(net->bn->running_mean.data_ptr(), gathered.data_ptr(),
                    static_cast<std::size_t>(net->bn->running_mean.numel()), DType::kFloat32)
          ->wait();
      const bool same = torch::equal(gathered[0], gathered[1]);
      if (broadcast && !same)
        throw std::runtime_error("broadcast_buffers: the ranks' buffers differ");
      if (!broadcast && same) {
        throw std::runtime_error("broadcast_buffers = false: the ranks' buffers were made equal");
      }
      if (model->logging_data().broadcast_buffers != broadcast) {
        throw std::runtime_error("logging_data().broadcast_buffers is wrong");
      }
    }
  });
  EXPECT_ALL_RANKS_OK(results);
}

// Parameters and buffers to ignore (PyTorch's _set_params_and_buffers_to_ignore_for_model):
// neither broadcast at construction nor reduced; the rest as usual. Each rank starts from its own
// seed, so what was not synchronised shows.
TEST(DistributedDataParallel, IgnoredParametersAndBuffersStayEachRanksOwn) {
  const int port = test::free_port();
  const auto results = run_ranks(2, [&](int rank) {
    auto pg = join_group(rank, 2, port);
    torch::manual_seed(100 + rank);
    WithBatchNorm net;
    {
      torch::NoGradGuard no_grad;
      net->bn->running_mean.fill_(static_cast<double>(rank));
    }
    const auto own_bias = net->fc->bias.detach().clone();
    DistributedDataParallel model(
        net.ptr(), pg,
        {.broadcast_buffers = false, .parameters_to_ignore = {"fc.bias", "bn.running_mean"}});
    const auto gathered_of = [&](const torch::Tensor& t) {
      auto gathered = torch::empty({2, t.numel()});
      auto mine = t.detach().reshape({-1}).contiguous();
      pg->allgather(mine.data_ptr(), gathered.data_ptr(), static_cast<std::size_t>(mine.numel()),
                    DType::kFloat32)
          ->wait();
      return gathered;
    };
    if (!torch::equal(net->fc->bias.detach(), own_bias))
      throw std::runtime_error("an ignored parameter was broadcast at construction");
    if (net->bn->running_mean[0].item<double>() != rank)
      throw std::runtime_error("an ignored buffer was broadcast at construction");
    expect_identical_across_ranks(*pg, {net->fc->weight, net->bn->weight}, "synchronised params");
    const auto data = make_batches(1, 16, {20});
    model->forward(data.inputs[0].narrow(0, rank * 8, 8)).pow(2).mean().backward();
    // The weight's gradient is averaged; the ignored bias's is this rank's own.
    expect_identical_across_ranks(*pg, {net->fc->weight.grad()}, "fc.weight's gradient");
    const auto bias_grads = gathered_of(net->fc->bias.grad());
    if (torch::equal(bias_grads[0], bias_grads[1]))
      throw std::runtime_error("the ignored fc.bias's gradient was averaged");
    std::size_t reduced = 0;
    for (const auto& bucket : model->reducer().bucket_assignment())
      reduced += bucket.size();
    if (reduced != 3) {
      throw std::runtime_error(fmt::format("the reducer holds {} parameters, not 3", reduced));
    }
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(DistributedDataParallel, IgnoringANameTheModuleDoesNotHaveIsAConfigErrorNamingIt) {
  const auto results = run_ranks(1, [](int) {
    const auto pg = join_group(0, 1, test::free_port());
    WithBatchNorm net;
    try {
      DistributedDataParallel model(net.ptr(), pg, {.parameters_to_ignore = {"fc.bais"}});
    } catch (const ConfigError& e) {
      const std::string message = e.what();
      if (message.find("'fc.bais'") == std::string::npos ||
          message.find("fc.bias") == std::string::npos) {
        throw std::runtime_error("unhelpful message: " + message);
      }
      return;
    }
    throw std::runtime_error("no ConfigError for an unknown name to ignore");
  });
  EXPECT_ALL_RANKS_OK(results);
}

// Bucket caps that are not a number of MiB a bucket can have: named, not turned into 0 bytes (an
// undefined conversion of 1e300 gave "bucket caps must be positive") or a cap of 2^64.
TEST(DistributedDataParallel, BucketCapsThatAreNotASizeAreConfigErrorsNamingTheOption) {
  const auto results = run_ranks(1, [](int) {
    const auto pg = join_group(0, 1, test::free_port());
    WithBatchNorm net;
    for (const double mb : {1e300, -1.0, 0.0, std::nan(""), 2e6}) {
      try {
        DistributedDataParallel model(net.ptr(), pg, {.bucket_cap_mb = mb});
        throw std::runtime_error(fmt::format("bucket_cap_mb = {} was accepted", mb));
      } catch (const ConfigError& e) {
        if (std::string(e.what()).find("DdpOptions::bucket_cap_mb") == std::string::npos) {
          throw std::runtime_error("unhelpful message: " + std::string(e.what()));
        }
      }
    }
  });
  EXPECT_ALL_RANKS_OK(results);
}

// Big enough that backward takes a while, in several buckets.
struct DeepImpl : torch::nn::Module {
  DeepImpl() {
    for (int i = 0; i < 6; ++i) {
      layers.push_back(register_module("fc" + std::to_string(i), torch::nn::Linear(256, 256)));
    }
  }
  torch::Tensor forward(torch::Tensor x) {
    for (auto& layer : layers)
      x = torch::relu(layer(x));
    return x;
  }
  std::vector<torch::nn::Linear> layers;
};
TORCH_MODULE(Deep);

TEST(DistributedDataParallel, BucketReductionsStartBeforeBackwardEnds) {
  const int port = test::free_port();
  const auto results = run_ranks(2, [&](int rank) {
    auto pg = join_group(rank, 2, port);
    Deep net;
    DistributedDataParallel model(net.ptr(), pg,
                                  {.bucket_cap_mb = 0.3, .first_bucket_cap_mb = 0.3});
    const auto buckets = model->reducer().bucket_assignment();
    if (buckets.size() < 3) throw std::runtime_error("expected several buckets");
    // The first bucket holds the last layer's parameters (reverse order).
    if (buckets.front().front() != net->parameters().size() - 1) {
      throw std::runtime_error("first bucket is not the last parameter");
    }
    for (int step = 0; step < 3; ++step) {
      model->forward(torch::randn({512, 256})).square().mean().backward();
      const auto timeline = model->reducer().last_timeline();
      if (timeline.bucket_launched.size() != buckets.size()) {
        throw std::runtime_error("timeline has the wrong number of buckets");
      }
      if (!(timeline.bucket_launched.front() < timeline.backward_finished)) {
        throw std::runtime_error("the first bucket's allreduce did not start during backward");
      }
      for (std::size_t b = 1; b < buckets.size(); ++b) {
        if (timeline.bucket_launched[b] < timeline.bucket_launched[b - 1]) {
          throw std::runtime_error("buckets launched out of order");
        }
      }
    }
    if (!model->reducer().buckets_rebuilt()) throw std::runtime_error("buckets not rebuilt");
  });
  EXPECT_ALL_RANKS_OK(results);
}

// With the default hook and gradient_as_bucket_view off, every bucket's gradients are averaged
// where they lie (no copy through the bucket) over both transports; a registered hook, even the
// default allreduce_hook(), takes the bucket path. The equivalence tests check the values.
// Forwards every call to `inner` and records which buffers allreduce was given and how often
// allreduce_segments was called, to see the Reducer's gradient path.
class RecordingGroup final : public test::ForwardingGroup {
 public:
  using ForwardingGroup::allreduce;
  using ForwardingGroup::ForwardingGroup;
  std::shared_ptr<Work> allreduce(const void* s, void* r, std::size_t n, DType d, ReduceOp op,
                                  CallOptions o) override {
    allreduce_buffers.push_back(r);
    return ForwardingGroup::allreduce(s, r, n, d, op, o);
  }
  std::shared_ptr<Work> allreduce_segments(std::vector<BufferSegment> segments, DType d,
                                           ReduceOp op, CallOptions o) override {
    ++segment_calls;
    return ForwardingGroup::allreduce_segments(std::move(segments), d, op, o);
  }

  std::vector<void*> allreduce_buffers;
  int segment_calls = 0;
};

// The default hook's path: over shared memory the gradients are averaged where they lie (one
// allreduce_segments per bucket); over TCP, where the engine would pack the pieces into a fresh
// buffer on every pass, they go through the bucket's own flat buffer, the same buffers every pass.
// A registered hook always gets the bucket.
TEST(DistributedDataParallel, GradientsAreAveragedInPlaceOnSharedMemoryElseThroughTheBucket) {
  for (const char* transport : {"auto", "tcp"}) {
    for (const bool with_hook : {false, true}) {
      const int port = test::free_port();
      const auto results = run_ranks(2, [&](int rank) {
        ::setenv("DDP_TRANSPORT", transport, 1);
        auto recording = std::make_shared<RecordingGroup>(join_group(rank, 2, port));
        std::shared_ptr<ProcessGroup> pg = recording;
        const bool shm = std::string_view(transport) == "auto";
        if (pg->allreduce_segments_in_place() != shm) {
          throw std::runtime_error(fmt::format("transport {}: allreduce_segments_in_place() is {}",
                                               transport, pg->allreduce_segments_in_place()));
        }
        Mlp net;
        DistributedDataParallel model(net.ptr(), pg,
                                      {.bucket_cap_mb = 0.001, .first_bucket_cap_mb = 0.001});
        if (with_hook) model->register_comm_hook(allreduce_hook());
        const bool expect_in_place = shm && !with_hook;
        torch::manual_seed(rank);
        std::vector<void*> first_pass_buffers;
        for (int step = 0; step < 3; ++step) {
          model->zero_grad();
          recording->allreduce_buffers.clear();
          recording->segment_calls = 0;
          model->forward(torch::randn({8, 20})).square().mean().backward();
          const auto in_place = model->reducer().last_timeline().bucket_in_place;
          if (in_place.size() < 2) throw std::runtime_error("expected several buckets");
          for (std::size_t b = 0; b < in_place.size(); ++b) {
            if (in_place[b] != expect_in_place) {
              throw std::runtime_error(
                  fmt::format("transport {}, {}: bucket {} {} reduced in place at step {}",
                              transport, with_hook ? "hook registered" : "default hook", b,
                              in_place[b] ? "was" : "was not", step));
            }
          }
          const int expected_segment_calls =
              expect_in_place ? static_cast<int>(in_place.size()) : 0;
          if (recording->segment_calls != expected_segment_calls) {
            throw std::runtime_error(
                fmt::format("transport {}: {} allreduce_segments calls at step {}, expected {}",
                            transport, recording->segment_calls, step, expected_segment_calls));
          }
          if (!expect_in_place) {
            // One allreduce per bucket, of the bucket's own buffer: the same ones every pass
            // (step 0 is before the buckets are rebuilt in the order gradients arrived).
            if (recording->allreduce_buffers.size() != in_place.size()) {
              throw std::runtime_error(fmt::format("{} allreduces for {} buckets at step {}",
                                                   recording->allreduce_buffers.size(),
                                                   in_place.size(), step));
            }
            if (step == 1) first_pass_buffers = recording->allreduce_buffers;
            if (step == 2 && recording->allreduce_buffers != first_pass_buffers) {
              throw std::runtime_error(fmt::format(
                  "transport {}: step 2 reduced other buffers than step 1 (a buffer per pass?)",
                  transport));
            }
          }
          expect_identical_across_ranks(
              *pg,
              [&] {
                std::vector<torch::Tensor> grads;
                for (const auto& p : model->parameters())
                  grads.push_back(p.grad());
                return grads;
              }(),
              fmt::format("gradients after step {}", step));
        }
      });
      SCOPED_TRACE(fmt::format("transport {}, {}", transport, with_hook ? "hook" : "default"));
      EXPECT_ALL_RANKS_OK(results);
    }
  }
}

// One Linear applied twice, and a second module registering the first one's weight again.
struct TiedImpl : torch::nn::Module {
  TiedImpl() {
    a = register_module("a", torch::nn::Linear(20, 20));
    b = register_module("b", torch::nn::Linear(20, 4));
    head = register_module("head", std::make_shared<torch::nn::Module>());
    head->register_parameter("tied_weight", b->weight);
  }
  torch::Tensor forward(torch::Tensor x) {
    auto h = torch::relu(a(torch::relu(a(x))));
    return b(h) +
           torch::nn::functional::linear(h.square(), head->named_parameters()["tied_weight"]);
  }
  torch::nn::Linear a{nullptr}, b{nullptr};
  std::shared_ptr<torch::nn::Module> head;
};
TORCH_MODULE(Tied);

TEST(DistributedDataParallel, SharedAndReusedParametersEqualOneProcess) {
  check_equivalence<Tied>(2, 8, {20}, {});
}

TEST(DistributedDataParallel, NoProcessGroupIsAConfigError) {
  const auto results = run_ranks(1, [](int) {
    Mlp net;
    try {
      DistributedDataParallel model(net.ptr());
    } catch (const ConfigError& e) {
      if (std::string(e.what()).find("init_process_group") == std::string::npos) throw;
      return;
    }
    throw std::runtime_error("construction without a group should fail");
  });
  EXPECT_ALL_RANKS_OK(results);
}

}  // namespace DDP_UNITY_ID
}  // namespace
}  // namespace ddp
