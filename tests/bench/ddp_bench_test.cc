// ddp-bench as users run it: real rank processes under ddprun, or started directly with the
// torchrun variables, every collective checked against the reference; bad options exit 2.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "ddp/runtime/init.h"
#include "support/multiprocess.h"
#include "support/subprocess.h"

namespace ddp::test {
namespace {

using namespace std::chrono_literals;
using ::testing::HasSubstr;
using Env = std::map<std::string, std::optional<std::string>>;

// Launcher variables of the test's own environment, removed so that a rank started here does not
// believe it belongs to some outer job.
Env clean_launch_env() {
  Env env;
  for (const char* name : {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                           "MASTER_PORT", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                           "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE",
                           "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "DDP_BACKEND"}) {
    env[name] = std::nullopt;
  }
  env["DDP_TIMEOUT"] = "60";
  return env;
}

const std::vector<std::string> kSmokeArgs{"--op", "all",      "--max-bytes", "64K",     "--iters",
                                          "2",    "--warmup", "1",           "--check", "--json"};

// The JSON rows in `output`: lines that are a JSON object, after ddprun's "[rank] " prefix if any.
std::vector<nlohmann::json> json_rows(const std::string& output) {
  std::vector<nlohmann::json> rows;
  std::istringstream in(output);
  for (std::string line; std::getline(in, line);) {
    if (line.starts_with("[")) {
      const auto end = line.find("] ");
      if (end != std::string::npos) line = line.substr(end + 2);
    }
    if (!line.starts_with("{")) continue;
    rows.push_back(nlohmann::json::parse(line));  // throws (fails the test) on a malformed row
  }
  return rows;
}

// Every row well-formed and correct; every collective present; 14 sizes (8 B .. 64 KiB) each.
void expect_smoke_rows(const std::vector<nlohmann::json>& rows, int world_size,
                       const std::string& output) {
  ASSERT_EQ(rows.size(), 8u * 14u + 1u) << output;
  std::map<std::string, int> rows_per_op;
  for (const auto& row : rows) {
    SCOPED_TRACE(row.dump());
    for (const char* key : {"op", "bytes", "count", "dtype", "time_us", "algbw_gbps", "busbw_gbps",
                            "wrong", "world_size", "backend"}) {
      EXPECT_TRUE(row.contains(key)) << key;
    }
    ASSERT_TRUE(row["wrong"].is_number_integer());
    EXPECT_EQ(row["wrong"].get<long long>(), 0);
    EXPECT_EQ(row["world_size"].get<int>(), world_size);
    EXPECT_EQ(row["backend"].get<std::string>(), "ring");
    EXPECT_EQ(row["dtype"].get<std::string>(), "float32");
    EXPECT_GT(row["time_us"].get<double>(), 0.0);
    EXPECT_GE(row["busbw_gbps"].get<double>(), 0.0);
    const auto op = row["op"].get<std::string>();
    if (op != "barrier") {
      EXPECT_EQ(row["bytes"].get<std::size_t>(), row["count"].get<std::size_t>() * 4);
      EXPECT_LE(row["bytes"].get<std::size_t>(), 64u << 10);
    }
    ++rows_per_op[op];
  }
  const std::set<std::string> expected_ops{"allreduce",      "broadcast", "reduce",
                                           "allgather",      "gather",    "scatter",
                                           "reduce_scatter", "alltoall",  "barrier"};
  std::set<std::string> ops;
  for (const auto& [op, n] : rows_per_op) {
    ops.insert(op);
    EXPECT_EQ(n, op == "barrier" ? 1 : 14) << op;
  }
  EXPECT_EQ(ops, expected_ops);
}

TEST(DdpBench, EveryCollectiveIsCorrectUnderDdprun) {
  std::vector<std::string> argv{built_program("ddprun"), "--standalone", "--nproc-per-node", "2",
                                built_program("ddp-bench")};
  argv.insert(argv.end(), kSmokeArgs.begin(), kSmokeArgs.end());
  const ExitStatus result = Subprocess::start(argv, clean_launch_env()).wait(180s);
  ASSERT_FALSE(result.timed_out) << result.output;
  ASSERT_EQ(result.exit_code, 0) << result.output;
  expect_smoke_rows(json_rows(result.output), 2, result.output);
}

// --op sendrecv (each rank sends to the next and receives from the previous, both posted before
// either is waited for) on three ranks, checked, up to 4 MiB (past the eager limit: rendezvous).
TEST(DdpBench, SendRecvIsCorrectUnderDdprun) {
  const std::vector<std::string> argv{built_program("ddprun"),
                                      "--standalone",
                                      "--nproc-per-node",
                                      "3",
                                      built_program("ddp-bench"),
                                      "--op",
                                      "sendrecv",
                                      "--sizes",
                                      "8,64K,4M",
                                      "--iters",
                                      "2",
                                      "--warmup",
                                      "1",
                                      "--check",
                                      "--json"};
  const ExitStatus result = Subprocess::start(argv, clean_launch_env()).wait(180s);
  ASSERT_FALSE(result.timed_out) << result.output;
  ASSERT_EQ(result.exit_code, 0) << result.output;
  const auto rows = json_rows(result.output);
  ASSERT_EQ(rows.size(), 3u) << result.output;
  for (const auto& row : rows) {
    EXPECT_EQ(row["op"].get<std::string>(), "sendrecv");
    EXPECT_EQ(row["wrong"].get<long long>(), 0) << row.dump();
    EXPECT_EQ(row["world_size"].get<int>(), 3);
  }
  EXPECT_EQ(rows[2]["bytes"].get<std::size_t>(), 4u << 20);
}

// --op sendrecv needs a peer: on one rank it is a usage error, not a hang or a crash.
// --in-place and --shared-buffer (the zero-copy allreduce) on three ranks, checked at sizes on
// both sides of the small-message path; over TCP there is no shared buffer: a clear failure.
TEST(DdpBench, InPlaceAndSharedBufferAllreducesAreCorrectUnderDdprun) {
  for (const char* flag : {"--in-place", "--shared-buffer"}) {
    SCOPED_TRACE(flag);
    const std::vector<std::string> argv{built_program("ddprun"),
                                        "--standalone",
                                        "--nproc-per-node",
                                        "3",
                                        built_program("ddp-bench"),
                                        "--op",
                                        "allreduce",
                                        "--sizes",
                                        "8,64K,4M",
                                        "--iters",
                                        "3",
                                        "--warmup",
                                        "1",
                                        "--check",
                                        "--json",
                                        flag};
    Env env = clean_launch_env();
    env["DDP_TRANSPORT"] = "auto";
    const ExitStatus result = Subprocess::start(argv, env).wait(180s);
    ASSERT_FALSE(result.timed_out) << result.output;
    ASSERT_EQ(result.exit_code, 0) << result.output;
    const auto rows = json_rows(result.output);
    ASSERT_EQ(rows.size(), 3u) << result.output;
    for (const auto& row : rows)
      EXPECT_EQ(row["wrong"].get<long long>(), 0) << row.dump();
  }
  const std::vector<std::string> argv{built_program("ddprun"),
                                      "--standalone",
                                      "--nproc-per-node",
                                      "2",
                                      built_program("ddp-bench"),
                                      "--sizes",
                                      "64K",
                                      "--shared-buffer"};
  Env env = clean_launch_env();
  env["DDP_TRANSPORT"] = "tcp";
  const ExitStatus result = Subprocess::start(argv, env).wait(180s);
  ASSERT_FALSE(result.timed_out) << result.output;
  EXPECT_NE(result.exit_code, 0) << result.output;
  EXPECT_THAT(result.output, HasSubstr("no shared buffer")) << result.output;
}

TEST(DdpBench, SendRecvOnOneRankIsAUsageError) {
  const std::vector<std::string> argv{built_program("ddp-bench"), "--op", "sendrecv", "--sizes",
                                      "1K"};
  const ExitStatus result = Subprocess::start(argv, clean_launch_env()).wait(60s);
  ASSERT_FALSE(result.timed_out) << result.output;
  EXPECT_EQ(result.exit_code, 2) << result.output;
  EXPECT_NE(result.output.find("needs at least 2 ranks"), std::string::npos) << result.output;
}

// The same, with the ranks started here with torchrun's variables (no launcher at all), three
// ranks, another dtype and reduction, and a root that is not rank 0.
TEST(DdpBench, RanksStartedWithTorchrunVariablesAgreeOnEveryResult) {
  const int world_size = 3;
  const int port = free_port();
  std::vector<Subprocess> ranks;
  for (int rank = 0; rank < world_size; ++rank) {
    Env env = clean_launch_env();
    env["RANK"] = std::to_string(rank);
    env["LOCAL_RANK"] = std::to_string(rank);
    env["WORLD_SIZE"] = std::to_string(world_size);
    env["LOCAL_WORLD_SIZE"] = std::to_string(world_size);
    env["MASTER_ADDR"] = "127.0.0.1";
    env["MASTER_PORT"] = std::to_string(port);
    ranks.push_back(Subprocess::start({built_program("ddp-bench"),
                                       "--op",
                                       "all",
                                       "--min-bytes",
                                       "2",
                                       "--max-bytes",
                                       "100K",
                                       "--step-factor",
                                       "5",
                                       "--dtype",
                                       "bfloat16",
                                       "--reduce-op",
                                       "avg",
                                       "--root",
                                       "2",
                                       "--iters",
                                       "2",
                                       "--warmup",
                                       "1",
                                       "--check",
                                       "--json"},
                                      env));
  }
  std::vector<ExitStatus> results;
  for (auto& rank : ranks)
    results.push_back(rank.wait(180s));
  for (int rank = 0; rank < world_size; ++rank) {
    ASSERT_FALSE(results[rank].timed_out) << "rank " << rank << ": " << results[rank].output;
    ASSERT_EQ(results[rank].exit_code, 0) << "rank " << rank << ": " << results[rank].output;
  }
  // Only rank 0 prints rows.
  EXPECT_TRUE(json_rows(results[1].output).empty()) << results[1].output;
  const auto rows = json_rows(results[0].output);
  ASSERT_EQ(rows.size(), 8u * 7u + 1u) << results[0].output;  // 2 B .. 31250 B by 5: 7 sizes
  for (const auto& row : rows) {
    EXPECT_EQ(row["wrong"].get<long long>(), 0) << row.dump();
    EXPECT_EQ(row["world_size"].get<int>(), world_size);
    EXPECT_EQ(row["dtype"].get<std::string>(), "bfloat16");
    EXPECT_EQ(row["reduce_op"].get<std::string>(), "avg");
    EXPECT_EQ(row["root"].get<int>(), 2);
  }
}

// The program `name` on PATH, or "" when there is none.
std::string find_on_path(const std::string& name) {
  const char* path = std::getenv("PATH");
  std::istringstream dirs(path != nullptr ? path : "/usr/bin:/bin");
  for (std::string dir; std::getline(dirs, dir, ':');) {
    const std::string candidate = (dir.empty() ? "." : dir) + "/" + name;
    if (::access(candidate.c_str(), X_OK) == 0) return candidate;
  }
  return "";
}

TEST(DdpBench, MpiBackendUnderMpirunIsCorrect) {
  const auto backends = available_backends();
  if (std::find(backends.begin(), backends.end(), "mpi") == backends.end()) {
    GTEST_SKIP() << "this build has no mpi backend";
  }
  const std::string mpirun = find_on_path("mpirun");
  if (mpirun.empty()) GTEST_SKIP() << "mpirun is not on PATH";
  Env env = clean_launch_env();
  env["MASTER_ADDR"] = "127.0.0.1";
  env["MASTER_PORT"] = std::to_string(free_port());
  const ExitStatus result = Subprocess::start({mpirun,
                                               "--allow-run-as-root",
                                               "--oversubscribe",
                                               "-np",
                                               "2",
                                               "-x",
                                               "MASTER_ADDR",
                                               "-x",
                                               "MASTER_PORT",
                                               "-x",
                                               "DDP_TIMEOUT",
                                               built_program("ddp-bench"),
                                               "--backend",
                                               "mpi",
                                               "--op",
                                               "all",
                                               "--max-bytes",
                                               "4K",
                                               "--step-factor",
                                               "8",
                                               "--iters",
                                               "2",
                                               "--warmup",
                                               "1",
                                               "--check",
                                               "--json"},
                                              env)
                                .wait(180s);
  ASSERT_FALSE(result.timed_out) << result.output;
  ASSERT_EQ(result.exit_code, 0) << result.output;
  const auto rows = json_rows(result.output);
  ASSERT_EQ(rows.size(), 8u * 4u + 1u) << result.output;  // 8 B, 64 B, 512 B, 4 KiB each
  for (const auto& row : rows) {
    EXPECT_EQ(row["wrong"].get<long long>(), 0) << row.dump();
    EXPECT_EQ(row["backend"].get<std::string>(), "mpi");
  }
}

TEST(DdpBench, TableHasAHeaderAndOneRowPerSize) {
  const ExitStatus result =
      Subprocess::start({built_program("ddp-bench"), "--min-bytes", "1K", "--max-bytes", "4K",
                         "--iters", "1", "--warmup", "0", "--check"},
                        clean_launch_env())
          .wait(60s);
  ASSERT_EQ(result.exit_code, 0) << result.output;
  EXPECT_THAT(result.output, HasSubstr("# ddp-bench: backend ring, world size 1"));
  EXPECT_THAT(result.output, HasSubstr("median"));
  EXPECT_THAT(result.output, HasSubstr("which changes the timings"));  // --check says so
  std::istringstream in(result.output);
  int rows = 0;
  for (std::string line; std::getline(in, line);) {
    if (line.find("allreduce") != std::string::npos && !line.starts_with("#")) {
      ++rows;
      EXPECT_THAT(line, ::testing::EndsWith(" 0")) << "wrong column: " << line;
    }
  }
  EXPECT_EQ(rows, 3) << result.output;  // 1K, 2K, 4K
}

TEST(DdpBench, BadOptionsExitWithTwoAndSayWhy) {
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases{
      {{"--op", "allreduse"}, "--op 'allreduse'"},
      {{"--dtype", "float8"}, "--dtype 'float8'"},
      {{"--reduce-op", "mean"}, "--reduce-op 'mean'"},
      {{"--max-bytes", "12X"}, "--max-bytes '12X'"},
      {{"--min-bytes", "1M", "--max-bytes", "1K"}, "--min-bytes"},
      {{"--step-factor", "1"}, "--step-factor"},
      {{"--iters", "0"}, "--iters"},
      {{"--backend", "nccl"}, "--backend"},
      {{"--no-such-option"}, "--no-such-option"},
  };
  for (const auto& [args, message] : cases) {
    std::vector<std::string> argv{built_program("ddp-bench")};
    argv.insert(argv.end(), args.begin(), args.end());
    const ExitStatus result = Subprocess::start(argv, clean_launch_env()).wait(30s);
    EXPECT_EQ(result.exit_code, 2) << args.front() << ": " << result.output;
    EXPECT_THAT(result.output, HasSubstr("ddp-bench: error:"));
    EXPECT_THAT(result.output, HasSubstr(message));
  }
}

TEST(DdpBench, UnavailableBackendOrRootOutsideTheJobExitWithTwo) {
  const auto backends = available_backends();
  if (std::find(backends.begin(), backends.end(), "mpi") == backends.end()) {
    const ExitStatus result =
        Subprocess::start({built_program("ddp-bench"), "--backend", "mpi"}, clean_launch_env())
            .wait(30s);
    EXPECT_EQ(result.exit_code, 2) << result.output;
    EXPECT_THAT(result.output, HasSubstr("unknown backend 'mpi' (from --backend)"));
  }
  const ExitStatus result =
      Subprocess::start({built_program("ddp-bench"), "--op", "broadcast", "--root", "1"},
                        clean_launch_env())
          .wait(30s);
  EXPECT_EQ(result.exit_code, 2) << result.output;
  EXPECT_THAT(result.output, HasSubstr("--root 1 is not a rank of this job of 1 ranks"));
}

TEST(DdpBench, UnknownDdpBackendIsRefusedNotIgnored) {
  Env env = clean_launch_env();
  env["DDP_BACKEND"] = "foo";
  const ExitStatus result =
      Subprocess::start({built_program("ddp-bench"), "--iters", "1", "--max-bytes", "8"}, env)
          .wait(30s);
  EXPECT_EQ(result.exit_code, 2) << result.output;
  EXPECT_THAT(result.output, HasSubstr("unknown backend 'foo' (from DDP_BACKEND)"));
  EXPECT_THAT(result.output, HasSubstr("ring"));
  // A valid DDP_BACKEND is used when --backend is not given; --backend wins over it.
  env["DDP_BACKEND"] = "ring";
  const ExitStatus ok =
      Subprocess::start({built_program("ddp-bench"), "--iters", "1", "--max-bytes", "8"}, env)
          .wait(60s);
  EXPECT_EQ(ok.exit_code, 0) << ok.output;
  EXPECT_THAT(ok.output, HasSubstr("backend ring"));
}

}  // namespace
}  // namespace ddp::test
