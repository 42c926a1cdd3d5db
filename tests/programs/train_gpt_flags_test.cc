// train-gpt (examples/gpt) refuses every bad flag by name: exit 1 and a message naming the flag,
// the value and what would be valid, never a crash, a runaway, libtorch's error alone or an exit 0
// with an invented result. One process each (a job of world size 1, no launcher).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "support/program_refusal.h"
#include "support/subprocess.h"
#include "support/temp_dir.h"

namespace ddp::test {
namespace {

using namespace std::chrono_literals;
using ::testing::HasSubstr;

// A model small enough that a few steps take a second.
const std::vector<std::string> kSmall{"--layers",     "1", "--hidden",     "16",
                                      "--heads",      "2", "--block-size", "8",
                                      "--batch-size", "4", "--log-every",  "1"};

ExitStatus train_gpt(const std::vector<std::string>& args, std::chrono::milliseconds timeout) {
  return run_program("train-gpt", args, timeout);
}

void expect_refusal(const std::vector<std::string>& args, const std::vector<std::string>& named) {
  ddp::test::expect_refused("train-gpt", args, named, "final loss");
}

void write_file(const std::filesystem::path& path, const std::string& text) {
  std::ofstream(path, std::ios::binary) << text;
}

TEST(TrainGptFlags, ThreadsAbove256AreRefusedBeforeAnyStarts) {
  // --threads 100000 started threads until the machine ran out (2,195 and 18 GB after 25 s).
  expect_refusal({"--threads", "100000"}, {"--threads", "100000", "1 to 256"});
  expect_refusal({"--threads", "0"}, {"--threads", "1 to 256"});
}

TEST(TrainGptFlags, ABlockSizeTheTextCannotFillIsNamedWithBothLengths) {
  // It failed inside random_ ("from is out of bounds"), naming neither the flag nor the text.
  TempDir dir("train-gpt-flags");
  std::string short_text(500, 'a');
  short_text += 'b';  // not a + "b": GCC 12 warns on that (-Warray-bounds, a false positive)
  write_file(dir.path() / "short.txt", short_text);
  const auto text = (dir.path() / "short.txt").string();
  expect_refusal({"--data", text, "--block-size", "600"},
                 {"--block-size 600", text, "has 501 characters", "at least 602"});
  expect_refusal({"--block-size", "100000"},
                 {"--block-size 100000", "characters", "at least 100002"});
  // The bound of the flag itself (the attention scores grow with its square).
  expect_refusal({"--block-size", "2000000"}, {"--block-size", "2000000", "1 to 1048576"});
}

TEST(TrainGptFlags, DataThatIsNotAReadableRegularFileIsNamed) {
  // A directory failed with "basic_filebuf::underflow error reading the file: Is a directory".
  TempDir dir("train-gpt-flags");
  write_file(dir.path() / "empty.txt", "");
  const auto empty = (dir.path() / "empty.txt").string();
  const auto missing = (dir.path() / "missing.txt").string();
  expect_refusal({"--data", "/etc"}, {"--data", "'/etc' is a directory, not a regular file"});
  expect_refusal({"--data", "/dev/null"}, {"--data", "'/dev/null' is a character device"});
  expect_refusal({"--data", empty}, {"--data", fmt::format("'{}' is empty", empty)});
  // A given file that is missing is not replaced by the generated text.
  expect_refusal({"--data", missing}, {"--data", fmt::format("'{}' does not exist", missing)});
}

TEST(TrainGptFlags, ALayoutWhoseProductOverflowsIsNamedAgainstTheWorldSize) {
  // The product was an int: 65536 x 65536 made "0 ranks".
  expect_refusal({"--dp", "65536", "--tp", "65536"},
                 {"--dp 65536 x --tp 65536 x --pp 1 = 4294967296 ranks, but the job has 1"});
  expect_refusal({"--dp", "2147483647", "--tp", "2147483647", "--pp", "2147483647"},
                 {"= more than 2^63 ranks, but the job has 1"});
  expect_refusal({"--dp", "0"}, {"--dp", "1 to 2147483647"});
}

TEST(TrainGptFlags, ResumingAtOrPastTheRequestedStepsIsRefusedWithoutAnInventedLoss) {
  // It ran no step and printed "final loss=0" with exit 0.
  TempDir dir("train-gpt-flags");
  const auto checkpoint = (dir.path() / "ckpt").string();
  auto args = kSmall;
  args.insert(args.end(), {"--checkpoint", checkpoint});
  auto first = args;
  first.insert(first.end(), {"--steps", "2"});
  const auto saved = train_gpt(first, 120s);
  ASSERT_EQ(saved.exit_code, 0) << saved.output;
  ASSERT_THAT(saved.output, HasSubstr("final loss="));
  for (const std::string steps : {"2", "1"}) {
    auto resume = args;
    resume.insert(resume.end(), {"--resume", "--steps", steps});
    expect_refusal(resume, {fmt::format("the checkpoint in '{}' is at step 2 already", checkpoint),
                            fmt::format("--steps is {}: nothing to run", steps), "more than 2"});
  }
  // One step past the checkpoint still trains.
  auto more = args;
  more.insert(more.end(), {"--resume", "--steps", "3"});
  const auto resumed = train_gpt(more, 120s);
  EXPECT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_THAT(resumed.output, HasSubstr("at step 2"));
  EXPECT_THAT(resumed.output, HasSubstr("step 3 loss"));
}

TEST(TrainGptFlags, OtherOutOfRangeNonFiniteAndMismatchedValuesAreNamed) {
  expect_refusal({"--lr", "nan"}, {"--lr", "nan is not a number", "above 0 and at most 10"});
  expect_refusal({"--lr", "inf"}, {"--lr", "inf is not finite"});
  expect_refusal({"--lr", "0"}, {"--lr", "0 is not above 0"});
  expect_refusal({"--lr", "1e300"}, {"--lr", "1e300 is too large"});
  expect_refusal({"--seed", "-1"}, {"--seed", "'-1' is not a whole number"});
  expect_refusal({"--schedule", "zigzag"}, {"--schedule", "zigzag"});
  expect_refusal({"--dtype", "float16"}, {"--dtype", "float16"});
  expect_refusal({"--heads", "3"}, {"--hidden 32 must be a multiple of --heads 3"});
  expect_refusal({"--steps", "5", "--time-after", "5"},
                 {"--time-after 5", "--steps is 5", "0 to 4"});
  expect_refusal({"--checkpoint", "/etc/hostname"}, {"--checkpoint '/etc/hostname'"});
  // Sizes that no machine holds: named before anything is allocated.
  expect_refusal({"--hidden", "1048576"}, {"--hidden 1048576", "needs at least", "GiB per rank"});
}

}  // namespace
}  // namespace ddp::test
