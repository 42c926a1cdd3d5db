// ddp-train-bench (bench/compare/ddp_train_bench.cc) refuses every bad flag by name: exit 1 and a
// message naming the flag, the value and what would be valid, never a runaway or libtorch's error
// alone. One process each (world size 1, no launcher).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
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

// One step and no warm-up, should a flag get through; the cases add --model (or --model-file).
void expect_refusal(std::vector<std::string> args, const std::vector<std::string>& named) {
  if (std::find(args.begin(), args.end(), "--steps") == args.end()) {
    args.insert(args.end(), {"--steps", "1", "--warmup", "0"});
  }
  expect_refused("ddp-train-bench", args, named, "step_ms=");
}

TEST(DdpTrainBenchFlags, ThreadsAbove256AreRefusedBeforeAnyStarts) {
  // --threads 100000 started threads until the machine ran out (2,195 and 18 GB after 25 s).
  expect_refusal({"--model", "cnn", "--batch-size", "2", "--threads", "100000"},
                 {"--threads", "100000", "1 to 256"});
}

TEST(DdpTrainBenchFlags, HugeOrNonFiniteBucketCapsAreNamedWithTheBound) {
  // 1e300 MiB reached DDP as a cap of 0 bytes: "bucket caps must be positive", no flag named.
  expect_refusal(
      {"--model", "cnn", "--batch-size", "2", "--always-ddp", "--bucket-cap-mb", "1e300"},
      {"--bucket-cap-mb", "1e300 is too large", "at most 1048576 MiB"});
  expect_refusal(
      {"--model", "cnn", "--batch-size", "2", "--always-ddp", "--first-bucket-cap-mb", "inf"},
      {"--first-bucket-cap-mb", "inf is not finite"});
  expect_refusal({"--model", "cnn", "--batch-size", "2", "--always-ddp", "--bucket-cap-mb", "nan"},
                 {"--bucket-cap-mb", "nan is not a number"});
  expect_refusal(
      {"--model", "cnn", "--batch-size", "2", "--always-ddp", "--first-bucket-cap-mb", "0"},
      {"--first-bucket-cap-mb", "0 is not above 0"});
}

TEST(DdpTrainBenchFlags, AModelFileThatIsNoTorchScriptArchiveIsNamed) {
  // /dev/null reached torch::jit::load, whose error named neither the flag nor the file.
  expect_refusal({"--model-file", "/dev/null"},
                 {"--model-file", "'/dev/null' is a character device, not a regular file"});
  expect_refusal({"--model-file", "/etc"}, {"--model-file", "'/etc' is a directory"});
  TempDir dir("ddp-train-bench-flags");
  const auto empty = (dir.path() / "empty.pt").string();
  const auto text = (dir.path() / "text.pt").string();
  std::ofstream(empty).flush();
  std::ofstream(text) << "not a zip archive\n";
  expect_refusal({"--model-file", empty}, {"--model-file", fmt::format("'{}' is empty", empty)});
  expect_refusal({"--model-file", text},
                 {fmt::format("--model-file '{}' is not a TorchScript archive", text)});
}

TEST(DdpTrainBenchFlags, ATorchScriptModelOfTheWrongShapeIsNamedBeforeTheFirstStep) {
  // Exported by /usr/bin/python3's torch (Debian's, as bench/probes/torchscript_vs_module.py does).
  TempDir dir("ddp-train-bench-flags");
  const auto model = (dir.path() / "five_logits.pt").string();
  const auto exported =
      Subprocess::start({"/usr/bin/python3", "-c",
                         "import sys, torch; torch.jit.script(torch.nn.Sequential(torch.nn."
                         "Flatten(), torch.nn.Linear(784, 5))).save(sys.argv[1])",
                         model})
          .wait(std::chrono::seconds(120));
  if (exported.exit_code != 0) {
    GTEST_SKIP() << "/usr/bin/python3 could not export a TorchScript module: " << exported.output;
  }
  expect_refusal({"--model-file", model, "--batch-size", "2"},
                 {fmt::format("--model-file '{}'", model), "returned a tensor of shape [2, 5]",
                  "not [2, 10] logits"});
}

TEST(DdpTrainBenchFlags, OtherOutOfRangeValuesAreNamed) {
  // A batch no machine holds: named before libtorch's allocator fails on it.
  expect_refusal({"--model", "cnn", "--batch-size", "2000000000"},
                 {"--batch-size 2000000000", "needs at least", "GiB per rank"});
  // --warmup + --steps must stay an int.
  expect_refusal({"--steps", "2000000000"}, {"--steps", "1 to 1000000000"});
  expect_refusal({"--min-num-params", "0"}, {"--min-num-params", "1 to 1099511627776"});
  expect_refusal({"--divergence-check-every", "-1"},
                 {"--divergence-check-every", "0 to 9223372036854775807"});
  // A combination that cannot work exits 1 like every other refusal (it was 2).
  expect_refusal({"--model", "cnn", "--batch-size", "2", "--cpu-offload"},
                 {"--cpu-offload is FSDP's"});
}

}  // namespace
}  // namespace ddp::test
