// Checkpoints: a round trip restores model and optimizer exactly; writes are atomic; every bad
// file is an error naming the path.
#include <fcntl.h>
#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <torch/torch.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <thread>
#include <vector>

#include "ddp/error.h"
#include "ddp/torch/checkpoint/checkpoint.h"
#include "support/temp_dir.h"
#include "support/unity_namespace.h"

namespace ddp::test {
namespace {
namespace DDP_UNITY_ID {

using ::testing::HasSubstr;
using ::testing::Not;

struct Model {
  torch::nn::Sequential net;
  std::unique_ptr<torch::optim::SGD> optimizer;

  explicit Model(int inputs = 4) {
    net = torch::nn::Sequential(torch::nn::Linear(inputs, 8), torch::nn::BatchNorm1d(8),
                                torch::nn::ReLU(), torch::nn::Linear(8, 3));
    optimizer = std::make_unique<torch::optim::SGD>(net->parameters(),
                                                    torch::optim::SGDOptions(0.1).momentum(0.9));
  }
  // One SGD step on fixed data; creates momentum buffers and moves BatchNorm's running stats.
  void step(std::int64_t seed) {
    torch::manual_seed(seed);
    const auto x = torch::randn({16, 4});
    const auto y = torch::randint(0, 3, {16});
    optimizer->zero_grad();
    torch::nn::functional::cross_entropy(net->forward(x), y).backward();
    optimizer->step();
  }
};

void expect_same_state(const torch::nn::Module& a, const torch::nn::Module& b) {
  const auto pa = a.named_parameters();
  const auto pb = b.named_parameters();
  ASSERT_EQ(pa.size(), pb.size());
  for (const auto& item : pa) {
    EXPECT_TRUE(torch::equal(item.value(), pb[item.key()])) << "parameter " << item.key();
  }
  const auto ba = a.named_buffers();
  const auto bb = b.named_buffers();
  ASSERT_EQ(ba.size(), bb.size());
  for (const auto& item : ba) {
    EXPECT_TRUE(torch::equal(item.value(), bb[item.key()])) << "buffer " << item.key();
  }
}

TEST(CheckpointTest, RoundTripRestoresModelOptimizerAndInfo) {
  torch::set_num_threads(1);
  TempDir dir;
  const auto path = dir.path() / "run.pt";
  torch::manual_seed(1);
  Model saved;
  saved.step(10);
  saved.step(11);
  save_checkpoint(path, *saved.net, *saved.optimizer, {.epoch = 7, .tag = "cnn"});
  EXPECT_TRUE(std::filesystem::exists(path));
  EXPECT_FALSE(std::filesystem::exists(dir.path() / "run.pt.tmp"));

  torch::manual_seed(2);  // different initial values, overwritten by the load
  Model loaded;
  const auto info = load_checkpoint(path, *loaded.net, *loaded.optimizer, "cnn");
  EXPECT_EQ(info.epoch, 7);
  EXPECT_EQ(info.tag, "cnn");
  expect_same_state(*saved.net, *loaded.net);

  // The momentum buffers came back too: the same next step gives the same parameters.
  saved.step(12);
  loaded.step(12);
  expect_same_state(*saved.net, *loaded.net);
}

TEST(CheckpointTest, SaveReplacesTheOldFileAndIgnoresAStaleTemporary) {
  TempDir dir;
  const auto path = dir.path() / "run.pt";
  {
    std::ofstream stale(dir.path() / "run.pt.tmp");
    stale << "left over from a crash";
  }
  Model model;
  save_checkpoint(path, *model.net, *model.optimizer, {.epoch = 1});
  save_checkpoint(path, *model.net, *model.optimizer, {.epoch = 2});
  EXPECT_FALSE(std::filesystem::exists(dir.path() / "run.pt.tmp"));
  Model loaded;
  EXPECT_EQ(load_checkpoint(path, *loaded.net, *loaded.optimizer).epoch, 2);
}

TEST(CheckpointTest, MissingFileIsAConfigErrorNamingThePath) {
  TempDir dir;
  const auto path = dir.path() / "absent.pt";
  Model model;
  try {
    load_checkpoint(path, *model.net, *model.optimizer);
    FAIL() << "loaded a missing file";
  } catch (const ConfigError& e) {
    EXPECT_THAT(e.what(), HasSubstr(path.string()));
    EXPECT_THAT(e.what(), HasSubstr("does not exist"));
  }
}

// A checkpoint path that names a folder (a program's --snapshot D for D/snapshot.pt) is a
// ConfigError saying so, on load ("does not exist" misled) and on save before anything is written
// (it was found only at the rename, after the whole file was written next to the folder).
TEST(CheckpointTest, APathThatIsAFolderIsAConfigErrorSayingSo) {
  TempDir dir;
  const auto folder = dir.path() / "snapshots";
  std::filesystem::create_directory(folder);
  const std::string expected = fmt::format(
      "checkpoint: {} is a folder; give the path of a file in it, such as {}/checkpoint.pt",
      folder.string(), folder.string());
  Model model;
  try {
    load_checkpoint(folder, *model.net, *model.optimizer);
    FAIL() << "loaded a folder";
  } catch (const ConfigError& e) {
    EXPECT_THAT(e.what(), HasSubstr(expected));
  }
  try {
    save_checkpoint(folder, *model.net, *model.optimizer, {.epoch = 1});
    FAIL() << "saved onto a folder";
  } catch (const ConfigError& e) {
    EXPECT_THAT(e.what(), HasSubstr(expected));
  }
  EXPECT_FALSE(std::filesystem::exists(dir.path() / "snapshots.tmp"));
  EXPECT_TRUE(std::filesystem::is_empty(folder));
}

TEST(CheckpointTest, CorruptOrTruncatedFileIsAnErrorNamingThePath) {
  TempDir dir;
  const auto garbage = dir.path() / "garbage.pt";
  {
    std::ofstream out(garbage, std::ios::binary);
    out << "this is not a zip archive at all";
  }
  Model model;
  try {
    load_checkpoint(garbage, *model.net, *model.optimizer);
    FAIL() << "loaded garbage";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr(garbage.string()));
  }

  const auto good = dir.path() / "good.pt";
  save_checkpoint(good, *model.net, *model.optimizer, {.epoch = 1});
  const auto truncated = dir.path() / "truncated.pt";
  std::filesystem::copy_file(good, truncated);
  std::filesystem::resize_file(truncated, std::filesystem::file_size(good) / 2);
  try {
    load_checkpoint(truncated, *model.net, *model.optimizer);
    FAIL() << "loaded a truncated file";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr(truncated.string()));
  }
}

std::string read_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), {});
}

void write_file(const std::filesystem::path& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// Where the bytes of `tensor` lie in the file (libtorch stores tensors uncompressed), or npos.
std::size_t find_tensor_bytes(const std::string& file, const torch::Tensor& tensor) {
  const torch::Tensor t = tensor.contiguous();
  const std::string needle(static_cast<const char*>(t.data_ptr()), t.nbytes());
  const std::size_t at = file.find(needle);
  EXPECT_EQ(file.find(needle, at + 1), std::string::npos) << "the tensor's bytes appear twice";
  return at;
}

TEST(CheckpointTest, DamageInsideAWeightIsAnErrorNamingTheFileAndTheTensor) {
  torch::set_num_threads(1);
  TempDir dir;
  // A weight of 64x32 floats (8 KiB), so 64 damaged bytes lie well inside it.
  torch::nn::Sequential net(torch::nn::Linear(32, 64), torch::nn::ReLU(), torch::nn::Linear(64, 3));
  torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  const auto path = dir.path() / "run.pt";
  save_checkpoint(path, *net, optimizer, {.epoch = 1});
  // The saved file loads (it is verified).
  load_checkpoint(path, *net, optimizer);

  std::string file = read_file(path);
  const torch::Tensor weight = net->named_parameters()["0.weight"];
  const std::size_t at = find_tensor_bytes(file, weight);
  ASSERT_NE(at, std::string::npos);
  for (std::size_t i = 0; i < 64; ++i)
    file[at + 4096 + i] = static_cast<char>(file[at + 4096 + i] ^ 0x5a);
  const auto damaged = dir.path() / "damaged.pt";
  write_file(damaged, file);

  torch::nn::Sequential fresh(torch::nn::Linear(32, 64), torch::nn::ReLU(),
                              torch::nn::Linear(64, 3));
  torch::optim::SGD fresh_optimizer(fresh->parameters(), torch::optim::SGDOptions(0.1));
  const torch::Tensor before = fresh->named_parameters()["0.weight"].clone();
  try {
    load_checkpoint(damaged, *fresh, fresh_optimizer);
    FAIL() << "a checkpoint with 64 damaged bytes inside a weight loaded";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr(damaged.string()));
    EXPECT_THAT(e.what(), HasSubstr("tensor 'model.0.weight'"));
    EXPECT_THAT(e.what(), HasSubstr("is damaged"));
  }
  // Nothing was loaded into the model.
  EXPECT_TRUE(torch::equal(fresh->named_parameters()["0.weight"], before));
  // load_archive verifies too.
  EXPECT_THROW(load_archive(damaged), Error);
}

// What `fn` writes to stderr (where TORCH_WARN's default handler prints).
template <typename Fn>
std::string stderr_of(Fn&& fn) {
  TempDir dir;
  const auto file = dir.path() / "stderr";
  std::fflush(stderr);
  const int saved = ::dup(STDERR_FILENO);
  const int fd = ::open(file.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  ::dup2(fd, STDERR_FILENO);
  ::close(fd);
  try {
    fn();
  } catch (...) {
    std::fflush(stderr);
    ::dup2(saved, STDERR_FILENO);
    ::close(saved);
    throw;
  }
  std::fflush(stderr);
  ::dup2(saved, STDERR_FILENO);
  ::close(saved);
  return read_file(file);
}

TEST(CheckpointTest, CheckpointWithoutChecksumsLoadsWithAWarning) {
  TempDir dir;
  Model saved;
  saved.step(1);
  // A checkpoint as ddp wrote them before checksums: the same entries, written by torch itself.
  torch::serialize::OutputArchive archive;
  archive.write("ddp_checkpoint_format", c10::IValue(std::int64_t{1}));
  archive.write("epoch", c10::IValue(std::int64_t{3}));
  archive.write("tag", c10::IValue(std::string("cnn")));
  torch::serialize::OutputArchive model_archive(archive.compilation_unit());
  saved.net->save(model_archive);
  archive.write("model", model_archive);
  torch::serialize::OutputArchive optimizer_archive(archive.compilation_unit());
  saved.optimizer->save(optimizer_archive);
  archive.write("optimizer", optimizer_archive);
  const auto path = dir.path() / "old.pt";
  archive.save_to(path.string());

  Model loaded;
  std::int64_t epoch = 0;
  std::string warnings =
      stderr_of([&] { epoch = load_checkpoint(path, *loaded.net, *loaded.optimizer).epoch; });
  EXPECT_EQ(epoch, 3);
  expect_same_state(*saved.net, *loaded.net);
  EXPECT_THAT(warnings, HasSubstr(path.string() + " has no checksums"));
  EXPECT_THAT(warnings, HasSubstr("Save it again"));

  // A checkpoint with checksums loads without a warning.
  save_checkpoint(path, *loaded.net, *loaded.optimizer, {.epoch = 4});
  warnings =
      stderr_of([&] { epoch = load_checkpoint(path, *loaded.net, *loaded.optimizer).epoch; });
  EXPECT_EQ(epoch, 4);
  EXPECT_THAT(warnings, Not(HasSubstr("checksums")));
}

TEST(CheckpointTest, ArchiveWithoutCheckpointEntriesIsRejected) {
  TempDir dir;
  const auto path = dir.path() / "plain.pt";
  torch::nn::Linear linear(2, 2);
  torch::save(linear, path.string());
  Model model;
  try {
    load_checkpoint(path, *model.net, *model.optimizer);
    FAIL() << "loaded a plain module archive as a checkpoint";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("not a ddp checkpoint"));
  }
}

TEST(CheckpointTest, WrongTagOrShapeIsAnErrorNamingWhatDiffers) {
  TempDir dir;
  const auto path = dir.path() / "run.pt";
  Model four_inputs(4);
  save_checkpoint(path, *four_inputs.net, *four_inputs.optimizer, {.epoch = 1, .tag = "mlp"});
  try {
    load_checkpoint(path, *four_inputs.net, *four_inputs.optimizer, "cnn");
    FAIL() << "loaded an mlp checkpoint as cnn";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("'mlp'"));
    EXPECT_THAT(e.what(), HasSubstr("'cnn'"));
  }
  Model five_inputs(5);
  try {
    load_checkpoint(path, *five_inputs.net, *five_inputs.optimizer);
    FAIL() << "loaded weights of the wrong shape";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("0.weight"));
    EXPECT_THAT(e.what(), HasSubstr(path.string()));
  }
}

TEST(CheckpointTest, UnwritableLocationIsAnErrorNamingThePath) {
  Model model;
  const std::filesystem::path path = "/nonexistent-ddp-folder/run.pt";
  try {
    save_checkpoint(path, *model.net, *model.optimizer, {.epoch = 1});
    FAIL() << "saved into a missing folder";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("/nonexistent-ddp-folder/run.pt.tmp"));
  }
}

// A full disk in the middle of a save, simulated without root: in a forked child, a file-size
// limit (RLIMIT_FSIZE) with SIGXFSZ ignored makes write() fail with EFBIG once the file would
// pass it, as ENOSPC does on a full disk. The save must throw a named ddp::Error (not escape
// through libtorch's writer into std::terminate), remove its partial PATH.tmp and leave the
// previous file as it was. Child exit codes: 0 caught ddp::Error, 2 no error, 3 another
// exception; the message goes to a file for the parent to check.
TEST(CheckpointTest, AFullDiskDuringSaveIsANamedErrorThatRemovesTheTemporary) {
  torch::set_num_threads(1);
  TempDir dir;
  const auto path = dir.path() / "run.pt";
  const auto message_file = dir.path() / "message.txt";
  Model small;
  save_checkpoint(path, *small.net, *small.optimizer, {.epoch = 1});
  const auto before = [&] {
    std::ifstream in(path, std::ios::binary);
    return std::string((std::istreambuf_iterator<char>(in)), {});
  }();
  // 64 KiB of weights: far past the 16 KiB limit.
  Model big(2000);

  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::signal(SIGXFSZ, SIG_IGN);
    struct rlimit limit {};
    ::getrlimit(RLIMIT_FSIZE, &limit);
    limit.rlim_cur = 16 * 1024;
    if (::setrlimit(RLIMIT_FSIZE, &limit) != 0) ::_exit(4);
    int code = 2;
    std::string text;
    try {
      save_checkpoint(path, *big.net, *big.optimizer, {.epoch = 2});
    } catch (const Error& e) {
      code = 0;
      text = e.what();
    } catch (const std::exception& e) {
      code = 3;
      text = e.what();
    }
    // The message is short: it fits under the limit.
    std::ofstream(message_file) << text;
    ::_exit(code);
  }
  int status = 0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (::waitpid(child, &status, WNOHANG) == 0) {
    if (std::chrono::steady_clock::now() > deadline) {
      ::kill(child, SIGKILL);
      ::waitpid(child, &status, 0);
      FAIL() << "the saving child did not finish within 60 s";
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  std::ifstream in(message_file);
  const std::string message((std::istreambuf_iterator<char>(in)), {});
  ASSERT_TRUE(WIFEXITED(status)) << "the child died of signal " << WTERMSIG(status)
                                 << " (SIGABRT: std::terminate)";
  ASSERT_EQ(WEXITSTATUS(status), 0) << "exit " << WEXITSTATUS(status) << ": " << message;
  EXPECT_THAT(message, HasSubstr(path.string() + ".tmp"));
  EXPECT_THAT(message, HasSubstr("File too large"));  // strerror(EFBIG); ENOSPC on a full disk
  EXPECT_THAT(message, HasSubstr(path.string() + " is unchanged"));
  EXPECT_FALSE(std::filesystem::exists(path.string() + ".tmp"));
  const std::string after = [&] {
    std::ifstream file(path, std::ios::binary);
    return std::string((std::istreambuf_iterator<char>(file)), {});
  }();
  EXPECT_EQ(after, before);
  Model loaded;
  EXPECT_EQ(load_checkpoint(path, *loaded.net, *loaded.optimizer).epoch, 1);
}

}  // namespace DDP_UNITY_ID
}  // namespace
}  // namespace ddp::test
