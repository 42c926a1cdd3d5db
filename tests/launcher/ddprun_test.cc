// ddprun as users run it: a real ddprun process starting real worker processes (small /bin/sh
// scripts), checked through its output, its exit code, timing, and which processes are left.
#include <arpa/inet.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sched.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>
#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <random>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "ddprun/env_tuning.h"
#include "support/multiprocess.h"
#include "support/subprocess.h"
#include "support/temp_dir.h"

namespace ddp::test {
namespace {

using namespace std::chrono_literals;
using ::testing::HasSubstr;
using ::testing::Not;
using Clock = std::chrono::steady_clock;

std::string ddprun() {
  return built_program("ddprun");
}

ExitStatus run_ddprun(const std::vector<std::string>& args,
                      const std::map<std::string, std::optional<std::string>>& env = {},
                      std::chrono::milliseconds timeout = 30s) {
  std::vector<std::string> argv{ddprun()};
  argv.insert(argv.end(), args.begin(), args.end());
  return Subprocess::start(argv, env).wait(timeout);
}

std::vector<std::string> split_lines(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);)
    lines.push_back(line);
  return lines;
}

// "[r] KEY=VALUE" lines, by rank.
std::map<int, std::map<std::string, std::string>> env_by_rank(const std::string& output) {
  static const std::regex line_re(R"(^\[(\d+)\] ([A-Za-z_][A-Za-z0-9_]*)=(.*)$)");
  std::map<int, std::map<std::string, std::string>> result;
  for (const auto& line : split_lines(output)) {
    std::smatch m;
    if (std::regex_match(line, m, line_re)) result[std::stoi(m[1])][m[2]] = m[3];
  }
  return result;
}

std::vector<pid_t> read_pids(const std::string& path) {
  std::vector<pid_t> pids;
  std::ifstream in(path);
  for (pid_t pid; in >> pid;)
    pids.push_back(pid);
  return pids;
}

int cpu_count() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (::sched_getaffinity(0, sizeof set, &set) != 0) return 1;
  return CPU_COUNT(&set);
}

// Waits until `output` of `process` contains every one of `needles`, or the deadline passes.
bool wait_for_output(Subprocess& process, const std::vector<std::string>& needles,
                     std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  while (Clock::now() < deadline) {
    const std::string& output = process.output_so_far();
    if (std::all_of(needles.begin(), needles.end(), [&](const std::string& needle) {
          return output.find(needle) != std::string::npos;
        })) {
      return true;
    }
    std::this_thread::sleep_for(10ms);
  }
  return false;
}

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// ---------------------------------------------------------------------------------------------
// Environment

// What torchrun would give the worker with this local rank of this job.
struct Job {
  int nproc_per_node, nnodes, node_rank, max_restarts;
  std::string master_addr, master_port;
};

std::map<std::string, std::string> torchrun_variables(const Job& job, int local_rank) {
  const std::string rank = std::to_string(job.node_rank * job.nproc_per_node + local_rank);
  const std::string world_size = std::to_string(job.nnodes * job.nproc_per_node);
  return {
      {"RANK", rank},
      {"LOCAL_RANK", std::to_string(local_rank)},
      {"WORLD_SIZE", world_size},
      {"LOCAL_WORLD_SIZE", std::to_string(job.nproc_per_node)},
      {"GROUP_RANK", std::to_string(job.node_rank)},
      {"GROUP_WORLD_SIZE", std::to_string(job.nnodes)},
      {"ROLE_NAME", "default"},
      {"ROLE_RANK", rank},
      {"ROLE_WORLD_SIZE", world_size},
      {"MASTER_ADDR", job.master_addr},
      {"MASTER_PORT", job.master_port},
      {"TORCHELASTIC_RESTART_COUNT", "0"},
      {"TORCHELASTIC_MAX_RESTARTS", std::to_string(job.max_restarts)},
      {"TORCHELASTIC_RUN_ID", "none"},
      {"TORCHELASTIC_USE_AGENT_STORE", "False"},
      {"DDP_RESTART_COUNT", "0"},
      {"OMP_NUM_THREADS", std::to_string(std::max(1, cpu_count() / job.nproc_per_node))},
  };
}

void expect_torchrun_variables(const std::string& output, const Job& job) {
  const auto envs = env_by_rank(output);
  ASSERT_EQ(envs.size(), static_cast<std::size_t>(job.nproc_per_node)) << output;
  for (int local_rank = 0; local_rank < job.nproc_per_node; ++local_rank) {
    const int rank = job.node_rank * job.nproc_per_node + local_rank;
    SCOPED_TRACE(fmt::format("rank {}", rank));
    ASSERT_TRUE(envs.contains(rank)) << output;
    const auto& env = envs.at(rank);
    for (const auto& [key, value] : torchrun_variables(job, local_rank)) {
      EXPECT_TRUE(env.contains(key) && env.at(key) == value)
          << key << " is '" << (env.contains(key) ? env.at(key) : "(unset)") << "', expected '"
          << value << "'";
    }
  }
}

TEST(Ddprun, EveryWorkerGetsTorchrunsVariables) {
  // A RANK left in ddprun's own environment must not leak into the workers.
  const auto r = run_ddprun({"--nproc-per-node", "3", "--master-port", "29555", "/usr/bin/env"},
                            {{"OMP_NUM_THREADS", std::nullopt}, {"RANK", "99"}});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  expect_torchrun_variables(r.output, {.nproc_per_node = 3,
                                       .nnodes = 1,
                                       .node_rank = 0,
                                       .max_restarts = 0,
                                       .master_addr = "127.0.0.1",
                                       .master_port = "29555"});
}

TEST(Ddprun, SecondNodeNumbersItsWorkersAfterTheFirstNodes) {
  // With --max-restarts the nodes' ddprun meet in node 0's restart-round store, so node 0 runs
  // too (its workers do nothing).
  const std::string port = std::to_string(free_port());
  const std::string agent_port = std::to_string(free_port());
  const auto node_args = [&](const std::string& node, const std::string& program) {
    return std::vector<std::string>{ddprun(),    "--nnodes",         "2",  "--node-rank",
                                    node,        "--nproc-per-node", "2",  "--master-addr",
                                    "127.0.0.1", "--master-port",    port, "--agent-port",
                                    agent_port,  "--max-restarts",   "4",  program};
  };
  auto node0 = Subprocess::start(node_args("0", "/bin/true"));
  const auto r =
      Subprocess::start(node_args("1", "/usr/bin/env"), {{"OMP_NUM_THREADS", std::nullopt}})
          .wait(30s);
  EXPECT_EQ(node0.wait(30s).exit_code, 0);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  expect_torchrun_variables(r.output, {.nproc_per_node = 2,
                                       .nnodes = 2,
                                       .node_rank = 1,
                                       .max_restarts = 4,
                                       .master_addr = "127.0.0.1",
                                       .master_port = port});
}

TEST(Ddprun, PresetOmpNumThreadsIsLeftAlone) {
  const auto r = run_ddprun({"--nproc-per-node", "2", "/usr/bin/env"}, {{"OMP_NUM_THREADS", "7"}});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto envs = env_by_rank(r.output);
  ASSERT_EQ(envs.size(), 2u) << r.output;
  for (const auto& [rank, env] : envs)
    EXPECT_EQ(env.at("OMP_NUM_THREADS"), "7") << rank;
}

TEST(Ddprun, WorkersGetMallocTuningUnlessSetOrTurnedOff) {
  const auto tuned =
      run_ddprun({"--nproc-per-node", "2", "/usr/bin/env"}, {{"GLIBC_TUNABLES", std::nullopt}});
  ASSERT_EQ(tuned.exit_code, 0) << tuned.output;
  auto envs = env_by_rank(tuned.output);
  ASSERT_EQ(envs.size(), 2u) << tuned.output;
  for (const auto& [rank, env] : envs)
    EXPECT_EQ(env.at("GLIBC_TUNABLES"), ddp::ddprun::kMallocTunables) << rank;

  const auto preset = run_ddprun(
      {"--nproc-per-node", "2", "/usr/bin/env"},
      {{"GLIBC_TUNABLES", "glibc.malloc.arena_max=2"}, {"OPENBLAS_CORETYPE", "Haswell"}});
  ASSERT_EQ(preset.exit_code, 0) << preset.output;
  for (const auto& [rank, env] : env_by_rank(preset.output)) {
    EXPECT_EQ(env.at("GLIBC_TUNABLES"), "glibc.malloc.arena_max=2") << rank;
    EXPECT_EQ(env.at("OPENBLAS_CORETYPE"), "Haswell") << rank;
  }

  const auto off =
      run_ddprun({"--no-env-tuning", "--nproc-per-node", "2", "/usr/bin/env"},
                 {{"GLIBC_TUNABLES", std::nullopt}, {"OPENBLAS_CORETYPE", std::nullopt}});
  ASSERT_EQ(off.exit_code, 0) << off.output;
  envs = env_by_rank(off.output);
  ASSERT_EQ(envs.size(), 2u) << off.output;
  for (const auto& [rank, env] : envs) {
    EXPECT_FALSE(env.contains("GLIBC_TUNABLES")) << rank;
    EXPECT_FALSE(env.contains("OPENBLAS_CORETYPE")) << rank;
  }
}

TEST(Ddprun, StandalonePicksAFreePortForAllWorkers) {
  for (const std::vector<std::string>& how :
       {std::vector<std::string>{"--standalone"}, std::vector<std::string>{"--master-port", "0"}}) {
    std::vector<std::string> args = how;
    for (const char* a : {"--nproc-per-node", "2", "/usr/bin/env"})
      args.push_back(a);
    const auto r = run_ddprun(args);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const auto envs = env_by_rank(r.output);
    ASSERT_EQ(envs.size(), 2u) << r.output;
    const std::string port = envs.at(0).at("MASTER_PORT");
    EXPECT_EQ(envs.at(1).at("MASTER_PORT"), port);
    EXPECT_NE(port, "29500");
    EXPECT_GT(std::stoi(port), 0);
    EXPECT_LT(std::stoi(port), 65536);
  }
}

TEST(Ddprun, ProgramArgumentsArePassedUntouched) {
  const auto r = run_ddprun({"/bin/sh", "-c", R"(printf '%s|' "$@"; echo)", "sh",
                             "--nproc-per-node", "3", "--", "a b", ""});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(r.output, "[0] --nproc-per-node|3|--|a b||\n");
}

TEST(Ddprun, PyTorchWorkersFindEachOtherThroughTheVariables) {
  // The torchrun contract, checked against torchrun's own consumer: torch.distributed's env://.
  if (Subprocess::start({"/usr/bin/python3", "-c", "import torch.distributed"})
          .wait(60s)
          .exit_code != 0) {
    GTEST_SKIP() << "/usr/bin/python3 cannot import torch.distributed (python3-torch)";
  }
  const auto r = run_ddprun({"--standalone", "--nproc-per-node", "2", "/usr/bin/python3", "-c",
                             R"(
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1) * (dist.get_rank() + 1)
dist.all_reduce(t)
print("rank", dist.get_rank(), "of", dist.get_world_size(), "sum", int(t.item()))
)"},
                            {{"OMP_NUM_THREADS", "1"}}, 60s);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("[0] rank 0 of 2 sum 3\n"));
  EXPECT_THAT(r.output, HasSubstr("[1] rank 1 of 2 sum 3\n"));
}

// ---------------------------------------------------------------------------------------------
// Output

TEST(Ddprun, LinesStayWholeAndGoToTheRightStream) {
  // Each line is written in two parts, so whole lines are ddprun's doing, not the pipe's.
  constexpr int kLines = 2000;
  TempDir dir;
  const std::string err_file = dir.file("stderr");
  const std::string script = fmt::format(R"(
      i=0
      while [ $i -lt {} ]; do
        printf 'out r%s i%s part1 ' "$RANK" "$i"; printf 'part2 end\n'
        printf 'err r%s i%s part1 ' "$RANK" "$i" >&2; printf 'part2 end\n' >&2
        i=$((i+1))
      done)",
                                         kLines);
  // ddprun's stderr goes to a file so that the two streams can be told apart.
  auto p = Subprocess::start({"/bin/sh", "-c", R"(exec "$0" "$@" 2>")" + err_file + "\"", ddprun(),
                              "--nproc-per-node", "2", "/bin/sh", "-c", script});
  const auto r = p.wait(30s);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::ifstream err_in(err_file);
  const std::string err_output((std::istreambuf_iterator<char>(err_in)),
                               std::istreambuf_iterator<char>());

  for (const auto& [stream, text] : {std::pair{"out", r.output}, std::pair{"err", err_output}}) {
    SCOPED_TRACE(stream);
    const std::regex line_re(
        fmt::format(R"(^\[([01])\] {} r([01]) i(\d+) part1 part2 end$)", stream));
    std::map<int, int> next_index;
    int bad = 0;
    for (const auto& line : split_lines(text)) {
      std::smatch m;
      if (!std::regex_match(line, m, line_re) || m[1] != m[2]) {
        if (++bad <= 5) ADD_FAILURE() << "mangled line: '" << line << "'";
        continue;
      }
      const int rank = std::stoi(m[1]);
      // Each worker's lines arrive complete and in order.
      EXPECT_EQ(std::stoi(m[3]), next_index[rank]) << line;
      next_index[rank] = std::stoi(m[3]) + 1;
    }
    EXPECT_EQ(bad, 0);
    EXPECT_EQ(next_index[0], kLines);
    EXPECT_EQ(next_index[1], kLines);
  }
}

TEST(Ddprun, LastLineWithoutNewlineIsStillPrinted) {
  const auto r = run_ddprun({"/bin/sh", "-c", "printf 'first\\nno newline'"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(r.output, "[0] first\n[0] no newline\n");
}

TEST(Ddprun, WorkerThatClosesItsStdoutIsStillSupervised) {
  const auto r = run_ddprun(
      {"/bin/sh", "-c", "echo before; exec >&-; sleep 0.5; echo after >&2; exit 4"}, {}, 20s);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_THAT(r.output, HasSubstr("[0] before\n"));
  EXPECT_THAT(r.output, HasSubstr("[0] after\n"));
  EXPECT_THAT(r.output, HasSubstr("rank 0 exited with code 4"));
}

TEST(Ddprun, NoPrefixPassesTheBytesThroughUntouched) {
  // No "[r] ", no newline added to the unterminated last line, and --no_python is accepted.
  const std::string text = "plain line\n{\"k\": [1, 2]}\n\nlast without newline";
  for (const char* no_python : {"--no-python", "--no_python"}) {
    const auto r =
        run_ddprun({"--no-prefix", no_python, "/bin/sh", "-c", "printf '%s' \"$0\"", text});
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_EQ(r.output, text);
  }
}

TEST(Ddprun, NoPrefixOutputOfARealJobParsesAsJson) {
  // What a user pipes: ddp-bench's JSON rows through ddprun into a JSON reader.
  const std::string bench = built_program("ddp-bench");
  if (::access(bench.c_str(), X_OK) != 0) GTEST_SKIP() << "ddp-bench is not built";
  if (::access("/usr/bin/python3", X_OK) != 0) GTEST_SKIP() << "/usr/bin/python3 is missing";
  const std::string reader =
      "import json, sys\n"
      "rows = [json.loads(line) for line in sys.stdin]\n"
      "assert rows and all(row['op'] == 'allreduce' for row in rows), rows\n"
      "print('parsed', len(rows), 'rows')";
  const std::string pipeline = fmt::format(
      "set -o pipefail 2>/dev/null; '{}' --no-prefix --standalone --nproc-per-node 2 '{}' --op "
      "allreduce --min-bytes 1K --max-bytes 4K --iters 3 --warmup 1 --json | /usr/bin/python3 -c "
      "\"$0\"",
      ddprun(), bench);
  auto p = Subprocess::start({"/bin/bash", "-c", pipeline, reader});
  const auto r = p.wait(60s);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("parsed 3 rows"));
}

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

TEST(Ddprun, LogDirGetsEveryStreamAsWrittenAndTheConsoleFollowsRedirectsTeeAndFilter) {
  TempDir dir;
  // Rank 0: stdout to the file only. Rank 1: both streams redirected, stderr teed back. Rank 2:
  // filtered off the console. Every file gets its stream byte for byte.
  auto p = Subprocess::start(
      {"/bin/sh", "-c", R"(exec "$0" "$@" 2>")" + dir.file("console-err") + "\"", ddprun(),
       "--nproc-per-node", "3", "--log-dir", dir.file("logs"), "--redirects", "0:1,1:3", "--tee",
       "1:2", "--local-ranks-filter", "0,1", "/bin/sh", "-c",
       R"(printf 'out %s\nno newline' "$RANK"; printf 'err %s\n' "$RANK" >&2; echo "dump=$DDP_DUMP_DIR" >&2)"},
      {{"DDP_DUMP_DIR", std::nullopt}});
  const auto r = p.wait(30s);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::string console_err = read_file(dir.file("console-err"));
  const std::string attempt = dir.file("logs") + "/none/attempt_0";
  for (int rank = 0; rank < 3; ++rank) {
    SCOPED_TRACE(fmt::format("rank {}", rank));
    EXPECT_EQ(read_file(fmt::format("{}/{}/stdout.log", attempt, rank)),
              fmt::format("out {}\nno newline", rank));
    EXPECT_EQ(read_file(fmt::format("{}/{}/stderr.log", attempt, rank)),
              fmt::format("err {}\ndump={}\n", rank, attempt));
  }
  // The console (stdout of ddprun in r.output, its stderr in console-err).
  EXPECT_THAT(r.output, Not(HasSubstr("out 0")));
  EXPECT_THAT(r.output, Not(HasSubstr("out 1")));
  EXPECT_THAT(r.output, Not(HasSubstr("out 2")));
  EXPECT_THAT(console_err, HasSubstr("[0] err 0\n"));
  EXPECT_THAT(console_err, HasSubstr("[1] err 1\n"));
  EXPECT_THAT(console_err, Not(HasSubstr("err 2")));
  EXPECT_THAT(console_err, HasSubstr("ddprun: writing the workers' output to " + attempt));

  // Without --redirects every stream reaches the console as well as the files.
  const auto both = run_ddprun({"--nproc-per-node", "2", "--log-dir", dir.file("logs2"),
                                "--rdzv-id", "run-2", "/bin/sh", "-c", "echo hello $RANK"});
  ASSERT_EQ(both.exit_code, 0) << both.output;
  EXPECT_THAT(both.output, HasSubstr("[0] hello 0\n"));
  EXPECT_THAT(both.output, HasSubstr("[1] hello 1\n"));
  EXPECT_EQ(read_file(dir.file("logs2") + "/run-2/attempt_0/1/stdout.log"), "hello 1\n");
}

TEST(Ddprun, LogDirKeepsEachRestartAttemptApartAndAPresetDumpDir) {
  TempDir dir;
  // The first attempt fails, the second succeeds: each writes its own folder.
  const auto r = run_ddprun(
      {"--nproc-per-node", "2", "--max-restarts", "1", "--log-dir", dir.file("logs"),
       "--grace-period", "0.2", "/bin/sh", "-c",
       R"(echo "attempt $DDP_RESTART_COUNT dump $DDP_DUMP_DIR"; [ "$DDP_RESTART_COUNT" = 1 ] || [ "$RANK" = 0 ] || exit 3)"},
      {{"DDP_DUMP_DIR", "/somewhere/else"}});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (int attempt = 0; attempt < 2; ++attempt) {
    for (int rank = 0; rank < 2; ++rank) {
      EXPECT_EQ(read_file(fmt::format("{}/none/attempt_{}/{}/stdout.log", dir.file("logs"), attempt,
                                      rank)),
                fmt::format("attempt {} dump /somewhere/else\n", attempt));
    }
  }
  // A second run with the same run id replaces the files, and says so.
  const auto again =
      run_ddprun({"--log-dir", dir.file("logs"), "/bin/sh", "-c", "echo second run"});
  ASSERT_EQ(again.exit_code, 0) << again.output;
  EXPECT_THAT(again.output, HasSubstr("replacing the logs of an earlier run"));
  EXPECT_EQ(read_file(dir.file("logs") + "/none/attempt_0/0/stdout.log"), "second run\n");
}

TEST(Ddprun, ALogFileThatCannotBeWrittenIsReportedAndTheJobGoesOn) {
  if (::access("/dev/full", W_OK) != 0) GTEST_SKIP() << "/dev/full is not available";
  TempDir dir;
  // Rank 0's stdout.log is a link to /dev/full: every write fails with ENOSPC, like a full disk.
  const std::string rank_dir = dir.file("logs") + "/none/attempt_0/0";
  std::filesystem::create_directories(rank_dir);
  std::filesystem::create_symlink("/dev/full", rank_dir + "/stdout.log");
  const auto r = run_ddprun(
      {"--log-dir", dir.file("logs"), "/bin/sh", "-c", "echo one; echo two; echo three >&2"});
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("ddprun: cannot write '" + rank_dir +
                                  "/stdout.log': No space left on device; the rest of this "
                                  "stream is not logged"));
  // Once per stream, and the console still has everything.
  EXPECT_EQ(r.output.find("cannot write"), r.output.rfind("cannot write")) << r.output;
  EXPECT_THAT(r.output, HasSubstr("[0] one\n[0] two\n"));
  EXPECT_EQ(read_file(rank_dir + "/stderr.log"), "three\n");
}

TEST(Ddprun, RendezvousOptionsReachTheWorkers) {
  const auto r = run_ddprun({"--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:29577",
                             "--rdzv-id", "job42", "--nproc-per-node", "2", "/usr/bin/env"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto envs = env_by_rank(r.output);
  ASSERT_EQ(envs.size(), 2u) << r.output;
  for (const auto& [rank, env] : envs) {
    EXPECT_EQ(env.at("MASTER_ADDR"), "127.0.0.1") << rank;
    EXPECT_EQ(env.at("MASTER_PORT"), "29577") << rank;
    EXPECT_EQ(env.at("TORCHELASTIC_RUN_ID"), "job42") << rank;
  }
}

TEST(Ddprun, ARendezvousThatWaitsLongWarnsUntilItsDeadline) {
  // Node 0 of a two-node job is started alone: its rank waits for node 1, says so every 0.4 s
  // (DDP_WAIT_WARN_SECONDS), and fails at the 1.5 s deadline naming the missing rank.
  const std::string bench = built_program("ddp-bench");
  if (::access(bench.c_str(), X_OK) != 0) GTEST_SKIP() << "ddp-bench is not built";
  const auto r = run_ddprun({"--nnodes", "2", "--node-rank", "0", "--master-port",
                             std::to_string(free_port()), bench, "--op", "barrier"},
                            {{"DDP_WAIT_WARN_SECONDS", "0.4"}, {"DDP_TIMEOUT", "1.5"}});
  EXPECT_EQ(r.exit_code, 1) << r.output;
  const std::regex warning(
      R"(\[0\] ddp: rank 0: the rendezvous has waited [0-9.]+ s for 1 of 2 ranks: missing rank\(s\) 1 on node\(s\) 1 \(of 2\); it gives up after 1\.5 s \(DDP_TIMEOUT\))");
  int warnings = 0;
  for (const auto& line : split_lines(r.output)) {
    if (std::regex_match(line, warning)) ++warnings;
  }
  EXPECT_GE(warnings, 2) << r.output;
  EXPECT_LE(warnings, 3) << r.output;
  EXPECT_THAT(r.output, HasSubstr("missing rank(s): 1"));
}

// ---------------------------------------------------------------------------------------------
// Failures

TEST(Ddprun, FailingWorkerStopsTheOthers) {
  const auto start = Clock::now();
  const auto r = run_ddprun(
      {"--nproc-per-node", "3", "/bin/sh", "-c", "if [ $RANK = 1 ]; then exit 3; fi; sleep 60"}, {},
      30s);
  EXPECT_LT(seconds_since(start), 15.0);
  EXPECT_FALSE(r.timed_out);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_THAT(r.output, HasSubstr("rank 1 exited with code 3"));
}

TEST(Ddprun, WorkerKilledBySignalIsReported) {
  const auto r = run_ddprun(
      {"--nproc-per-node", "2", "/bin/sh", "-c", "if [ $RANK = 1 ]; then kill -9 $$; fi; sleep 60"},
      {}, 30s);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_THAT(r.output, HasSubstr("rank 1 was killed by signal 9 (Killed)"));
}

TEST(Ddprun, RankKilledBySignalIsBlamedEvenWhenItsPeerIsReapedFirst) {
  // Rank 1 exits with an error just before rank 0 is killed, as a rank whose peer died may be
  // reaped first: the death by signal is the cause and is named.
  const auto r = run_ddprun({"--nproc-per-node", "2", "/bin/sh", "-c",
                             "if [ $RANK = 1 ]; then sleep 0.5; exit 1; fi; sleep 0.6; kill -9 $$"},
                            {}, 30s);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_THAT(r.output, HasSubstr("ddprun: rank 0 was killed by signal 9 (Killed); stopping"));
  EXPECT_THAT(r.output,
              HasSubstr("ddprun: also failed (likely in consequence): rank 1 exited with code 1"));
}

// The pid of the worker with RANK=`rank` among ddprun's children, or -1.
pid_t worker_pid(pid_t ddprun_pid, int rank) {
  std::ifstream children(fmt::format("/proc/{0}/task/{0}/children", ddprun_pid));
  const std::string wanted = fmt::format("RANK={}", rank);
  for (pid_t pid; children >> pid;) {
    std::ifstream environ(fmt::format("/proc/{}/environ", pid), std::ios::binary);
    for (std::string entry; std::getline(environ, entry, '\0');) {
      if (entry == wanted) return pid;
    }
  }
  return -1;
}

TEST(Ddprun, KilledRankOfARealJobIsBlamedEveryTime) {
  const std::string bench = built_program("ddp-bench");
  if (::access(bench.c_str(), X_OK) != 0) GTEST_SKIP() << "ddp-bench is not built";
  std::mt19937 random(12345);
  constexpr int kRounds = 20;
  int blamed = 0;
  for (int round = 0; round < kRounds; ++round) {
    SCOPED_TRACE(fmt::format("round {}", round));
    auto p = Subprocess::start(
        {ddprun(), "--nproc-per-node", "2", bench, "--op", "allreduce", "--min-bytes", "256K",
         "--max-bytes", "256K", "--iters", "1000000", "--warmup", "0"},
        {{"DDP_TIMEOUT", "30"}});
    // Rank 0 prints the table's header once the group is set up; then both ranks allreduce.
    ASSERT_TRUE(wait_for_output(p, {"[0] # ddp-bench"}, 30s)) << p.output_so_far();
    std::this_thread::sleep_for(std::chrono::milliseconds(random() % 100));
    const pid_t rank0 = worker_pid(p.pid(), 0);
    ASSERT_GT(rank0, 0) << p.output_so_far();
    ASSERT_EQ(::kill(rank0, SIGKILL), 0);
    const auto r = p.wait(30s);
    EXPECT_EQ(r.exit_code, 1) << r.output;
    if (r.output.find("ddprun: rank 0 was killed by signal 9") != std::string::npos) {
      ++blamed;
    } else {
      ADD_FAILURE() << "ddprun blamed another rank:\n" << r.output;
    }
  }
  EXPECT_EQ(blamed, kRounds);
}

TEST(Ddprun, WorkerIgnoringSigtermIsKilledAfterTheGracePeriod) {
  TempDir dir;
  const std::string ready = dir.file("ready");
  // Rank 0 ignores SIGTERM (its sleeps die, the loop goes on); rank 1 fails once rank 0 is set.
  const std::string script = fmt::format(R"(
      if [ $RANK = 0 ]; then trap '' TERM; touch {0}; while :; do sleep 0.1; done; fi
      n=0; while [ ! -e {0} ] && [ $n -lt 200 ]; do sleep 0.05; n=$((n+1)); done
      exit 5)",
                                         ready);
  const auto start = Clock::now();
  const auto r = run_ddprun(
      {"--nproc-per-node", "2", "--grace-period", "1", "/bin/sh", "-c", script}, {}, 30s);
  const double took = seconds_since(start);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_THAT(r.output, HasSubstr("rank 1 exited with code 5"));
  EXPECT_GE(took, 0.9);  // it did wait for the grace period
  EXPECT_LT(took, 10.0);
}

TEST(Ddprun, AWorkerStoppedAfterTheOthersFinishedIsNamedAndStoppedAtTheTimeout) {
  // Rank 1 stops itself (SIGSTOP) and handles SIGTERM; rank 0 exits 0. ddprun used to wait for
  // rank 1 forever: now it gets DDP_TIMEOUT from rank 0's exit, then SIGTERM and SIGCONT (a
  // stopped process handles nothing until continued).
  TempDir dir;
  const std::string pid_file = dir.file("pid");
  const std::string script = fmt::format(R"(
      if [ "$RANK" = 0 ]; then exit 0; fi
      echo $$ > {0}
      trap 'echo "got TERM"; exit 0' TERM
      kill -STOP $$
      sleep 60)",
                                         pid_file);
  const auto start = Clock::now();
  const auto r =
      run_ddprun({"--nproc-per-node", "2", "--grace-period", "10", "/bin/sh", "-c", script},
                 {{"DDP_TIMEOUT", "2"}}, 40s);
  const double took = seconds_since(start);
  EXPECT_FALSE(r.timed_out) << r.output;
  EXPECT_EQ(r.exit_code, 1) << r.output;
  const auto pids = read_pids(pid_file);
  ASSERT_EQ(pids.size(), 1u) << r.output;
  EXPECT_THAT(r.output,
              HasSubstr(fmt::format("rank 1 (pid {}) still running 2 s after rank 0 finished "
                                    "(DDP_TIMEOUT); stopping it",
                                    pids[0])));
  EXPECT_THAT(r.output, HasSubstr("[1] got TERM"));  // continued, so its handler ran
  EXPECT_GE(took, 2.0);
  EXPECT_LT(took, 9.0);  // not the grace period: it exited on SIGTERM once continued
  EXPECT_FALSE(process_alive(pids[0]));
}

TEST(Ddprun, AWorkerThatIgnoresSigtermAfterTheOthersFinishedIsKilled) {
  const auto start = Clock::now();
  const auto r = run_ddprun({"--nproc-per-node", "3", "--grace-period", "1", "/bin/sh", "-c",
                             "[ \"$RANK\" = 0 ] && exit 0; trap '' TERM; sleep 60"},
                            {{"DDP_TIMEOUT", "1.5"}}, 40s);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_THAT(r.output, HasSubstr("still running 1.5 s after rank 0 finished"));
  EXPECT_THAT(r.output, HasSubstr("rank 1 (pid"));
  EXPECT_THAT(r.output, HasSubstr("rank 2 (pid"));
  EXPECT_LT(seconds_since(start), 15.0);
}

TEST(Ddprun, MaxRestartsRestartsTheGroupUntilItSucceeds) {
  const auto r = run_ddprun(
      {"--nproc-per-node", "2", "--max-restarts", "3", "/bin/sh", "-c",
       R"(echo "attempt $DDP_RESTART_COUNT $TORCHELASTIC_RESTART_COUNT $TORCHELASTIC_MAX_RESTARTS"
          if [ $RANK = 1 ] && [ $DDP_RESTART_COUNT -lt 2 ]; then exit 3; fi)"},
      {}, 30s);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("[1] attempt 0 0 3\n"));
  EXPECT_THAT(r.output, HasSubstr("[1] attempt 1 1 3\n"));
  EXPECT_THAT(r.output, HasSubstr("[1] attempt 2 2 3\n"));
  EXPECT_THAT(r.output, HasSubstr("[0] attempt 2 2 3\n"));
  EXPECT_THAT(r.output, Not(HasSubstr("attempt 3")));
}

TEST(Ddprun, MaxRestartsGivesUpAfterKPlusOneAttempts) {
  const auto r = run_ddprun(
      {"--max-restarts", "2", "/bin/sh", "-c", R"(echo "attempt $DDP_RESTART_COUNT"; exit 3)"}, {},
      30s);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  const auto lines = split_lines(r.output);
  EXPECT_EQ(std::count_if(lines.begin(), lines.end(),
                          [](const std::string& l) { return l.rfind("[0] attempt ", 0) == 0; }),
            3)
      << r.output;
  EXPECT_THAT(r.output, HasSubstr("rank 0 exited with code 3"));
  EXPECT_THAT(r.output, HasSubstr("giving up after 2 restarts"));
}

// Two ddprun processes as the two nodes of one job on loopback, with whole-job restarts.
struct TwoNodes {
  int master_port = free_port();
  int agent_port = free_port();
  std::vector<std::string> node_args(int node, int max_restarts) const {
    return {"--nnodes",       "2",
            "--node-rank",    std::to_string(node),
            "--master-addr",  "127.0.0.1",
            "--master-port",  std::to_string(master_port),
            "--agent-port",   std::to_string(agent_port),
            "--max-restarts", std::to_string(max_restarts)};
  }
  // Runs `script` (sh) as the one worker of each node; returns both nodes' results.
  std::pair<ExitStatus, ExitStatus> run(int max_restarts, const std::string& script,
                                        std::chrono::milliseconds timeout = 60s) const {
    std::vector<Subprocess> nodes;
    for (int node = 0; node < 2; ++node) {
      std::vector<std::string> argv{ddprun()};
      const auto args = node_args(node, max_restarts);
      argv.insert(argv.end(), args.begin(), args.end());
      argv.insert(argv.end(), {"/bin/sh", "-c", script});
      nodes.push_back(Subprocess::start(argv, {{"DDP_TIMEOUT", "20"}}));
    }
    auto first = nodes[0].wait(timeout);
    auto second = nodes[1].wait(timeout);
    return {first, second};
  }
};

// The IPv4 address `pid` listens on at TCP `port` (from /proc/net/tcp and the socket inodes in
// /proc/PID/fd), or "" while it has no such socket.
std::string listening_address(pid_t pid, int port) {
  std::set<std::string> inodes;
  std::error_code ec;
  for (const auto& fd : std::filesystem::directory_iterator(fmt::format("/proc/{}/fd", pid), ec)) {
    const std::string target = std::filesystem::read_symlink(fd.path(), ec).string();
    if (target.rfind("socket:[", 0) == 0) inodes.insert(target.substr(8, target.size() - 9));
  }
  std::ifstream table("/proc/net/tcp");
  std::string line;
  std::getline(table, line);  // the header
  while (std::getline(table, line)) {
    std::istringstream fields(line);
    std::string slot, local, remote, state, queues, timer, retransmits, uid, timeouts, inode;
    fields >> slot >> local >> remote >> state >> queues >> timer >> retransmits >> uid >>
        timeouts >> inode;
    const auto colon = local.find(':');
    if (state != "0A" || colon == std::string::npos || !inodes.count(inode)) continue;
    if (std::stoi(local.substr(colon + 1), nullptr, 16) != port) continue;
    in_addr address{static_cast<in_addr_t>(std::stoul(local.substr(0, colon), nullptr, 16))};
    char text[INET_ADDRSTRLEN] = {};
    ::inet_ntop(AF_INET, &address, text, sizeof text);
    return text;
  }
  return "";
}

// The two jobs whose node 0 serves rounds on the agent port: a static two-node job with restarts,
// and an elastic one (which always has rounds).
const std::vector<std::string> kStaticJobWithRestarts{"--nnodes", "2", "--max-restarts", "1"};
const std::vector<std::string> kElasticJob{"--nnodes", "2:3"};

// Node 0 of `job`, waiting for node 1 (never started): where does it serve the rounds?
std::string agent_address(const std::vector<std::string>& extra,
                          const std::map<std::string, std::optional<std::string>>& env,
                          const std::vector<std::string>& job = kStaticJobWithRestarts) {
  const int agent_port = free_port();
  std::vector<std::string> argv{ddprun()};
  argv.insert(argv.end(), job.begin(), job.end());
  argv.insert(argv.end(),
              {"--node-rank", "0", "--master-addr", "127.0.0.1", "--master-port",
               std::to_string(free_port()), "--agent-port", std::to_string(agent_port)});
  argv.insert(argv.end(), extra.begin(), extra.end());
  argv.insert(argv.end(), {"/bin/true"});
  auto env_with_timeout = env;
  env_with_timeout["DDP_TIMEOUT"] = "30";
  auto node0 = Subprocess::start(argv, env_with_timeout);
  std::string address;
  const auto deadline = Clock::now() + 15s;
  while (address.empty() && Clock::now() < deadline) {
    std::this_thread::sleep_for(20ms);
    address = listening_address(node0.pid(), agent_port);
  }
  node0.signal_group(SIGKILL);
  node0.wait(10s);
  return address.empty() ? "(not listening within 15 s) " + node0.output_so_far() : address;
}

TEST(Ddprun, TheRestartRoundsListenOnTheMasterAddressesInterfaceUnlessWidened) {
  // They listened on 0.0.0.0 whatever --master-addr said: without a secret, a process on another
  // host could join the restart rounds of a job meant for one machine.
  EXPECT_EQ(agent_address({}, {{"DDP_STORE_LISTEN_ADDR", std::nullopt}}), "127.0.0.1");
  EXPECT_EQ(
      agent_address({"--agent-listen-addr", "0.0.0.0"}, {{"DDP_STORE_LISTEN_ADDR", std::nullopt}}),
      "0.0.0.0");
  // The workers' store's variable widens both.
  EXPECT_EQ(agent_address({}, {{"DDP_STORE_LISTEN_ADDR", "0.0.0.0"}}), "0.0.0.0");
  // An elastic job's rendezvous is served the same way (issue 24: restart rounds, --max-restarts
  // and elastic --nnodes all listened on 0.0.0.0).
  EXPECT_EQ(agent_address({}, {{"DDP_STORE_LISTEN_ADDR", std::nullopt}}, kElasticJob), "127.0.0.1");
  EXPECT_EQ(agent_address({"--agent-listen-addr", "0.0.0.0"},
                          {{"DDP_STORE_LISTEN_ADDR", std::nullopt}}, kElasticJob),
            "0.0.0.0");
  const auto r = run_ddprun({"--agent-listen-addr", "", "/bin/true"});
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_THAT(r.output, HasSubstr("--agent-listen-addr is empty"));
}

TEST(Ddprun, AFailureOnOneNodeRestartsEveryNodeTogether) {
  const TwoNodes job;
  const auto start = Clock::now();
  // Rank 1 (node 1) fails on the first attempt; rank 0 would still be busy then, so node 0 must
  // stop it and start it again rather than wait for it.
  const auto [node0, node1] = job.run(3, R"(echo "attempt $TORCHELASTIC_RESTART_COUNT"
      if [ "$TORCHELASTIC_RESTART_COUNT" = 0 ]; then
        if [ "$RANK" = 1 ]; then sleep 0.5; exit 1; fi
        sleep 30
      fi
      echo "done $TORCHELASTIC_RESTART_COUNT")");
  EXPECT_EQ(node0.exit_code, 0) << node0.output;
  EXPECT_EQ(node1.exit_code, 0) << node1.output;
  EXPECT_LT(seconds_since(start), 25.0) << "node 0 waited for its worker instead of restarting it";
  EXPECT_THAT(node0.output, HasSubstr("[0] attempt 0\n"));
  EXPECT_THAT(node0.output, HasSubstr("[0] attempt 1\n"));
  EXPECT_THAT(node0.output, HasSubstr("[0] done 1\n"));
  EXPECT_THAT(node0.output, Not(HasSubstr("done 0")));
  EXPECT_THAT(node0.output, HasSubstr("another node failed (rank 1 (node 1) exited with code 1)"));
  EXPECT_THAT(node1.output, HasSubstr("[1] done 1\n"));
  EXPECT_THAT(node1.output, HasSubstr("restart 1 of 3: starting the workers of every node again"));
  EXPECT_THAT(node0.output, Not(HasSubstr("attempt 2")));
}

TEST(Ddprun, WholeJobRestartsExhaustedFailEveryNodeNamingTheRank) {
  const TwoNodes job;
  const auto [node0, node1] = job.run(1, R"(echo "attempt $TORCHELASTIC_RESTART_COUNT"
      if [ "$RANK" = 1 ]; then exit 1; fi
      sleep 30)");
  EXPECT_EQ(node0.exit_code, 1) << node0.output;
  EXPECT_EQ(node1.exit_code, 1) << node1.output;
  for (const auto* r : {&node0, &node1}) {
    EXPECT_THAT(r->output, HasSubstr("giving up after 1 restarts; the job's last failure: rank 1 "
                                     "(node 1) exited with code 1"))
        << r->output;
  }
  EXPECT_THAT(node0.output, HasSubstr("[0] attempt 1\n"));
  EXPECT_THAT(node0.output, Not(HasSubstr("attempt 2")));
}

TEST(Ddprun, ANodeThatNeverJoinsTheRestartRoundIsNamedAtTheDeadline) {
  const TwoNodes job;
  std::vector<std::string> argv{ddprun()};
  const auto args = job.node_args(0, 1);
  argv.insert(argv.end(), args.begin(), args.end());
  argv.insert(argv.end(), {"/bin/true"});
  const auto r = Subprocess::start(argv, {{"DDP_TIMEOUT", "2"}}).wait(30s);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_THAT(r.output, HasSubstr("restart round 0: node(s) 1 did not join within 2 s"));
}

// ---------------------------------------------------------------------------------------------
// Elastic membership (--nnodes MIN:MAX): several ddprun on loopback as the agents of one job.

// Agent 0 (--node-rank 0, serves the rendezvous) and the others (no --node-rank) of one job.
struct ElasticJob {
  std::string nnodes;
  int max_restarts = 0;
  int master_port = free_port();
  int agent_port = free_port();
  std::vector<Subprocess> agents;

  // Starts one more agent running `script` (sh) as its one worker.
  Subprocess& start_agent(const std::string& script) {
    std::vector<std::string> argv{ddprun(),
                                  "--nnodes",
                                  nnodes,
                                  "--master-addr",
                                  "127.0.0.1",
                                  "--master-port",
                                  std::to_string(master_port),
                                  "--agent-port",
                                  std::to_string(agent_port),
                                  "--max-restarts",
                                  std::to_string(max_restarts),
                                  "--rdzv-last-call",
                                  "2",
                                  "--grace-period",
                                  "1"};
    if (agents.empty()) argv.insert(argv.end(), {"--node-rank", "0"});
    argv.insert(argv.end(), {"/bin/sh", "-c", script});
    agents.push_back(Subprocess::start(argv, {{"DDP_TIMEOUT", "20"}}));
    return agents.back();
  }
};

// Each worker prints its round's place; `hold` decides (sh) whether it stays busy for 60 s.
std::string elastic_worker(const std::string& hold) {
  return fmt::format(
      R"(echo "round $TORCHELASTIC_RESTART_COUNT rank $RANK of $WORLD_SIZE group $GROUP_RANK of $GROUP_WORLD_SIZE"
      if {}; then sleep 60; fi
      echo "done at world $WORLD_SIZE")",
      hold);
}

TEST(Ddprun, ElasticJobGoesOnAtASmallerWorldWhenAWholeHostIsKilled) {
  ElasticJob job{.nnodes = "2:3", .max_restarts = 1};
  // Busy until the kill: in round 0, and at world 3 (a loaded machine may start the third agent
  // after round 0 closed with two; it then joins in round 1).
  const std::string script =
      elastic_worker(R"([ "$WORLD_SIZE" = 3 ] || [ "$TORCHELASTIC_RESTART_COUNT" = 0 ])");
  for (int i = 0; i < 3; ++i)
    job.start_agent(script);
  for (auto& agent : job.agents)
    ASSERT_TRUE(wait_for_output(agent, {"of 3 group"}, 30s)) << agent.output_so_far();
  EXPECT_THAT(job.agents[0].output_so_far(), HasSubstr(" rank 0 of 3 group 0 of 3\n"));
  // A whole host: its ddprun and (through PR_SET_PDEATHSIG) its worker, with no goodbye.
  job.agents[1].signal_group(SIGKILL);
  const auto start = Clock::now();
  const ExitStatus killed = job.agents[1].wait(10s);
  EXPECT_EQ(killed.signal, SIGKILL);
  const ExitStatus node0 = job.agents[0].wait(40s);
  const ExitStatus other = job.agents[2].wait(40s);
  EXPECT_EQ(node0.exit_code, 0) << node0.output;
  EXPECT_EQ(other.exit_code, 0) << other.output;
  EXPECT_LT(seconds_since(start), 30.0);
  for (const ExitStatus* r : {&node0, &other}) {
    EXPECT_THAT(r->output, HasSubstr("stopped responding (no heartbeat)")) << r->output;
    EXPECT_THAT(r->output, HasSubstr("1 of 1 restarts used")) << r->output;
  }
  // The survivors keep their order: agent 0 is node 0, the third agent is node 1 now.
  EXPECT_THAT(node0.output, HasSubstr(" rank 0 of 2 group 0 of 2\n"));
  EXPECT_THAT(node0.output, HasSubstr("[0] done at world 2\n"));
  EXPECT_THAT(other.output, HasSubstr(" rank 1 of 2 group 1 of 2\n"));
  EXPECT_THAT(other.output, HasSubstr("[1] done at world 2\n"));
  EXPECT_THAT(node0.output, Not(HasSubstr("done at world 3")));
}

TEST(Ddprun, ElasticJobTakesInANodeThatComesLaterWithoutCountingARestart) {
  ElasticJob job{.nnodes = "2:3", .max_restarts = 0};
  const std::string script = elastic_worker(R"([ "$WORLD_SIZE" -lt 3 ])");
  job.start_agent(script);
  job.start_agent(script);
  for (auto& agent : job.agents)
    ASSERT_TRUE(wait_for_output(agent, {"round 0 rank"}, 20s)) << agent.output_so_far();
  EXPECT_THAT(job.agents[0].output_so_far(), HasSubstr("[0] round 0 rank 0 of 2 group 0 of 2\n"));
  job.start_agent(script);
  std::vector<ExitStatus> results;
  for (auto& agent : job.agents)
    results.push_back(agent.wait(40s));
  for (const ExitStatus& r : results) {
    EXPECT_EQ(r.exit_code, 0) << r.output;
    EXPECT_THAT(r.output, HasSubstr("elastic round 1: 3 node(s)")) << r.output;
    EXPECT_THAT(r.output, HasSubstr("0 of 0 restarts used")) << r.output;
    EXPECT_THAT(r.output, HasSubstr("done at world 3")) << r.output;
    EXPECT_THAT(r.output, Not(HasSubstr("done at world 2"))) << r.output;
  }
  EXPECT_THAT(results[0].output,
              HasSubstr("1 node(s) waiting to join; restarting the workers in round 1 (not "
                        "counted against --max-restarts)"));
  EXPECT_THAT(results[2].output, HasSubstr("[2] round 1 rank 2 of 3 group 2 of 3\n"));
}

TEST(Ddprun, ElasticJobBelowMinFailsOnEverySurvivorNamingWhy) {
  ElasticJob job{.nnodes = "3:4", .max_restarts = 3};
  const std::string script = elastic_worker("true");
  for (int i = 0; i < 3; ++i)
    job.start_agent(script);
  for (auto& agent : job.agents)
    ASSERT_TRUE(wait_for_output(agent, {"round 0 rank"}, 20s)) << agent.output_so_far();
  job.agents[2].signal_group(SIGKILL);
  const ExitStatus node0 = job.agents[0].wait(40s);
  const ExitStatus other = job.agents[1].wait(40s);
  for (const ExitStatus* r : {&node0, &other}) {
    EXPECT_EQ(r->exit_code, 1) << r->output;
    EXPECT_THAT(r->output, HasSubstr("elastic round 1: 2 node(s) left, fewer than the 3 of "
                                     "--nnodes 3:4"))
        << r->output;
  }
}

TEST(Ddprun, ElasticJobGivesUpOnEveryNodeAfterMaxRestarts) {
  ElasticJob job{.nnodes = "2:3", .max_restarts = 1};
  // Rank 1 fails in every round; the second round is the last --max-restarts 1 allows.
  const std::string script = R"(echo "round $TORCHELASTIC_RESTART_COUNT"
      if [ "$RANK" = 1 ]; then exit 3; fi
      sleep 60)";
  job.start_agent(script);
  job.start_agent(script);
  const ExitStatus node0 = job.agents[0].wait(40s);
  const ExitStatus other = job.agents[1].wait(40s);
  for (const ExitStatus* r : {&node0, &other}) {
    EXPECT_EQ(r->exit_code, 1) << r->output;
    EXPECT_THAT(r->output, HasSubstr("giving up after 1 restarts; the job's last failure: rank 1 "
                                     "(node 1) exited with code 3"))
        << r->output;
    EXPECT_THAT(r->output, HasSubstr("elastic round 1: 2 node(s)")) << r->output;
    EXPECT_THAT(r->output, HasSubstr("1 of 1 restarts used")) << r->output;
    EXPECT_THAT(r->output, Not(HasSubstr("elastic round 2"))) << r->output;
  }
}

TEST(Ddprun, ElasticJobEndsWithANamedErrorWhenTheRendezvousAgentDies) {
  ElasticJob job{.nnodes = "1:2", .max_restarts = 3};
  const std::string script = elastic_worker("true");
  job.start_agent(script);
  job.start_agent(script);
  for (auto& agent : job.agents)
    ASSERT_TRUE(wait_for_output(agent, {"of 2 group"}, 30s)) << agent.output_so_far();
  job.agents[0].signal_group(SIGKILL);
  const ExitStatus other = job.agents[1].wait(30s);
  EXPECT_EQ(other.exit_code, 1) << other.output;
  EXPECT_THAT(other.output, HasSubstr("the ddprun with --node-rank 0, which serves it, is gone"));
}

TEST(Ddprun, ProgramThatCannotBeExecutedIsReported) {
  TempDir dir;
  const std::string program = dir.file("not-a-program");
  {
    std::ofstream(program) << "\x7f"
                              "ELF garbage";
  }
  ::chmod(program.c_str(), 0755);
  const auto r = run_ddprun({"--nproc-per-node", "2", program}, {}, 30s);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_THAT(r.output, HasSubstr("cannot start rank 0"));
  EXPECT_THAT(r.output, HasSubstr("Exec format error"));
}

// 64 workers under a limit of 64 descriptors: the pipes of the workers run out. The error says so
// once, prefixed once ("ddprun: error: ddprun: pipe2 failed" before), with the limit.
TEST(Ddprun, RunningOutOfDescriptorsIsOneLineWithOnePrefix) {
  const auto r =
      Subprocess::start({"/bin/bash", "-c",
                         "ulimit -n 64 && exec \"$0\" --nproc-per-node 64 /bin/true", ddprun()})
          .wait(60s);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_THAT(r.output, HasSubstr("ddprun: error: pipe2 failed: Too many open files (out of file "
                                  "descriptors: ddprun holds two or more per worker, and may "
                                  "open 64; raise ulimit -n)"));
  EXPECT_THAT(r.output, Not(HasSubstr("ddprun: error: ddprun:")));
}

// ---------------------------------------------------------------------------------------------
// Signals and orphans

// Workers that print "ready", record their pids (and a child's), and report a signal.
std::string trapping_worker(const std::string& sig, const std::string& pid_file) {
  return fmt::format(R"(
      sleep 60 & child=$!
      echo $$ >> {1}; echo $child >> {1}
      trap 'echo "got {0}"; kill $child; exit 0' {0}
      echo ready
      wait)",
                     sig, pid_file);
}

void expect_all_dead(const std::vector<pid_t>& pids) {
  for (const pid_t pid : pids)
    EXPECT_FALSE(process_alive(pid)) << "pid " << pid << " survived";
}

void check_signal_is_forwarded(int sig, const std::string& name, int expected_exit) {
  TempDir dir;
  const std::string pids = dir.file("pids");
  auto p = Subprocess::start(
      {ddprun(), "--nproc-per-node", "2", "/bin/sh", "-c", trapping_worker(name, pids)});
  ASSERT_TRUE(wait_for_output(p, {"[0] ready", "[1] ready"}, 15s)) << p.output_so_far();
  ASSERT_EQ(::kill(p.pid(), sig), 0);
  const auto r = p.wait(20s);
  EXPECT_EQ(r.exit_code, expected_exit) << r.output;
  EXPECT_THAT(r.output, HasSubstr("[0] got " + name));
  EXPECT_THAT(r.output, HasSubstr("[1] got " + name));
  const auto recorded = read_pids(pids);
  EXPECT_EQ(recorded.size(), 4u);
  expect_all_dead(recorded);
}

TEST(Ddprun, SigtermIsForwardedToTheWorkers) {
  check_signal_is_forwarded(SIGTERM, "TERM", 143);
}

TEST(Ddprun, SigintIsForwardedToTheWorkers) {
  check_signal_is_forwarded(SIGINT, "INT", 130);
}

TEST(Ddprun, SigusrOneReachesTheWorkersThatHandleItAndSparesTheOthers) {
  // Rank 0 handles SIGUSR1 (as a ddp process group's flight recorder does); rank 1 does not and
  // would die of it. Both exit 0 once rank 0 got the signal.
  TempDir dir;
  const std::string done = dir.file("done");
  const std::string script = fmt::format(R"(
      if [ "$LOCAL_RANK" = 0 ]; then trap 'echo got USR1; touch {0}; exit 0' USR1; fi
      echo ready
      i=0; while [ ! -f {0} ] && [ $i -lt 300 ]; do sleep 0.1; i=$((i+1)); done
      [ -f {0} ])",
                                         done);
  auto p = Subprocess::start({ddprun(), "--nproc-per-node", "2", "/bin/sh", "-c", script});
  ASSERT_TRUE(wait_for_output(p, {"[0] ready", "[1] ready"}, 15s)) << p.output_so_far();
  ASSERT_EQ(::kill(p.pid(), SIGUSR1), 0);
  const auto r = p.wait(40s);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("[0] got USR1"));
  EXPECT_THAT(r.output, HasSubstr("SIGUSR1 passed on to rank(s) [0]"));
  EXPECT_THAT(r.output, HasSubstr("not to rank(s) [1]"));
}

TEST(Ddprun, SecondSignalSkipsTheGracePeriod) {
  // Workers that ignore both signals would hold ddprun for the whole 60 s grace period.
  auto p = Subprocess::start({ddprun(), "--nproc-per-node", "2", "--grace-period", "60", "/bin/sh",
                              "-c", "trap '' INT TERM; echo ready; while :; do sleep 0.1; done"});
  ASSERT_TRUE(wait_for_output(p, {"[0] ready", "[1] ready"}, 15s)) << p.output_so_far();
  ASSERT_EQ(::kill(p.pid(), SIGINT), 0);
  ASSERT_TRUE(wait_for_output(p, {"received SIGINT"}, 15s)) << p.output_so_far();
  const auto start = Clock::now();
  ASSERT_EQ(::kill(p.pid(), SIGINT), 0);
  const auto r = p.wait(30s);
  EXPECT_LT(seconds_since(start), 10.0);
  EXPECT_EQ(r.exit_code, 130) << r.output;
}

TEST(Ddprun, NoProcessOutlivesAFailedJob) {
  TempDir dir;
  const std::string pids = dir.file("pids");
  // Each worker records itself, a child, and a grandchild that left the group (setsid); rank 1
  // fails once all six pids are written.
  const std::string script = fmt::format(R"(
      sleep 60 & echo $! >> {0}
      setsid sleep 60 & echo $! >> {0}
      echo $$ >> {0}
      if [ $RANK = 1 ]; then
        n=0; while [ $(wc -l < {0}) -lt 6 ] && [ $n -lt 200 ]; do sleep 0.05; n=$((n+1)); done
        exit 1
      fi
      wait)",
                                         pids);
  const auto start = Clock::now();
  const auto r = run_ddprun({"--nproc-per-node", "2", "/bin/sh", "-c", script}, {}, 30s);
  EXPECT_LT(seconds_since(start), 15.0);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_THAT(r.output, HasSubstr("rank 1 exited with code 1"));
  const auto recorded = read_pids(pids);
  EXPECT_EQ(recorded.size(), 6u);
  expect_all_dead(recorded);
}

TEST(Ddprun, NoProcessOutlivesASuccessfulJob) {
  TempDir dir;
  const std::string pids = dir.file("pids");
  const auto start = Clock::now();
  const auto r = run_ddprun(
      {"--nproc-per-node", "2", "/bin/sh", "-c",
       fmt::format("sleep 60 & echo $! >> {0}; setsid sleep 60 & echo $! >> {0}; exit 0", pids)},
      {}, 30s);
  EXPECT_LT(seconds_since(start), 10.0);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  const auto recorded = read_pids(pids);
  EXPECT_EQ(recorded.size(), 4u);
  expect_all_dead(recorded);
}

TEST(Ddprun, WorkersDieWhenDdprunIsKilledOutright) {
  // SIGKILL gives ddprun no chance to stop anyone: the kernel does it (parent-death signal).
  TempDir dir;
  const std::string pids = dir.file("pids");
  auto p = Subprocess::start({ddprun(), "--nproc-per-node", "2", "/bin/sh", "-c",
                              fmt::format("echo $$ >> {}; echo ready; exec sleep 60", pids)});
  ASSERT_TRUE(wait_for_output(p, {"[0] ready", "[1] ready"}, 15s)) << p.output_so_far();
  ASSERT_EQ(::kill(p.pid(), SIGKILL), 0);
  p.wait(10s);
  const auto recorded = read_pids(pids);
  ASSERT_EQ(recorded.size(), 2u);
  const auto deadline = Clock::now() + 5s;
  while (Clock::now() < deadline && std::any_of(recorded.begin(), recorded.end(), process_alive)) {
    std::this_thread::sleep_for(10ms);
  }
  expect_all_dead(recorded);
}

// Fields 5 (process group) and 6 (session) of /proc/PID/stat; {-1, -1} when it is gone.
std::pair<pid_t, pid_t> group_and_session(pid_t pid) {
  std::ifstream in(fmt::format("/proc/{}/stat", pid));
  std::string stat;
  std::getline(in, stat);
  const auto end_of_name = stat.rfind(')');  // the name in parentheses may hold spaces
  if (end_of_name == std::string::npos) return {-1, -1};
  std::istringstream rest(stat.substr(end_of_name + 1));
  std::string state;
  pid_t parent = 0, group = -1, session = -1;
  rest >> state >> parent >> group >> session;
  return {group, session};
}

// Each worker prints its pid, process group and session as it sees them (/proc/self/stat).
const char* const kPrintSession =
    "read -r pid _ _ _ pgrp sid _ < /proc/$$/stat; echo \"pid=$pid pgrp=$pgrp sid=$sid\"";

std::map<int, std::array<pid_t, 3>> sessions_by_rank(const std::string& output) {
  static const std::regex line_re(R"(^\[(\d+)\] pid=(\d+) pgrp=(\d+) sid=(\d+)$)");
  std::map<int, std::array<pid_t, 3>> result;
  for (const auto& line : split_lines(output)) {
    std::smatch m;
    if (std::regex_match(line, m, line_re)) {
      result[std::stoi(m[1])] = {std::stoi(m[2]), std::stoi(m[3]), std::stoi(m[4])};
    }
  }
  return result;
}

TEST(Ddprun, EachWorkerLeadsItsOwnProcessSession) {
  // The kernel's autogroup scheduler shares the CPU between sessions: workers in ddprun's session
  // would share one session's slice on a loaded machine (issue 24; torchrun's get one each).
  auto p = Subprocess::start({ddprun(), "--nproc-per-node", "2", "/bin/sh", "-c", kPrintSession});
  // 0 where the session's leader lives outside this pid namespace (CI's container); -1 is an error.
  const pid_t ddprun_session = ::getsid(p.pid());
  ASSERT_GE(ddprun_session, 0) << std::strerror(errno);
  const auto r = p.wait(30s);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto ranks = sessions_by_rank(r.output);
  ASSERT_EQ(ranks.size(), 2u) << r.output;
  for (const auto& [rank, ids] : ranks) {
    const auto [pid, group, session] = ids;
    EXPECT_EQ(session, pid) << "rank " << rank << " does not lead a session: " << r.output;
    EXPECT_EQ(group, pid) << "rank " << rank << " does not lead its process group";
    EXPECT_NE(session, ddprun_session) << "rank " << rank << " is in ddprun's session";
  }
}

TEST(Ddprun, SameSessionMeasurementAidKeepsTheWorkersInDdprunsSession) {
  // DDP_LAUNCHER_SAME_SESSION=1 is the old behaviour, for bench/probes/launcher_under_load.py: its
  // own process group still, but ddprun's session.
  auto p = Subprocess::start({ddprun(), "--nproc-per-node", "2", "/bin/sh", "-c", kPrintSession},
                             {{"DDP_LAUNCHER_SAME_SESSION", "1"}});
  // 0 where the session's leader lives outside this pid namespace (CI's container); -1 is an error.
  const pid_t ddprun_session = ::getsid(p.pid());
  ASSERT_GE(ddprun_session, 0) << std::strerror(errno);
  const auto r = p.wait(30s);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto ranks = sessions_by_rank(r.output);
  ASSERT_EQ(ranks.size(), 2u) << r.output;
  for (const auto& [rank, ids] : ranks) {
    EXPECT_EQ(ids[2], ddprun_session) << "rank " << rank << ": " << r.output;
    EXPECT_EQ(ids[1], ids[0]) << "rank " << rank << " does not lead its process group";
  }
  const auto bad = run_ddprun({"/bin/true"}, {{"DDP_LAUNCHER_SAME_SESSION", "yes"}});
  EXPECT_EQ(bad.exit_code, 1) << bad.output;
  EXPECT_THAT(bad.output, HasSubstr("DDP_LAUNCHER_SAME_SESSION='yes'"));
}

TEST(Ddprun, WorkersInTheirOwnSessionsDieWithinFiveSecondsOfASigkilledDdprun) {
  // Leaving ddprun's session must not leave its reach: the parent-death signal still fires.
  TempDir dir;
  const std::string pids = dir.file("pids");
  auto p = Subprocess::start({ddprun(), "--nproc-per-node", "2", "/bin/sh", "-c",
                              fmt::format("echo $$ >> {}; echo ready; exec sleep 60", pids)});
  ASSERT_TRUE(wait_for_output(p, {"[0] ready", "[1] ready"}, 15s)) << p.output_so_far();
  const auto recorded = read_pids(pids);
  ASSERT_EQ(recorded.size(), 2u);
  for (const pid_t pid : recorded) {
    EXPECT_EQ(group_and_session(pid).second, pid) << "worker " << pid << " leads no session";
  }
  ASSERT_EQ(::kill(p.pid(), SIGKILL), 0);
  p.wait(10s);
  const auto deadline = Clock::now() + 5s;
  while (Clock::now() < deadline && std::any_of(recorded.begin(), recorded.end(), process_alive)) {
    std::this_thread::sleep_for(10ms);
  }
  expect_all_dead(recorded);
}

TEST(Ddprun, SigtermStopsWhatAWorkerStartedThoughTheWorkerIgnoresIt) {
  // The worker's children are in its process group (its session's), which ddprun signals.
  TempDir dir;
  const std::string pids = dir.file("pids");
  auto p = Subprocess::start(
      {ddprun(), "--nproc-per-node", "2", "--grace-period", "2", "/bin/sh", "-c",
       fmt::format("sleep 60 & echo $! >> {0}; echo $$ >> {0}; echo ready; wait", pids)});
  ASSERT_TRUE(wait_for_output(p, {"[0] ready", "[1] ready"}, 15s)) << p.output_so_far();
  ASSERT_EQ(::kill(p.pid(), SIGTERM), 0);
  const auto r = p.wait(20s);
  EXPECT_EQ(r.exit_code, 143) << r.output;
  const auto recorded = read_pids(pids);
  EXPECT_EQ(recorded.size(), 4u);
  expect_all_dead(recorded);
}

// ---------------------------------------------------------------------------------------------
// The job's secret

std::string write_secret_file(const TempDir& dir, const std::string& secret) {
  const std::string path = dir.file("secret");
  std::ofstream(path) << secret << "\n";
  ::chmod(path.c_str(), 0600);
  return path;
}

TEST(Ddprun, SecretFileReachesTheWorkersOnNoCommandLine) {
  TempDir dir;
  const std::string secret = "ddprun-test-secret-4f1c";
  const std::string path = write_secret_file(dir, secret);
  // Each worker prints its environment, its own command line and ddprun's (its parent's).
  const auto r = run_ddprun({"--secret-file", path, "--nproc-per-node", "2", "/bin/sh", "-c",
                             "env; echo \"cmdline=$(tr '\\0' ' ' < /proc/$$/cmdline)\"; "
                             "echo \"parent=$(tr '\\0' ' ' < /proc/$PPID/cmdline)\""},
                            {{"DDP_SECRET", std::nullopt}, {"DDP_SECRET_FILE", std::nullopt}});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, Not(HasSubstr(secret)));
  EXPECT_THAT(r.output, HasSubstr("[0] DDP_SECRET_FILE=" + path));
  EXPECT_THAT(r.output, HasSubstr("[1] DDP_SECRET_FILE=" + path));
  EXPECT_THAT(r.output, HasSubstr("[1] parent=" + ddprun()));  // the check read /proc
  EXPECT_THAT(r.output, Not(HasSubstr("DDP_SECRET=")));
}

TEST(Ddprun, WorkersOfAJobWithASecretRunCollectives) {
  TempDir dir;
  const std::string path = write_secret_file(dir, "bench secret");
  const auto r = run_ddprun({"--secret-file", path, "--standalone", "--nproc-per-node", "3",
                             built_program("ddp-bench"), "--op", "allreduce", "--sizes", "1K,1M",
                             "--iters", "3", "--warmup", "1", "--check", "--timeout", "30"},
                            {{"DDP_SECRET", std::nullopt}, {"DDP_SECRET_FILE", std::nullopt}}, 60s);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, Not(HasSubstr("refused")));
}

TEST(Ddprun, BadSecretFileIsAUsageError) {
  TempDir dir;
  const std::string path = dir.file("empty");
  std::ofstream(path) << "";
  ::chmod(path.c_str(), 0600);
  const auto r = run_ddprun({"--secret-file", path, "/bin/true"});
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_THAT(r.output, HasSubstr("is empty"));
}

TEST(Ddprun, ASecretFifoIsRefusedAtOnceAsOptionAndAsVariable) {
  // Both used to hang: ddprun (or every worker) blocked reading the pipe.
  TempDir dir;
  const std::string fifo = dir.file("secret.fifo");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  const std::string marker = dir.file("started");
  const std::vector<std::string> worker{"/bin/sh", "-c", "touch " + marker};
  for (const bool as_option : {true, false}) {
    std::vector<std::string> args;
    if (as_option) args = {"--secret-file", fifo};
    args.insert(args.end(), worker.begin(), worker.end());
    const auto start = Clock::now();
    const auto r = run_ddprun(
        args,
        {{"DDP_SECRET", std::nullopt},
         {"DDP_SECRET_FILE", as_option ? std::optional<std::string>() : std::optional(fifo)}},
        20s);
    EXPECT_FALSE(r.timed_out) << r.output;
    EXPECT_LT(seconds_since(start), 10.0);
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_THAT(r.output, HasSubstr(as_option ? "--secret-file: " : "DDP_SECRET_FILE: "));
    EXPECT_THAT(r.output, HasSubstr("'" + fifo + "' is a FIFO (named pipe), not a regular file"));
  }
  EXPECT_FALSE(std::filesystem::exists(marker));
}

TEST(Ddprun, ASecretFileItsGroupCanReadIsRefusedNamingModeAndFix) {
  TempDir dir;
  const std::string path = write_secret_file(dir, "group-readable");
  ASSERT_EQ(::chmod(path.c_str(), 0660), 0);
  const auto r = run_ddprun({"--secret-file", path, "/bin/true"},
                            {{"DDP_SECRET", std::nullopt}, {"DDP_SECRET_FILE", std::nullopt}});
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_THAT(r.output, HasSubstr("--secret-file: the secret file '" + path + "'"));
  EXPECT_THAT(r.output, HasSubstr("mode 0660"));
  EXPECT_THAT(r.output, HasSubstr("chmod 600 " + path));
  const auto inherited =
      run_ddprun({"/bin/true"}, {{"DDP_SECRET", std::nullopt}, {"DDP_SECRET_FILE", path}});
  EXPECT_EQ(inherited.exit_code, 2) << inherited.output;
  EXPECT_THAT(inherited.output, HasSubstr("DDP_SECRET_FILE: the secret file '" + path + "'"));
}

TEST(Ddprun, RestartRoundSecretErrorsNameDdprunsOptionsNotTheStores) {
  // Node 0 has a secret, node 1 none: node 1's ddprun is turned away by the restart rounds'
  // store, and says which ddprun option or variable gives it the secret.
  TempDir dir;
  const std::string path = write_secret_file(dir, "rounds secret");
  const int master_port = free_port();
  const int agent_port = free_port();
  const auto node = [&](int rank, bool with_secret) {
    std::vector<std::string> argv{ddprun(),
                                  "--nnodes",
                                  "2",
                                  "--node-rank",
                                  std::to_string(rank),
                                  "--master-addr",
                                  "127.0.0.1",
                                  "--master-port",
                                  std::to_string(master_port),
                                  "--agent-port",
                                  std::to_string(agent_port),
                                  "--max-restarts",
                                  "1"};
    if (with_secret) argv.insert(argv.end(), {"--secret-file", path});
    argv.insert(argv.end(), {"/bin/true"});
    return Subprocess::start(
        argv,
        {{"DDP_SECRET", std::nullopt}, {"DDP_SECRET_FILE", std::nullopt}, {"DDP_TIMEOUT", "10"}});
  };
  auto node0 = node(0, true);
  auto node1 = node(1, false);
  const auto r = node1.wait(30s);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_THAT(r.output, HasSubstr("requires a shared secret"));
  EXPECT_THAT(r.output, HasSubstr("--secret-file"));
  EXPECT_THAT(r.output, HasSubstr("DDP_SECRET"));
  EXPECT_THAT(r.output, Not(HasSubstr("TcpStoreOptions")));
  node0.signal_group(SIGKILL);
  node0.wait(10s);
}

// ---------------------------------------------------------------------------------------------
// Bad command lines

TEST(Ddprun, AMalformedDdpTimeoutIsAUsageErrorAsInTheLibrary) {
  // One parser for ddprun and its workers (settings::timeout): ddprun used to take 'inf' and
  // '1e300' into a negative deadline and '60abc' and '0x10' as numbers, or not look at all.
  TempDir dir;
  const std::string marker = dir.file("started");
  for (const std::string bad : {"inf", "1e300", "60abc", "0x10", "nan", "0", "-5", ""}) {
    const auto r = run_ddprun({"--nproc-per-node", "2", "/bin/sh", "-c", "touch " + marker},
                              {{"DDP_TIMEOUT", bad}});
    EXPECT_EQ(r.exit_code, 2) << bad << ": " << r.output;
    EXPECT_THAT(r.output, HasSubstr("DDP_TIMEOUT='" + bad + "'"));
    EXPECT_THAT(r.output, HasSubstr("e.g. DDP_TIMEOUT=60"));
    EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 1) << "one line: " << r.output;
  }
  // The same for a job with restart rounds, where ddprun had a parser of its own.
  const auto r = run_ddprun({"--nnodes", "2", "--node-rank", "0", "--max-restarts", "1",
                             "--master-port", "29811", "/bin/sh", "-c", "touch " + marker},
                            {{"DDP_TIMEOUT", "1e300"}});
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_THAT(r.output, HasSubstr("DDP_TIMEOUT='1e300'"));
  EXPECT_THAT(r.output, Not(HasSubstr("-9223372036854775808")));
  EXPECT_FALSE(std::filesystem::exists(marker));
  const auto good = run_ddprun({"/bin/true"}, {{"DDP_TIMEOUT", "0.5"}});
  EXPECT_EQ(good.exit_code, 0) << good.output;
}

TEST(Ddprun, BadOptionsExitWithTwoBeforeStartingAnything) {
  TempDir dir;
  const std::string marker = dir.file("started");
  const std::vector<std::string> worker{"/bin/sh", "-c", "touch " + marker};
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases{
      {{"--nnodes", "2", "--node-rank", "2"}, "--node-rank"},
      {{"--nproc-per-node", "0"}, "--nproc-per-node"},
      {{"--nproc-per-node", "many"}, "--nproc-per-node"},
      {{"--master-port", "65536"}, "--master-port"},
      {{"--grace-period", "soon"}, "--grace-period"},
      {{"--no-such-option"}, "--no-such-option"},
      {{"--log-dir", "/dev/null/logs"}, "--log-dir: cannot create the folder"},
      {{"--log-dir", dir.file("logs"), "--redirects", "4"}, "--redirects"},
      {{"--log-dir", dir.file("logs"), "--tee", "0:3,x"}, "--tee"},
      {{"--redirects", "3"}, "--log-dir"},
      {{"--local-ranks-filter", "0,1"}, "--local-ranks-filter: local rank 1 does not exist"},
      {{"--rdzv-backend", "etcd-v2"}, "--rdzv-backend"},
      {{"--rdzv-endpoint", "host:"}, "--rdzv-endpoint"},
  };
  for (const auto& [options, named] : cases) {
    std::vector<std::string> args = options;
    args.insert(args.end(), worker.begin(), worker.end());
    const auto r = run_ddprun(args);
    EXPECT_EQ(r.exit_code, 2) << named << ": " << r.output;
    EXPECT_THAT(r.output, HasSubstr(named));
    EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 1) << "one line: " << r.output;
  }
  const auto missing = run_ddprun({"--nproc-per-node", "2"});
  EXPECT_EQ(missing.exit_code, 2) << missing.output;
  EXPECT_THAT(missing.output, HasSubstr("PROGRAM"));
  const auto not_found = run_ddprun({"ddprun-test-no-such-program"});
  EXPECT_EQ(not_found.exit_code, 2) << not_found.output;
  EXPECT_THAT(not_found.output, HasSubstr("ddprun-test-no-such-program"));
  const std::string data_file = dir.file("data.txt");
  { std::ofstream(data_file) << "not a program\n"; }
  ::chmod(data_file.c_str(), 0644);
  const auto not_executable = run_ddprun({data_file});
  EXPECT_EQ(not_executable.exit_code, 2) << not_executable.output;
  EXPECT_THAT(not_executable.output, HasSubstr(data_file));
  EXPECT_FALSE(std::filesystem::exists(marker));
}

}  // namespace
}  // namespace ddp::test
