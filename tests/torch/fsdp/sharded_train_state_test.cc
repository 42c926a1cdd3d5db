// ddp::ShardedTrainState (train_state.h) over FullyShardedDataParallel, in real processes: a run
// saved at world 2 loads at world 3 with the progress, rank 0's buffers and torch's generator
// back, and resumed at world 2 ends bit for bit where the uninterrupted run ends; a newer save
// replaces the older; a rank dying mid-save leaves the previous checkpoint as the one that loads; a
// damaged or hostile latest.pt, another model's state and a missing folder are named errors that
// change nothing.
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "ddp/error.h"
#include "ddp/torch/checkpoint/checkpoint.h"
#include "ddp/torch/checkpoint/train_state.h"
#include "ddp/torch/fsdp/fully_sharded_data_parallel.h"
#include "support/multiprocess.h"
#include "support/temp_dir.h"
#include "support/torch/ddp_test_util.h"
#include "support/unity_namespace.h"

namespace ddp {
namespace {
namespace DDP_UNITY_ID {

using namespace std::chrono_literals;
using test::join_group;
using test::run_ranks;

constexpr int kBatch = 12;  // global: 6 per rank at world 2, 4 at world 3

// Linear(5, 7), BatchNorm1d(7), Tanh, Linear(7, 3): two units of 42 + 14 and 24 parameters.
torch::nn::Sequential make_net(int width = 7) {
  torch::manual_seed(11);
  return torch::nn::Sequential(torch::nn::Linear(5, width), torch::nn::BatchNorm1d(width),
                               torch::nn::Tanh(), torch::nn::Linear(width, 3));
}

torch::Tensor running_mean(const FullyShardedDataParallel& model) {
  return model->module()->named_buffers()["1.running_mean"];
}

FsdpOptions two_units() {
  return {.units = {{0, 3}, {3, 4}}};
}

// Rank `rank`'s part of the global batch of `step` (the same samples at every world size).
std::pair<torch::Tensor, torch::Tensor> batch_of(int rank, int world, int step) {
  torch::manual_seed(1000 + step);
  const auto x = torch::randn({kBatch, 5});
  const auto y = torch::randn({kBatch, 3});
  const int per = kBatch / world;
  return {x.narrow(0, rank * per, per), y.narrow(0, rank * per, per)};
}

void train(FullyShardedDataParallel& model, torch::optim::Optimizer& opt, int rank, int world,
           int from, int to) {
  for (int step = from; step < to; ++step) {
    const auto [x, y] = batch_of(rank, world, step);
    opt.zero_grad();
    torch::mse_loss(model->forward(x), y).backward();
    opt.step();
  }
}

TEST(ShardedTrainState, SavedAtTwoLoadsAtThreeAndResumesAtTwoWhereTheUninterruptedRunEnds) {
  test::TempDir dir;
  const auto ckpt = dir.path() / "state";
  const auto expected = dir.path() / "expected.pt";
  const int port = test::free_port();
  EXPECT_ALL_RANKS_OK(run_ranks(2, [&](int rank) {
    auto pg = join_group(rank, 2, port);
    FullyShardedDataParallel model(make_net(), pg, two_units());
    torch::optim::Adam opt(model->parameters(), 0.01);
    ShardedTrainState state(*model, opt, {.tag = "net"});
    train(model, opt, rank, 2, 0, 4);
    state.save(ckpt, {.epoch = 1, .epoch_offset = 36, .global_step = 4, .scheduler_step = 4}, 2);
    // What load must give back: rank 0's buffers now, and torch's next draw.
    torch::serialize::OutputArchive archive;
    archive.write("running_mean", running_mean(model).clone());  // it changes in place
    archive.write("draw", torch::randn({4}));
    train(model, opt, rank, 2, 4, 8);
    const auto final_state = model->full_state_dict(0);
    if (rank != 0) return;
    for (const auto& item : final_state)
      archive.write("final/" + item.key(), item.value());
    archive.save_to(expected.string());
  }));
  ASSERT_TRUE(std::filesystem::exists(ckpt / "latest.pt"));
  // PyTorch's distributed checkpoint of the model and its optimizer, beside the progress.
  ASSERT_TRUE(std::filesystem::exists(ckpt / "ckpt-1" / ".metadata"));
  ASSERT_TRUE(std::filesystem::exists(ckpt / "ckpt-1" / "train_state.pt"));

  // At world 3 and at world 2 (BatchNorm normalises each rank's own batch, so only a resume at
  // the saving world size can end bit for bit where the uninterrupted run ended).
  for (const int world : {3, 2}) {
    const int port_resumed = test::free_port();
    EXPECT_ALL_RANKS_OK(run_ranks(world, [&](int rank) {
      auto pg = join_group(rank, world, port_resumed);
      FullyShardedDataParallel model(make_net(), pg, two_units());
      torch::optim::Adam opt(model->parameters(), 0.01);
      ShardedTrainState state(*model, opt, {.tag = "net"});
      torch::manual_seed(99);  // load must replace it
      const auto progress = state.load(ckpt);
      if (progress.epoch != 1 || progress.epoch_offset != 36 || progress.global_step != 4 ||
          progress.world_size != 2) {
        throw std::runtime_error(fmt::format("progress epoch {} offset {} step {} world {}",
                                             progress.epoch, progress.epoch_offset,
                                             progress.global_step, progress.world_size));
      }
      torch::serialize::InputArchive want;
      want.load_from(expected.string());
      torch::Tensor mean, draw;
      want.read("running_mean", mean);
      want.read("draw", draw);
      test::expect_close(running_mean(model), mean, "running_mean after load", 0, 0);
      test::expect_close(torch::randn({4}), draw, "torch's draw after load", 0, 0);
      train(model, opt, rank, world, 4, 8);
      const auto final_state = model->full_state_dict(0);
      if (rank != 0 || world != 2) return;
      for (const auto& item : final_state) {
        torch::Tensor saved;
        want.read("final/" + item.key(), saved);
        test::expect_close(item.value(), saved, "resumed " + item.key(), 0, 0);
      }
    }));
  }
}

TEST(ShardedTrainState, ANewerSaveReplacesTheOlderAndARankDyingMidSaveLeavesIt) {
  test::TempDir dir;
  const auto ckpt = dir.path() / "state";
  const int port = test::free_port();
  const auto results = run_ranks(2, [&](int rank) {
    auto pg = join_group(rank, 2, port, 10s);
    FullyShardedDataParallel model(make_net(), pg, two_units());
    torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    ShardedTrainState state(*model, opt, {.tag = "net"});
    train(model, opt, rank, 2, 0, 2);
    state.save(ckpt, {.global_step = 2});
    train(model, opt, rank, 2, 2, 3);
    state.save(ckpt, {.global_step = 3});
    train(model, opt, rank, 2, 3, 4);
    // Rank 1 dies instead of saving: rank 0's save fails, naming the group's error.
    if (rank == 1) std::_Exit(0);
    state.save(ckpt, {.global_step = 4});
  });
  ASSERT_EQ(results[1].exit_code, 0);
  EXPECT_NE(results[0].exit_code, 0) << "rank 0's save returned although rank 1 never saved";
  EXPECT_TRUE(std::filesystem::exists(ckpt / "ckpt-2"));
  EXPECT_FALSE(std::filesystem::exists(ckpt / "ckpt-1")) << "the older checkpoint was kept";
  EXPECT_FALSE(std::filesystem::exists(ckpt / "ckpt-3" / ".metadata"));

  const int port1 = test::free_port();
  EXPECT_ALL_RANKS_OK(run_ranks(1, [&](int rank) {
    auto pg = join_group(rank, 1, port1);
    FullyShardedDataParallel model(make_net(), pg, two_units());
    torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    ShardedTrainState state(*model, opt, {.tag = "net"});
    const auto progress = state.load(ckpt);
    if (progress.global_step != 3) {
      throw std::runtime_error(fmt::format("loaded global_step {}, not 3", progress.global_step));
    }
  }));
}

TEST(ShardedTrainState, BadFoldersAreNamedAndChangeNothing) {
  test::TempDir dir;
  const auto ckpt = dir.path() / "state";
  const int port = test::free_port();
  EXPECT_ALL_RANKS_OK(run_ranks(1, [&](int rank) {
    auto pg = join_group(rank, 1, port);
    FullyShardedDataParallel model(make_net(), pg, two_units());
    torch::optim::Adam opt(model->parameters(), 0.01);
    ShardedTrainState state(*model, opt, {.tag = "net"});
    train(model, opt, rank, 1, 0, 2);
    state.save(ckpt, {.global_step = 2});

    // A checkpoint folder of ddp's earlier sharded format (written by units, no .metadata) still
    // loads: the same shards come back.
    {
      const auto folder = ckpt / "ckpt-1";
      std::vector<std::filesystem::path> dcp_files;
      for (const auto& entry : std::filesystem::directory_iterator(folder)) {
        const auto name = entry.path().filename().string();
        if (name == ".metadata" || name.ends_with(".distcp")) dcp_files.push_back(entry.path());
      }
      for (const auto& file : dcp_files)
        std::filesystem::remove(file);
      model->save_sharded_checkpoint(folder, opt);
      const auto saved = model->parameters()[0].detach().clone();
      model->parameters()[0].detach().add_(1.0);
      if (state.load(ckpt).global_step != 2) throw std::runtime_error("the earlier format: step");
      test::expect_close(model->parameters()[0], saved, "the earlier format's shard", 0, 0);
    }

    const auto expect_unchanged_after = [&](const std::function<void()>& load,
                                            const std::string& needle, const std::string& what) {
      const auto before = model->parameters()[0].detach().clone();
      test::expect_throws<Error>(load, needle, what);
      test::expect_close(model->parameters()[0], before, what + ": the shard changed", 0, 0);
    };
    // Another tag; another model (a wider layer: other buffers and units).
    ShardedTrainState other_tag(*model, opt, {.tag = "mlp"});
    expect_unchanged_after([&] { other_tag.load(ckpt); }, "saved for 'net'", "another tag");
    FullyShardedDataParallel wider(make_net(8), pg, two_units());
    torch::optim::Adam wider_opt(wider->parameters(), 0.01);
    ShardedTrainState wider_state(*wider, wider_opt, {.tag = "net"});
    test::expect_throws<Error>([&] { wider_state.load(ckpt); }, "has shape 7 there but 8",
                               "another model");
    // A latest.pt that points outside the folder, and one that is damaged.
    torch::serialize::OutputArchive hostile;
    hostile.write("checkpoint", c10::IValue(std::string("../../etc")));
    save_archive_atomically(hostile, ckpt / "latest.pt");
    expect_unchanged_after([&] { state.load(ckpt); }, "does not name a ckpt-<n> folder",
                           "a latest.pt naming ../../etc");
    {
      std::ofstream damaged(ckpt / "latest.pt", std::ios::binary | std::ios::trunc);
      damaged << "not an archive";
    }
    expect_unchanged_after([&] { state.load(ckpt); }, "latest.pt", "a damaged latest.pt");
    test::expect_throws<ConfigError>([&] { state.load(dir.path() / "nothing"); }, "nothing",
                                     "a missing folder");
  }));
}

}  // namespace DDP_UNITY_ID
}  // namespace
}  // namespace ddp
