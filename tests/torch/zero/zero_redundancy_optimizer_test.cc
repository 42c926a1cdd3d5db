// ddp::ZeroRedundancyOptimizer (ZeRO stage 1). Every test forks real ranks. The model has 113
// parameters in 6 tensors (divisible by none of 2, 3, 4: the shards are uneven); the global batch
// of 12 samples is split evenly, so runs at different world sizes train the same model. Model and
// data come from formulas that pytorch_zero_reference.py evaluates the same way.
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "ddp/comm/comm_error.h"
#include "ddp/error.h"
#include "ddp/torch/api/join.h"
#include "ddp/torch/checkpoint/checkpoint.h"
#include "ddp/torch/checkpoint/dcp_model_state.h"
#include "ddp/torch/ddp/distributed_data_parallel.h"
#include "ddp/torch/formats/optimizer_state_dict.h"
#include "ddp/torch/formats/state_dict.h"
#include "ddp/torch/zero/zero_redundancy_optimizer.h"
#include "support/multiprocess.h"
#include "support/subprocess.h"
#include "support/temp_dir.h"
#include "support/test_paths.h"
#include "support/torch/ddp_test_util.h"
#include "support/torch/deterministic_models.h"
#include "support/unity_namespace.h"
#include "torch/core/host_staging.h"
#include "torch/core/libtorch_compat.h"

namespace ddp {
namespace {
namespace DDP_UNITY_ID {

using namespace std::chrono_literals;
using test::expect_identical_across_ranks;
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

enum class Kind { kSgd, kAdam, kAdamW };

OptimizerFactory factory(Kind kind) {
  switch (kind) {
    case Kind::kSgd:
      return optimizer_factory<torch::optim::SGD>(torch::optim::SGDOptions(0.1).momentum(0.9));
    case Kind::kAdam:
      return optimizer_factory<torch::optim::Adam>(torch::optim::AdamOptions(0.01));
    case Kind::kAdamW:
      return optimizer_factory<torch::optim::AdamW>(
          torch::optim::AdamWOptions(0.01).weight_decay(0.05));
  }
  return nullptr;
}

// State tensors per parameter of each kind (momentum; exp_avg and exp_avg_sq).
int state_tensors_per_parameter(Kind kind) {
  return kind == Kind::kSgd ? 1 : 2;
}

// `model` is a DistributedDataParallel or a plain module.
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

std::vector<torch::Tensor> snapshot(const torch::nn::Sequential& net) {
  std::vector<torch::Tensor> out;
  for (const auto& p : net->parameters())
    out.push_back(p.detach().clone());
  return out;
}

// In each rank: DDP + the full optimizer and DDP + ZeRO, 20 steps each, from the same start.
// Throws unless the two agree to 1e-5; returns (through `identical`) whether they agree bit for
// bit on every rank.
void expect_zero_equals_full(Kind kind, int world, ZeroOptions options, bool& identical) {
  const int port = test::free_port();
  test::TempDir dir;
  const auto flag = (dir.path() / "differs").string();
  const auto results = run_ranks(world, [&](int rank) {
    auto pg = join_group(rank, world, port);
    auto net_full = make_model();
    DistributedDataParallel ddp_full(net_full, pg);
    auto full = factory(kind)({torch::optim::OptimizerParamGroup(ddp_full->parameters())});
    train_steps(ddp_full, *full, rank, world, 0, kSteps);

    auto net_zero = make_model();
    DistributedDataParallel ddp_zero(net_zero, pg);
    ZeroRedundancyOptimizer zero(ddp_zero->parameters(), factory(kind), pg, options);
    train_steps(ddp_zero, zero, rank, world, 0, kSteps);

    const auto want = snapshot(net_full);
    const auto got = snapshot(net_zero);
    bool same_bits = true;
    for (std::size_t i = 0; i < want.size(); ++i) {
      test::expect_close(got[i], want[i], fmt::format("parameter {}", i), 1e-5, 1e-6);
      same_bits = same_bits && torch::equal(got[i], want[i]);
    }
    if (!same_bits) std::ofstream(flag + std::to_string(rank)) << "x";
    expect_identical_across_ranks(*pg, net_zero->parameters(), "ZeRO parameters");

    // The shards partition the parameters, and this rank's state covers its shard only.
    std::set<const void*> all;
    std::int64_t shard_numel = 0;
    for (int r = 0; r < world; ++r) {
      for (const auto& p : zero.shard_parameters(r)) {
        if (!all.insert(p.unsafeGetTensorImpl()).second) throw std::runtime_error("shared param");
        if (r == rank) shard_numel += p.numel();
      }
    }
    if (all.size() != net_zero->parameters().size()) throw std::runtime_error("lost a param");
    std::int64_t local_params = 0;
    for (const auto& g : zero.local_optimizer().param_groups())
      for (const auto& p : g.params())
        local_params += p.numel();
    if (local_params != shard_numel) throw std::runtime_error("local optimizer != shard");
    const std::int64_t expected = shard_numel * 4 * state_tensors_per_parameter(kind);
    if (zero.local_state_bytes() != expected) {
      throw std::runtime_error(fmt::format("state bytes {} but the shard's state is {}",
                                           zero.local_state_bytes(), expected));
    }
    auto total = torch::tensor({static_cast<double>(zero.local_state_bytes())}, torch::kFloat64);
    all_reduce(total, ReduceOp::kSum, pg);
    const double everything = 113.0 * 4 * state_tensors_per_parameter(kind);
    if (total.item<double>() != everything) throw std::runtime_error("shards' state != full");
  });
  EXPECT_ALL_RANKS_OK(results);
  identical = true;
  for (int r = 0; r < world; ++r)
    identical = identical && !std::filesystem::exists(flag + std::to_string(r));
}

void check_kind(Kind kind) {
  for (const int world : {2, 3, 4}) {
    SCOPED_TRACE(fmt::format("world {}", world));
    bool identical = false;
    expect_zero_equals_full(kind, world, {}, identical);
    // Element-wise optimizers on the same averaged gradients: the owner computes exactly what
    // the full optimizer computes, and the broadcast copies bits.
    EXPECT_TRUE(identical) << "ZeRO and the full optimizer agree to 1e-5 but not bit for bit";
  }
}

TEST(ZeroRedundancyOptimizer, SgdMomentumWithDdpEqualsDdpWithTheFullOptimizer) {
  check_kind(Kind::kSgd);
}
TEST(ZeroRedundancyOptimizer, AdamWithDdpEqualsDdpWithTheFullOptimizer) {
  check_kind(Kind::kAdam);
}
TEST(ZeroRedundancyOptimizer, AdamWWithDdpEqualsDdpWithTheFullOptimizer) {
  check_kind(Kind::kAdamW);
}

// The consolidated state of a ZeRO-sharded run crosses to Python's layout (state_dict.h,
// optimizer_state_dict.h): rank 0 writes the model and the consolidated optimizer state, and a
// plain model and optimizer loaded from the two files take the next step as one loaded from DDP
// with the full optimizer does.
TEST(ZeroRedundancyOptimizer, ConsolidatedStateSavedInPythonsLayoutContinuesAsTheFullOptimizer) {
  constexpr int kWorld = 2;
  test::TempDir dir;
  const int port = test::free_port();
  const auto results = run_ranks(kWorld, [&](int rank) {
    auto pg = join_group(rank, kWorld, port);
    auto net_full = make_model();
    DistributedDataParallel ddp_full(net_full, pg);
    auto full = factory(Kind::kAdam)({torch::optim::OptimizerParamGroup(ddp_full->parameters())});
    train_steps(ddp_full, *full, rank, kWorld, 0, 4);
    auto net_zero = make_model();
    DistributedDataParallel ddp_zero(net_zero, pg);
    ZeroRedundancyOptimizer zero(ddp_zero->parameters(), factory(Kind::kAdam), pg);
    train_steps(ddp_zero, zero, rank, kWorld, 0, 4);
    zero.consolidate_state_dict(0);
    if (rank != 0) return;
    save_state_dict(*net_zero, dir.path() / "zero_model.pt");
    save_optimizer_state_dict(zero.state_dict(), dir.path() / "zero_optim.pt");
    save_state_dict(*net_full, dir.path() / "full_model.pt");
    save_optimizer_state_dict(*full, dir.path() / "full_optim.pt");
    // One process continues from each pair of files (on the whole batch): the two steps agree.
    const auto resume_and_step = [&](const std::string& prefix) {
      auto plain = make_model();
      {
        torch::NoGradGuard no_grad;
        for (auto& p : plain->parameters())
          p.zero_();
      }
      load_state_dict(*plain, dir.path() / (prefix + "_model.pt"));
      auto opt = factory(Kind::kAdam)({torch::optim::OptimizerParamGroup(plain->parameters())});
      load_optimizer_state_dict(*opt, dir.path() / (prefix + "_optim.pt"));
      train_steps(plain, *opt, 0, 1, 4, 5);
      return plain;
    };
    const auto from_zero = resume_and_step("zero");
    const auto want = resume_and_step("full")->named_parameters();
    for (const auto& item : from_zero->named_parameters()) {
      test::expect_close(item.value(), want[item.key()], "after the resumed step: " + item.key(),
                         1e-6, 1e-7);
    }
  });
  EXPECT_ALL_RANKS_OK(results);
}

// Uneven inputs: rank r trains 6 + 3r steps. Under ddp::Join, DDP + ZeRO (a joinable after DDP)
// must end with the parameters of DDP + the full optimizer under the same Join: a rank that ran
// out of data still owns a shard, which has to keep stepping with the averaged gradients of the
// ranks still training (DDP's shadow step hands them over), or its part of the model would stop.
TEST(ZeroRedundancyOptimizer, UnevenInputsUnderJoinEqualDdpWithTheFullOptimizer) {
  constexpr int kWorld = 3;
  for (const bool divide : {true, false}) {
    SCOPED_TRACE(fmt::format("divide_by_initial_world_size {}", divide));
    const int port = test::free_port();
    const auto results = run_ranks(kWorld, [&](int rank) {
      auto pg = join_group(rank, kWorld, port);
      const int steps = 6 + 3 * rank;
      const JoinOptions options{.divide_by_initial_world_size = divide};
      auto net_full = make_model();
      DistributedDataParallel ddp_full(net_full, pg);
      auto full = factory(Kind::kAdam)({torch::optim::OptimizerParamGroup(ddp_full->parameters())});
      {
        Join join({*ddp_full}, options);
        train_steps(ddp_full, *full, rank, kWorld, 0, steps);
        join.finish();
      }
      auto net_zero = make_model();
      DistributedDataParallel ddp_zero(net_zero, pg);
      ZeroRedundancyOptimizer zero(ddp_zero->parameters(), factory(Kind::kAdam), pg);
      // Every rank owns some of the 6 tensors, so the ranks that join early own shards.
      if (zero.shard_parameters(rank).empty()) throw std::runtime_error("rank owns nothing");
      // Listed before DDP, the optimizer would step with the gradients of an earlier step.
      try {
        Join wrong_order({zero, *ddp_zero}, options);
        throw std::runtime_error("Join({optimizer, model}) was accepted");
      } catch (const ConfigError& e) {
        if (std::string(e.what()).find("must come before it") == std::string::npos) throw;
      }
      {
        Join join({*ddp_zero, zero}, options);
        train_steps(ddp_zero, zero, rank, kWorld, 0, steps);
        join.finish();
      }
      const auto want = snapshot(net_full);
      const auto got = snapshot(net_zero);
      for (std::size_t i = 0; i < want.size(); ++i) {
        if (!torch::equal(got[i], want[i])) {
          test::expect_close(got[i], want[i], fmt::format("parameter {}", i), 1e-6, 1e-7);
        }
      }
      expect_identical_across_ranks(*pg, net_zero->parameters(), "ZeRO parameters after Join");
    });
    EXPECT_ALL_RANKS_OK(results);
  }
}

TEST(ZeroRedundancyOptimizer, BucketViewAndSmallBucketsChangeNothing) {
  // A 100-byte cap makes many buckets, some packed (alternating staging buffers), some direct.
  for (const ZeroOptions options :
       {ZeroOptions{.parameters_as_bucket_view = true},
        ZeroOptions{.bucket_cap_mb = 100.0 / (1 << 20)},
        ZeroOptions{.parameters_as_bucket_view = true, .bucket_cap_mb = 100.0 / (1 << 20)}}) {
    bool identical = false;
    expect_zero_equals_full(Kind::kAdam, 3, options, identical);
    EXPECT_TRUE(identical);
  }
}

// The shard broadcasts staged through host copies, as for CUDA parameters on a host group
// (distributed.h; the test switch stages CPU tensors the same way): bit for bit the same
// training, with packed and direct buckets, in place and as bucket views.
TEST(ZeroRedundancyOptimizer, ShardBroadcastsStagedThroughHostCopiesChangeNothing) {
  const int world = 3;
  const int port = test::free_port();
  const auto results = run_ranks(world, [&](int rank) {
    auto pg = join_group(rank, world, port);
    for (const ZeroOptions options :
         {ZeroOptions{.bucket_cap_mb = 100.0 / (1 << 20)},
          ZeroOptions{.parameters_as_bucket_view = true, .bucket_cap_mb = 100.0 / (1 << 20)}}) {
      std::vector<std::vector<torch::Tensor>> trained;
      for (const bool staged : {false, true}) {
        auto net = make_model();
        DistributedDataParallel ddp(net, pg);
        ZeroRedundancyOptimizer zero(ddp->parameters(), factory(Kind::kAdam), pg, options);
        std::unique_ptr<detail::ScopedStagingOfCpuTensorsForTests> staging;
        if (staged) staging = std::make_unique<detail::ScopedStagingOfCpuTensorsForTests>();
        train_steps(ddp, zero, rank, world, 0, kSteps);
        if (staged && (staging->copies_to_host() == 0 || staging->copies_back() == 0))
          throw std::runtime_error("the staged run staged nothing");
        trained.push_back(snapshot(net));
      }
      for (std::size_t i = 0; i < trained[0].size(); ++i) {
        if (!torch::equal(trained[1][i], trained[0][i]))
          throw std::runtime_error(fmt::format("staged parameter {} differs", i));
      }
    }
  });
  EXPECT_ALL_RANKS_OK(results);
}

// step(closure) runs the closure once per rank (its backward averages through DDP), and options
// changed on param_groups() (a scheduler's lr) reach every shard.
TEST(ZeroRedundancyOptimizer, ClosureAndLearningRateChangesReachTheShards) {
  const int port = test::free_port();
  const auto results = run_ranks(2, [&](int rank) {
    auto pg = join_group(rank, 2, port);
    auto net_full = make_model();
    DistributedDataParallel ddp_full(net_full, pg);
    auto full = factory(Kind::kAdam)({torch::optim::OptimizerParamGroup(net_full->parameters())});
    auto net = make_model();
    DistributedDataParallel model(net, pg);
    ZeroRedundancyOptimizer zero(model->parameters(), factory(Kind::kAdam), pg);
    for (int step = 0; step < 8; ++step) {
      if (step == 4) {
        for (auto* opt : {static_cast<torch::optim::Optimizer*>(full.get()),
                          static_cast<torch::optim::Optimizer*>(&zero)}) {
          opt->param_groups()[0].options().set_lr(0.1);
        }
      }
      auto [x, y] = make_batch(rank, 2, step);
      full->zero_grad();
      torch::mse_loss(ddp_full->forward(x), y).backward();
      full->step();
      int calls = 0;
      auto loss = zero.step([&] {
        ++calls;
        zero.zero_grad();
        auto l = torch::mse_loss(model->forward(x), y);
        l.backward();
        return l;
      });
      if (calls != 1 || !loss.defined()) throw std::runtime_error("closure not run once");
    }
    const auto want = snapshot(net_full);
    const auto got = snapshot(net);
    for (std::size_t i = 0; i < want.size(); ++i) {
      if (!torch::equal(got[i], want[i])) {
        throw std::runtime_error(fmt::format("parameter {} differs", i));
      }
    }
    if (zero.local_optimizer().param_groups()[0].options().get_lr() != 0.1) {
      throw std::runtime_error("the local optimizer did not get the new lr");
    }
  });
  EXPECT_ALL_RANKS_OK(results);
}

// Two parameters at world 3: rank 2 owns nothing, steps an optimizer of empty groups, still
// takes part in every broadcast, and can be the rank that consolidates.
TEST(ZeroRedundancyOptimizer, RanksThatOwnNothingTakePart) {
  const int port = test::free_port();
  test::TempDir dir;
  const auto path = dir.path() / "state.pt";
  const auto results = run_ranks(3, [&](int rank) {
    auto pg = join_group(rank, 3, port);
    torch::manual_seed(5);
    torch::nn::Linear full_net(kIn, 2);
    torch::manual_seed(5);
    torch::nn::Linear net(kIn, 2);
    DistributedDataParallel ddp_full(full_net, pg);
    DistributedDataParallel model(net, pg);
    auto full = factory(Kind::kAdam)({torch::optim::OptimizerParamGroup(ddp_full->parameters())});
    ZeroRedundancyOptimizer zero(model->parameters(), factory(Kind::kAdam), pg);
    if (!zero.shard_parameters(2).empty()) throw std::runtime_error("rank 2 owns something");
    train_steps(ddp_full, *full, rank, 3, 0, 3);
    train_steps(model, zero, rank, 3, 0, 3);
    for (std::size_t i = 0; i < 2; ++i) {
      if (!torch::equal(net->parameters()[i], full_net->parameters()[i])) {
        throw std::runtime_error(fmt::format("parameter {} differs", i));
      }
    }
    if (rank == 2 && zero.local_state_bytes() != 0) throw std::runtime_error("state on rank 2");
    zero.consolidate_state_dict(2);
    if (rank == 2) {
      if (zero.state_dict().state().size() != 2) throw std::runtime_error("states missing");
      torch::serialize::OutputArchive archive;
      zero.save(archive);
      save_archive_atomically(archive, path);
    }
    barrier(pg);
    auto archive = load_archive(path);
    zero.load(archive);
    const std::int64_t want = rank == 2 ? 0 : 8 * zero.shard_parameters(rank)[0].numel();
    if (zero.local_state_bytes() != want) throw std::runtime_error("reloaded state bytes");
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(ZeroRedundancyOptimizer, PartitionIsPyTorchsGreedyLargestFirst) {
  const int port = test::free_port();
  const auto results = run_ranks(3, [&](int rank) {
    auto pg = join_group(rank, 3, port);
    auto net = make_model();
    ZeroRedundancyOptimizer zero(net->parameters(), torch::optim::SGDOptions(0.1), pg);
    // Sizes in order 54, 9, 36, 4, 8, 2; largest first 54 36 9 8 4 2 -> ranks 0 1 2 2 2 2
    // (totals 54 | 36 | 9+8+4+2), what PyTorch 1.13's _partition_parameters() gives.
    const std::vector<int> owners{0, 2, 1, 2, 2, 2};
    for (std::size_t i = 0; i < owners.size(); ++i) {
      if (zero.owner_of(i) != owners[i]) {
        throw std::runtime_error(
            fmt::format("parameter {} owned by {}, want {}", i, zero.owner_of(i), owners[i]));
      }
    }
    if (zero.bucket_count() != 3) throw std::runtime_error("one bucket per rank expected");
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

TEST(ZeroRedundancyOptimizer, DifferentModelsOrOptimizersAcrossRanksAreNamedOnEveryRank) {
  int port = test::free_port();
  auto results = run_ranks(3, [&](int rank) {
    auto pg = join_group(rank, 3, port, 10s);
    auto net = make_model(rank == 2 ? 1 : 0);
    ZeroRedundancyOptimizer zero(net->parameters(), torch::optim::AdamOptions(0.01), pg);
  });
  expect_error_on_every_rank(results,
                             "rank 0 has parameter 2: [4, 9] Float but rank 2 has "
                             "parameter 2: [5, 9] Float");

  port = test::free_port();
  results = run_ranks(2, [&](int rank) {
    auto pg = join_group(rank, 2, port, 10s);
    auto net = make_model();
    if (rank == 1) {
      ZeroRedundancyOptimizer zero(net->parameters(), torch::optim::SGDOptions(0.1), pg);
    } else {
      ZeroRedundancyOptimizer zero(net->parameters(), torch::optim::AdamOptions(0.1), pg);
    }
  });
  expect_error_on_every_rank(
      results,
      "rank 0 has optimizer torch::optim::Adam but rank 1 has optimizer torch::optim::SGD");

  port = test::free_port();
  results = run_ranks(2, [&](int rank) {
    auto pg = join_group(rank, 2, port, 10s);
    auto net = make_model();
    ZeroRedundancyOptimizer zero(
        net->parameters(), optimizer_factory<torch::optim::LBFGS>(torch::optim::LBFGSOptions(0.1)),
        pg);
  });
  expect_error_on_every_rank(results, "LBFGS cannot be sharded");
}

// A rank that calls step() where the other runs a collective of its own (uneven step counts): the
// mismatch names the optimizer's phase and the likely causes in one line (issue 24).
TEST(ZeroRedundancyOptimizer, ACollectiveMismatchInStepNamesTheLikelyCauses) {
  const int port = test::free_port();
  // The mismatch's flight-recorder dumps go to the test's folder, not the working directory.
  test::TempDir dumps;
  const auto results = run_ranks(2, [&](int rank) {
    ::setenv("DDP_DUMP_DIR", dumps.path().c_str(), 1);
    auto pg = join_group(rank, 2, port, 10s);
    auto net = make_model();
    ZeroRedundancyOptimizer zero(net->parameters(), factory(Kind::kAdam), pg);
    if (rank == 1) {
      std::vector<double> values(1000, 1.0);
      try {
        pg->allreduce(values.data(), values.size(), DType::kFloat64, ReduceOp::kSum)->wait();
      } catch (const Error&) {
        // The mismatch as rank 1 sees it, outside the optimizer: no causes to add.
      }
      return;
    }
    auto [x, y] = make_batch(rank, 2, 0);
    torch::mse_loss(net->forward(x), y).backward();
    try {
      zero.step();
    } catch (const CommError& e) {
      const std::string what = e.what();
      for (const std::string part :
           {"ZeroRedundancyOptimizer, shard broadcast after step(): ", ". Likely causes: ",
            "called step() a different number of times", "ddp::Join"}) {
        if (what.find(part) == std::string::npos) {
          throw std::runtime_error(fmt::format("the error lacks '{}': {}", part, what));
        }
      }
      if (what.find('\n') != std::string::npos) {
        throw std::runtime_error("the causes are not on one line: " + what);
      }
      return;
    }
    throw std::runtime_error("step() met no error although rank 1 never stepped");
  });
  EXPECT_ALL_RANKS_OK(results);
}

// Adam, 10 steps with ZeRO at `save_world`, consolidated on rank 1 and saved with the model
// (ddp::save_checkpoint); then a fresh ZeRO at `load_world` loads both (ddp::load_checkpoint) and
// trains 10 more: the parameters equal 20 uninterrupted steps of DDP + Adam (run at save_world).
void check_resume(int save_world, int load_world) {
  test::TempDir dir;
  const auto checkpoint = dir.path() / "checkpoint.pt";
  const auto reference_file = (dir.path() / "reference.pt").string();
  constexpr int kTo = 1;
  int port = test::free_port();
  auto results = run_ranks(save_world, [&](int rank) {
    auto pg = join_group(rank, save_world, port);
    auto net_full = make_model();
    DistributedDataParallel ddp_full(net_full, pg);
    auto full = factory(Kind::kAdam)({torch::optim::OptimizerParamGroup(net_full->parameters())});
    train_steps(ddp_full, *full, rank, save_world, 0, kSteps / 2);

    auto net = make_model();
    DistributedDataParallel model(net, pg);
    ZeroRedundancyOptimizer zero(net->parameters(), factory(Kind::kAdam), pg);
    train_steps(model, zero, rank, save_world, 0, kSteps / 2);
    zero.consolidate_state_dict(kTo);
    if (rank == kTo) {
      // The consolidated state is the full optimizer's, parameter by parameter.
      const auto& state = zero.state_dict().state();
      const auto params = net->parameters();
      const auto full_params = net_full->parameters();
      if (state.size() != params.size()) throw std::runtime_error("states missing");
      for (std::size_t i = 0; i < params.size(); ++i) {
        const auto& got = static_cast<const torch::optim::AdamParamState&>(
            *state.at(libtorch_compat::optimizer_state_key(params[i])));
        const auto& want = static_cast<const torch::optim::AdamParamState&>(
            *full->state().at(libtorch_compat::optimizer_state_key(full_params[i])));
        if (got.step() != want.step() || !torch::equal(got.exp_avg(), want.exp_avg()) ||
            !torch::equal(got.exp_avg_sq(), want.exp_avg_sq())) {
          throw std::runtime_error(fmt::format("consolidated state of parameter {} differs", i));
        }
      }
      save_checkpoint(checkpoint, *net, zero, {.epoch = 10});
      // A plain Adam over the full model loads it, with the same state.
      auto plain_net = make_model();
      auto plain =
          factory(Kind::kAdam)({torch::optim::OptimizerParamGroup(plain_net->parameters())});
      load_checkpoint(checkpoint, *plain_net, *plain);
      if (plain->state().size() != params.size()) throw std::runtime_error("plain Adam: states");
      const auto& first = static_cast<const torch::optim::AdamParamState&>(
          *plain->state().at(libtorch_compat::optimizer_state_key(plain_net->parameters()[0])));
      const auto& first_full = static_cast<const torch::optim::AdamParamState&>(
          *full->state().at(libtorch_compat::optimizer_state_key(full_params[0])));
      if (!torch::equal(first.exp_avg_sq(), first_full.exp_avg_sq())) {
        throw std::runtime_error("plain Adam loaded another state");
      }
    } else {
      try {
        zero.state_dict();
        throw std::runtime_error("state_dict() on a rank that did not consolidate returned");
      } catch (const Error& e) {
        if (std::string(e.what()).find("no consolidated optimizer state") == std::string::npos)
          throw;
      }
    }
    train_steps(ddp_full, *full, rank, save_world, kSteps / 2, kSteps);
    if (rank == 0) torch::save(net_full, reference_file);
  });
  ASSERT_TRUE(std::all_of(results.begin(), results.end(), [](auto& r) { return r.ok(); }))
      << test::describe(results);

  port = test::free_port();
  results = run_ranks(load_world, [&](int rank) {
    auto pg = join_group(rank, load_world, port);
    auto net = make_model();
    DistributedDataParallel model(net, pg);
    ZeroRedundancyOptimizer zero(net->parameters(), factory(Kind::kAdam), pg);
    if (load_checkpoint(checkpoint, *net, zero).epoch != 10) throw std::runtime_error("epoch");
    train_steps(model, zero, rank, load_world, kSteps / 2, kSteps);
    auto reference = make_model();
    torch::load(reference, reference_file);
    const auto got = snapshot(net);
    const auto want = snapshot(reference);
    for (std::size_t i = 0; i < want.size(); ++i)
      test::expect_close(got[i], want[i], fmt::format("parameter {} after resuming", i));
    expect_identical_across_ranks(*pg, net->parameters(), "resumed parameters");
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(ZeroRedundancyOptimizer, ConsolidatedStateResumesAtTheSameWorldSize) {
  check_resume(3, 3);
}
TEST(ZeroRedundancyOptimizer, ConsolidatedStateResumesAtAnotherWorldSize) {
  check_resume(4, 2);
  check_resume(2, 3);
}

// PyTorch's distributed checkpoint: ZeRO at world 3 saves, each rank adding the state of the
// parameters it owns only; ZeRO at world 2, and a plain model with its Adam, load it, and the
// steps after end where 20 uninterrupted steps of DDP + Adam end (1e-5).
TEST(ZeroRedundancyOptimizer, DistributedCheckpointHoldsEachRanksOwnStateAndResumesAtTwo) {
  test::TempDir dir;
  const auto path = dir.path() / "dcp";
  const auto reference_file = (dir.path() / "reference.pt").string();
  int port = test::free_port();
  EXPECT_ALL_RANKS_OK(run_ranks(3, [&](int rank) {
    auto pg = join_group(rank, 3, port);
    auto net = make_model();
    DistributedDataParallel model(net, pg);
    ZeroRedundancyOptimizer zero(net->parameters(), factory(Kind::kAdam), pg);
    train_steps(model, zero, rank, 3, 0, kSteps / 2);
    const DcpStateDict state = zero.dcp_state(*net);
    std::size_t owned = 0, added = 0;
    for (std::size_t i = 0; i < net->parameters().size(); ++i)
      owned += zero.owner_of(i) == rank ? 1 : 0;
    for (const auto& entry : state.entries())
      added += entry.name.starts_with("optim.state.") && entry.name.ends_with(".exp_avg") ? 1 : 0;
    if (added != owned) {
      throw std::runtime_error(
          fmt::format("rank {} added the state of {} parameters, owns {}", rank, added, owned));
    }
    save_dcp(state, path);

    auto net_full = make_model();
    DistributedDataParallel ddp_full(net_full, pg);
    auto full = factory(Kind::kAdam)({torch::optim::OptimizerParamGroup(net_full->parameters())});
    train_steps(ddp_full, *full, rank, 3, 0, kSteps);
    if (rank == 0) torch::save(net_full, reference_file);
  }));

  port = test::free_port();
  EXPECT_ALL_RANKS_OK(run_ranks(2, [&](int rank) {
    auto pg = join_group(rank, 2, port);
    auto reference = make_model();
    torch::load(reference, reference_file);
    const auto want = snapshot(reference);
    auto expect_reference = [&](const torch::nn::Sequential& got, const std::string& what) {
      const auto params = snapshot(got);
      for (std::size_t i = 0; i < want.size(); ++i)
        test::expect_close(params[i], want[i], fmt::format("{}: parameter {}", what, i));
    };
    auto net = make_model();
    DistributedDataParallel model(net, pg);
    ZeroRedundancyOptimizer zero(net->parameters(), factory(Kind::kAdam), pg);
    if (!zero.load_dcp_state(path, *net).complete()) throw std::runtime_error("incomplete load");
    train_steps(model, zero, rank, 2, kSteps / 2, kSteps);
    expect_reference(net, "ZeRO resumed at world 2");

    auto plain = make_model();
    auto adam = factory(Kind::kAdam)({torch::optim::OptimizerParamGroup(plain->parameters())});
    load_dcp_model_state(path, *plain, adam.get());
    train_steps(plain, *adam, 0, 1, kSteps / 2, kSteps);
    expect_reference(plain, "a plain Adam resumed");
  }));
}

std::string archive_bytes(const torch::optim::Optimizer& opt) {
  torch::serialize::OutputArchive archive;
  opt.save(archive);
  std::ostringstream out;
  archive.save_to(out);
  return out.str();
}

TEST(ZeroRedundancyOptimizer, AStateThatDoesNotFitIsNamedAndChangesNothing) {
  const int port = test::free_port();
  const auto results = run_ranks(2, [&](int rank) {
    auto pg = join_group(rank, 2, port);
    auto net = make_model();
    ZeroRedundancyOptimizer zero(net->parameters(), factory(Kind::kAdam), pg);
    train_steps(net, zero, rank, 2, 0, 3);
    // An AdamW's consolidated state (same fields as Adam's: only the recorded kind tells).
    auto other_net = make_model();
    ZeroRedundancyOptimizer adamw(other_net->parameters(), factory(Kind::kAdamW), pg);
    train_steps(other_net, adamw, rank, 2, 0, 1);
    adamw.consolidate_state_dict(0);
    if (rank != 0) return;

    const auto before = archive_bytes(zero.local_optimizer());
    const auto lr = zero.param_groups()[0].options().get_lr();
    auto expect_refused = [&](torch::serialize::InputArchive& archive, const std::string& what) {
      try {
        zero.load(archive);
        throw std::runtime_error("loading " + what + " was accepted");
      } catch (const Error& e) {
        const std::string message = e.what();
        if (message.find("ZeroRedundancyOptimizer") == std::string::npos) throw;
        std::cerr << what << ": " << message << "\n";
      }
      if (archive_bytes(zero.local_optimizer()) != before ||
          zero.param_groups()[0].options().get_lr() != lr) {
        throw std::runtime_error("loading " + what + " changed the optimizer");
      }
    };
    auto reload = [](const std::function<void(torch::serialize::OutputArchive&)>& write) {
      torch::serialize::OutputArchive out;
      write(out);
      std::ostringstream bytes;
      out.save_to(bytes);
      const auto text = bytes.str();
      torch::serialize::InputArchive in;
      in.load_from(text.data(), text.size());
      return in;
    };
    {  // another model: same number of tensors, other shapes
      auto wide = make_model(1);
      torch::optim::Adam plain(wide->parameters(), torch::optim::AdamOptions(0.5));
      train_steps(wide, plain, 0, 1, 0, 1);
      auto in = reload([&](auto& a) { plain.save(a); });
      expect_refused(in, "another model's Adam state");
    }
    {  // an SGD's state
      torch::optim::SGD plain(net->parameters(), torch::optim::SGDOptions(0.5).momentum(0.9));
      auto in = reload([&](auto& a) { plain.save(a); });
      expect_refused(in, "an SGD state");
    }
    {  // fewer parameters
      auto part = net->parameters();
      part.pop_back();
      torch::optim::Adam plain(part, torch::optim::AdamOptions(0.5));
      auto in = reload([&](auto& a) { plain.save(a); });
      expect_refused(in, "a state of 5 parameters");
    }
    {
      auto in = reload([&](auto& a) { adamw.save(a); });
      expect_refused(in, "an AdamW state");
    }
  });
  EXPECT_ALL_RANKS_OK(results);
}

// "optimizer name v0 v1 ..." lines -> (optimizer, name) -> values.
std::map<std::pair<std::string, std::string>, torch::Tensor> parse_reference(
    const std::string& output) {
  std::map<std::pair<std::string, std::string>, torch::Tensor> params;
  std::istringstream lines(output);
  std::string line;
  while (std::getline(lines, line)) {
    std::istringstream fields(line);
    std::string optimizer, name;
    fields >> optimizer >> name;
    std::vector<double> values;
    double v = 0;
    while (fields >> v)
      values.push_back(v);
    if (!values.empty()) {
      params[{optimizer, name}] = torch::tensor(values, torch::kFloat64).to(torch::kFloat32);
    }
  }
  return params;
}

TEST(ZeroRedundancyOptimizer, SameParametersAsPyTorchsZeroRedundancyOptimizerOnGloo) {
  const std::string python = "/usr/bin/python3";
  auto probe = test::Subprocess::start({python, "-c", "import torch.distributed.optim"});
  const auto probed = probe.wait(60s);
  if (probed.exit_code != 0) {
    GTEST_SKIP() << python << " cannot import torch.distributed.optim (install python3-torch): "
                 << probed.output;
  }
  constexpr int kWorld = 3;
  auto reference = test::Subprocess::start(
      {python, test::paths::zero_reference_script, std::to_string(kWorld), std::to_string(kSteps),
       "sgd,adam,adamw", std::to_string(test::free_port())},
      {{"OMP_NUM_THREADS", "1"}});
  const auto done = reference.wait(180s);
  ASSERT_EQ(done.exit_code, 0) << done.output;
  const auto want = parse_reference(done.output);
  ASSERT_EQ(want.size(), 18u) << done.output;

  test::TempDir dir;
  const int port = test::free_port();
  const std::vector<std::pair<std::string, Kind>> kinds{
      {"sgd", Kind::kSgd}, {"adam", Kind::kAdam}, {"adamw", Kind::kAdamW}};
  const auto results = run_ranks(kWorld, [&](int rank) {
    auto pg = join_group(rank, kWorld, port);
    for (const auto& [name, kind] : kinds) {
      auto net = make_model();
      DistributedDataParallel model(net, pg);
      ZeroRedundancyOptimizer zero(model->parameters(), factory(kind), pg);
      train_steps(model, zero, rank, kWorld, 0, kSteps);
      if (rank == 0) torch::save(net, (dir.path() / (name + ".pt")).string());
    }
  });
  ASSERT_TRUE(std::all_of(results.begin(), results.end(), [](auto& r) { return r.ok(); }))
      << test::describe(results);
  for (const auto& [name, kind] : kinds) {
    auto net = make_model();
    torch::load(net, (dir.path() / (name + ".pt")).string());
    double largest = 0;
    for (const auto& item : net->named_parameters()) {
      const auto key = std::make_pair(name, item.key());
      ASSERT_TRUE(want.count(key)) << name << " " << item.key();
      const auto diff = (item.value().detach().flatten() - want.at(key)).abs().max().item<double>();
      EXPECT_LE(diff, 1e-5) << name << " " << item.key();
      largest = std::max(largest, diff);
    }
    std::cout << name << ": largest difference from PyTorch " << largest << "\n";
  }
}

// The per-rank optimizer-state bytes of Adam (docs/sharding.md quotes these lines): eight equal
// 512x512 layers, so the shards are even and the state is 8 bytes x parameters / world.
TEST(ZeroRedundancyOptimizer, AdamStateBytesPerRankAreEightBytesPerParameterOverTheWorld) {
  for (const int world : {1, 2, 4}) {
    const int port = test::free_port();
    const auto results = run_ranks(world, [&](int rank) {
      auto pg = join_group(rank, world, port);
      torch::manual_seed(1);
      torch::nn::Sequential net;
      for (int i = 0; i < 8; ++i)
        net->push_back(torch::nn::Linear(512, 512));
      std::int64_t psi = 0;
      for (const auto& p : net->parameters())
        psi += p.numel();
      ZeroRedundancyOptimizer zero(net->parameters(), torch::optim::AdamOptions(1e-3), pg);
      zero.zero_grad();
      net->forward(torch::randn({4, 512})).sum().backward();
      zero.step();
      const auto bytes = zero.local_state_bytes();
      const std::int64_t formula = 8 * psi / world;
      std::cout << fmt::format(
                       "zero1 adam state: world={} rank={} params={} state_bytes={} "
                       "formula_8psi_over_w={}\n",
                       world, rank, psi, bytes, formula)
                << std::flush;
      if (bytes != formula) throw std::runtime_error("state bytes differ from 8 psi / W");
    });
    EXPECT_ALL_RANKS_OK(results);
  }
}

namespace overlap {

// Small buckets (about 30 parameters each), so that the 113 parameters make several buckets and
// a bucket holds parameters of several owners.
DdpOptions small_buckets() {
  return {.bucket_cap_mb = 120.0 / (1 << 20), .first_bucket_cap_mb = 120.0 / (1 << 20)};
}

}  // namespace overlap

// PyTorch's overlap_with_ddp: each bucket's shard is stepped in DDP's comm hook as soon as its
// average is there, and step() only collects the broadcasts. Against DDP (with the same comm hook)
// and a plain ZeroRedundancyOptimizer stepping after backward: the same bits, for the plain
// all-reduce and for fp16 compression, with SGD momentum and AdamW, at world 3.
TEST(ZeroRedundancyOptimizer, OverlapWithDdpStepsEachBucketInTheHookAndEqualsTheStepAfterIt) {
  const int world = 3;
  const int port = test::free_port();
  const auto results = run_ranks(world, [&](int rank) {
    auto pg = join_group(rank, world, port);
    for (const Kind kind : {Kind::kSgd, Kind::kAdamW}) {
      for (const bool fp16 : {false, true}) {
        const auto what = fmt::format("{}{}", kind == Kind::kSgd ? "SGD" : "AdamW",
                                      fp16 ? " with fp16 compression" : "");
        const auto hook = [fp16] { return fp16 ? fp16_compress_hook() : allreduce_hook(); };
        auto net_plain = make_model();
        DistributedDataParallel ddp_plain(net_plain, pg, overlap::small_buckets());
        ddp_plain->register_comm_hook(hook());
        ZeroRedundancyOptimizer plain(ddp_plain->parameters(), factory(kind), pg);

        auto net_overlap = make_model();
        DistributedDataParallel ddp_overlap(net_overlap, pg, overlap::small_buckets());
        ZeroRedundancyOptimizer overlapped(ddp_overlap->parameters(), factory(kind), pg,
                                           ZeroOptions{.overlap_with_ddp = true});
        ddp_overlap->register_comm_hook(hook_with_zero_step(hook(), overlapped), "zero");

        for (int step = 0; step < kSteps; ++step) {
          train_steps(ddp_plain, plain, rank, world, step, step + 1);
          const auto before = snapshot(net_overlap);
          auto [x, y] = make_batch(rank, world, step);
          overlapped.zero_grad();
          torch::mse_loss(ddp_overlap->forward(x), y).backward();
          // The hook stepped this rank's parameters already; the others arrive in step().
          const auto mine = overlapped.shard_parameters(rank);
          for (std::size_t i = 0; i < before.size(); ++i) {
            const auto p = net_overlap->parameters()[i];  // a copy: parameters() is a temporary
            const bool owned = std::any_of(mine.begin(), mine.end(), [&](const auto& m) {
              return m.unsafeGetTensorImpl() == p.unsafeGetTensorImpl();
            });
            if (owned && torch::equal(p, before[i])) {
              throw std::runtime_error(fmt::format(
                  "{} step {}: owned parameter {} unchanged after backward", what, step, i));
            }
          }
          overlapped.step();
          const auto want = snapshot(net_plain);
          const auto got = snapshot(net_overlap);
          for (std::size_t i = 0; i < want.size(); ++i) {
            if (!torch::equal(got[i], want[i])) {
              throw std::runtime_error(fmt::format("{} step {}: parameter {} differs by {:g}", what,
                                                   step, i,
                                                   (got[i] - want[i]).abs().max().item<double>()));
            }
          }
        }
        test::expect_throws<ConfigError>([&] { overlapped.step(); }, "no backward ran",
                                         "a second step() without backward");
      }
    }
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(ZeroRedundancyOptimizer, OverlapWithDdpMisuseIsNamed) {
  const int port = test::free_port();
  const auto results = run_ranks(2, [&](int rank) {
    auto pg = join_group(rank, 2, port, 10s);
    auto net = make_model();
    DistributedDataParallel ddp(net, pg);
    ZeroRedundancyOptimizer plain(ddp->parameters(), factory(Kind::kSgd), pg);
    test::expect_throws<ConfigError>([&] { hook_with_zero_step(allreduce_hook(), plain); },
                                     "without overlap_with_ddp", "a ZeRO without overlap");
    ZeroRedundancyOptimizer overlapped(ddp->parameters(), factory(Kind::kSgd), pg,
                                       ZeroOptions{.overlap_with_ddp = true});
    test::expect_throws<ConfigError>([&] { hook_with_zero_step(CommHook(), overlapped); },
                                     "the comm hook to wrap is empty", "an empty hook");
    test::expect_throws<ConfigError>([&] { overlapped.step(); }, "no backward ran",
                                     "step() before any backward");
    test::expect_throws<ConfigError>([&] { overlapped.step([] { return torch::zeros({}); }); },
                                     "takes no closure", "a closure");
    // A ZeRO over another model's parameters: the hook names it in backward, on every rank.
    auto other = make_model();
    ZeroRedundancyOptimizer stranger(other->parameters(), factory(Kind::kSgd), pg,
                                     ZeroOptions{.overlap_with_ddp = true});
    ddp->register_comm_hook(hook_with_zero_step(allreduce_hook(), stranger));
    auto [x, y] = make_batch(rank, 2, 0);
    test::expect_throws<Error>([&] { torch::mse_loss(ddp->forward(x), y).backward(); },
                               "does not optimize", "a stranger's optimizer");
  });
  EXPECT_ALL_RANKS_OK(results);
}

}  // namespace DDP_UNITY_ID
}  // namespace
}  // namespace ddp
