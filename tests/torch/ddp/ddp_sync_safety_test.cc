// Ranks never drift apart silently: loads and replaced parameters after wrapping, forwards that
// bypass the wrapper, the divergence check, errors that name the DDP phase, buffers in
// evaluation. Every test forks real rank processes.
#include <cstdlib>
#include <filesystem>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "ddp/error.h"
#include "ddp/torch/checkpoint/checkpoint.h"
#include "ddp/torch/ddp/distributed_data_parallel.h"
#include "support/multiprocess.h"
#include "support/temp_dir.h"
#include "support/torch/ddp_test_models.h"
#include "support/torch/ddp_test_util.h"
#include "support/unity_namespace.h"

namespace ddp {
namespace {
namespace DDP_UNITY_ID {

using namespace std::chrono_literals;
using test::expect_close;
using test::expect_identical_across_ranks;
using test::join_group;
using test::make_batches;
using test::make_sgd;
using test::Mlp;
using test::run_ranks;

// An Mlp with a BatchNorm, so the model has buffers.
struct NormedImpl : torch::nn::Module {
  NormedImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(20, 16));
    norm = register_module("norm", torch::nn::BatchNorm1d(16));
    fc2 = register_module("fc2", torch::nn::Linear(16, 4));
  }
  torch::Tensor forward(torch::Tensor x) { return fc2(torch::relu(norm(fc1(x)))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::nn::BatchNorm1d norm{nullptr};
};
TORCH_MODULE(Normed);

// Replaces a registered parameter the way a module can from the inside (libtorch's
// register_parameter refuses an existing name): the slot in the module's parameter dictionary.
struct ParameterSlot : torch::nn::Module {
  static torch::Tensor& of(torch::nn::Module& module, const std::string& name) {
    auto slots = &ParameterSlot::parameters_;
    return (module.*slots)[name];
  }
};

void replace_parameter(torch::nn::Module& module, torch::Tensor& member, const std::string& name,
                       torch::Tensor fresh) {
  ParameterSlot::of(module, name) = fresh;
  member = fresh;
}

template <typename Model>
void train_step(Model& model, torch::optim::Optimizer& opt, const test::Batches& data, int step,
                int rank, int batch) {
  opt.zero_grad();
  auto x = data.inputs[step].narrow(0, rank * batch, batch);
  auto y = data.targets[step].narrow(0, rank * batch, batch);
  torch::nn::functional::cross_entropy(model->forward(x), y).backward();
  opt.step();
}

void expect_error_containing(const std::function<void()>& body,
                             const std::vector<std::string>& parts) {
  try {
    body();
  } catch (const Error& e) {
    for (const auto& part : parts) {
      if (std::string(e.what()).find(part) == std::string::npos) {
        throw std::runtime_error(fmt::format("error lacks '{}': {}", part, e.what()));
      }
    }
    return;
  }
  throw std::runtime_error("no error was thrown");
}

enum class Reload { kTorchLoad, kModuleLoad, kDdpLoadCheckpoint, kReplacedTensor };

// Every rank wraps, then reloads (the way under test), then trains on its own data: the ranks
// stay bit-identical only if gradients are still averaged, and match one process.
void check_reload_keeps_ranks_in_sync(Reload how) {
  const int port = test::free_port();
  const int world = 2, batch = 8, steps = 3;
  test::TempDir dir;
  const auto file = dir.path() / "model.pt";
  const auto results = run_ranks(world, [&](int rank) {
    auto pg = join_group(rank, world, port);
    torch::manual_seed(5);
    Mlp net;
    DistributedDataParallel model(net.ptr(), pg);
    auto opt = std::make_unique<torch::optim::SGD>(make_sgd(model->parameters()));
    if (rank == 0) {
      torch::manual_seed(6);
      Mlp saved;
      if (how == Reload::kDdpLoadCheckpoint) {
        auto saved_opt = make_sgd(saved->parameters());
        save_checkpoint(file, *saved, saved_opt, {.epoch = 1});
      } else {
        torch::save(saved, file.string());
      }
    }
    pg->barrier()->wait();
    switch (how) {
      case Reload::kTorchLoad:
        torch::load(net, file.string());
        break;
      case Reload::kModuleLoad: {
        torch::serialize::InputArchive archive;
        archive.load_from(file.string());
        net->load(archive);
        break;
      }
      case Reload::kDdpLoadCheckpoint:
        load_checkpoint(file, *net, *opt);
        break;
      case Reload::kReplacedTensor: {
        torch::NoGradGuard no_grad;
        auto fresh = net->fc2->weight.detach().clone().mul_(0.5).requires_grad_(true);
        replace_parameter(*net->fc2, net->fc2->weight, "weight", fresh);
        break;
      }
    }
    // The optimizer must hold the current tensors too (a replaced one is new to it).
    opt = std::make_unique<torch::optim::SGD>(make_sgd(model->parameters()));
    const auto data = make_batches(steps, world * batch, {20});
    const auto start = [&] {
      std::vector<torch::Tensor> copy;
      for (const auto& p : net->parameters())
        copy.push_back(p.detach().clone());
      return copy;
    }();
    for (int step = 0; step < steps; ++step) {
      train_step(model, *opt, data, step, rank, batch);
      expect_identical_across_ranks(*pg, model->parameters(),
                                    fmt::format("parameters after step {}", step));
    }
    if (rank != 0) return;
    // One process on the combined batches from the same start.
    Mlp reference;
    {
      torch::NoGradGuard no_grad;
      for (std::size_t i = 0; i < start.size(); ++i)
        reference->parameters()[i].copy_(start[i]);
    }
    auto ref_opt = make_sgd(reference->parameters());
    for (int step = 0; step < steps; ++step) {
      ref_opt.zero_grad();
      torch::nn::functional::cross_entropy(reference->forward(data.inputs[step]),
                                           data.targets[step])
          .backward();
      ref_opt.step();
    }
    for (std::size_t i = 0; i < start.size(); ++i) {
      expect_close(net->parameters()[i], reference->parameters()[i],
                   fmt::format("parameter {}", i));
    }
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(DdpSyncSafety, TorchLoadAfterWrappingKeepsRanksInSync) {
  check_reload_keeps_ranks_in_sync(Reload::kTorchLoad);
}

TEST(DdpSyncSafety, ModuleLoadAfterWrappingKeepsRanksInSync) {
  check_reload_keeps_ranks_in_sync(Reload::kModuleLoad);
}

TEST(DdpSyncSafety, LoadCheckpointAfterWrappingKeepsRanksInSync) {
  check_reload_keeps_ranks_in_sync(Reload::kDdpLoadCheckpoint);
}

TEST(DdpSyncSafety, ReplacedParameterTensorIsReattached) {
  check_reload_keeps_ranks_in_sync(Reload::kReplacedTensor);
}

TEST(DdpSyncSafety, TorchLoadIsNoticedAndReattached) {
  // The check that runs before every forward finds the parameters whose accumulator the load
  // replaced (or none, if this libtorch keeps them): either way a second check finds nothing.
  const int port = test::free_port();
  test::TempDir dir;
  const auto results = run_ranks(1, [&](int rank) {
    auto pg = join_group(rank, 1, port);
    Mlp net;
    DistributedDataParallel model(net.ptr(), pg);
    torch::save(net, (dir.path() / "m.pt").string());
    torch::load(net, (dir.path() / "m.pt").string());
    std::fprintf(stderr, "torch::load: %zu parameter(s) re-attached\n", model->check_parameters());
    if (model->check_parameters() != 0) throw std::runtime_error("re-attached twice");
    // A replaced tensor is re-attached exactly once.
    auto fresh = net->fc1->bias.detach().clone().requires_grad_(true);
    replace_parameter(*net->fc1, net->fc1->bias, "bias", fresh);
    if (model->check_parameters() != 1) throw std::runtime_error("replaced bias not re-attached");
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(DdpSyncSafety, ChangedShapeDtypeOrParameterSetIsANamedError) {
  const int port = test::free_port();
  const auto results = run_ranks(1, [&](int rank) {
    auto pg = join_group(rank, 1, port);
    {
      Mlp net;
      DistributedDataParallel model(net.ptr(), pg);
      {
        torch::NoGradGuard no_grad;
        net->fc2->weight.set_data(torch::randn({7, 32}));
      }
      expect_error_containing(
          [&] {
            model->forward(torch::randn({2, 20}));
          },
          {"fc2.weight", "[7, 32]", "[16, 32]", "DistributedDataParallel"});
    }
    {
      Mlp net;
      DistributedDataParallel model(net.ptr(), pg);
      {
        torch::NoGradGuard no_grad;
        net->fc1->bias.set_data(net->fc1->bias.to(torch::kFloat64));
      }
      expect_error_containing(
          [&] {
            model->forward(torch::randn({2, 20}));
          },
          {"fc1.bias", "Double"});
    }
    {
      Mlp net;
      DistributedDataParallel model(net.ptr(), pg);
      net->fc3->bias.requires_grad_(false);
      expect_error_containing(
          [&] {
            model->forward(torch::randn({2, 20}));
          },
          {"trainable parameters changed", "fc3.bias"});
    }
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(DdpSyncSafety, ForwardThatBypassesTheWrapperIsNamed) {
  const int port = test::free_port();
  const int world = 2, batch = 4;
  const auto results = run_ranks(world, [&](int rank) {
    auto pg = join_group(rank, world, port);
    Mlp net;
    DistributedDataParallel model(net.ptr(), pg, {.find_unused_parameters = true});
    auto opt = make_sgd(model->parameters());
    const auto data = make_batches(2, world * batch, {20});
    auto x = data.inputs[0].narrow(0, rank * batch, batch);
    auto y = data.targets[0].narrow(0, rank * batch, batch);
    expect_error_containing(
        [&] { torch::nn::functional::cross_entropy(model->module()->forward(x), y).backward(); },
        {"did not go through the DistributedDataParallel wrapper", "model->forward(x)"});
    // The failed pass left nothing behind: a normal step synchronises.
    train_step(model, opt, data, 1, rank, batch);
    expect_identical_across_ranks(*pg, model->parameters(), "after a normal step");
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(DdpSyncSafety, DivergenceCheckNamesTheFirstDifferingParameterAndTheRanks) {
  const int port = test::free_port();
  const int world = 3, batch = 4;
  const auto results = run_ranks(world, [&](int rank) {
    auto pg = join_group(rank, world, port);
    Mlp net;
    DistributedDataParallel model(net.ptr(), pg, {.divergence_check_every = 2});
    auto opt = make_sgd(model->parameters());
    const auto data = make_batches(4, world * batch, {20});
    train_step(model, opt, data, 0, rank, batch);  // forward 1: no check
    train_step(model, opt, data, 1, rank, batch);  // forward 2: checked, all equal
    if (rank == 2) {
      torch::NoGradGuard no_grad;
      net->fc2->bias[3] += 1e-6f;  // one element, by a hair
    }
    train_step(model, opt, data, 2, rank, batch);  // forward 3: no check
    expect_error_containing([&] { train_step(model, opt, data, 3, rank, batch); },
                            {"drifted apart", "'fc2.bias'", "rank(s) 2", "1 of 6"});
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(DdpSyncSafety, DivergenceCheckFromTheEnvironment) {
  const int port = test::free_port();
  const auto results = run_ranks(2, [&](int rank) {
    auto pg = join_group(rank, 2, port);
    ::setenv("DDP_DIVERGENCE_CHECK_EVERY", "1", 1);
    Mlp net;
    DistributedDataParallel model(net.ptr(), pg);
    if (model->options().divergence_check_every != 1) {
      throw std::runtime_error("DDP_DIVERGENCE_CHECK_EVERY was not read");
    }
    if (rank == 1) {
      torch::NoGradGuard no_grad;
      net->fc1->weight[0][0] += 1.0f;
    }
    expect_error_containing(
        [&] {
          model->forward(torch::randn({2, 20}));
        },
        {"'fc1.weight'", "rank(s) 1"});
    ::setenv("DDP_DIVERGENCE_CHECK_EVERY", "often", 1);
    Mlp other;
    expect_error_containing([&] { DistributedDataParallel bad(other.ptr(), pg); },
                            {"DDP_DIVERGENCE_CHECK_EVERY='often'"});
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(DdpSyncSafety, CommErrorsNameTheDdpPhase) {
  // Rank 1 leaves after construction; rank 0's next collective fails, and its message says which
  // part of DDP was waiting: the buffer broadcast for a model with buffers, the first gradient
  // bucket for one without (the divergence guard, which would run first, is off here).
  for (const bool with_buffers : {true, false}) {
    const int port = test::free_port();
    const auto results = run_ranks(2, [&](int rank) {
      auto pg = join_group(rank, 2, port, 20s);
      if (with_buffers) {
        Normed normed;
        DistributedDataParallel model(normed.ptr(), pg, {.divergence_check_every = 0});
        if (rank == 1) std::_Exit(0);
        expect_error_containing(
            [&] {
              model->forward(torch::randn({4, 20}));
            },
            {"DistributedDataParallel, buffer broadcast before forward"});
      } else {
        Mlp mlp;
        DistributedDataParallel model(mlp.ptr(), pg,
                                      {.first_bucket_cap_mb = 0.0001, .divergence_check_every = 0});
        if (rank == 1) std::_Exit(0);
        expect_error_containing(
            [&] {
              model->forward(torch::randn({4, 20})).sum().backward();
            },
            {"DistributedDataParallel, gradient bucket 1 of ", "(parameters fc3.bias"});
      }
    });
    SCOPED_TRACE(with_buffers ? "with buffers" : "without buffers");
    EXPECT_ALL_RANKS_OK(results);
  }
}

TEST(DdpSyncSafety, EvaluationOnRankZeroAloneNeverWaitsAndSyncBuffersAligns) {
  const int port = test::free_port();
  const int world = 2, batch = 8;
  const auto results = run_ranks(world, [&](int rank) {
    auto pg = join_group(rank, world, port, 10s);
    Normed net;
    DistributedDataParallel model(net.ptr(), pg);
    auto opt = make_sgd(model->parameters());
    const auto data = make_batches(3, world * batch, {20});
    for (int step = 0; step < 3; ++step)
      train_step(model, opt, data, step, rank, batch);
    if (rank == 0) {
      // Alone, in eval mode, with and without gradients: no collective, so no wait.
      model->eval();
      const auto started = std::chrono::steady_clock::now();
      {
        torch::NoGradGuard no_grad;
        model->forward(torch::randn({4, 20}));
      }
      model->forward(torch::randn({4, 20}));
      if (std::chrono::steady_clock::now() - started > 2s) {
        throw std::runtime_error("rank-0-only evaluation waited");
      }
      model->train();
    }
    // Each rank's BatchNorm statistics came from its own last batch, so they differ.
    auto mean = net->norm->running_mean.clone();
    auto high = mean.clone();
    auto low = mean.clone();
    allreduce_tensor(*pg, high, ReduceOp::kMax)->wait();
    allreduce_tensor(*pg, low, ReduceOp::kMin)->wait();
    if (torch::equal(high, low)) throw std::runtime_error("buffers already equal: test is void");
    model->sync_buffers();
    expect_identical_across_ranks(*pg, net->buffers(), "buffers after sync_buffers()");
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(DdpSyncSafety, LoadCheckpointCopiesInPlaceAndChangesNothingOnMismatch) {
  test::TempDir dir;
  const auto file = dir.path() / "ck.pt";
  torch::manual_seed(1);
  Mlp saved;
  auto saved_opt = make_sgd(saved->parameters());
  save_checkpoint(file, *saved, saved_opt, {.epoch = 3});

  Mlp net;
  auto opt = make_sgd(net->parameters());
  std::vector<const void*> storage;
  for (const auto& p : net->parameters())
    storage.push_back(p.data_ptr());
  EXPECT_EQ(load_checkpoint(file, *net, opt).epoch, 3);
  for (std::size_t i = 0; i < storage.size(); ++i) {
    EXPECT_EQ(net->parameters()[i].data_ptr(), storage[i]) << "parameter " << i << " moved";
    EXPECT_TRUE(torch::equal(net->parameters()[i], saved->parameters()[i])) << i;
  }

  Mlp wider(64);  // fc1 and fc2 differ in shape
  auto wider_opt = make_sgd(wider->parameters());
  std::vector<torch::Tensor> before;
  for (const auto& p : wider->parameters())
    before.push_back(p.detach().clone());
  try {
    load_checkpoint(file, *wider, wider_opt);
    ADD_FAILURE() << "a checkpoint of another shape loaded";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), ::testing::HasSubstr("fc1.weight"));
    EXPECT_THAT(e.what(), ::testing::HasSubstr(file.string()));
  }
  for (std::size_t i = 0; i < before.size(); ++i) {
    EXPECT_TRUE(torch::equal(wider->parameters()[i], before[i])) << "parameter " << i << " changed";
  }
}

// ---- the divergence guard, on by default --------------------------------------------------------

enum class OneRankLoad { kTorchLoad, kLoadCheckpoint, kReplacedTensor };

// Rank 0 alone loads another model's values after two steps: the next training forward fails on
// every rank, naming the first parameter that differs and rank 0 as the one that loaded.
void check_one_rank_load_is_caught_at_the_next_forward(OneRankLoad how) {
  const int port = test::free_port();
  const int world = 2, batch = 4;
  test::TempDir dir;
  const auto file = dir.path() / "other.pt";
  const auto results = run_ranks(world, [&](int rank) {
    ::unsetenv("DDP_DIVERGENCE_CHECK_EVERY");
    auto pg = join_group(rank, world, port);
    torch::manual_seed(5);
    Mlp net;
    DistributedDataParallel model(net.ptr(), pg);
    if (model->options().divergence_check_every != kDefaultDivergenceCheckEvery) {
      throw std::runtime_error("the divergence guard is not on by default");
    }
    auto opt = make_sgd(model->parameters());
    const auto data = make_batches(4, world * batch, {20});
    train_step(model, opt, data, 0, rank, batch);
    train_step(model, opt, data, 1, rank, batch);
    if (rank == 0) {
      torch::manual_seed(6);
      Mlp other;
      switch (how) {
        case OneRankLoad::kTorchLoad:
          torch::save(other, file.string());
          torch::load(net, file.string());
          break;
        case OneRankLoad::kLoadCheckpoint: {
          auto other_opt = make_sgd(other->parameters());
          save_checkpoint(file, *other, other_opt, {.epoch = 1});
          load_checkpoint(file, *net, opt);
          break;
        }
        case OneRankLoad::kReplacedTensor: {
          torch::NoGradGuard no_grad;
          auto fresh = net->fc1->weight.detach().clone().mul_(0.5).requires_grad_(true);
          replace_parameter(*net->fc1, net->fc1->weight, "weight", fresh);
          break;
        }
      }
    }
    expect_error_containing([&] { train_step(model, opt, data, 2, rank, batch); },
                            {"drifted apart", "rank(s) 0 loaded or replaced parameters",
                             "'fc1.weight' [32, 20] Float", "differs on rank(s) 1"});
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(DdpDivergenceGuard, TorchLoadOnOneRankIsCaughtAtTheNextForward) {
  check_one_rank_load_is_caught_at_the_next_forward(OneRankLoad::kTorchLoad);
}

TEST(DdpDivergenceGuard, LoadCheckpointOnOneRankIsCaughtAtTheNextForward) {
  check_one_rank_load_is_caught_at_the_next_forward(OneRankLoad::kLoadCheckpoint);
}

TEST(DdpDivergenceGuard, ReplacedTensorOnOneRankIsCaughtAtTheNextForward) {
  check_one_rank_load_is_caught_at_the_next_forward(OneRankLoad::kReplacedTensor);
}

TEST(DdpDivergenceGuard, AnInvisibleChangeIsCaughtAtTheDefaultInterval) {
  // copy_ into a parameter changes neither its storage nor ddp's load count: only the periodic
  // comparison sees it, at the first multiple of the interval.
  const int port = test::free_port();
  const int world = 2, batch = 2;
  const auto results = run_ranks(world, [&](int rank) {
    ::unsetenv("DDP_DIVERGENCE_CHECK_EVERY");
    auto pg = join_group(rank, world, port);
    Mlp net;
    DistributedDataParallel model(net.ptr(), pg);
    torch::optim::SGD opt(model->parameters(), 0.01);
    const auto data = make_batches(1, world * batch, {20});
    const auto every = kDefaultDivergenceCheckEvery;
    for (std::int64_t step = 1; step < every - 1; ++step)
      train_step(model, opt, data, 0, rank, batch);
    if (rank == 1) {
      torch::NoGradGuard no_grad;
      net->fc3->bias.copy_(net->fc3->bias + 1.0f);
    }
    train_step(model, opt, data, 0, rank, batch);  // forward every - 1: not compared
    expect_error_containing([&] { train_step(model, opt, data, 0, rank, batch); },
                            {fmt::format("divergence check after {} training forwards", every),
                             "'fc3.bias'", "rank(s) 1"});
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(DdpDivergenceGuard, EveryRankLoadingTheSameFileTrainsOn) {
  const int port = test::free_port();
  const int world = 2, batch = 4;
  test::TempDir dir;
  const auto file = dir.path() / "same.pt";
  const auto results = run_ranks(world, [&](int rank) {
    ::unsetenv("DDP_DIVERGENCE_CHECK_EVERY");
    auto pg = join_group(rank, world, port);
    Mlp net;
    DistributedDataParallel model(net.ptr(), pg);
    auto opt = make_sgd(model->parameters());
    const auto data = make_batches(3, world * batch, {20});
    train_step(model, opt, data, 0, rank, batch);
    if (rank == 0) save_checkpoint(file, *net, opt, {.epoch = 1});
    pg->barrier()->wait();
    load_checkpoint(file, *net, opt);
    train_step(model, opt, data, 1, rank, batch);
    train_step(model, opt, data, 2, rank, batch);
    expect_identical_across_ranks(*pg, model->parameters(), "after loading the same file");
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(DdpDivergenceGuard, TurnedOffByTheOptionOrTheEnvironmentItComparesNothing) {
  for (const bool by_environment : {false, true}) {
    const int port = test::free_port();
    const int world = 2, batch = 4;
    const auto results = run_ranks(world, [&](int rank) {
      if (by_environment) {
        ::setenv("DDP_DIVERGENCE_CHECK_EVERY", "0", 1);
      } else {
        ::unsetenv("DDP_DIVERGENCE_CHECK_EVERY");
      }
      auto pg = join_group(rank, world, port);
      Mlp net;
      DdpOptions options;
      if (!by_environment) options.divergence_check_every = 0;
      DistributedDataParallel model(net.ptr(), pg, options);
      if (model->options().divergence_check_every != 0) {
        throw std::runtime_error("the guard is still on");
      }
      const auto data = make_batches(3, world * batch, {20});
      if (rank == 0) {
        torch::NoGradGuard no_grad;
        auto fresh = net->fc1->weight.detach().clone().mul_(0.5).requires_grad_(true);
        replace_parameter(*net->fc1, net->fc1->weight, "weight", fresh);
      }
      auto opt = make_sgd(model->parameters());
      // Off means off: the ranks train apart, silently, as before the guard.
      for (int step = 0; step < 3; ++step)
        train_step(model, opt, data, step, rank, batch);
      auto high = net->fc1->weight.detach().clone();
      auto low = high.clone();
      allreduce_tensor(*pg, high, ReduceOp::kMax)->wait();
      allreduce_tensor(*pg, low, ReduceOp::kMin)->wait();
      if (torch::equal(high, low)) throw std::runtime_error("the ranks were realigned");
    });
    SCOPED_TRACE(by_environment ? "DDP_DIVERGENCE_CHECK_EVERY=0" : "divergence_check_every = 0");
    EXPECT_ALL_RANKS_OK(results);
  }
}

TEST(DdpDivergenceGuard, TrainingModeForwardWithoutGradientsOnOneRankCommunicatesNothing) {
  // An evaluation that forgot eval() but runs under NoGradGuard, on rank 0 alone, must not wait
  // for the other rank (the model has no buffers, so nothing else communicates).
  const int port = test::free_port();
  const int world = 2, batch = 4;
  const auto results = run_ranks(world, [&](int rank) {
    ::unsetenv("DDP_DIVERGENCE_CHECK_EVERY");
    auto pg = join_group(rank, world, port, 10s);
    Mlp net;
    DistributedDataParallel model(net.ptr(), pg);
    auto opt = make_sgd(model->parameters());
    const auto data = make_batches(2, world * batch, {20});
    train_step(model, opt, data, 0, rank, batch);
    if (rank == 0) {
      const auto started = std::chrono::steady_clock::now();
      torch::NoGradGuard no_grad;
      for (int i = 0; i < 3; ++i)
        model->forward(torch::randn({4, 20}));
      if (std::chrono::steady_clock::now() - started > 2s) {
        throw std::runtime_error("a no-grad training-mode forward waited for the other rank");
      }
    }
    train_step(model, opt, data, 1, rank, batch);
    expect_identical_across_ranks(*pg, model->parameters(), "after the extra forwards");
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(DdpErrorsSayWhy, ConstructionNamesTheFirstDifferingParameterOnEveryRank) {
  const int port = test::free_port();
  const int world = 3;
  const auto results = run_ranks(world, [&](int rank) {
    auto pg = join_group(rank, world, port);
    Mlp net(rank == 2 ? 64 : 32);
    expect_error_containing(
        [&] { DistributedDataParallel model(net.ptr(), pg); },
        {"the model differs across ranks", "rank 0 has parameter 'fc1.weight' [32, 20] Float",
         "rank 2 has parameter 'fc1.weight' [64, 20] Float"});
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(DdpErrorsSayWhy, ConstructionWithAnotherParameterCountNamesTheFirstMissingOne) {
  const int port = test::free_port();
  const int world = 2;
  const auto results = run_ranks(world, [&](int rank) {
    auto pg = join_group(rank, world, port);
    Mlp net;
    if (rank == 1) net->fc3->bias.requires_grad_(false);
    expect_error_containing(
        [&] { DistributedDataParallel model(net.ptr(), pg); },
        {"rank 0 has parameter 'fc3.bias' [4] Float", "rank 1 has 5 trainable parameters"});
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(DdpErrorsSayWhy, ACollectiveMismatchInsideDdpNamesTheLikelyCauses) {
  // Rank 1 runs a collective of its own where rank 0's DDP runs its training forward: rank 0's
  // error names the phase and the usual causes.
  const int port = test::free_port();
  const int world = 2, batch = 4;
  const auto results = run_ranks(world, [&](int rank) {
    ::unsetenv("DDP_DIVERGENCE_CHECK_EVERY");
    auto pg = join_group(rank, world, port, 10s);
    Mlp net;
    DistributedDataParallel model(net.ptr(), pg);
    auto opt = make_sgd(model->parameters());
    const auto data = make_batches(2, world * batch, {20});
    train_step(model, opt, data, 0, rank, batch);
    if (rank == 0) {
      expect_error_containing(
          [&] { train_step(model, opt, data, 1, rank, batch); },
          {"DistributedDataParallel, ", "ikely causes: ", "ddp::Join", "model->eval()"});
    } else {
      std::vector<double> values(1000, 1.0);
      try {
        pg->allreduce(values.data(), values.size(), DType::kFloat64, ReduceOp::kSum)->wait();
      } catch (const Error&) {
        // The mismatch (or timeout) as rank 1 sees it, outside DDP: no causes to add.
      }
    }
  });
  EXPECT_ALL_RANKS_OK(results);
}
}  // namespace DDP_UNITY_ID
}  // namespace
}  // namespace ddp
