// train-char-gpt (examples/char_gpt) refuses every bad flag by name: exit 1 and a message naming
// the flag, the value and what would be valid, never libtorch's error alone or an exit 0 with an
// invented loss. One process each (world size 1, no launcher).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "support/program_refusal.h"
#include "support/temp_dir.h"

namespace ddp::test {
namespace {

using namespace std::chrono_literals;
using ::testing::HasSubstr;

void expect_refusal(const std::vector<std::string>& args, const std::vector<std::string>& named) {
  expect_refused("train-char-gpt", args, named, "final_loss");
}

// A text of `characters` characters at `path`.
std::string write_text(const std::filesystem::path& path, std::size_t characters) {
  std::string text;
  for (std::size_t i = 0; i < characters; ++i)
    text += "the model is split over ranks\n"[i % 30];
  std::ofstream(path, std::ios::binary) << text;
  return path.string();
}

TEST(TrainCharGptFlags, DataThatIsNotAReadableRegularFileIsNamed) {
  // A directory failed with "basic_filebuf::underflow error reading the file: Is a directory".
  TempDir dir("train-char-gpt-flags");
  const auto empty = write_text(dir.path() / "empty.txt", 0);
  const auto missing = (dir.path() / "missing.txt").string();
  expect_refusal({"--data", "/etc"}, {"--data", "'/etc' is a directory, not a regular file"});
  expect_refusal({"--data", "/dev/null"}, {"--data", "'/dev/null' is a character device"});
  expect_refusal({"--data", empty}, {"--data", fmt::format("'{}' is empty", empty)});
  expect_refusal({"--data", missing}, {"--data", fmt::format("'{}' does not exist", missing)});
}

TEST(TrainCharGptFlags, NonFiniteRatesAndClipsAreNamed) {
  // --lr nan ended in libtorch's check inside AdamW, with a backtrace and no flag named.
  expect_refusal({"--lr", "nan"}, {"--lr", "nan is not a number", "above 0 and at most 10"});
  expect_refusal({"--lr", "inf"}, {"--lr", "inf is not finite"});
  expect_refusal({"--grad-clip", "nan"}, {"--grad-clip", "nan is not a finite number above 0"});
  expect_refusal({"--grad-clip", "0"}, {"--grad-clip", "0 is not a finite number above 0"});
}

TEST(TrainCharGptFlags, ABlockSizeTheTextCannotFillIsNamedWithBothLengths) {
  TempDir dir("train-char-gpt-flags");
  const auto text = write_text(dir.path() / "short.txt", 501);
  expect_refusal({"--data", text, "--block-size", "600"},
                 {"--block-size 600", text, "has 501 characters", "at least 602"});
  expect_refusal({"--block-size", "2000000"}, {"--block-size", "2000000", "1 to 1048576"});
  // Sizes that no machine holds: attention scores of 30,000 x 30,000 for every sample of the text.
  const auto long_text = write_text(dir.path() / "long.txt", 40000);
  expect_refusal({"--data", long_text, "--block-size", "30000", "--batch-size", "1048576"},
                 {"--block-size 30000", "needs at least", "GiB per rank"});
}

TEST(TrainCharGptFlags, ASnapshotPathThatCannotBeWrittenIsNamedBeforeTraining) {
  expect_refusal({"--snapshot", "/etc"}, {"--snapshot '/etc'", "not a regular file"});
  TempDir dir("train-char-gpt-flags");
  const auto folder = (dir.path() / "missing").string();
  expect_refusal({"--snapshot", folder + "/gpt.pt"},
                 {fmt::format("its folder '{}' does not exist", folder)});
}

TEST(TrainCharGptFlags, ResumingWithNoEpochLeftIsRefusedWithoutAnInventedLoss) {
  // It trained nothing and printed "final_loss=nan" with exit 0.
  TempDir dir("train-char-gpt-flags");
  const auto snapshot = (dir.path() / "gpt.pt").string();
  const std::vector<std::string> args{"--max-steps", "1", "--snapshot", snapshot};
  auto first = args;
  first.insert(first.end(), {"--epochs", "1"});
  const auto trained = run_program("train-char-gpt", first, 120s);
  ASSERT_EQ(trained.exit_code, 0) << trained.output;
  ASSERT_THAT(trained.output, HasSubstr("final_loss="));
  expect_refusal(first, {"--epochs 1", fmt::format("the snapshot '{}'", snapshot),
                         "epochs 0 to 0 already: nothing to run", "pass 2 or more"});
  // One epoch more still trains.
  auto more = args;
  more.insert(more.end(), {"--epochs", "2"});
  const auto resumed = run_program("train-char-gpt", more, 120s);
  EXPECT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_THAT(resumed.output, HasSubstr("at epoch 1"));
  EXPECT_THAT(resumed.output, HasSubstr("final_loss="));
}

}  // namespace
}  // namespace ddp::test
