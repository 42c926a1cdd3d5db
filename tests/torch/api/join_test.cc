// ddp::Join: uneven inputs across ranks. Rank r trains on base + r batches; the ranks that run out
// shadow the others' collectives, all leave together with identical models, and the numbers are
// PyTorch's (pytorch_join_reference.py runs PyTorch's DDP + Join on gloo with the same model,
// data and split).
#include <cmath>
#include <map>
#include <sstream>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "ddp/error.h"
#include "ddp/torch/api/join.h"
#include "ddp/torch/ddp/distributed_data_parallel.h"
#include "support/multiprocess.h"
#include "support/subprocess.h"
#include "support/temp_dir.h"
#include "support/test_paths.h"
#include "support/torch/ddp_test_models.h"
#include "support/torch/ddp_test_util.h"
#include "support/torch/deterministic_models.h"
#include "support/unity_namespace.h"

namespace ddp {
namespace {
namespace DDP_UNITY_ID {

using namespace std::chrono_literals;
using test::expect_close;
using test::expect_identical_across_ranks;
using test::join_group;
using test::run_ranks;

constexpr int kIn = 6, kHidden = 8, kOut = 3, kBatch = 5;

// The same model and data as pytorch_join_reference.py, from the same formulas.
torch::nn::Sequential make_model() {
  torch::nn::Sequential model(torch::nn::Linear(kIn, kHidden), torch::nn::Tanh(),
                              torch::nn::Linear(kHidden, kOut));
  test::fill_deterministic(*model);
  return model;
}

std::pair<torch::Tensor, torch::Tensor> make_batch(int rank, int step) {
  std::vector<double> x, y;
  for (int s = 0; s < kBatch; ++s) {
    for (int f = 0; f < kIn; ++f)
      x.push_back(std::sin(0.011 * (rank * 1000 + step * 50 + s * kIn + f) + 0.5 * f));
  }
  for (int s = 0; s < kBatch; ++s) {
    for (int o = 0; o < kOut; ++o)
      y.push_back(std::cos(0.017 * (rank * 1000 + step * 50 + s * kOut + o)));
  }
  return {torch::tensor(x, torch::kFloat64).view({kBatch, kIn}).to(torch::kFloat32),
          torch::tensor(y, torch::kFloat64).view({kBatch, kOut}).to(torch::kFloat32)};
}

torch::optim::SGD make_optimizer(std::vector<torch::Tensor> params) {
  return torch::optim::SGD(std::move(params), torch::optim::SGDOptions(0.1).momentum(0.9));
}

// Trains under Join on `world` ranks, rank r for base + r steps; returns rank 0's parameters
// (every rank checks that all hold the same ones).
std::map<std::string, torch::Tensor> train_uneven(int world, int base, bool divide,
                                                  const std::string& out_file) {
  const int port = test::free_port();
  const auto results = run_ranks(world, [&](int rank) {
    auto pg = join_group(rank, world, port);
    auto net = make_model();
    DistributedDataParallel model(net, pg);
    auto opt = make_optimizer(model->parameters());
    {
      Join join({*model}, {.divide_by_initial_world_size = divide});
      for (int step = 0; step < base + rank; ++step) {
        auto [x, y] = make_batch(rank, step);
        opt.zero_grad();
        torch::mse_loss(model->forward(x), y).backward();
        opt.step();
      }
    }
    expect_identical_across_ranks(*pg, model->parameters(), "parameters after Join");
    if (rank == 0) torch::save(net, out_file);
  });
  for (const auto& r : results) {
    if (!r.ok()) throw std::runtime_error(test::describe(results));
  }
  auto net = make_model();
  torch::load(net, out_file);
  std::map<std::string, torch::Tensor> params;
  for (const auto& item : net->named_parameters())
    params[item.key()] = item.value().detach();
  return params;
}

// One process: at step k the ranks still training are those with k < base + r; their losses are
// summed and divided by the world size (divide) or by their number.
std::map<std::string, torch::Tensor> train_reference(int world, int base, bool divide) {
  auto net = make_model();
  auto opt = make_optimizer(net->parameters());
  for (int step = 0; step < base + world - 1; ++step) {
    opt.zero_grad();
    torch::Tensor loss = torch::zeros({});
    int active = 0;
    for (int r = 0; r < world; ++r) {
      if (step >= base + r) continue;
      auto [x, y] = make_batch(r, step);
      loss = loss + torch::mse_loss(net->forward(x), y);
      ++active;
    }
    (loss / (divide ? world : active)).backward();
    opt.step();
  }
  std::map<std::string, torch::Tensor> params;
  for (const auto& item : net->named_parameters())
    params[item.key()] = item.value().detach();
  return params;
}

void expect_same_parameters(const std::map<std::string, torch::Tensor>& got,
                            const std::map<std::string, torch::Tensor>& want, double tolerance) {
  ASSERT_EQ(got.size(), want.size());
  for (const auto& [name, tensor] : want) {
    ASSERT_TRUE(got.count(name)) << name;
    const auto diff = (got.at(name) - tensor).abs().max().item<double>();
    EXPECT_LE(diff, tolerance) << name;
  }
}

TEST(Join, UnevenInputsEqualOneProcessDividingByTheInitialWorldSize) {
  test::TempDir dir;
  for (const int world : {2, 3}) {
    const auto got = train_uneven(world, 2, true, (dir.path() / "p.pt").string());
    expect_same_parameters(got, train_reference(world, 2, true), 1e-5);
  }
}

TEST(Join, UnevenInputsEqualOneProcessDividingByTheRanksStillTraining) {
  test::TempDir dir;
  const auto got = train_uneven(3, 2, false, (dir.path() / "p.pt").string());
  expect_same_parameters(got, train_reference(3, 2, false), 1e-5);
  // Not the same training as dividing by the world size: the option matters.
  const auto other = train_reference(3, 2, true);
  EXPECT_GT((got.at("2.bias") - other.at("2.bias")).abs().max().item<double>(), 1e-4);
}

std::map<std::string, torch::Tensor> parse_reference(const std::string& output) {
  std::map<std::string, torch::Tensor> params;
  std::istringstream lines(output);
  std::string line;
  while (std::getline(lines, line)) {
    std::istringstream fields(line);
    std::string name;
    fields >> name;
    std::vector<double> values;
    double v = 0;
    while (fields >> v)
      values.push_back(v);
    if (!name.empty() && !values.empty()) {
      params[name] = torch::tensor(values, torch::kFloat64).to(torch::kFloat32);
    }
  }
  return params;
}

TEST(Join, SameNumbersAsPyTorchDdpWithJoinOnGloo) {
  const std::string python = "/usr/bin/python3";
  auto probe = test::Subprocess::start({python, "-c", "import torch.distributed.algorithms.join"});
  const auto probed = probe.wait(60s);
  if (probed.exit_code != 0) {
    GTEST_SKIP() << python
                 << " cannot import torch.distributed (install python3-torch): " << probed.output;
  }
  test::TempDir dir;
  for (const bool divide : {true, false}) {
    auto reference =
        test::Subprocess::start({python, test::paths::join_reference_script, "3", "3",
                                 divide ? "1" : "0", std::to_string(test::free_port())},
                                {{"OMP_NUM_THREADS", "1"}});
    const auto done = reference.wait(180s);
    ASSERT_EQ(done.exit_code, 0) << done.output;
    const auto want = parse_reference(done.output);
    ASSERT_EQ(want.size(), 4u) << done.output;
    auto got = train_uneven(3, 3, divide, (dir.path() / "p.pt").string());
    for (auto& [name, tensor] : got)
      tensor = tensor.flatten();
    expect_same_parameters(got, want, 1e-5);
  }
}

// BatchNorm buffers, an unused branch, small buckets (so the rebuild after the first step
// matters), uneven steps: rank 0 joins after one step and shadows the rebuild, the buffer
// broadcasts and the unused map.
struct BranchyImpl : torch::nn::Module {
  BranchyImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(20, 16));
    norm = register_module("norm", torch::nn::BatchNorm1d(16));
    side = register_module("side", torch::nn::Linear(16, 4));
    fc2 = register_module("fc2", torch::nn::Linear(16, 4));
  }
  torch::Tensor forward(torch::Tensor x, bool use_side) {
    auto h = torch::relu(norm(fc1(x)));
    return use_side ? side(h) : fc2(h);
  }
  torch::nn::Linear fc1{nullptr}, side{nullptr}, fc2{nullptr};
  torch::nn::BatchNorm1d norm{nullptr};
};
TORCH_MODULE(Branchy);

TEST(Join, ShadowsBuffersRebuildAndUnusedMap) {
  const int port = test::free_port();
  const int world = 3;
  const auto results = run_ranks(world, [&](int rank) {
    auto pg = join_group(rank, world, port);
    torch::manual_seed(3);
    Branchy net;
    DistributedDataParallel model(
        net.ptr(), pg,
        {.bucket_cap_mb = 0.0005, .first_bucket_cap_mb = 0.0002, .find_unused_parameters = true});
    auto opt = make_optimizer(model->parameters());
    torch::manual_seed(10 + rank);
    {
      Join join({*model});
      for (int step = 0; step < 1 + 2 * rank; ++step) {
        opt.zero_grad();
        auto out = model->forward(torch::randn({6, 20}), step % 2 == 1);
        out.pow(2).mean().backward();
        opt.step();
      }
      join.finish();
    }
    if (!model->reducer().buckets_rebuilt()) throw std::runtime_error("buckets not rebuilt");
    expect_identical_across_ranks(*pg, model->parameters(), "parameters after Join");
    expect_identical_across_ranks(*pg, net->buffers(), "buffers after Join");
    // Training goes on normally afterwards (with a fresh optimizer: the momentum of ranks that
    // joined early differs, as in PyTorch).
    torch::optim::SGD later(model->parameters(), 0.1);
    later.zero_grad();
    model->forward(torch::randn({6, 20}), false).pow(2).mean().backward();
    later.step();
    expect_identical_across_ranks(*pg, model->parameters(), "parameters after a later step");
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(Join, NoSyncAccumulationUnderJoin) {
  // Micro-steps in no_sync, then a synchronised one; rank 1 has more of them.
  const int port = test::free_port();
  const auto results = run_ranks(2, [&](int rank) {
    auto pg = join_group(rank, 2, port);
    auto net = make_model();
    DistributedDataParallel model(net, pg);
    auto opt = make_optimizer(model->parameters());
    Join join({*model});
    for (int step = 0; step < 2 + 2 * rank; ++step) {
      opt.zero_grad();
      for (int micro = 0; micro < 3; ++micro) {
        auto [x, y] = make_batch(rank, step * 3 + micro);
        if (micro < 2) {
          auto guard = model->no_sync();
          torch::mse_loss(model->forward(x), y).backward();
        } else {
          torch::mse_loss(model->forward(x), y).backward();
        }
      }
      opt.step();
    }
    join.finish();
    expect_identical_across_ranks(*pg, model->parameters(), "parameters after Join");
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(Join, ThrowOnEarlyTerminationThrowsOnEveryRank) {
  const int port = test::free_port();
  const auto results = run_ranks(3, [&](int rank) {
    auto pg = join_group(rank, 3, port);
    auto net = make_model();
    DistributedDataParallel model(net, pg);
    auto opt = make_optimizer(model->parameters());
    try {
      Join join({*model}, {.throw_on_early_termination = true});
      for (int step = 0; step < 2 + rank; ++step) {
        auto [x, y] = make_batch(rank, step);
        opt.zero_grad();
        torch::mse_loss(model->forward(x), y).backward();
        opt.step();
      }
      join.finish();
    } catch (const Error& e) {
      if (std::string(e.what()).find("exhausted its inputs") == std::string::npos) throw;
      return;
    }
    throw std::runtime_error("no rank-wide error");
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(Join, DifferentJoinablesAreANamedErrorOnEveryRank) {
  const int port = test::free_port();
  const auto results = run_ranks(2, [&](int rank) {
    auto pg = join_group(rank, 2, port, 20s);
    auto first = make_model();
    DistributedDataParallel a(first, pg);
    test::Mlp second;
    DistributedDataParallel b(second.ptr(), pg);
    try {
      if (rank == 0) {
        Join join({*a});
      } else {
        Join join({*a, *b});
      }
    } catch (const Error& e) {
      if (std::string(e.what()).find("joined different joinables") == std::string::npos) throw;
      return;
    }
    throw std::runtime_error("no error");
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(Join, RanksDisagreeingOnNoSyncAreNamed) {
  const int port = test::free_port();
  const auto results = run_ranks(2, [&](int rank) {
    auto pg = join_group(rank, 2, port, 20s);
    auto net = make_model();
    DistributedDataParallel model(net, pg);
    try {
      Join join({*model});
      auto [x, y] = make_batch(rank, 0);
      if (rank == 0) {
        auto guard = model->no_sync();
        torch::mse_loss(model->forward(x), y).backward();
      } else {
        torch::mse_loss(model->forward(x), y).backward();
      }
    } catch (const Error& e) {
      if (std::string(e.what()).find("no_sync") == std::string::npos) throw;
      return;
    }
    throw std::runtime_error("no error");
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(Join, DisabledJoinMakesNoCollectives) {
  // Even inputs; with enable = false the step makes exactly the collectives of plain DDP, so a
  // rank without Join works with a rank inside a disabled one.
  const int port = test::free_port();
  const auto results = run_ranks(2, [&](int rank) {
    auto pg = join_group(rank, 2, port, 20s);
    auto net = make_model();
    DistributedDataParallel model(net, pg);
    auto opt = make_optimizer(model->parameters());
    std::optional<Join> join;
    if (rank == 0)
      join.emplace(std::vector<std::reference_wrapper<Joinable>>{*model},
                   JoinOptions{.enable = false});
    for (int step = 0; step < 3; ++step) {
      auto [x, y] = make_batch(rank, step);
      opt.zero_grad();
      torch::mse_loss(model->forward(x), y).backward();
      opt.step();
    }
    if (join) join->finish();
    expect_identical_across_ranks(*pg, model->parameters(), "parameters");
  });
  EXPECT_ALL_RANKS_OK(results);
}

}  // namespace DDP_UNITY_ID
}  // namespace
}  // namespace ddp
