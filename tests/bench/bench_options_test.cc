// ddp-bench's command line, parsed in-process: sizes with suffixes, defaults, and errors that
// name what was wrong.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <sstream>
#include <string>
#include <vector>

#include "ddp-bench/bench_options.h"

namespace ddp::bench {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

BenchOptions parse(const std::vector<std::string>& args) {
  std::ostringstream help;
  auto options = parse_command_line(args, help);
  if (!options) throw std::runtime_error("help was printed");
  return *options;
}

// The message of the UsageError that parsing `args` throws, or "" when it does not throw.
std::string usage_error(const std::vector<std::string>& args) {
  try {
    parse(args);
  } catch (const UsageError& e) {
    return e.what();
  }
  return "";
}

TEST(BenchByteSize, AcceptsPlainNumbersAndBinarySuffixes) {
  EXPECT_EQ(parse_byte_size("8"), 8u);
  EXPECT_EQ(parse_byte_size("64K"), 64u << 10);
  EXPECT_EQ(parse_byte_size("64k"), 64u << 10);
  EXPECT_EQ(parse_byte_size("1M"), 1u << 20);
  EXPECT_EQ(parse_byte_size("2G"), std::size_t{2} << 30);
  EXPECT_EQ(parse_byte_size("16KiB"), 16u << 10);
  EXPECT_EQ(parse_byte_size("3MB"), 3u << 20);
  EXPECT_EQ(parse_byte_size("512B"), 512u);
  EXPECT_EQ(parse_byte_size("0"), 0u);
}

TEST(BenchByteSize, RejectsWhatIsNotASize) {
  for (const char* bad : {"", "K", "12X", "-1", "1.5M", "1 M", "1T", "99999999999999999999999",
                          "18446744073709551615G"}) {
    EXPECT_THROW(parse_byte_size(bad, "--max-bytes"), UsageError) << bad;
  }
  try {
    parse_byte_size("12X", "--max-bytes");
    FAIL() << "no error";
  } catch (const UsageError& e) {
    EXPECT_THAT(e.what(), HasSubstr("--max-bytes '12X'"));
    EXPECT_THAT(e.what(), HasSubstr("64K"));  // says what to write instead
  }
}

TEST(BenchCommandLine, DefaultsAreThoseOfTheDocs) {
  const BenchOptions o = parse({});
  EXPECT_EQ(o.backend, "");  // DDP_BACKEND or the default, resolved by ddp::resolve_backend
  EXPECT_THAT(o.collectives, ElementsAre(Collective::kAllreduce));
  EXPECT_EQ(o.dtype, DType::kFloat32);
  EXPECT_EQ(o.reduce_op, ReduceOp::kSum);
  EXPECT_EQ(o.min_bytes, 8u);
  EXPECT_EQ(o.max_bytes, std::size_t{64} << 20);
  EXPECT_EQ(o.step_factor, 2u);
  EXPECT_EQ(o.iters, 20);
  EXPECT_EQ(o.warmup, 5);
  EXPECT_FALSE(o.check);
  EXPECT_FALSE(o.json);
  EXPECT_FALSE(o.timeout.has_value());
  const auto sizes = o.byte_sizes();
  ASSERT_EQ(sizes.size(), 24u);  // 8 B .. 64 MiB, doubling
  EXPECT_EQ(sizes.front(), 8u);
  EXPECT_EQ(sizes.back(), std::size_t{64} << 20);
}

TEST(BenchCommandLine, ReadsEveryOption) {
  const BenchOptions o =
      parse({"--backend",     "mpi",      "--op",        "reduce_scatter,barrier",
             "--dtype",       "bfloat16", "--reduce-op", "avg",
             "--min-bytes",   "1K",       "--max-bytes", "1M",
             "--step-factor", "4",        "--iters",     "3",
             "--warmup",      "0",        "--root",      "1",
             "--check",       "--json",   "--timeout",   "2.5"});
  EXPECT_EQ(o.backend, "mpi");
  EXPECT_THAT(o.collectives, ElementsAre(Collective::kReduceScatter, Collective::kBarrier));
  EXPECT_EQ(o.dtype, DType::kBFloat16);
  EXPECT_EQ(o.reduce_op, ReduceOp::kAvg);
  EXPECT_THAT(o.byte_sizes(),
              ElementsAre(1u << 10, 4u << 10, 16u << 10, 64u << 10, 256u << 10, 1u << 20));
  EXPECT_EQ(o.iters, 3);
  EXPECT_EQ(o.warmup, 0);
  EXPECT_EQ(o.root, 1);
  EXPECT_TRUE(o.check);
  EXPECT_TRUE(o.json);
  ASSERT_TRUE(o.timeout.has_value());
  EXPECT_EQ(o.timeout->count(), 2500);
}

TEST(BenchCommandLine, OpAllRunsEveryCollectiveOnce) {
  const BenchOptions o = parse({"--op", "all"});
  EXPECT_EQ(o.collectives, all_collectives());
  EXPECT_EQ(o.collectives.size(), 9u);
  for (Collective c : o.collectives)
    EXPECT_NE(to_string(c), "unknown");
}

TEST(BenchCommandLine, ExplicitSizesReplaceTheRange) {
  const BenchOptions o = parse({"--sizes", "1K,64K,1M,16M,64M", "--max-bytes", "8"});
  EXPECT_THAT(o.byte_sizes(),
              ElementsAre(1u << 10, 64u << 10, 1u << 20, 16u << 20, std::size_t{64} << 20));
}

TEST(BenchCommandLine, EveryDTypeAndReduceOpHasAName) {
  for (const char* dtype :
       {"float32", "float64", "float16", "bfloat16", "int8", "uint8", "int32", "int64"}) {
    EXPECT_EQ(to_string(parse({"--dtype", dtype}).dtype), dtype);
  }
  for (const char* op : {"sum", "avg", "min", "max", "product"}) {
    EXPECT_EQ(to_string(parse({"--reduce-op", op}).reduce_op), op);
  }
}

TEST(BenchCommandLine, BadOptionsSayWhatWasWrong) {
  EXPECT_THAT(usage_error({"--op", "allreduse"}), HasSubstr("--op 'allreduse'"));
  EXPECT_THAT(usage_error({"--op", "allreduse"}), HasSubstr("reduce_scatter"));
  EXPECT_THAT(usage_error({"--dtype", "float8"}), HasSubstr("bfloat16"));
  EXPECT_THAT(usage_error({"--reduce-op", "mean"}), HasSubstr("--reduce-op 'mean'"));
  EXPECT_THAT(usage_error({"--backend", "nccl"}), HasSubstr("--backend"));
  EXPECT_THAT(usage_error({"--max-bytes", "lots"}), HasSubstr("--max-bytes"));
  EXPECT_THAT(usage_error({"--min-bytes", "1M", "--max-bytes", "1K"}), HasSubstr("swap"));
  EXPECT_THAT(usage_error({"--min-bytes", "0"}), HasSubstr("--min-bytes"));
  EXPECT_THAT(usage_error({"--step-factor", "1"}), HasSubstr("--step-factor"));
  EXPECT_THAT(usage_error({"--iters", "0"}), HasSubstr("--iters"));
  EXPECT_THAT(usage_error({"--warmup", "-1"}), HasSubstr("--warmup"));
  EXPECT_THAT(usage_error({"--sizes", "1K,,2K"}), HasSubstr("--sizes"));
  EXPECT_THAT(usage_error({"--frobnicate"}), HasSubstr("--frobnicate"));
}

TEST(BenchCommandLine, HelpPrintsAndReturnsNothing) {
  std::ostringstream help;
  EXPECT_FALSE(parse_command_line({"--help"}, help).has_value());
  EXPECT_THAT(help.str(), HasSubstr("--reduce-op"));
  EXPECT_THAT(help.str(), HasSubstr("busbw"));
}

}  // namespace
}  // namespace ddp::bench
