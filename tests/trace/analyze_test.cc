// ddp-trace analyze on hand-written dumps: what it names (the rank behind, the collective that
// never matched, mismatched fingerprints, missing ranks), that healthy dumps are no problem, the
// errors for an empty, missing or corrupt folder, and the program's exit codes (0, 1, 2).
#include "ddp-trace/analyze.h"

#include <gtest/gtest.h>

#include <fstream>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "ddp-trace/flight_dump.h"
#include "support/subprocess.h"
#include "support/temp_dir.h"

namespace ddp::test {
namespace {

using namespace std::chrono_literals;
using trace::analyze;
using trace::read_flight_dumps;
using trace::TraceError;

struct Op {
  std::uint64_t sequence;
  std::string op;
  std::uint64_t count;
  std::string state;
  long long enqueued_us;
  std::string reduce = "sum";
  int root = -1;
};

std::string entry_json(const Op& o) {
  const bool started = o.state != "queued";
  const bool ended = o.state == "completed" || o.state == "failed";
  return fmt::format(
      R"({{"id": {0}, "sequence": {0}, "channel": "collective", "peer": null, "op": "{1}",
          "dtype": "float32", "count": {2}, "bytes": {3}, "reduce_op": {4}, "root": {5},
          "algorithm": "ring", "state": "{6}", "enqueued_us": {7}, "started_us": {8},
          "ended_us": {9}, "duration_us": null}})",
      o.sequence, o.op, o.count, o.count * 4, o.reduce.empty() ? "null" : "\"" + o.reduce + "\"",
      o.root < 0 ? "null" : std::to_string(o.root), o.state, o.enqueued_us,
      started ? std::to_string(o.enqueued_us + 1) : "null",
      ended ? std::to_string(o.enqueued_us + 10) : "null");
}

void write_dump(const TempDir& dir, int rank, int size, const std::vector<Op>& ops,
                const std::string& reason = "signal", const std::string& error = "") {
  std::string entries;
  for (const auto& o : ops)
    entries += (entries.empty() ? "" : ",\n") + entry_json(o);
  std::ofstream(dir / fmt::format("ddp_flight_default_rank{}.json", rank)) << fmt::format(
      R"({{"format": "ddp-flight-recorder", "version": 1, "group": "default", "backend": "ring",
          "rank": {}, "size": {}, "job_rank": null, "job_world_size": null, "pid": 1, "host": "h",
          "dump_time": "x", "dump_time_unix_us": 5000000, "reason": "{}", "error": {},
          "capacity": 2000, "recorded": {}, "entries": [{}]}})",
      rank, size, reason, error.empty() ? "null" : "\"" + error + "\"", ops.size(), entries);
}

std::string text_of(const trace::Report& report) {
  std::string text;
  for (const auto& line : report.lines)
    text += line + "\n";
  return text;
}

TEST(TraceAnalyze, HealthyDumpsAreNoProblem) {
  TempDir dir("ddp-trace");
  for (int r = 0; r < 3; ++r) {
    write_dump(
        dir, r, 3,
        {{0, "allreduce", 8, "completed", 1000}, {1, "broadcast", 8, "completed", 2000, "", 0}});
  }
  const auto report = analyze(read_flight_dumps(dir.path()));
  EXPECT_FALSE(report.problem) << text_of(report);
  EXPECT_NE(text_of(report).find("no problem found: every rank reached #1"), std::string::npos)
      << text_of(report);
}

TEST(TraceAnalyze, AHangWithoutFailureNamesTheRankBehindAndTheCollectiveThatNeverMatched) {
  TempDir dir("ddp-trace");
  // SIGUSR1 dumps of a hang: ranks 0 and 2 wait in #2; rank 1 stopped after #1.
  write_dump(dir, 0, 3,
             {{0, "allreduce", 8, "completed", 1000},
              {1, "allreduce", 8, "completed", 2000},
              {2, "allreduce", 8, "started", 3000}});
  write_dump(dir, 1, 3,
             {{0, "allreduce", 8, "completed", 1000}, {1, "allreduce", 8, "completed", 2000}});
  write_dump(dir, 2, 3,
             {{0, "allreduce", 8, "completed", 1000},
              {1, "allreduce", 8, "completed", 2000},
              {2, "allreduce", 8, "started", 3000}});
  const auto report = analyze(read_flight_dumps(dir.path()));
  const std::string text = text_of(report);
  EXPECT_TRUE(report.problem) << text;
  EXPECT_NE(text.find("rank 1 is behind: it last completed allreduce(float32 x 8, sum) #1"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("collective allreduce(float32 x 8, sum) #2 never matched: issued on ranks "
                      "0, 2, never issued on rank 1; still queued or running on ranks 0, 2"),
            std::string::npos)
      << text;
  EXPECT_EQ(text.find("rank 0 is behind"), std::string::npos) << text;
}

TEST(TraceAnalyze, MismatchedFingerprintsAreNamedWithEveryCall) {
  TempDir dir("ddp-trace");
  write_dump(dir, 0, 2,
             {{0, "allreduce", 8, "completed", 1000}, {1, "allreduce", 256, "failed", 2000}},
             "mismatch", "collective mismatch");
  write_dump(dir, 1, 2,
             {{0, "allreduce", 8, "completed", 1000}, {1, "broadcast", 256, "failed", 2000, "", 0}},
             "mismatch", "collective mismatch");
  const auto report = analyze(read_flight_dumps(dir.path()));
  const std::string text = text_of(report);
  EXPECT_TRUE(report.problem) << text;
  EXPECT_NE(text.find("mismatch at #1: rank 0 called allreduce(float32 x 256, sum) #1; rank 1 "
                      "called broadcast(float32 x 256, root 0) #1"),
            std::string::npos)
      << text;
}

TEST(TraceAnalyze, ARankWithoutADumpIsNamed) {
  TempDir dir("ddp-trace");
  write_dump(dir, 0, 3, {{0, "allreduce", 8, "completed", 1000}});
  write_dump(dir, 2, 3, {{0, "allreduce", 8, "completed", 1000}});
  const auto report = analyze(read_flight_dumps(dir.path()));
  EXPECT_TRUE(report.problem);
  EXPECT_NE(text_of(report).find("no dump from rank 1"), std::string::npos) << text_of(report);
}

TEST(TraceAnalyze, SequenceNumbersFarApartAndHugeSizesDoNotHangOrExhaustMemory) {
  TempDir dir("ddp-trace");
  const std::uint64_t far = 18'446'744'073'709'551'000ull;
  write_dump(dir, 0, 2,
             {{0, "allreduce", 8, "completed", 1000}, {far, "allreduce", 8, "started", 2000}});
  write_dump(dir, 1, 2, {{0, "allreduce", 8, "completed", 1000}});
  const auto report = analyze(read_flight_dumps(dir.path()));
  EXPECT_TRUE(report.problem);
  EXPECT_NE(text_of(report).find(fmt::format("#{} never matched", far)), std::string::npos)
      << text_of(report);
  write_dump(dir, 1, 2'000'000'000, {{0, "allreduce", 8, "completed", 1000}});
  EXPECT_THROW(read_flight_dumps(dir.path()), TraceError);
}

TEST(TraceAnalyze, EmptyMissingAndCorruptFoldersAreClearErrors) {
  TempDir dir("ddp-trace");
  const auto message = [](const std::filesystem::path& p) {
    try {
      read_flight_dumps(p);
    } catch (const TraceError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message(dir.path()).find("no flight recorder dumps (ddp_flight_*.json) in"),
            std::string::npos);
  EXPECT_NE(message(dir / "nope").find("is not a folder"), std::string::npos);
  std::ofstream(dir / "ddp_flight_default_rank0.json")
      << R"({"format": "ddp-flight-recorder", "ver)";
  EXPECT_NE(message(dir.path()).find("ddp_flight_default_rank0.json: not valid JSON"),
            std::string::npos)
      << message(dir.path());
  std::ofstream(dir / "ddp_flight_default_rank0.json") << R"({"format": 5e777777})";
  EXPECT_NE(message(dir.path()).find("not valid JSON"), std::string::npos) << message(dir.path());
  std::ofstream(dir / "ddp_flight_default_rank0.json") << R"({"something": "else"})";
  EXPECT_NE(message(dir.path()).find("not a ddp flight recorder dump"), std::string::npos);
  std::ofstream(dir / "ddp_flight_default_rank0.json")
      << R"({"format": "ddp-flight-recorder", "version": 1, "group": "g", "rank": 0, "size": 1})";
  EXPECT_NE(message(dir.path()).find("has no field 'entries'"), std::string::npos)
      << message(dir.path());
}

TEST(TraceAnalyze, ExitCodesSayWhatWasFound) {
  TempDir dir("ddp-trace");
  const std::string program = built_program("ddp-trace");
  auto empty = Subprocess::start({program, "analyze", dir.path()}).wait(30s);
  EXPECT_EQ(empty.exit_code, 2) << empty.output;
  EXPECT_NE(empty.output.find("ddp-trace: error: no flight recorder dumps"), std::string::npos)
      << empty.output;
  write_dump(dir, 0, 1, {{0, "allreduce", 8, "completed", 1000}});
  auto healthy = Subprocess::start({program, "analyze", dir.path()}).wait(30s);
  EXPECT_EQ(healthy.exit_code, 0) << healthy.output;
  write_dump(dir, 0, 2, {{0, "allreduce", 8, "completed", 1000}});
  auto missing = Subprocess::start({program, "analyze", dir.path()}).wait(30s);
  EXPECT_EQ(missing.exit_code, 1) << missing.output;
  auto usage = Subprocess::start({program}).wait(30s);
  EXPECT_EQ(usage.exit_code, 2) << usage.output;
}

}  // namespace
}  // namespace ddp::test
