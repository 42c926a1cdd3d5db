// ddp::FullyShardedDataParallel (ZeRO stages 2 and 3). Every test forks real ranks. The model is
// the one of zero_redundancy_optimizer_test.cc: 113 parameters in 3 linear layers (63, 40, 10:
// divisible by none of 2, 3, 4, so every unit is padded and the shards are uneven); the global
// batch of 12 samples is split evenly, so runs at different world sizes train the same model.
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "ddp/comm/comm_error.h"
#include "ddp/error.h"
#include "ddp/torch/api/join.h"
#include "ddp/torch/checkpoint/checkpoint.h"
#include "ddp/torch/ddp/distributed_data_parallel.h"
#include "ddp/torch/formats/state_dict.h"
#include "ddp/torch/fsdp/fully_sharded_data_parallel.h"
#include "support/multiprocess.h"
#include "support/temp_dir.h"
#include "support/torch/ddp_test_util.h"
#include "support/torch/deterministic_models.h"
#include "support/torch/refusing_allocator.h"
#include "support/unity_namespace.h"

namespace ddp {
namespace {
namespace DDP_UNITY_ID {

using namespace std::chrono_literals;
using test::join_group;
using test::run_ranks;
using ::testing::HasSubstr;

constexpr int kIn = test::kShardedIn, kGlobalBatch = test::kShardedGlobalBatch, kSteps = 20;

torch::nn::Sequential make_model(int variant = 0) {
  return test::sharded_suite_model(variant);
}

std::pair<torch::Tensor, torch::Tensor> make_batch(int rank, int world, int step) {
  return test::sharded_suite_batch(rank, world, step);
}

enum class Kind { kSgd, kAdam };

std::unique_ptr<torch::optim::Optimizer> make_optimizer(Kind kind,
                                                        std::vector<torch::Tensor> params) {
  if (kind == Kind::kSgd) {
    return std::make_unique<torch::optim::SGD>(std::move(params),
                                               torch::optim::SGDOptions(0.1).momentum(0.9));
  }
  return std::make_unique<torch::optim::Adam>(std::move(params), torch::optim::AdamOptions(0.01));
}

// `model` is a DistributedDataParallel or a FullyShardedDataParallel.
template <class Model>
void train_steps(Model& model, torch::optim::Optimizer& opt, int rank, int world, int from,
                 int to) {
  for (int step = from; step < to; ++step) {
    auto [x, y] = make_batch(rank, world, step);
    opt.zero_grad();
    torch::mse_loss(model->forward(x), y).backward();
    opt.step();
  }
}

// min_num_params 30 makes three units: [0, 1) 63 parameters, [1, 3) 40, [3, 5) 10.
FsdpOptions three_units(ShardingStrategy strategy) {
  return {.sharding_strategy = strategy, .min_num_params = 30};
}

// In each rank: DDP + the full optimizer, then each strategy + the optimizer over the shards, 20
// steps each from the same start. Throws unless every strategy's parameters (gathered with
// full_state_dict and loaded into an unwrapped model) equal DDP's to 1e-5.
void expect_every_strategy_equals_ddp(Kind kind, int world) {
  const int port = test::free_port();
  const auto results = run_ranks(world, [&](int rank) {
    auto pg = join_group(rank, world, port);
    auto net_ddp = make_model();
    DistributedDataParallel ddp(net_ddp, pg);
    auto full = make_optimizer(kind, ddp->parameters());
    train_steps(ddp, *full, rank, world, 0, kSteps);
    const auto [x_probe, y_probe] = make_batch(0, 1, 99);
    const auto want_output = net_ddp->forward(x_probe).detach();

    for (const auto strategy : {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp,
                                ShardingStrategy::kNoShard}) {
      const std::string name = to_string(strategy);
      FullyShardedDataParallel fsdp(make_model(), pg, three_units(strategy));
      if (fsdp->unit_count() != 3) throw std::runtime_error(name + ": expected 3 units");
      std::int64_t total = 0;
      for (std::size_t u = 0; u < fsdp->unit_count(); ++u) {
        const auto info = fsdp->unit_info(u);
        total += info.numel;
        const auto expected_shard =
            strategy == ShardingStrategy::kNoShard ? info.numel : (info.numel + world - 1) / world;
        if (info.shard_numel != expected_shard || fsdp->parameters()[u].numel() != expected_shard) {
          throw std::runtime_error(fmt::format("{}: unit {} shard of {} elements, expected {}",
                                               name, u, info.shard_numel, expected_shard));
        }
      }
      if (total != 113) throw std::runtime_error(name + ": the units lost parameters");

      auto opt = make_optimizer(kind, fsdp->parameters());
      train_steps(fsdp, *opt, rank, world, 0, kSteps);

      // FULL_SHARD gathers each unit before its forward and again before its backward, and
      // holds no full parameters between steps; SHARD_GRAD_OP gathers once per forward and
      // keeps them; NO_SHARD never gathers.
      const std::int64_t gathers = fsdp->all_gather_count();
      const std::int64_t held = fsdp->gathered_parameter_bytes();
      std::int64_t padded_bytes = 0;
      for (std::size_t u = 0; u < 3; ++u)
        padded_bytes += 4 * fsdp->unit_info(u).padded_numel;
      const auto [want_gathers, want_held] =
          strategy == ShardingStrategy::kFullShard     ? std::pair{6 * kSteps, std::int64_t{0}}
          : strategy == ShardingStrategy::kShardGradOp ? std::pair{3 * kSteps, padded_bytes}
                                                       : std::pair{0, std::int64_t{0}};
      if (gathers != want_gathers || held != want_held) {
        throw std::runtime_error(
            fmt::format("{}: {} all-gathers and {} bytes of full parameters held, expected {} "
                        "and {}",
                        name, gathers, held, want_gathers, want_held));
      }

      const auto state = fsdp->full_state_dict(0);
      if (rank != 0) {
        if (!state.is_empty()) throw std::runtime_error(name + ": state dict off rank 0");
        continue;
      }
      auto plain = make_model(0);
      torch::NoGradGuard no_grad;
      const auto want = net_ddp->named_parameters();
      auto mine = plain->named_parameters();
      if (state.size() != want.size()) throw std::runtime_error(name + ": state dict size");
      for (const auto& item : want) {
        const auto* got = state.find(item.key());
        if (got == nullptr) throw std::runtime_error(name + ": no entry " + item.key());
        test::expect_close(*got, item.value().detach(), name + " " + item.key(), 1e-5, 1e-6);
        mine[item.key()].copy_(*got);
      }
      test::expect_close(plain->forward(x_probe), want_output, name + " loaded model output", 1e-5,
                         1e-6);
    }
  });
  EXPECT_ALL_RANKS_OK(results);
}

// HYBRID_SHARD: sharded inside pairs of ranks {0,1}, {2,3}, replicated over {0,2}, {1,3} (as two
// hosts of two); and with the default groups (one host here: shard over all, replicas of one).
// Both train as DDP over every rank does, to 1e-5.
TEST(FullyShardedDataParallel, HybridShardEqualsDdpWithGivenAndDefaultGroups) {
  for (const int world : {4, 2}) {
    const int port = test::free_port();
    const auto results = run_ranks(world, [&](int rank) {
      auto pg = join_group(rank, world, port);
      auto net_ddp = make_model();
      DistributedDataParallel ddp(net_ddp, pg);
      auto full = make_optimizer(Kind::kSgd, ddp->parameters());
      train_steps(ddp, *full, rank, world, 0, kSteps);
      FsdpOptions options = three_units(ShardingStrategy::kHybridShard);
      int shard_size = world;
      if (world == 4) {
        options.shard_group = split_group({{0, 1}, {2, 3}}, pg);
        options.replicate_group = split_group({{0, 2}, {1, 3}}, pg);
        shard_size = 2;
      }
      FullyShardedDataParallel fsdp(make_model(), pg, options);
      for (std::size_t u = 0; u < fsdp->unit_count(); ++u) {
        const auto info = fsdp->unit_info(u);
        if (info.shard_numel != (info.numel + shard_size - 1) / shard_size) {
          throw std::runtime_error(
              fmt::format("unit {}: shard of {} elements of {}", u, info.shard_numel, info.numel));
        }
      }
      auto opt = make_optimizer(Kind::kSgd, fsdp->parameters());
      train_steps(fsdp, *opt, rank, world, 0, kSteps);
      if (fsdp->all_gather_count() != 6 * kSteps || fsdp->gathered_parameter_bytes() != 0) {
        throw std::runtime_error("HYBRID_SHARD does not gather and free as FULL_SHARD");
      }
      const auto state = fsdp->full_state_dict(0);
      if (rank == 0) {
        for (const auto& item : net_ddp->named_parameters()) {
          test::expect_close(state[item.key()], item.value().detach(),
                             fmt::format("world {} {}", world, item.key()), 1e-5, 1e-6);
        }
      }
      // Sharded checkpoints are not built for it; groups without the strategy, or one group alone,
      // are refused.
      test::expect_throws<ConfigError>([&] { fsdp->save_sharded_checkpoint("/nonexistent", *opt); },
                                       "not built", "a sharded checkpoint of HYBRID_SHARD");
      auto refused = [&](FsdpOptions bad, const std::string& words) {
        test::expect_throws<ConfigError>(
            [&] { FullyShardedDataParallel wrong(make_model(), pg, std::move(bad)); }, words,
            "bad HYBRID_SHARD groups");
      };
      FsdpOptions one_group = three_units(ShardingStrategy::kHybridShard);
      one_group.shard_group = pg;
      refused(one_group, "both shard_group and replicate_group, or neither");
      FsdpOptions not_hybrid = three_units(ShardingStrategy::kFullShard);
      not_hybrid.shard_group = pg;
      not_hybrid.replicate_group = pg;
      refused(not_hybrid, "are for kHybridShard");
      FsdpOptions too_many = three_units(ShardingStrategy::kHybridShard);
      too_many.shard_group = pg;
      too_many.replicate_group = pg;
      refused(too_many, fmt::format("is not the group's {} ranks", world));
    });
    EXPECT_ALL_RANKS_OK(results);
  }
}

// The full state of a sharded model crosses to Python's layout: full_state_dict gathered on rank
// 0, written by save_state_dict, read back into an unwrapped model with strict checks, equal to
// the gathered values bit for bit.
TEST(FullyShardedDataParallel, FullStateDictSavedInPythonsLayoutLoadsIntoTheUnwrappedModel) {
  test::TempDir dir;
  const int port = test::free_port();
  const auto results = run_ranks(2, [&](int rank) {
    auto pg = join_group(rank, 2, port);
    FullyShardedDataParallel fsdp(make_model(), pg, three_units(ShardingStrategy::kFullShard));
    auto opt = make_optimizer(Kind::kSgd, fsdp->parameters());
    train_steps(fsdp, *opt, rank, 2, 0, 3);
    const auto state = fsdp->full_state_dict(0);
    if (rank != 0) return;
    save_state_dict(state, dir.path() / "fsdp.pt");
    auto plain = make_model();
    {
      torch::NoGradGuard no_grad;
      for (auto& p : plain->parameters())
        p.zero_();
    }
    const auto report = load_state_dict(*plain, dir.path() / "fsdp.pt");
    if (!report.complete() || report.loaded.size() != state.size()) {
      throw std::runtime_error("the strict load did not load every entry");
    }
    for (const auto& item : plain->named_parameters()) {
      if (!torch::equal(item.value(), state[item.key()])) {
        throw std::runtime_error("loaded " + item.key() + " differs from the gathered state");
      }
    }
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(FullyShardedDataParallel, EveryStrategyWithSgdMomentumEqualsDdpWithTheFullOptimizer) {
  for (const int world : {2, 3, 4}) {
    SCOPED_TRACE(fmt::format("world {}", world));
    expect_every_strategy_equals_ddp(Kind::kSgd, world);
  }
}

TEST(FullyShardedDataParallel, EveryStrategyWithAdamEqualsDdpWithTheFullOptimizer) {
  for (const int world : {2, 3, 4}) {
    SCOPED_TRACE(fmt::format("world {}", world));
    expect_every_strategy_equals_ddp(Kind::kAdam, world);
  }
}

// Gradients accumulate into the shards over backward passes (no_sync-style accumulation), and a
// forward without gradients (evaluation) gathers and frees without touching them.
// Uneven inputs under ddp::Join at world 3: rank 2 has 2 batches, the others 5. Every strategy
// ends with DDP-under-Join's parameters (gradients averaged over 3 ranks, the joined one adding
// zeros; DDP copies the last joiner's model at the end, FSDP's joined rank steps its shards while
// it shadows), to 1e-5. Without set_join_optimizer the first forward is a ConfigError.
TEST(FullyShardedDataParallel, UnevenInputsUnderJoinEqualDdpUnderJoin) {
  const int world = 3;
  const int port = test::free_port();
  EXPECT_ALL_RANKS_OK(run_ranks(world, [&](int rank) {
    auto pg = join_group(rank, world, port);
    const int steps = rank == 2 ? 2 : 5;
    auto net_ddp = make_model();
    DistributedDataParallel ddp(net_ddp, pg);
    auto full = make_optimizer(Kind::kSgd, ddp->parameters());
    {
      Join join({*ddp});
      train_steps(ddp, *full, rank, world, 0, steps);
      join.finish();
    }
    for (const auto strategy : {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp,
                                ShardingStrategy::kNoShard}) {
      const std::string name = to_string(strategy);
      FullyShardedDataParallel fsdp(make_model(), pg, three_units(strategy));
      auto opt = make_optimizer(Kind::kSgd, fsdp->parameters());
      fsdp->set_join_optimizer(*opt);
      {
        Join join({*fsdp});
        train_steps(fsdp, *opt, rank, world, 0, steps);
        join.finish();
      }
      const auto state = fsdp->full_state_dict(0);
      if (rank != 0) continue;
      for (const auto& item : net_ddp->named_parameters()) {
        test::expect_close(state[item.key()], item.value().detach(),
                           name + " under Join: " + item.key(), 1e-5, 1e-6);
      }
    }
    FullyShardedDataParallel no_optimizer(make_model(), pg,
                                          three_units(ShardingStrategy::kFullShard));
    Join join({*no_optimizer});
    test::expect_throws<ConfigError>(
        [&] { no_optimizer->forward(make_batch(rank, world, 0).first); }, "set_join_optimizer",
        "Join without the optimizer");
  }));
}

TEST(FullyShardedDataParallel, GradientsAccumulateAndEvaluationLeavesNothingGathered) {
  const int port = test::free_port();
  const auto results = run_ranks(2, [&](int rank) {
    auto pg = join_group(rank, 2, port);
    FullyShardedDataParallel fsdp(make_model(), pg, three_units(ShardingStrategy::kFullShard));
    auto [x, y] = make_batch(rank, 2, 0);
    torch::mse_loss(fsdp->forward(x), y).backward();
    std::vector<torch::Tensor> once;
    for (const auto& p : fsdp->parameters())
      once.push_back(p.grad().clone());
    torch::mse_loss(fsdp->forward(x), y).backward();
    for (std::size_t u = 0; u < once.size(); ++u)
      test::expect_close(fsdp->parameters()[u].grad(), 2 * once[u], "accumulated gradient");
    {
      torch::NoGradGuard no_grad;
      fsdp->eval();
      const auto out = fsdp->forward(x);
      if (out.requires_grad() || out.size(1) != 2) throw std::runtime_error("eval output");
    }
    if (fsdp->gathered_parameter_bytes() != 0) throw std::runtime_error("left gathered");
  });
  EXPECT_ALL_RANKS_OK(results);
}

// The error of `call`, or "" when it returns.
std::string error_of(const std::function<void()>& call) {
  try {
    call();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

// A backward that fails inside autograd (a hook that throws at its end, after some units'
// gradients were reduced; an allocation refused midway) never finishes: the next forward drops
// what it left, a gradient it may have reached is never added to silently (the next backward is
// refused by name until the gradients are zeroed), and a step after zero_grad equals the same step
// of a wrapper that never failed (before the fix its first unit got no gradient at all). Gradients
// accumulated under no_sync() that the failure took are named once. Both sharded strategies, with
// and without low_memory_backward (whose sums go into the shards' gradients during backward).
TEST(FullyShardedDataParallel, ABackwardThatFailedIsDroppedAndNeverPartOfAStepSilently) {
  const int port = test::free_port();
  const auto results = run_ranks(2, [&](int rank) {
    auto pg = join_group(rank, 2, port, 10s);
    auto [x, y] = make_batch(rank, 2, 0);
    auto zero = [](FullyShardedDataParallel& model) {
      for (auto& p : model->parameters())
        p.mutable_grad() = torch::Tensor();
    };
    auto expect_error = [](const std::string& what, const std::string& error,
                           const std::string& expected) {
      if (error.find(expected) == std::string::npos) {
        throw std::runtime_error(fmt::format("{}: expected an error with '{}', got '{}'", what,
                                             expected, error.empty() ? "none" : error));
      }
    };
    for (const auto& [strategy, low_memory] : {std::pair{ShardingStrategy::kFullShard, false},
                                               {ShardingStrategy::kShardGradOp, false},
                                               {ShardingStrategy::kFullShard, true},
                                               {ShardingStrategy::kShardGradOp, true}}) {
      const std::string name =
          fmt::format("{}{}", to_string(strategy), low_memory ? " (low-memory backward)" : "");
      auto options = three_units(strategy);
      options.low_memory_backward = low_memory;
      FullyShardedDataParallel fsdp(make_model(), pg, options);
      FullyShardedDataParallel clean(make_model(), pg, options);
      auto failing_input = x.clone().requires_grad_(true);
      failing_input.register_hook(
          [](const torch::Tensor&) -> torch::Tensor { throw std::runtime_error("a hook failed"); });
      expect_error(name + ": a backward whose hook throws",
                   error_of([&] { torch::mse_loss(fsdp->forward(failing_input), y).backward(); }),
                   "a hook failed");
      expect_error(name + ": summon_full_params after the failed backward",
                   error_of([&] { fsdp->summon_full_params([] {}); }), "after one that failed");
      expect_error(name + ": the next backward without zero_grad",
                   error_of([&] { torch::mse_loss(fsdp->forward(x), y).backward(); }),
                   "has not changed since a backward failed");
      expect_error(name + ": a backward with large allocations refused", error_of([&] {
                     auto loss = torch::mse_loss(fsdp->forward(x), y);
                     test::RefusingLargeAllocations refusing(64);
                     loss.backward();
                   }),
                   "RefusingLargeAllocations");
      zero(fsdp);
      torch::mse_loss(fsdp->forward(x), y).backward();
      torch::mse_loss(clean->forward(x), y).backward();
      for (std::size_t i = 0; i < clean->parameters().size(); ++i) {
        const auto& got = fsdp->parameters()[i].grad();
        if (!got.defined() || !torch::equal(got, clean->parameters()[i].grad())) {
          throw std::runtime_error(fmt::format(
              "{}: shard {}'s gradient after the failures and zero_grad {} the clean step's", name,
              i, got.defined() ? "differs from" : "is missing, unlike"));
        }
      }
      if (fsdp->gathered_parameter_bytes() != clean->gathered_parameter_bytes())
        throw std::runtime_error(name + ": gathers other parameters than the clean wrapper");
      zero(fsdp);
      {
        auto guard = fsdp->no_sync();
        torch::mse_loss(fsdp->forward(x), y).backward();
        error_of([&] { torch::mse_loss(fsdp->forward(failing_input), y).backward(); });
      }
      expect_error(name + ": the forward after a failed no_sync backward",
                   error_of([&] { fsdp->forward(x); }), "accumulated under no_sync() went with it");
      zero(fsdp);
      torch::mse_loss(fsdp->forward(x), y).backward();
      for (std::size_t i = 0; i < clean->parameters().size(); ++i) {
        if (!torch::equal(fsdp->parameters()[i].grad(), clean->parameters()[i].grad()))
          throw std::runtime_error(fmt::format("{}: shard {} after the no_sync failure", name, i));
      }
    }
  });
  EXPECT_ALL_RANKS_OK(results);
}

// Every rank gets `expected` in its error.
void expect_error_on_every_rank(const std::vector<test::RankResult>& results,
                                const std::string& expected) {
  for (const auto& r : results) {
    EXPECT_EQ(r.exit_code, 1) << test::describe(results);
    EXPECT_THAT(r.error, HasSubstr(expected)) << "rank " << r.rank;
  }
}

// Runs `build(rank, pg)` on 3 ranks; every rank must throw an error (of `ErrorT`) with `expected`.
template <class ErrorT>
void expect_build_fails(const std::string& expected,
                        const std::function<void(int, std::shared_ptr<ProcessGroup>)>& build) {
  const int port = test::free_port();
  const auto results = run_ranks(3, [&](int rank) {
    auto pg = join_group(rank, 3, port, 10s);
    try {
      build(rank, pg);
    } catch (const ErrorT& e) {
      throw std::runtime_error(std::string("caught: ") + e.what());
    }
    throw std::runtime_error("built without an error");
  });
  expect_error_on_every_rank(results, "caught: ");
  expect_error_on_every_rank(results, expected);
}

TEST(FullyShardedDataParallel, ANullModuleAndRanksWrappingDifferentModulesAreNamedOnEveryRank) {
  expect_build_fails<ConfigError>("the module to wrap is null", [](int, auto pg) {
    FullyShardedDataParallel(std::shared_ptr<torch::nn::Module>(), pg);
  });
  // One rank alone wraps another module (one unit, where the others have three): every rank
  // learns it, and nobody waits.
  expect_build_fails<Error>("the ranks differ", [](int rank, auto pg) {
    std::shared_ptr<torch::nn::Module> module = make_model().ptr();
    if (rank == 1) module = torch::nn::Linear(3, 2).ptr();
    FullyShardedDataParallel(module, pg, three_units(ShardingStrategy::kFullShard));
  });
}

TEST(FullyShardedDataParallel, BadUnitBoundariesAreNamedOnEveryRank) {
  using Units = std::vector<std::pair<std::size_t, std::size_t>>;
  const std::vector<std::pair<Units, std::string>> cases = {
      {{{0, 2}, {2, 9}}, "unit 1 is children [2, 9), which is empty or out of range"},
      {{{0, 2}, {2, 2}, {2, 5}}, "unit 1 is children [2, 2), which is empty"},
      {{{2, 4}, {0, 2}, {4, 5}}, "unit 1 [0, 2) starts before the previous unit ends"},
      {{{0, 2}, {2, 4}}, "child 4 has 10 parameters but is in no unit"},
      {{{0, 1}, {1, 2}, {2, 5}}, "unit 1 (children [1, 2)) has no parameters"},
  };
  for (const auto& [units, expected] : cases) {
    SCOPED_TRACE(expected);
    expect_build_fails<ConfigError>(expected, [&units = units](int, auto pg) {
      FullyShardedDataParallel(make_model(), pg, FsdpOptions{.units = units});
    });
  }
  // Parameter-free children may stay between explicit units; they run unsharded.
  const int port = test::free_port();
  const auto results = run_ranks(2, [&](int rank) {
    auto pg = join_group(rank, 2, port);
    FullyShardedDataParallel fsdp(make_model(), pg, FsdpOptions{.units = {{0, 1}, {2, 3}, {4, 5}}});
    auto [x, y] = make_batch(rank, 2, 0);
    torch::mse_loss(fsdp->forward(x), y).backward();
    for (const auto& p : fsdp->parameters())
      if (!p.grad().defined()) throw std::runtime_error("a shard got no gradient");
  });
  EXPECT_ALL_RANKS_OK(results);
}

// FsdpCpuOffload (PyTorch's CPUOffload) on the CPU changes nothing, the shards being host memory
// already: FULL_SHARD and SHARD_GRAD_OP with it train to the same bits as without it, with the
// optimizer over the same CPU shards (gpu_test.cc runs it on CUDA, where it moves them). With
// NO_SHARD it is a ConfigError on every rank; ranks that disagree about it are named.
TEST(FullyShardedDataParallel, CpuOffloadOnTheCpuChangesNothingAndNoShardRefusesIt) {
  const int port = test::free_port();
  const auto results = run_ranks(2, [&](int rank) {
    auto pg = join_group(rank, 2, port);
    for (const auto strategy : {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp}) {
      std::vector<torch::OrderedDict<std::string, torch::Tensor>> states;
      for (const bool offload : {false, true}) {
        auto options = three_units(strategy);
        options.cpu_offload.offload_params = offload;
        FullyShardedDataParallel fsdp(make_model(), pg, options);
        for (const auto& p : fsdp->parameters())
          if (!p.is_cpu()) throw std::runtime_error("a shard is not on the CPU");
        auto opt = make_optimizer(Kind::kAdam, fsdp->parameters());
        train_steps(fsdp, *opt, rank, 2, 0, 5);
        states.push_back(fsdp->full_state_dict(0));
      }
      for (const auto& item : states[0]) {
        if (!torch::equal(item.value(), states[1][item.key()])) {
          throw std::runtime_error(fmt::format("{}: {} differs with cpu_offload on the CPU",
                                               to_string(strategy), item.key()));
        }
      }
    }
  });
  EXPECT_ALL_RANKS_OK(results);
  expect_build_fails<ConfigError>("cpu_offload.offload_params with NO_SHARD is not built",
                                  [](int, auto pg) {
                                    auto options = three_units(ShardingStrategy::kNoShard);
                                    options.cpu_offload.offload_params = true;
                                    FullyShardedDataParallel(make_model(), pg, options);
                                  });
  expect_build_fails<Error>("cpu offload of parameters", [](int rank, auto pg) {
    auto options = three_units(ShardingStrategy::kFullShard);
    options.cpu_offload.offload_params = rank == 1;
    FullyShardedDataParallel(make_model(), pg, options);
  });
}

// The flat buffers hold fp32 or fp64 on the CPU or a CUDA device (gpu_test.cc runs CUDA, and
// names parameters on two devices; fsdp_tensor_parallel_test.cc trains fp64): another dtype is
// named, with the parameter and child, on every rank.
TEST(FullyShardedDataParallel, ParametersOfAnotherDtypeAreNamedOnEveryRank) {
  expect_build_fails<ConfigError>(
      "parameter [9, 6] Half of child 0 is Half on cpu; it must be a dense fp32 or fp64 tensor on "
      "the CPU or a CUDA device",
      [](int, auto pg) {
        auto model = make_model();
        model->to(torch::kHalf);
        FullyShardedDataParallel(model, pg);
      });
}

TEST(FullyShardedDataParallel, ModelsThatDifferAcrossRanksAreNamedOnEveryRank) {
  expect_build_fails<Error>(
      "the ranks differ: rank 0 has   parameter [4, 9] Float but rank 2 has   parameter [5, 9] "
      "Float",
      [](int rank, auto pg) {
        FullyShardedDataParallel(make_model(rank == 2 ? 1 : 0), pg,
                                 FsdpOptions{.units = {{0, 2}, {2, 4}, {4, 5}}});
      });
  expect_build_fails<Error>(
      "rank 0 has strategy FULL_SHARD but rank 1 has strategy SHARD_GRAD_OP",
      [](int rank, auto pg) {
        FullyShardedDataParallel(
            make_model(), pg,
            three_units(rank == 1 ? ShardingStrategy::kShardGradOp : ShardingStrategy::kFullShard));
      });
}

// Trains steps [from, to) and returns each step's loss averaged over the ranks.
std::vector<double> losses_of(FullyShardedDataParallel& model, torch::optim::Optimizer& opt,
                              ProcessGroup& pg, int from, int to) {
  std::vector<double> losses;
  for (int step = from; step < to; ++step) {
    auto [x, y] = make_batch(pg.rank(), pg.size(), step);
    opt.zero_grad();
    auto loss = torch::mse_loss(model->forward(x), y);
    loss.backward();
    opt.step();
    losses.push_back(average_across_ranks(loss.item<double>(), pg));
  }
  return losses;
}

// Saved after 10 of 20 steps at world `saved`, loaded at world `loaded`: the last 10 losses and
// the final parameters equal an uninterrupted run's at world `loaded` (to 1e-5).
void expect_resume_at_another_world_size(int saved, int loaded, ShardingStrategy strategy) {
  test::TempDir dir;
  const auto path = dir.path() / "ckpt";
  const int port_save = test::free_port();
  EXPECT_ALL_RANKS_OK(run_ranks(saved, [&](int rank) {
    auto pg = join_group(rank, saved, port_save);
    FullyShardedDataParallel model(make_model(), pg, three_units(strategy));
    auto opt = make_optimizer(Kind::kAdam, model->parameters());
    losses_of(model, *opt, *pg, 0, kSteps / 2);
    model->save_sharded_checkpoint(path, *opt);
  }));
  const int port_load = test::free_port();
  EXPECT_ALL_RANKS_OK(run_ranks(loaded, [&](int rank) {
    auto pg = join_group(rank, loaded, port_load);
    FullyShardedDataParallel straight(make_model(), pg, three_units(strategy));
    auto straight_opt = make_optimizer(Kind::kAdam, straight->parameters());
    losses_of(straight, *straight_opt, *pg, 0, kSteps / 2);
    const auto want = losses_of(straight, *straight_opt, *pg, kSteps / 2, kSteps);

    FullyShardedDataParallel resumed(make_model(), pg, three_units(strategy));
    auto resumed_opt = make_optimizer(Kind::kAdam, resumed->parameters());
    resumed->load_sharded_checkpoint(path, *resumed_opt);
    const auto got = losses_of(resumed, *resumed_opt, *pg, kSteps / 2, kSteps);
    for (std::size_t i = 0; i < want.size(); ++i) {
      if (std::abs(got[i] - want[i]) > 1e-5 * std::max(1.0, std::abs(want[i]))) {
        throw std::runtime_error(fmt::format("step {}: loss {} after resuming, {} uninterrupted",
                                             kSteps / 2 + i, got[i], want[i]));
      }
    }
    const auto a = straight->full_state_dict(0);
    const auto b = resumed->full_state_dict(0);
    for (const auto& item : a)
      test::expect_close(b[item.key()], item.value(), "resumed " + item.key(), 1e-5, 1e-6);
  }));
}

TEST(FullyShardedDataParallel, ShardedCheckpointSavedAtFourResumesAtTwo) {
  expect_resume_at_another_world_size(4, 2, ShardingStrategy::kFullShard);
}

TEST(FullyShardedDataParallel, ShardedCheckpointSavedAtTwoResumesAtThree) {
  expect_resume_at_another_world_size(2, 3, ShardingStrategy::kShardGradOp);
}

// A FULL_SHARD checkpoint of the suite's model after 2 Adam steps at world 2, in `path`.
void save_two_steps_at_world_two(const std::filesystem::path& path) {
  const int port = test::free_port();
  EXPECT_ALL_RANKS_OK(run_ranks(2, [&](int rank) {
    auto pg = join_group(rank, 2, port);
    FullyShardedDataParallel model(make_model(), pg, three_units(ShardingStrategy::kFullShard));
    auto opt = make_optimizer(Kind::kAdam, model->parameters());
    losses_of(model, *opt, *pg, 0, 2);
    model->save_sharded_checkpoint(path, *opt);
  }));
}

TEST(FullyShardedDataParallel, ACheckpointThatDoesNotFitIsNamedOnEveryRank) {
  test::TempDir dir;
  const auto path = dir.path() / "ckpt";
  save_two_steps_at_world_two(path);
  const int port2 = test::free_port();
  const auto results = run_ranks(3, [&](int rank) {
    auto pg = join_group(rank, 3, port2, 10s);
    FullyShardedDataParallel other(make_model(1), pg, three_units(ShardingStrategy::kFullShard));
    auto opt = make_optimizer(Kind::kAdam, other->parameters());
    const auto before = other->parameters()[1].detach().clone();
    try {
      other->load_sharded_checkpoint(path, *opt);
    } catch (const Error& e) {
      if (!torch::equal(before, other->parameters()[1])) throw std::runtime_error("changed");
      throw;
    }
  });
  expect_error_on_every_rank(results,
                             "holds units of [63, 40, 10] parameters but this model's "
                             "units hold [63, 50, 12]");
  const int port3 = test::free_port();
  expect_error_on_every_rank(run_ranks(2,
                                       [&](int rank) {
                                         auto pg = join_group(rank, 2, port3, 10s);
                                         FullyShardedDataParallel model(
                                             make_model(), pg,
                                             three_units(ShardingStrategy::kFullShard));
                                         auto sgd = make_optimizer(Kind::kSgd, model->parameters());
                                         model->load_sharded_checkpoint(path, *sgd);
                                       }),
                             "holds Adam state but the optimizer is SGD");
}

// Files with valid checksums that save_sharded_checkpoint did not write: a shard file whose range
// runs past its unit, a manifest recording a world size of 0 (which would read no shard file and
// load zeros). Each is named on every rank, and nothing is loaded.
TEST(FullyShardedDataParallel, ACheckpointWhoseRecordsDoNotHoldIsNamedAndNothingIsLoaded) {
  test::TempDir dir;
  const auto saved = dir.path() / "saved";
  save_two_steps_at_world_two(saved);
  const auto copy_of_saved = [&](const std::string& name) {
    const auto to = dir.path() / name;
    std::filesystem::copy(saved, to, std::filesystem::copy_options::recursive);
    return to;
  };
  const auto long_range = copy_of_saved("long-range");
  {
    torch::serialize::OutputArchive archive;
    archive.write("unit_0_range", torch::tensor({std::int64_t{0}, std::int64_t{1000}}));
    save_archive_atomically(archive, long_range / "shard-0-of-2.pt");
  }
  const auto no_world = copy_of_saved("no-world");
  {
    torch::serialize::OutputArchive manifest;
    manifest.write("world_size", torch::tensor({std::int64_t{0}}));
    manifest.write("unit_numels",
                   torch::tensor({std::int64_t{63}, std::int64_t{40}, std::int64_t{10}}));
    manifest.write("optimizer", c10::IValue(std::string("Adam")));
    save_archive_atomically(manifest, no_world / "manifest.pt");
  }
  for (const auto& [folder, expected] :
       {std::pair{long_range,
                  std::string("unit_0_range is [0, 1000), outside unit 0's 63 elements")},
        std::pair{no_world, std::string("it records a world size of 0 (valid: 1 to")}}) {
    const int load_port = test::free_port();
    expect_error_on_every_rank(
        run_ranks(2,
                  [&](int rank) {
                    auto pg = join_group(rank, 2, load_port, 10s);
                    FullyShardedDataParallel model(make_model(), pg,
                                                   three_units(ShardingStrategy::kFullShard));
                    auto opt = make_optimizer(Kind::kAdam, model->parameters());
                    const auto before = model->parameters()[0].detach().clone();
                    try {
                      model->load_sharded_checkpoint(folder, *opt);
                    } catch (const Error&) {
                      if (!torch::equal(before, model->parameters()[0])) {
                        throw std::runtime_error(
                            "the refused load changed "
                            "the shards");
                      }
                      throw;
                    }
                  }),
        expected);
  }
}

}  // namespace DDP_UNITY_ID
}  // namespace
}  // namespace ddp

namespace ddp {
namespace {
namespace DDP_UNITY_ID {

// What `body` throws must be a ddp::Error naming `part`; anything else (no error, another type)
// fails the rank.
void expect_error_naming(const std::function<void()>& body, const std::string& part) {
  try {
    body();
  } catch (const Error& e) {
    if (std::string(e.what()).find(part) == std::string::npos) {
      throw std::runtime_error(fmt::format("the error does not name '{}': {}", part, e.what()));
    }
    return;
  }
  throw std::runtime_error("no error was thrown");
}

// A rank that dies while the others gather a unit's parameters (before forward, or before the
// backward of a unit freed after forward): the survivors' forward or backward throws an Error
// naming the dead rank, well before the group's 20 s deadline; nothing waits for it.
TEST(FullyShardedDataParallel, ARankDyingMidAllGatherIsNamedOnTheOthersWithoutAHang) {
  for (const bool during_backward : {false, true}) {
    SCOPED_TRACE(during_backward ? "dies before backward" : "dies before forward");
    const int port = test::free_port();
    // A survivor that returned at once could exit before the other one saw rank 2 go, which would
    // then see (and name) the survivor's exit instead: each waits until both have their error.
    test::TempDir marks;
    const auto both_survivors_failed = [&](int rank) {
      std::ofstream(marks.path() / fmt::format("failed-{}", rank)).put('1');
      const auto deadline = std::chrono::steady_clock::now() + 10s;
      while (!(std::filesystem::exists(marks.path() / "failed-0") &&
               std::filesystem::exists(marks.path() / "failed-1"))) {
        if (std::chrono::steady_clock::now() > deadline) {
          throw std::runtime_error("the other survivor saw no error within 10 s");
        }
        std::this_thread::sleep_for(5ms);
      }
    };
    const auto start = std::chrono::steady_clock::now();
    const auto results = run_ranks(3, [&](int rank) {
      auto pg = join_group(rank, 3, port, 20s);
      FullyShardedDataParallel fsdp(make_model(), pg, three_units(ShardingStrategy::kFullShard));
      auto [x, y] = make_batch(rank, 3, 0);
      if (!during_backward) {
        if (rank == 2) std::_Exit(0);
        expect_error_naming([&] { fsdp->forward(x); }, "rank 2");
        both_survivors_failed(rank);
        return;
      }
      auto loss = torch::mse_loss(fsdp->forward(x), y);
      if (rank == 2) std::_Exit(0);
      // The last unit's parameters were freed after its forward: backward gathers them again.
      expect_error_naming([&] { loss.backward(); }, "rank 2");
      both_survivors_failed(rank);
    });
    EXPECT_ALL_RANKS_OK(results);
    EXPECT_LT(std::chrono::steady_clock::now() - start, 15s);
  }
}

// A forward on one rank where the other runs a collective of its own (uneven batch counts, or an
// evaluation on one rank only: FSDP's forward is collective): the mismatch names the unit's
// all-gather and the likely causes in one line (issue 24).
TEST(FullyShardedDataParallel, ACollectiveMismatchInForwardNamesTheLikelyCauses) {
  const int port = test::free_port();
  // The mismatch's flight-recorder dumps go to the test's folder, not the working directory.
  test::TempDir dumps;
  const auto results = run_ranks(2, [&](int rank) {
    ::setenv("DDP_DUMP_DIR", dumps.path().c_str(), 1);
    auto pg = join_group(rank, 2, port, 10s);
    FullyShardedDataParallel fsdp(make_model(), pg, three_units(ShardingStrategy::kFullShard));
    if (rank == 1) {
      std::vector<double> values(1000, 1.0);
      try {
        pg->allreduce(values.data(), values.size(), DType::kFloat64, ReduceOp::kSum)->wait();
      } catch (const Error&) {
        // The mismatch as rank 1 sees it, outside FSDP: no causes to add.
      }
      return;
    }
    auto [x, y] = make_batch(rank, 2, 0);
    try {
      fsdp->forward(x);
    } catch (const CommError& e) {
      const std::string what = e.what();
      for (const std::string part :
           {"FullyShardedDataParallel, parameter all-gather of unit 1 of 3: ", ". Likely causes: ",
            "different numbers of forwards or backwards", "evaluate on every rank"}) {
        if (what.find(part) == std::string::npos) {
          throw std::runtime_error(fmt::format("the error lacks '{}': {}", part, what));
        }
      }
      if (what.find('\n') != std::string::npos) {
        throw std::runtime_error("the causes are not on one line: " + what);
      }
      return;
    }
    throw std::runtime_error("forward met no error although rank 1 ran no forward");
  });
  EXPECT_ALL_RANKS_OK(results);
}

}  // namespace DDP_UNITY_ID
}  // namespace
}  // namespace ddp
