// train-fashion-mnist as users run it: under ddprun with two real rank processes, on the
// Fashion-MNIST files Debian installs. Small runs (--limit-train) so the whole file takes well
// under two minutes on two cores.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <optional>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "support/subprocess.h"
#include "support/temp_dir.h"

namespace ddp::test {
namespace {

using namespace std::chrono_literals;
using ::testing::HasSubstr;
using ::testing::Not;

const std::filesystem::path kDataDir = DDP_FMNIST_DEFAULT_DIR;
// The test images the short runs evaluate on (train-fashion-mnist --limit-test): enough that
// chance (0.1) and a trained cnn (above 0.5) are far apart, and that two runs of equal models
// agree, at a fifth of the whole set's time.
const char* const kTestSamples = "2000";

class TrainFashionMnistTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!std::filesystem::exists(kDataDir / "train-images-idx3-ubyte.gz")) {
      GTEST_SKIP() << kDataDir << " has no Fashion-MNIST files; install Debian's "
                   << "dataset-fashion-mnist to run the training tests";
    }
  }

  // ddprun --standalone --nproc-per-node 2 train-fashion-mnist ARGS, with one thread per rank
  // and a bounded rendezvous, so that a broken run fails instead of waiting. Evaluation on the
  // first kTestSamples test images unless ARGS say otherwise: the whole test set took most of a
  // short run's time (2.4 s per evaluation of the cnn on one thread).
  static ExitStatus train(std::vector<std::string> args, std::chrono::milliseconds timeout = 150s,
                          std::map<std::string, std::optional<std::string>> env = {}) {
    if (std::find(args.begin(), args.end(), "--limit-test") == args.end()) {
      args.insert(args.end(), {"--limit-test", kTestSamples});
    }
    std::vector<std::string> argv{built_program("ddprun"), "--standalone", "--nproc-per-node", "2",
                                  built_program("train-fashion-mnist")};
    argv.insert(argv.end(), args.begin(), args.end());
    env.emplace("OMP_NUM_THREADS", "1");
    env.emplace("DDP_TIMEOUT", "120");
    auto process = Subprocess::start(argv, env);
    auto result = process.wait(timeout);
    EXPECT_FALSE(result.timed_out) << "train-fashion-mnist did not finish:\n" << result.output;
    return result;
  }

  // Rank 0's lines, without ddprun's "[0] " prefix.
  static std::vector<std::string> rank0_lines(const std::string& output) {
    std::vector<std::string> lines;
    std::istringstream in(output);
    for (std::string line; std::getline(in, line);) {
      if (line.rfind("[0] ", 0) == 0) lines.push_back(line.substr(4));
    }
    return lines;
  }

  // The accuracy on rank 0's last line, which must be the "final" line.
  static double final_accuracy(const std::string& output) {
    const auto lines = rank0_lines(output);
    if (lines.empty()) {
      ADD_FAILURE() << "rank 0 printed nothing:\n" << output;
      return -1;
    }
    std::smatch match;
    static const std::regex final_line(R"(^final test_accuracy=([0-9.]+) epochs=(\d+) )");
    if (!std::regex_search(lines.back(), match, final_line)) {
      ADD_FAILURE() << "rank 0's last line is not the final line: '" << lines.back() << "'\n"
                    << output;
      return -1;
    }
    return std::stod(match[1].str());
  }
};

TEST_F(TrainFashionMnistTest, OneShortEpochLearnsWellAboveChance) {
  const auto result =
      train({"--epochs", "1", "--limit-train", "2048", "--batch-size", "64", "--log-every", "8"});
  ASSERT_EQ(result.exit_code, 0) << result.output;
  // Progress during the epoch, then the epoch's summary line, then the final line.
  EXPECT_THAT(result.output, HasSubstr("[0] epoch 1 [1024/2048] loss "));
  EXPECT_THAT(result.output, HasSubstr("[0] epoch 1 loss "));
  EXPECT_THAT(result.output, HasSubstr(" samples_per_s "));
  EXPECT_THAT(result.output, HasSubstr("world_size=2 "));
  // Rank 1 trains silently.
  EXPECT_THAT(result.output, Not(HasSubstr("[1] epoch")));
  const double accuracy = final_accuracy(result.output);
  EXPECT_GT(accuracy, 0.5) << result.output;  // chance is 0.1
  EXPECT_LE(accuracy, 1.0);
}

TEST_F(TrainFashionMnistTest, MetricsLinesParseAndTheTraceHasEveryPhase) {
  TempDir dir("ddp-fmnist-metrics");
  const std::string metrics = dir.file("metrics.jsonl");
  const std::string traces = dir.file("traces");
  const auto result = train({"--epochs", "1", "--limit-train", "1024", "--batch-size", "64",
                             "--log-every", "4", "--metrics", metrics},
                            150s, {{"DDP_TRACE", traces}});
  ASSERT_EQ(result.exit_code, 0) << result.output;
  // Not a terminal: today's plain lines, no bar.
  EXPECT_THAT(result.output, HasSubstr("[0] epoch 1 [512/1024] loss "));
  EXPECT_THAT(result.output, Not(HasSubstr("ETA")));

  std::ifstream in(metrics);
  int steps = 0;
  int epochs = 0;
  for (std::string line; std::getline(in, line);) {
    const auto record = nlohmann::json::parse(line);  // every line is one JSON object
    for (const char* field : {"kind", "epoch", "step", "loss", "samples_per_s", "step_time_s",
                              "bytes_per_step", "world_size", "time_s"}) {
      EXPECT_TRUE(record.contains(field)) << field << " missing in " << line;
    }
    EXPECT_EQ(record["world_size"], 2) << line;
    EXPECT_GT(record["samples_per_s"].get<double>(), 0.0) << line;
    EXPECT_GT(record["step_time_s"].get<double>(), 0.0) << line;
    EXPECT_GT(record["bytes_per_step"].get<std::int64_t>(), 0) << line;
    if (record["kind"] == "step") {
      ++steps;
    } else {
      ++epochs;
      EXPECT_EQ(record["kind"], "epoch") << line;
      EXPECT_GT(record["accuracy"].get<double>(), 0.1) << line;
    }
  }
  EXPECT_EQ(steps, 2);  // 8 batches per rank, a line every 4
  EXPECT_EQ(epochs, 1);

  for (int rank = 0; rank < 2; ++rank) {
    std::ifstream trace_file(std::filesystem::path(traces) /
                             fmt::format("trace_rank{}.json", rank));
    const auto trace = nlohmann::json::parse(trace_file);
    std::set<std::string> names;
    for (const auto& e : trace["traceEvents"])
      names.insert(e.value("name", ""));
    for (const char* name :
         {"data loading", "forward", "backward", "optimizer step", "allreduce", "bucket ready"}) {
      EXPECT_TRUE(names.count(name)) << "rank " << rank << " trace lacks " << name;
    }
  }
  // ddp-trace merge joins them.
  const std::string merged = dir.file("merged.json");
  auto merge = Subprocess::start({built_program("ddp-trace"), "merge", traces, "-o", merged});
  const auto merge_result = merge.wait(30s);
  ASSERT_EQ(merge_result.exit_code, 0) << merge_result.output;
  EXPECT_THAT(merge_result.output, HasSubstr("ping-pong"));
  std::ifstream merged_file(merged);
  const auto joined = nlohmann::json::parse(merged_file);
  std::set<int> pids;
  for (const auto& e : joined["traceEvents"])
    pids.insert(e["pid"].get<int>());
  EXPECT_EQ(pids, (std::set<int>{0, 1}));
}

TEST_F(TrainFashionMnistTest, AnUnwritableMetricsFileIsANamedErrorBeforeTraining) {
  const auto result = train({"--epochs", "1", "--limit-train", "256", "--log-every", "0",
                             "--metrics", "/nonexistent-folder/metrics.jsonl"});
  EXPECT_NE(result.exit_code, 0) << result.output;
  EXPECT_THAT(result.output, HasSubstr("--metrics /nonexistent-folder/metrics.jsonl: cannot open"));
  EXPECT_THAT(result.output, Not(HasSubstr("epoch 1 loss")));
}

TEST_F(TrainFashionMnistTest, FirstLineNamesTheLibtorch) {
  const auto result = train({"--epochs", "1", "--limit-train", "256", "--log-every", "0"});
  ASSERT_EQ(result.exit_code, 0) << result.output;
  const auto lines = rank0_lines(result.output);
  ASSERT_FALSE(lines.empty()) << result.output;
  EXPECT_EQ(lines.front(),
            fmt::format("train-fashion-mnist: libtorch {}, 2 ranks", DDP_LIBTORCH_VERSION))
      << result.output;
}

// PyTorch 2.x's own launcher (its torchrun runs on Python 3.11, Debian's 1.13 one does not),
// starting the ddp program directly (--no-python) with torchrun's defaults, as a user coming from
// PyTorch would.
TEST_F(TrainFashionMnistTest, TrainsUnderPyTorch2sTorchrun) {
  if (!std::filesystem::exists(std::filesystem::path(DDP_PYTORCH_VENV) / "bin" / "python")) {
    GTEST_SKIP() << "no PyTorch 2.x environment at " << DDP_PYTORCH_VENV
                 << "; scripts/install-deps.sh installs it (scripts/pytorch-python runs it)";
  }
  std::vector<std::string> argv{DDP_PYTORCH_PYTHON,
                                "-m",
                                "torch.distributed.run",
                                "--no-python",
                                "--standalone",
                                "--nproc-per-node",
                                "2",
                                "--tee",
                                "3",
                                built_program("train-fashion-mnist"),
                                "--epochs",
                                "1",
                                "--limit-train",
                                "1024",
                                "--batch-size",
                                "64",
                                "--log-every",
                                "0"};
  argv.insert(argv.end(), {"--limit-test", kTestSamples});
  auto process = Subprocess::start(
      argv,
      {{"OMP_NUM_THREADS", "1"}, {"DDP_TIMEOUT", "120"}, {"DDP_PYTORCH_VENV", DDP_PYTORCH_VENV}});
  // torchrun's default environment (TORCHELASTIC_USE_AGENT_STORE=True): the ranks join through
  // torchrun's own c10d store.
  const auto result = process.wait(150s);
  ASSERT_FALSE(result.timed_out) << "torchrun did not finish:\n" << result.output;
  ASSERT_EQ(result.exit_code, 0) << result.output;
  // torchrun's --tee prefixes each worker's lines with "[default0]:" (rank 0).
  EXPECT_THAT(result.output, HasSubstr("[default0]:train-fashion-mnist: libtorch "));
  EXPECT_THAT(result.output, HasSubstr(", 2 ranks"));
  std::smatch match;
  static const std::regex final_line(R"(\[default0\]:final test_accuracy=([0-9.]+) )");
  ASSERT_TRUE(std::regex_search(result.output, match, final_line)) << result.output;
  EXPECT_GT(std::stod(match[1].str()), 0.3) << result.output;  // chance is 0.1
}

TEST_F(TrainFashionMnistTest, SyncBatchNormTrainsTheCnn) {
  const auto result = train({"--sync-bn", "--epochs", "1", "--limit-train", "2048", "--batch-size",
                             "64", "--log-every", "0"});
  ASSERT_EQ(result.exit_code, 0) << result.output;
  EXPECT_THAT(result.output, HasSubstr("synchronised across ranks (SyncBatchNorm)"));
  const double accuracy = final_accuracy(result.output);
  EXPECT_GT(accuracy, 0.5) << result.output;  // chance is 0.1
}

TEST_F(TrainFashionMnistTest, ResumeContinuesFromTheCheckpointAtTheNextEpoch) {
  TempDir dir;
  const auto checkpoint = (dir.path() / "fmnist.pt").string();
  const std::vector<std::string> common{"--limit-train", "1024", "--batch-size", "64",
                                        "--log-every",   "0",    "--checkpoint", checkpoint};
  auto args = common;
  args.insert(args.end(), {"--epochs", "1"});
  const auto first = train(args);
  ASSERT_EQ(first.exit_code, 0) << first.output;
  ASSERT_TRUE(std::filesystem::exists(checkpoint)) << first.output;
  EXPECT_FALSE(std::filesystem::exists(checkpoint + ".tmp"));
  const double first_accuracy = final_accuracy(first.output);

  args = common;
  args.insert(args.end(), {"--epochs", "2", "--resume"});
  const auto second = train(args);
  ASSERT_EQ(second.exit_code, 0) << second.output;
  EXPECT_THAT(second.output, HasSubstr("after epoch 1; continuing at epoch 2"));
  EXPECT_THAT(second.output, HasSubstr("[0] epoch 2 loss "));
  EXPECT_THAT(second.output, Not(HasSubstr("[0] epoch 1 loss ")));
  const double second_accuracy = final_accuracy(second.output);
  // Resuming starts from the trained weights, not from scratch: after a second epoch the model
  // is at least about as good as after the first.
  EXPECT_GT(second_accuracy, first_accuracy - 0.05) << first.output << second.output;
}

TEST_F(TrainFashionMnistTest, ResumeFromAMissingOrCorruptCheckpointFailsClearly) {
  TempDir dir;
  const auto missing = (dir.path() / "absent.pt").string();
  auto result =
      train({"--epochs", "2", "--limit-train", "256", "--checkpoint", missing, "--resume"});
  EXPECT_NE(result.exit_code, 0) << result.output;
  EXPECT_THAT(result.output, HasSubstr(missing + " does not exist"));

  const auto corrupt = (dir.path() / "corrupt.pt").string();
  std::ofstream(corrupt) << "not a checkpoint";
  result = train({"--epochs", "2", "--limit-train", "256", "--checkpoint", corrupt, "--resume"});
  EXPECT_NE(result.exit_code, 0) << result.output;
  EXPECT_THAT(result.output, HasSubstr(corrupt + " is not a readable torch archive"));
}

TEST_F(TrainFashionMnistTest, MissingDataFolderFailsNamingThePath) {
  const auto result = train({"--data-dir", "/nonexistent/fmnist-data"}, 60s);
  EXPECT_NE(result.exit_code, 0) << result.output;
  EXPECT_THAT(result.output, HasSubstr("/nonexistent/fmnist-data does not exist"));
}

TEST_F(TrainFashionMnistTest, MixedPrecisionBf16Trains) {
  // 1024 samples (0.68 here): bf16 on a CPU without bf16 arithmetic is slow, 2048 took 47 s.
  const auto result = train({"--mixed-precision", "bf16", "--epochs", "1", "--limit-train", "1024",
                             "--batch-size", "64", "--log-every", "0"});
  ASSERT_EQ(result.exit_code, 0) << result.output;
  EXPECT_THAT(result.output, HasSubstr("mixed precision bf16"));
  EXPECT_GT(final_accuracy(result.output), 0.5) << result.output;  // chance is 0.1
}

// PowerSGD from step 2 (so nearly all of the 16 steps compress): it trains, and a step's
// gradients cost far fewer bytes than the cnn's 421,738 fp32 parameters (1,686,952 bytes).
TEST_F(TrainFashionMnistTest, PowerSgdCommHookTrains) {
  const auto result =
      train({"--comm-hook", "powersgd", "--powersgd-rank", "2", "--powersgd-start-iter", "2",
             "--epochs", "1", "--limit-train", "2048", "--batch-size", "64", "--log-every", "0"});
  ASSERT_EQ(result.exit_code, 0) << result.output;
  EXPECT_THAT(result.output, HasSubstr("comm hook powersgd (rank 2, from step 2)"));
  EXPECT_GT(final_accuracy(result.output), 0.5) << result.output;  // chance is 0.1
  std::smatch match;
  static const std::regex bytes_field(R"(bytes_per_step=(\d+))");
  ASSERT_TRUE(std::regex_search(result.output, match, bytes_field)) << result.output;
  const auto bytes = std::stoll(match[1].str());
  EXPECT_GT(bytes, 0);
  EXPECT_LT(bytes, 1686952 / 4) << result.output;
}

// ZeRO stage 1 changes where the optimizer state lives, not the arithmetic: with Adam the run
// prints the accuracy of the unsharded run to the last digit, also while its checkpoints gather
// every shard on rank 0; a training state saved that way resumes mid-epoch.
TEST_F(TrainFashionMnistTest, ZeroShardedAdamMatchesDdpAndItsCheckpointResumes) {
  const std::vector<std::string> common{"--optimizer",   "adam", "--epochs",    "1",
                                        "--limit-train", "1024", "--log-every", "0"};
  auto args = common;
  args.insert(args.end(), {"--sharding", "ddp"});
  const auto unsharded = train(args);
  ASSERT_EQ(unsharded.exit_code, 0) << unsharded.output;
  EXPECT_THAT(unsharded.output, HasSubstr(", adam, lr 0.001 "));

  TempDir dir;
  const auto checkpoint = (dir.path() / "zero.pt").string();
  args = common;
  args.insert(args.end(),
              {"--sharding", "zero1", "--checkpoint", checkpoint, "--checkpoint-every-steps", "3"});
  const auto sharded = train(args);
  ASSERT_EQ(sharded.exit_code, 0) << sharded.output;
  EXPECT_THAT(sharded.output, HasSubstr("adam sharded by ZeroRedundancyOptimizer"));
  EXPECT_THAT(sharded.output, HasSubstr("checkpoint global_step 6 epoch 1 offset 768"));
  EXPECT_EQ(final_accuracy(sharded.output), final_accuracy(unsharded.output))
      << unsharded.output << sharded.output;

  // The file after epoch 1 resumes at epoch 2 (every rank loads its shard from the full state).
  args = {"--optimizer",
          "adam",
          "--epochs",
          "2",
          "--limit-train",
          "1024",
          "--log-every",
          "0",
          "--sharding",
          "zero1",
          "--checkpoint",
          checkpoint,
          "--checkpoint-every-steps",
          "100",
          "--resume"};
  const auto resumed = train(args);
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_THAT(resumed.output, HasSubstr("resumed from " + checkpoint + " at epoch 2"));
  EXPECT_THAT(resumed.output, Not(HasSubstr("[0] epoch 1 loss ")));
  EXPECT_GT(final_accuracy(resumed.output), 0.5) << resumed.output;  // chance is 0.1
}

// ZeRO stages 2 and 3 (FullyShardedDataParallel over the cnn's layers, 2 units) train with Adam
// to DDP's accuracy: the same arithmetic, reduced in another order (reduce-scatter instead of
// allreduce), so equal to rounding. zero2 runs with --mixed-precision bf16 (autocast forward,
// gradients reduce-scattered in bf16), so to bf16's precision. The fsdp run writes a sharded
// training state (a folder: ddp::ShardedTrainState) every 3 steps and after the epoch, and a second
// run resumes from it at epoch 2.
TEST_F(TrainFashionMnistTest, FsdpAndZero2TrainWithAdamToDdpsAccuracyAndFsdpResumes) {
  const std::vector<std::string> common{"--optimizer",   "adam", "--epochs",    "1",
                                        "--limit-train", "1024", "--log-every", "0"};
  TempDir dir;
  const auto checkpoint = (dir.path() / "fsdp").string();
  std::map<std::string, double> accuracy;
  for (const std::string sharding : {"ddp", "zero2", "fsdp"}) {
    auto args = common;
    args.insert(args.end(), {"--sharding", sharding});
    if (sharding == "zero2") args.insert(args.end(), {"--mixed-precision", "bf16"});
    if (sharding == "fsdp") {
      args.insert(args.end(), {"--checkpoint", checkpoint, "--checkpoint-every-steps", "3"});
    }
    const auto result = train(args);
    ASSERT_EQ(result.exit_code, 0) << result.output;
    if (sharding == "zero2") {
      EXPECT_THAT(result.output, HasSubstr("bf16 gradient reduction")) << result.output;
    }
    if (sharding != "ddp") {
      EXPECT_THAT(result.output,
                  HasSubstr(sharding == "fsdp" ? "FULL_SHARD (ZeRO stage 3), 2 units"
                                               : "SHARD_GRAD_OP (ZeRO stage 2), 2 units"));
    }
    accuracy[sharding] = final_accuracy(result.output);
  }
  EXPECT_GT(accuracy["ddp"], 0.5);  // chance is 0.1
  EXPECT_NEAR(accuracy["zero2"], accuracy["ddp"], 0.05);
  EXPECT_NEAR(accuracy["fsdp"], accuracy["ddp"], 0.02);

  // Saves at steps 3 and 6 and after the epoch (step 8): the last one is the one kept.
  EXPECT_TRUE(std::filesystem::exists(std::filesystem::path(checkpoint) / "latest.pt"));
  EXPECT_TRUE(std::filesystem::exists(std::filesystem::path(checkpoint) / "ckpt-3"));
  EXPECT_FALSE(std::filesystem::exists(std::filesystem::path(checkpoint) / "ckpt-2"));
  auto args = common;
  args[3] = "2";  // --epochs 2
  args.insert(args.end(), {"--sharding", "fsdp", "--checkpoint", checkpoint, "--resume"});
  const auto resumed = train(args);
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_THAT(resumed.output, HasSubstr("resumed from " + checkpoint + " at epoch 2"));
  EXPECT_THAT(resumed.output, Not(HasSubstr("[0] epoch 1 loss ")));
  EXPECT_GT(final_accuracy(resumed.output), accuracy["fsdp"] - 0.02) << resumed.output;
}

TEST(TrainFashionMnistOptionsTest, BadOptionsAreRejectedBeforeAnythingStarts) {
  for (const std::vector<std::string>& args :
       {std::vector<std::string>{"--model", "resnet"},
        {"--mixed-precision", "fp8"},
        {"--comm-hook", "powersgd4"},
        {"--comm-hook", "int8", "--mixed-precision", "bf16"},
        {"--powersgd-rank", "0"},
        {"--epochs", "0"},
        {"--lr", "-1"},
        {"--optimizer", "lbfgs"},
        {"--sharding", "zero9"},
        {"--sharding", "zero1", "--uneven"},
        {"--sharding", "fsdp", "--comm-hook", "int8"},
        {"--sharding", "fsdp", "--checkpoint", "/etc/passwd"},
        {"--fsdp-min-params", "0"},
        {"--global-batch-size", "128", "--uneven"},
        {"--global-batch-size", "0"},
        {"--limit-test", "0"},
        {"--limit-test", "10001"},
        {"--resume"}}) {
    std::vector<std::string> argv{built_program("train-fashion-mnist")};
    argv.insert(argv.end(), args.begin(), args.end());
    auto process = Subprocess::start(argv);
    const auto result = process.wait(30s);
    EXPECT_NE(result.exit_code, 0) << args[0] << ": " << result.output;
    EXPECT_THAT(result.output, HasSubstr(args[0])) << result.output;
  }
}

TEST(TrainFashionMnistOptionsTest, NanInfAndNegativeFloatingOptionsAreRejectedClearly) {
  // Every floating option with NaN (which CLI::Range let through), and the learning rate with
  // every kind of bad value. Each run loads libtorch, so the list is kept short.
  const std::vector<std::pair<std::string, std::string>> cases{
      {"--lr", "nan"},  {"--lr", "inf"},       {"--lr", "-inf"},
      {"--lr", "-0.5"}, {"--momentum", "NaN"}, {"--weight-decay", "nan"},
  };
  for (const auto& [option, value] : cases) {
    SCOPED_TRACE(fmt::format("{} {}", option, value));
    const auto result =
        Subprocess::start({built_program("train-fashion-mnist"), option, value}).wait(30s);
    EXPECT_NE(result.exit_code, 0) << result.output;
    EXPECT_THAT(result.output, HasSubstr(option)) << result.output;
    // CLI11's message, not a libtorch stack trace from inside the optimizer.
    EXPECT_THAT(result.output, Not(HasSubstr("Exception raised from"))) << result.output;
    EXPECT_THAT(result.output, Not(HasSubstr("c10::"))) << result.output;
    if (value != "-0.5") {
      EXPECT_THAT(result.output, HasSubstr("not a finite number")) << result.output;
    }
  }
}

TEST(TrainFashionMnistOptionsTest, CheckpointFolderIsCheckedBeforeTrainingStarts) {
  const auto start = std::chrono::steady_clock::now();
  auto result = Subprocess::start({built_program("train-fashion-mnist"), "--checkpoint",
                                   "/nonexistent/dir/x.pt", "--data-dir", "/nonexistent/data"})
                    .wait(30s);
  EXPECT_NE(result.exit_code, 0) << result.output;
  // Named before the data is even read (the data folder is missing too).
  EXPECT_THAT(result.output, HasSubstr("the folder /nonexistent/dir does not exist"));
  EXPECT_THAT(result.output, Not(HasSubstr("/nonexistent/data")));
  EXPECT_LT(std::chrono::steady_clock::now() - start, 20s);

  if (::geteuid() != 0) {  // root writes anywhere
    TempDir dir;
    const auto locked = dir.path() / "locked";
    std::filesystem::create_directory(locked);
    std::filesystem::permissions(
        locked, std::filesystem::perms::owner_read | std::filesystem::perms::owner_exec);
    result = Subprocess::start({built_program("train-fashion-mnist"), "--checkpoint",
                                (locked / "x.pt").string(), "--data-dir", "/nonexistent/data"})
                 .wait(30s);
    EXPECT_NE(result.exit_code, 0) << result.output;
    EXPECT_THAT(result.output, HasSubstr(locked.string() + " is not writable"));
    std::filesystem::permissions(locked, std::filesystem::perms::owner_all);
  }
}

// CLI11 parses "-1" and numbers past 2^64 - 1 into a uint64 as 2^64 - 1 without a word; the
// seed is checked as text first.
TEST(TrainFashionMnistOptionsTest, SeedsOutsideTheUint64RangeAreRejected) {
  for (const std::string value :
       {"-1", "18446744073709551616", "99999999999999999999999", "1.5", "0x10", ""}) {
    SCOPED_TRACE("--seed '" + value + "'");
    const auto result = Subprocess::start({built_program("train-fashion-mnist"), "--seed", value,
                                           "--data-dir", "/nonexistent/data"})
                            .wait(30s);
    EXPECT_NE(result.exit_code, 0) << result.output;
    EXPECT_THAT(result.output, HasSubstr("--seed")) << result.output;
    if (!value.empty()) {
      EXPECT_THAT(result.output, HasSubstr(value)) << result.output;
    }
    EXPECT_THAT(result.output, HasSubstr("0 to 18446744073709551615")) << result.output;
    EXPECT_THAT(result.output, Not(HasSubstr("/nonexistent/data"))) << result.output;
  }
  // The largest seed is accepted: the run goes on to the (missing) data folder.
  const auto result = Subprocess::start({built_program("train-fashion-mnist"), "--seed",
                                         "18446744073709551615", "--data-dir", "/nonexistent/data"})
                          .wait(30s);
  EXPECT_NE(result.exit_code, 0) << result.output;
  EXPECT_THAT(result.output, HasSubstr("/nonexistent/data does not exist")) << result.output;
}

TEST(TrainFashionMnistOptionsTest, ACheckpointPathThatIsAFolderIsRefusedBeforeTraining) {
  TempDir dir;
  const auto start = std::chrono::steady_clock::now();
  const auto result = Subprocess::start({built_program("train-fashion-mnist"), "--checkpoint",
                                         dir.path().string(), "--data-dir", "/nonexistent/data"})
                          .wait(30s);
  EXPECT_NE(result.exit_code, 0) << result.output;
  EXPECT_THAT(result.output, HasSubstr(fmt::format(
                                 "--checkpoint {} is a folder; give a file path such as {}/ck.pt",
                                 dir.path().string(), dir.path().string())))
      << result.output;
  EXPECT_THAT(result.output, Not(HasSubstr("/nonexistent/data")));
  EXPECT_LT(std::chrono::steady_clock::now() - start, 20s);
}

TEST(TrainFashionMnistOptionsTest, CheckpointEveryStepsNeedsACheckpointAndEvenInputs) {
  const std::string program = built_program("train-fashion-mnist");
  // Both named before the data is read (its folder is missing too).
  auto result = Subprocess::start(
                    {program, "--checkpoint-every-steps", "10", "--data-dir", "/nonexistent/data"})
                    .wait(30s);
  EXPECT_NE(result.exit_code, 0) << result.output;
  EXPECT_THAT(result.output, HasSubstr("--checkpoint-every-steps needs --checkpoint PATH"));
  TempDir dir;
  result = Subprocess::start({program, "--checkpoint-every-steps", "10", "--checkpoint",
                              (dir.path() / "s.pt").string(), "--uneven", "--data-dir",
                              "/nonexistent/data"})
               .wait(30s);
  EXPECT_NE(result.exit_code, 0) << result.output;
  EXPECT_THAT(result.output, HasSubstr("cannot be combined with --uneven"));
  result = Subprocess::start({program, "--checkpoint-every-steps", "0"}).wait(30s);
  EXPECT_NE(result.exit_code, 0) << result.output;
  EXPECT_THAT(result.output, HasSubstr("--checkpoint-every-steps"));
}

// --global-batch-size keeps the optimizer's batch when the world size changes (an elastic job
// that lost a node): one rank accumulating 2 micro-batches of 32 per step trains the model that
// two ranks with batches of 32 train, up to rounding (the mlp: no BatchNorm statistics, which
// are per rank). A global batch the world size cannot split into whole micro-batches is named.
TEST_F(TrainFashionMnistTest, GlobalBatchSizeAccumulatesToTheSameModelAtHalfTheWorld) {
  // 256 samples (4 steps): the mlp moves 80 MB of gradients a step, and 1024 took 20 s a run.
  const std::vector<std::string> common{"--model",       "mlp", "--epochs",    "1",
                                        "--limit-train", "256", "--log-every", "0",
                                        "--batch-size",  "32"};
  const auto two = train(common);
  ASSERT_EQ(two.exit_code, 0) << two.output;

  auto args = std::vector<std::string>{built_program("ddprun"),
                                       "--standalone",
                                       "--nproc-per-node",
                                       "1",
                                       built_program("train-fashion-mnist"),
                                       "--global-batch-size",
                                       "64"};
  args.insert(args.end(), common.begin(), common.end());
  args.insert(args.end(), {"--limit-test", kTestSamples});
  auto process = Subprocess::start(args, {{"OMP_NUM_THREADS", "1"}, {"DDP_TIMEOUT", "120"}});
  const auto one = process.wait(150s);
  ASSERT_FALSE(one.timed_out) << one.output;
  ASSERT_EQ(one.exit_code, 0) << one.output;
  EXPECT_THAT(one.output, HasSubstr("global batch 64 (2 micro-batch(es) of 32 per rank and step)"));
  EXPECT_THAT(one.output, HasSubstr("world_size=1 "));
  // 2000 test images: 0.003 is 6 of them; the two models differ in rounding only (1 image of
  // 10 000 apart after 1024 samples).
  EXPECT_NEAR(final_accuracy(one.output), final_accuracy(two.output), 0.003)
      << two.output << one.output;

  args = common;
  args.insert(args.end(), {"--global-batch-size", "96"});  // 96 / (32 x 2) is not whole
  const auto bad = train(args);
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_THAT(bad.output, HasSubstr("--global-batch-size 96 is not a multiple of --batch-size 32 "
                                    "x 2 rank(s) = 64"));
}

TEST_F(TrainFashionMnistTest, UnevenInputsUnderJoinFinishAtWorldThree) {
  // 2000 samples over 3 ranks: 11 batches of 64 each, less 3 per higher rank: 11, 8, 5 per epoch,
  // for two epochs under one Join.
  auto process =
      Subprocess::start({built_program("ddprun"), "--standalone", "--nproc-per-node", "3",
                         built_program("train-fashion-mnist"), "--uneven", "--uneven-skew", "3",
                         "--epochs", "2", "--limit-train", "2000", "--limit-test", kTestSamples,
                         "--batch-size", "64", "--log-every", "0"},
                        {{"OMP_NUM_THREADS", "1"}, {"DDP_TIMEOUT", "120"}});
  const auto result = process.wait(200s);
  ASSERT_FALSE(result.timed_out) << result.output;
  ASSERT_EQ(result.exit_code, 0) << result.output;
  EXPECT_THAT(result.output,
              HasSubstr("[0] uneven inputs under ddp::Join: batches per epoch by rank 11, 8, 5"));
  EXPECT_THAT(result.output, HasSubstr("world_size=3 "));
  EXPECT_GT(final_accuracy(result.output), 0.5) << result.output;
}

// A full disk when rank 0 writes the checkpoint, simulated without root: a file-size limit
// (bash's ulimit -f, KiB) with SIGXFSZ ignored (inherited through exec) makes the write fail with
// EFBIG as a full disk fails with ENOSPC. The cnn's checkpoint (about 3.4 MB with momentum) does
// not fit under 1 MiB (the ranks talk over TCP: the shared-memory transport sizes a file, which
// the limit would refuse). Rank 0 must stop with a named error, not std::terminate; its partial
// .tmp is removed and the previous checkpoint stays as it was.
TEST_F(TrainFashionMnistTest, AFullDiskDuringTheCheckpointIsANamedErrorAndACleanStop) {
  TempDir dir;
  const auto checkpoint = (dir.path() / "fmnist.pt").string();
  const std::vector<std::string> common{"--limit-train", "256",     "--log-every", "0",
                                        "--checkpoint",  checkpoint};
  auto args = common;
  args.insert(args.end(), {"--epochs", "1"});
  const auto first = train(args);
  ASSERT_EQ(first.exit_code, 0) << first.output;
  std::ifstream before_file(checkpoint, std::ios::binary);
  const std::string before((std::istreambuf_iterator<char>(before_file)), {});
  ASSERT_GT(before.size(), 2u << 20) << "the checkpoint must not fit under the limit";

  std::vector<std::string> argv{"/bin/bash",
                                "-c",
                                "trap '' XFSZ; ulimit -f 1024; exec \"$@\"",
                                "bash",
                                built_program("ddprun"),
                                "--standalone",
                                "--nproc-per-node",
                                "2",
                                built_program("train-fashion-mnist"),
                                "--epochs",
                                "2",
                                "--resume"};
  argv.insert(argv.end(), common.begin(), common.end());
  // TCP between the ranks: the shared-memory transport sizes a file, which the limit refuses.
  auto process = Subprocess::start(
      argv, {{"OMP_NUM_THREADS", "1"}, {"DDP_TIMEOUT", "60"}, {"DDP_TRANSPORT", "tcp"}});
  const auto result = process.wait(150s);
  ASSERT_FALSE(result.timed_out) << result.output;
  EXPECT_NE(result.exit_code, 0) << result.output;
  EXPECT_THAT(result.output, HasSubstr("continuing at epoch 2")) << result.output;
  EXPECT_THAT(result.output, HasSubstr("[0] train-fashion-mnist: error: checkpoint: writing " +
                                       checkpoint + ".tmp failed: File too large"))
      << result.output;
  EXPECT_THAT(result.output, HasSubstr(checkpoint + " is unchanged")) << result.output;
  EXPECT_THAT(result.output, Not(HasSubstr("terminate called"))) << result.output;
  EXPECT_THAT(result.output, Not(HasSubstr("final test_accuracy"))) << result.output;
  // The launcher names rank 0 as the rank that failed, rank 1 as failing in consequence.
  EXPECT_THAT(result.output, HasSubstr("ddprun: rank 0 exited with code 1; stopping the other "
                                       "workers"))
      << result.output;
  EXPECT_FALSE(std::filesystem::exists(checkpoint + ".tmp"));
  std::ifstream after_file(checkpoint, std::ios::binary);
  const std::string after((std::istreambuf_iterator<char>(after_file)), {});
  EXPECT_EQ(after, before);
}

// A training state resumed by a run with another optimizer, or over another number of training
// samples (whose sampler position no longer fits), is refused with what the file holds and what
// the run has, before any training.
TEST_F(TrainFashionMnistTest, ResumingWithAnotherOptimizerOrDatasetSizeIsRefused) {
  TempDir dir;
  const auto state = (dir.path() / "state.pt").string();
  const std::vector<std::string> common{
      "--epochs", "1", "--log-every", "0", "--checkpoint", state, "--checkpoint-every-steps", "2"};
  auto args = common;
  args.insert(args.end(), {"--optimizer", "adam", "--limit-train", "512"});
  const auto first = train(args);
  ASSERT_EQ(first.exit_code, 0) << first.output;

  args = common;
  args.insert(args.end(), {"--optimizer", "sgd", "--limit-train", "512", "--resume"});
  const auto sgd = train(args);
  EXPECT_NE(sgd.exit_code, 0) << sgd.output;
  EXPECT_THAT(sgd.output,
              HasSubstr("the training state in " + state +
                        " holds an Adam optimizer's state; this run uses SGD with momentum "
                        "(--optimizer sgd). Resume with --optimizer adam or start without "
                        "--resume"))
      << sgd.output;
  EXPECT_THAT(sgd.output, Not(HasSubstr("INTERNAL ASSERT"))) << sgd.output;
  EXPECT_THAT(sgd.output, Not(HasSubstr("loss "))) << sgd.output;

  args = common;
  args.insert(args.end(), {"--optimizer", "adam", "--limit-train", "8", "--resume"});
  const auto smaller = train(args);
  EXPECT_NE(smaller.exit_code, 0) << smaller.output;
  EXPECT_THAT(smaller.output,
              HasSubstr("the training state in " + state + " was saved for 512 training samples"))
      << smaller.output;
  EXPECT_THAT(smaller.output, HasSubstr("this run has 8 (--limit-train 8)")) << smaller.output;
  EXPECT_THAT(smaller.output, Not(HasSubstr("loss "))) << smaller.output;

  // The same options still resume.
  args = common;
  args.insert(args.end(), {"--optimizer", "adam", "--limit-train", "512", "--resume"});
  const auto same = train(args);
  ASSERT_EQ(same.exit_code, 0) << same.output;
  EXPECT_THAT(same.output, HasSubstr("resumed from " + state)) << same.output;
}

// The epoch checkpoint (--checkpoint without --checkpoint-every-steps) records its optimizer
// too: one saved by SGD without momentum is refused by a run with momentum, naming the options
// that fit it.
TEST_F(TrainFashionMnistTest, AnEpochCheckpointOfSgdWithoutMomentumIsRefusedWithMomentum) {
  TempDir dir;
  const auto checkpoint = (dir.path() / "ck.pt").string();
  const auto first = train({"--epochs", "1", "--limit-train", "256", "--log-every", "0",
                            "--checkpoint", checkpoint, "--momentum", "0"});
  ASSERT_EQ(first.exit_code, 0) << first.output;
  const auto second = train({"--epochs", "2", "--limit-train", "256", "--log-every", "0",
                             "--checkpoint", checkpoint, "--resume"});
  EXPECT_NE(second.exit_code, 0) << second.output;
  EXPECT_THAT(second.output,
              HasSubstr("the checkpoint " + checkpoint +
                        " holds an SGD optimizer's state (without momentum); this run uses SGD "
                        "with momentum (--optimizer sgd). Resume with --optimizer sgd --momentum 0 "
                        "or start without --resume"))
      << second.output;
  EXPECT_THAT(second.output, Not(HasSubstr("loss "))) << second.output;
}

}  // namespace
}  // namespace ddp::test
