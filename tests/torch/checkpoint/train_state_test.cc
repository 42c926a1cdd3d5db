// TrainState in one process: a round trip restores model, optimizer, progress and both
// generators; a corrupt, truncated or foreign file is a named error that changes nothing, neither
// the model nor the file.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "ddp/error.h"
#include "ddp/torch/checkpoint/checkpoint.h"
#include "ddp/torch/checkpoint/train_state.h"
#include "support/temp_dir.h"
#include "support/unity_namespace.h"

namespace ddp::test {
namespace {
namespace DDP_UNITY_ID {

using ::testing::HasSubstr;
using ::testing::Not;

struct Trainee {
  torch::nn::Sequential net;
  std::unique_ptr<torch::optim::SGD> optimizer;
  explicit Trainee(int inputs = 4) {
    net = torch::nn::Sequential(torch::nn::Linear(inputs, 8), torch::nn::ReLU(),
                                torch::nn::Linear(8, 3));
    optimizer = std::make_unique<torch::optim::SGD>(net->parameters(),
                                                    torch::optim::SGDOptions(0.1).momentum(0.9));
  }
  void step() {
    const auto x = torch::randn({16, net->ptr(0)->as<torch::nn::Linear>()->options.in_features()});
    const auto y = torch::randint(0, 3, {16});
    optimizer->zero_grad();
    torch::nn::functional::cross_entropy(net->forward(x), y).backward();
    optimizer->step();
  }
  std::vector<torch::Tensor> snapshot() const {
    std::vector<torch::Tensor> values;
    for (const auto& p : net->parameters())
      values.push_back(p.detach().clone());
    return values;
  }
};

std::string file_bytes(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), {});
}

void expect_equal(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (std::size_t i = 0; i < a.size(); ++i)
    EXPECT_TRUE(torch::equal(a[i], b[i])) << "parameter " << i;
}

TEST(TrainStateTest, RoundTripRestoresModelOptimizerProgressAndGenerators) {
  torch::set_num_threads(1);
  TempDir dir;
  const auto path = dir.path() / "state.pt";
  torch::manual_seed(1);
  std::mt19937 rng(123);
  Trainee saved;
  saved.step();
  TrainState state(*saved.net, *saved.optimizer, {.tag = "small", .rng = &rng});
  state.save(path, {.epoch = 3, .epoch_offset = 640, .global_step = 1234, .scheduler_step = 1200},
             /*world_size=*/2);
  EXPECT_FALSE(std::filesystem::exists(dir.path() / "state.pt.tmp"));
  // What the run would have drawn next, from both generators.
  const auto next_torch = torch::rand({5});
  const auto next_user = rng();
  saved.step();
  const auto after_step = saved.snapshot();

  torch::manual_seed(99);  // everything different, then loaded back
  std::mt19937 other_rng(7);
  Trainee loaded;
  TrainState restore(*loaded.net, *loaded.optimizer, {.tag = "small", .rng = &other_rng});
  const TrainProgress progress = restore.load(path);
  EXPECT_EQ(progress.epoch, 3u);
  EXPECT_EQ(progress.epoch_offset, 640u);
  EXPECT_EQ(progress.global_step, 1234);
  EXPECT_EQ(progress.scheduler_step, 1200);
  EXPECT_EQ(progress.world_size, 2);
  EXPECT_TRUE(torch::equal(torch::rand({5}), next_torch)) << "torch's generator not restored";
  EXPECT_EQ(other_rng(), next_user) << "the std::mt19937 not restored";
  // Model, momentum and the generator together: the same next step gives the same parameters.
  loaded.step();
  expect_equal(loaded.snapshot(), after_step);
}

// Loads `path` into a fresh model and expects an Error containing `expected`, with the model and
// the file unchanged.
void expect_refused(const std::filesystem::path& path, const std::string& expected,
                    const std::string& tag = "small", int inputs = 4) {
  const std::string bytes_before = file_bytes(path);
  torch::manual_seed(5);
  Trainee model(inputs);
  const auto before = model.snapshot();
  TrainState state(*model.net, *model.optimizer, {.tag = tag});
  try {
    state.load(path);
    ADD_FAILURE() << "loaded " << path << " (expected an error containing '" << expected << "')";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr(path.string()));
    EXPECT_THAT(e.what(), HasSubstr(expected));
  }
  expect_equal(model.snapshot(), before);
  EXPECT_EQ(file_bytes(path), bytes_before) << "loading changed the file";
}

TEST(TrainStateTest, CorruptTruncatedOrForeignFilesAreNamedErrorsThatChangeNothing) {
  TempDir dir;
  Trainee model;
  model.step();
  TrainState state(*model.net, *model.optimizer, {.tag = "small"});
  const auto good = dir.path() / "good.pt";
  state.save(good, {.epoch = 1, .epoch_offset = 32, .global_step = 10});
  const std::string good_bytes = file_bytes(good);

  const auto truncated = dir.path() / "truncated.pt";
  std::filesystem::copy_file(good, truncated);
  std::filesystem::resize_file(truncated, good_bytes.size() / 2);
  expect_refused(truncated, "not a readable torch archive");

  // Flip bytes inside the first weight (libtorch stores tensors uncompressed).
  const auto weight = model.net->parameters()[0].detach().contiguous();
  const std::string needle(static_cast<const char*>(weight.data_ptr()), weight.nbytes());
  const auto at = good_bytes.find(needle);
  ASSERT_NE(at, std::string::npos);
  std::string damaged_bytes = good_bytes;
  for (std::size_t i = 0; i < 16; ++i)
    damaged_bytes[at + i] = static_cast<char>(~damaged_bytes[at + i]);
  const auto damaged = dir.path() / "damaged.pt";
  {
    std::ofstream out(damaged, std::ios::binary);
    out << damaged_bytes;
  }
  expect_refused(damaged, "is damaged");

  expect_refused(good, "was saved for 'small', but this run uses 'large'", "large");
  expect_refused(good, "tensor '0.weight'", "small", /*inputs=*/6);

  const auto plain_checkpoint = dir.path() / "checkpoint.pt";
  save_checkpoint(plain_checkpoint, *model.net, *model.optimizer, {.epoch = 1, .tag = "small"});
  expect_refused(plain_checkpoint, "not a ddp training state");

  // The good file still loads after all of that.
  Trainee again;
  TrainState load_again(*again.net, *again.optimizer, {.tag = "small"});
  EXPECT_EQ(load_again.load(good).global_step, 10);
}

TEST(TrainStateTest, AFailedSaveLeavesThePreviousFileIntact) {
  TempDir dir;
  Trainee model;
  TrainState state(*model.net, *model.optimizer);
  const auto path = dir.path() / "state.pt";
  state.save(path, {.global_step = 1});
  const std::string before = file_bytes(path);
  // A folder in the way of the temporary file makes the next save fail before the rename.
  std::filesystem::create_directory(dir.path() / "state.pt.tmp");
  EXPECT_THROW(state.save(path, {.global_step = 2}), Error);
  EXPECT_EQ(file_bytes(path), before);
  EXPECT_EQ(state.load(path).global_step, 1);
}

TEST(TrainStateTest, MissingFileIsAConfigErrorAndAMissingGeneratorIsNamed) {
  TempDir dir;
  Trainee model;
  TrainState state(*model.net, *model.optimizer);
  EXPECT_THROW(state.load(dir.path() / "absent.pt"), ConfigError);
  state.save(dir.path() / "plain.pt", {});
  std::mt19937 rng;
  TrainState wants_rng(*model.net, *model.optimizer, {.rng = &rng});
  try {
    wants_rng.load(dir.path() / "plain.pt");
    FAIL() << "loaded a file without a generator into a run that expects one";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("saved without a std::mt19937"));
  }
}

// An optimizer of another kind (or with other state-shaping options) is named, with the kind the
// file holds and the kind of this run, instead of libtorch's "is_tensor_type INTERNAL ASSERT
// FAILED"; nothing changes. The same holds for save_checkpoint's files.
TEST(TrainStateTest, AnotherOptimizerIsANamedErrorThatChangesNothing) {
  TempDir dir;
  const auto sgd_file = dir.path() / "sgd.pt";
  const auto adam_file = dir.path() / "adam.pt";
  Trainee sgd_model;  // SGD with momentum
  sgd_model.step();
  TrainState(*sgd_model.net, *sgd_model.optimizer).save(sgd_file, {.global_step = 1});
  Trainee adam_model;
  torch::optim::Adam adam(adam_model.net->parameters(), torch::optim::AdamOptions(1e-3));
  TrainState(*adam_model.net, adam).save(adam_file, {.global_step = 1});

  const auto expect_mismatch = [](TrainState& state, const std::filesystem::path& file,
                                  const std::string& stored, const std::string& current,
                                  const std::vector<torch::Tensor>& unchanged,
                                  const Trainee& model) {
    try {
      state.load(file);
      ADD_FAILURE() << "loaded " << file << " into another optimizer";
    } catch (const OptimizerMismatchError& e) {
      EXPECT_THAT(e.what(), HasSubstr(file.string() + " holds " + stored));
      EXPECT_THAT(e.what(), HasSubstr("this run uses " + current));
      EXPECT_THAT(e.what(), Not(HasSubstr("INTERNAL ASSERT")));
      EXPECT_THAT(e.what(), HasSubstr("start without resuming"));
    }
    expect_equal(model.snapshot(), unchanged);
  };

  Trainee into_sgd;
  TrainState sgd_state(*into_sgd.net, *into_sgd.optimizer);
  expect_mismatch(sgd_state, adam_file, "an Adam optimizer's state", "SGD with momentum",
                  into_sgd.snapshot(), into_sgd);

  Trainee into_adam;
  torch::optim::Adam adam2(into_adam.net->parameters(), torch::optim::AdamOptions(1e-3));
  TrainState adam_state(*into_adam.net, adam2);
  expect_mismatch(adam_state, sgd_file, "an SGD optimizer's state (with momentum)", "Adam",
                  into_adam.snapshot(), into_adam);

  Trainee plain;
  torch::optim::SGD no_momentum(plain.net->parameters(), torch::optim::SGDOptions(0.1));
  TrainState plain_state(*plain.net, no_momentum);
  expect_mismatch(plain_state, sgd_file, "an SGD optimizer's state (with momentum)",
                  "SGD without momentum", plain.snapshot(), plain);

  // save_checkpoint's files say the same.
  const auto checkpoint = dir.path() / "checkpoint.pt";
  save_checkpoint(checkpoint, *adam_model.net, adam, {.epoch = 1});
  try {
    load_checkpoint(checkpoint, *into_sgd.net, *into_sgd.optimizer);
    ADD_FAILURE() << "load_checkpoint loaded an Adam state into SGD";
  } catch (const OptimizerMismatchError& e) {
    EXPECT_EQ(e.stored(), "Adam");
    EXPECT_EQ(e.current(), "SGD with momentum");
    EXPECT_THAT(e.what(), Not(HasSubstr("INTERNAL ASSERT")));
  }
  // The same kind still loads.
  EXPECT_EQ(TrainState(*into_sgd.net, *into_sgd.optimizer).load(sgd_file).global_step, 1);
}

TEST(TrainStateTest, TheDatasetSizeIsStoredAndReturned) {
  TempDir dir;
  Trainee model;
  TrainState state(*model.net, *model.optimizer);
  state.save(dir.path() / "state.pt", {.epoch = 1, .epoch_offset = 256, .dataset_size = 512});
  EXPECT_EQ(state.load(dir.path() / "state.pt").dataset_size, 512u);
  state.save(dir.path() / "unknown.pt", {.epoch = 1});
  EXPECT_EQ(state.load(dir.path() / "unknown.pt").dataset_size, 0u);  // not recorded
}

}  // namespace DDP_UNITY_ID
}  // namespace
}  // namespace ddp::test
