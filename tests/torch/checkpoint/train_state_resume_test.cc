// TrainState across real processes: a run saved mid-epoch at world size 2 and resumed at 2 ends
// with the parameters of an uninterrupted run; resumed at 1 or 3 it repeats no sample and skips
// none (the indices each rank trained on are written to files and checked here) and trains on.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "ddp/torch/checkpoint/train_state.h"
#include "ddp/torch/ddp/distributed_data_parallel.h"
#include "ddp/torch/samplers/distributed_sampler.h"
#include "support/multiprocess.h"
#include "support/temp_dir.h"
#include "support/torch/ddp_test_models.h"
#include "support/torch/ddp_test_util.h"
#include "support/unity_namespace.h"

namespace ddp::test {
namespace {
namespace DDP_UNITY_ID {

constexpr std::int64_t kSamples = 96;
constexpr std::int64_t kBatch = 4;  // per rank
constexpr std::uint64_t kEpochs = 2;
constexpr std::int64_t kStopStep = 7;  // of 12 steps per epoch at world size 2

struct RunSpec {
  int world = 2;
  bool resume = false;
  std::int64_t stop_after_steps = -1;  // save the state there and stop; -1: run to the end
  std::filesystem::path state;         // the TrainState file
  std::filesystem::path folder;        // where the ranks write what the parent checks
  std::string name;                    // of this run, in those files' names
};

// Trains the Mlp of ddp_test_models.h on a fixed random dataset under DDP; each rank records the
// indices it trained on ("epoch index" lines), rank 0 the final parameters.
void train(int rank, int port, const RunSpec& spec) {
  auto group = join_group(rank, spec.world, port);
  torch::manual_seed(7);
  const auto inputs = torch::randn({kSamples, 20});
  const auto targets = torch::randint(0, 4, {kSamples});
  torch::manual_seed(1);
  Mlp net;
  auto optimizer = make_sgd(net->parameters());
  TrainState state(*net, optimizer, {.tag = "mlp"});
  TrainProgress progress;
  if (spec.resume) progress = state.load(spec.state);
  auto model = DistributedDataParallel(net.ptr(), group);
  DistributedSampler sampler(kSamples, *group, {.shuffle = true, .seed = 3});

  std::ofstream trained(spec.folder / fmt::format("{}-rank{}.txt", spec.name, rank));
  for (auto epoch = progress.epoch; epoch < kEpochs; ++epoch, progress.epoch_offset = 0) {
    sampler.set_epoch(epoch, progress.epoch_offset);
    const auto indices = sampler.indices();
    for (std::size_t start = 0; start < indices.size(); start += kBatch) {
      const auto count = std::min<std::size_t>(kBatch, indices.size() - start);
      const std::vector<std::int64_t> rows(
          indices.begin() + static_cast<std::ptrdiff_t>(start),
          indices.begin() + static_cast<std::ptrdiff_t>(start + count));
      for (auto row : rows)
        trained << epoch << ' ' << row << '\n';
      const auto index = torch::tensor(rows, torch::kInt64);
      optimizer.zero_grad();
      const auto loss = torch::nn::functional::cross_entropy(
          model->forward(inputs.index_select(0, index)), targets.index_select(0, index));
      loss.backward();
      optimizer.step();
      if (!std::isfinite(loss.item<double>())) throw std::runtime_error("the loss is not finite");
      ++progress.global_step;
      ++progress.scheduler_step;
      if (progress.global_step == spec.stop_after_steps) {
        if (rank == 0) {
          progress.epoch = epoch;
          progress.epoch_offset = sampler.consumed_after(start + count);
          state.save(spec.state, progress, spec.world);
        }
        group->barrier()->wait();
        return;
      }
    }
  }
  expect_identical_across_ranks(*group, net->parameters(), "the trained parameters");
  if (rank == 0) {
    torch::save(net->parameters(), (spec.folder / (spec.name + "-params.pt")).string());
  }
  group->barrier()->wait();
}

void run(const RunSpec& spec) {
  const int port = free_port();
  const auto results = run_ranks(spec.world, [&](int rank) { train(rank, port, spec); });
  EXPECT_ALL_RANKS_OK(results);
}

// epoch -> every index trained in it, over the ranks of run `name`.
std::map<std::uint64_t, std::multiset<std::int64_t>> trained_indices(
    const std::filesystem::path& folder, const std::string& name, int world) {
  std::map<std::uint64_t, std::multiset<std::int64_t>> result;
  for (int rank = 0; rank < world; ++rank) {
    std::ifstream in(folder / fmt::format("{}-rank{}.txt", name, rank));
    std::uint64_t epoch = 0;
    std::int64_t index = 0;
    while (in >> epoch >> index)
      result[epoch].insert(index);
  }
  return result;
}

class TrainStateResume : public ::testing::Test {
 protected:
  TempDir dir_{"ddp-train-state"};
  std::filesystem::path state_ = dir_.path() / "state.pt";
  void save_mid_epoch() {
    run({.world = 2,
         .stop_after_steps = kStopStep,
         .state = state_,
         .folder = dir_.path(),
         .name = "first"});
    ASSERT_TRUE(std::filesystem::exists(state_));
  }
};

TEST_F(TrainStateResume, AtTheSameWorldSizeGivesTheParametersOfAnUninterruptedRun) {
  run({.world = 2, .folder = dir_.path(), .name = "whole"});
  save_mid_epoch();
  run({.world = 2, .resume = true, .state = state_, .folder = dir_.path(), .name = "resumed"});
  // The parent never touches libtorch before forking; these loads come after every fork.
  std::vector<torch::Tensor> whole;
  std::vector<torch::Tensor> resumed;
  torch::load(whole, (dir_.path() / "whole-params.pt").string());
  torch::load(resumed, (dir_.path() / "resumed-params.pt").string());
  ASSERT_EQ(whole.size(), resumed.size());
  for (std::size_t i = 0; i < whole.size(); ++i) {
    EXPECT_TRUE(torch::allclose(whole[i], resumed[i], 0.0, 1e-6))
        << "parameter " << i << " differs by "
        << (whole[i] - resumed[i]).abs().max().item<double>();
  }
  // And the samples were the same ones, in the same epochs.
  auto first = trained_indices(dir_.path(), "first", 2);
  for (const auto& [epoch, indices] : trained_indices(dir_.path(), "resumed", 2))
    first[epoch].insert(indices.begin(), indices.end());
  EXPECT_EQ(first, trained_indices(dir_.path(), "whole", 2));
}

void expect_every_sample_once(const std::filesystem::path& folder, int world) {
  const auto first = trained_indices(folder, "first", 2);
  const auto resumed = trained_indices(folder, fmt::format("resumed{}", world), world);
  // Epoch 0: the first run's part plus the resumed part cover every sample; a repeat is only the
  // sampler's padding of the remaining samples to a multiple of the new world size.
  const auto& done = first.at(0);
  const auto& rest = resumed.at(0);
  EXPECT_EQ(done.size(), static_cast<std::size_t>(kStopStep * kBatch * 2));
  std::set<std::int64_t> all(done.begin(), done.end());
  all.insert(rest.begin(), rest.end());
  EXPECT_EQ(all.size(), static_cast<std::size_t>(kSamples)) << "a sample was skipped";
  for (auto index : done)
    EXPECT_EQ(rest.count(index), 0u) << "sample " << index << " trained again after the resume";
  const auto remaining = static_cast<std::size_t>(kSamples) - done.size();
  const auto w = static_cast<std::size_t>(world);
  EXPECT_EQ(rest.size(), (remaining + w - 1) / w * w) << "padding beyond the new world size";
  // Epoch 1 runs whole at the new world size.
  EXPECT_EQ(std::set<std::int64_t>(resumed.at(1).begin(), resumed.at(1).end()).size(),
            static_cast<std::size_t>(kSamples));
  EXPECT_TRUE(std::filesystem::exists(folder / fmt::format("resumed{}-params.pt", world)));
}

TEST_F(TrainStateResume, AtWorldSizeOneRepeatsNoSampleAndSkipsNone) {
  save_mid_epoch();
  run({.world = 1, .resume = true, .state = state_, .folder = dir_.path(), .name = "resumed1"});
  expect_every_sample_once(dir_.path(), 1);
}

TEST_F(TrainStateResume, AtWorldSizeThreeRepeatsNoSampleAndSkipsNone) {
  save_mid_epoch();
  run({.world = 3, .resume = true, .state = state_, .folder = dir_.path(), .name = "resumed3"});
  expect_every_sample_once(dir_.path(), 3);
}

}  // namespace DDP_UNITY_ID
}  // namespace
}  // namespace ddp::test
