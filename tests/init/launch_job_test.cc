// init_process_group() in real processes started the way users start them: by ddprun, by mpirun,
// or by hand without any launcher (init_allreduce_worker: init, allreduce, check).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>

#include <fmt/format.h>

#include "ddp/runtime/init.h"
#include "support/subprocess.h"
#include "support/temp_dir.h"
#include "support/test_paths.h"
#include "support/unity_namespace.h"

namespace ddp {
namespace {
namespace DDP_UNITY_ID {

using namespace std::chrono_literals;
using test::built_program;
using test::ExitStatus;
using test::Subprocess;
using ::testing::HasSubstr;
using ::testing::Not;

// Launcher variables a test's own environment might carry (a test run under ddprun or mpirun),
// removed so that each test sees only what it sets.
std::map<std::string, std::optional<std::string>> clean_environment() {
  std::map<std::string, std::optional<std::string>> env;
  for (const char* name :
       {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
        "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS", "PMI_SIZE",
        "PMIX_RANK", "TORCHELASTIC_USE_AGENT_STORE", "DDP_BACKEND", "DDP_QUIET", "DDP_SECRET",
        "DDP_SECRET_FILE", "DDP_TRACE", "DDP_DUMP_DIR"}) {
    env[name] = std::nullopt;
  }
  env["DDP_TIMEOUT"] = "30";
  return env;
}

bool mpi_built() {
  const auto names = available_backends();
  return std::find(names.begin(), names.end(), "mpi") != names.end();
}

int count(const std::string& text, const std::string& what) {
  int n = 0;
  for (auto pos = text.find(what); pos != std::string::npos; pos = text.find(what, pos + 1))
    ++n;
  return n;
}

constexpr const char* kNotice =
    "ddp: no launcher environment (RANK, WORLD_SIZE, OMPI_COMM_WORLD_*, SLURM_*) found; running "
    "as a single process. Launch more with `ddprun --nproc-per-node N prog` or torchrun";

// A program started by hand trains as one process: it says so once, on stderr.
TEST(NoLauncher, OneLineNoticeOnStderr) {
  auto worker = Subprocess::start({built_program("init_allreduce_worker")}, clean_environment());
  const auto result = worker.wait(60s);
  ASSERT_FALSE(result.timed_out) << result.output;
  EXPECT_EQ(result.exit_code, 0) << result.output;
  EXPECT_THAT(result.output, HasSubstr("rank 0 of 1: sum 1 ok"));
  EXPECT_EQ(count(result.output, kNotice), 1) << result.output;
}

TEST(NoLauncher, NoticeSilencedByDdpQuiet) {
  auto env = clean_environment();
  env["DDP_QUIET"] = "1";
  auto worker = Subprocess::start({built_program("init_allreduce_worker")}, env);
  const auto result = worker.wait(60s);
  ASSERT_FALSE(result.timed_out) << result.output;
  EXPECT_EQ(result.exit_code, 0) << result.output;
  EXPECT_THAT(result.output, HasSubstr("rank 0 of 1: sum 1 ok"));
  EXPECT_THAT(result.output, Not(HasSubstr("no launcher environment")));
}

// Under a launcher there is nothing to say.
TEST(NoLauncher, NoNoticeUnderDdprun) {
  auto job = Subprocess::start(
      {built_program("ddprun"), "--nproc-per-node", "2", built_program("init_allreduce_worker")},
      clean_environment());
  const auto result = job.wait(90s);
  ASSERT_FALSE(result.timed_out) << result.output;
  EXPECT_EQ(result.exit_code, 0) << result.output;
  EXPECT_THAT(result.output, HasSubstr("rank 1 of 2: sum 3 ok"));
  EXPECT_THAT(result.output, Not(HasSubstr("no launcher environment")));
}

// DDP_DUMP_DIR / DDP_TRACE: the folders are made at init (mkdir -p), or refused there by name;
// before, a missing dump folder was noticed only when the dump it was for was lost.
ExitStatus run_worker_with(const char* variable, const std::string& path) {
  auto env = clean_environment();
  env["DDP_QUIET"] = "1";
  env[variable] = path;
  auto worker = Subprocess::start({built_program("init_allreduce_worker")}, env);
  return worker.wait(60s);
}

TEST(OutputFolders, MissingFoldersAreCreatedAtInit) {
  test::TempDir dir("ddp-output-folders");
  for (const char* variable : {"DDP_DUMP_DIR", "DDP_TRACE"}) {
    const auto folder = dir.path() / variable / "nested" / "deeper";
    const auto result = run_worker_with(variable, folder.string());
    ASSERT_FALSE(result.timed_out) << result.output;
    EXPECT_EQ(result.exit_code, 0) << variable << ": " << result.output;
    EXPECT_TRUE(std::filesystem::is_directory(folder)) << variable;
  }
  // The trace was written into the folder made for it.
  EXPECT_TRUE(
      std::filesystem::exists(dir.path() / "DDP_TRACE" / "nested" / "deeper" / "trace_rank0.json"));
}

TEST(OutputFolders, PathThatIsAFileIsANamedErrorAtInit) {
  test::TempDir dir("ddp-output-folders");
  const auto file = dir.path() / "a-file";
  std::ofstream(file) << "not a folder\n";
  for (const char* variable : {"DDP_DUMP_DIR", "DDP_TRACE"}) {
    for (const auto& path : {file, file / "below"}) {
      const auto result = run_worker_with(variable, path.string());
      ASSERT_FALSE(result.timed_out) << result.output;
      EXPECT_EQ(result.exit_code, 1) << result.output;
      EXPECT_THAT(result.output, HasSubstr(fmt::format("{}='{}'", variable, path.string())));
      EXPECT_THAT(result.output, HasSubstr("point " + std::string(variable) + " at a folder"));
      EXPECT_THAT(result.output, Not(HasSubstr("sum 1 ok")));  // refused before training
    }
  }
  const auto nested = run_worker_with("DDP_DUMP_DIR", (file / "below").string());
  EXPECT_THAT(nested.output, HasSubstr("cannot be created (Not a directory)"));
  const auto plain = run_worker_with("DDP_DUMP_DIR", file.string());
  EXPECT_THAT(plain.output, HasSubstr("is not a folder (a file of that name exists)"));
}

TEST(OutputFolders, UnwritablePlaceIsANamedErrorWithTheSystemsReason) {
  // /proc refuses new folders, even to root.
  const auto result = run_worker_with("DDP_DUMP_DIR", "/proc/ddp-dumps-here");
  ASSERT_FALSE(result.timed_out) << result.output;
  EXPECT_EQ(result.exit_code, 1) << result.output;
  EXPECT_THAT(result.output, HasSubstr("DDP_DUMP_DIR='/proc/ddp-dumps-here' cannot be created ("));
}

// An error in init comes before the group knows the rank: ddp-bench said "rank -1". Now it says
// the launcher's RANK, or that the rank is not known yet.
TEST(ErrorsBeforeInit, NameTheLaunchersRankNotMinusOne) {
  test::TempDir dir("ddp-rank-before-init");
  const auto file = dir.path() / "a-file";
  std::ofstream(file) << "not a folder\n";
  auto env = clean_environment();
  env["DDP_QUIET"] = "1";
  env["DDP_DUMP_DIR"] = file.string();  // init refuses it
  {
    auto bench = Subprocess::start({built_program("ddp-bench")}, env);
    const auto result = bench.wait(60s);
    ASSERT_FALSE(result.timed_out) << result.output;
    EXPECT_NE(result.exit_code, 0) << result.output;
    EXPECT_THAT(result.output, HasSubstr("ddp-bench: before the rank is known: error: "
                                         "DDP_DUMP_DIR="));
    EXPECT_THAT(result.output, Not(HasSubstr("rank -1")));
  }
  env["RANK"] = "0";
  env["WORLD_SIZE"] = "1";
  auto bench = Subprocess::start({built_program("ddp-bench")}, env);
  const auto result = bench.wait(60s);
  ASSERT_FALSE(result.timed_out) << result.output;
  EXPECT_NE(result.exit_code, 0) << result.output;
  EXPECT_THAT(result.output,
              HasSubstr("ddp-bench: rank 0 (RANK, before init finished): error: DDP_DUMP_DIR="));
  EXPECT_THAT(result.output, Not(HasSubstr("rank -1")));
}

// The adversarial run's finding: under ddprun, DDP_BACKEND=mpi made each process an MPI world of
// one, and the job exited 0 having trained two separate models.
TEST(MpiBackendWithoutMpirun, UnderDdprunIsRefusedOnEveryRank) {
  if (!mpi_built()) GTEST_SKIP() << "the mpi backend is not built (no OpenMPI at configure time)";
  auto env = clean_environment();
  env["DDP_BACKEND"] = "mpi";
  auto job = Subprocess::start(
      {built_program("ddprun"), "--nproc-per-node", "2", built_program("init_allreduce_worker")},
      env);
  const auto result = job.wait(90s);
  ASSERT_FALSE(result.timed_out) << result.output;
  EXPECT_NE(result.exit_code, 0) << result.output;
  EXPECT_THAT(result.output, Not(HasSubstr("of 1: sum 1 ok")));
  EXPECT_GE(count(result.output, "the mpi backend needs mpirun"), 1) << result.output;
  EXPECT_THAT(result.output, HasSubstr("DDP_BACKEND=ring"));
}

// The same refusal without any launcher process: RANK/WORLD_SIZE set by hand.
TEST(MpiBackendWithoutMpirun, LauncherWorldOfTwoIsNeverAWorldOfOne) {
  if (!mpi_built()) GTEST_SKIP() << "the mpi backend is not built (no OpenMPI at configure time)";
  auto env = clean_environment();
  env["DDP_BACKEND"] = "mpi";
  env["RANK"] = "1";
  env["WORLD_SIZE"] = "2";
  auto worker = Subprocess::start({built_program("init_allreduce_worker")}, env);
  const auto result = worker.wait(60s);
  ASSERT_FALSE(result.timed_out) << result.output;
  EXPECT_EQ(result.exit_code, 1) << result.output;
  EXPECT_THAT(result.output, HasSubstr("the mpi backend needs mpirun: this process was started "
                                       "with RANK=1 WORLD_SIZE=2"));
  EXPECT_THAT(result.output, HasSubstr("mpirun -np 2"));
}

// The check does not get in the way of the real thing: under mpirun the mpi backend joins MPI's
// world of two.
TEST(MpiBackendWithoutMpirun, UnderMpirunStillRuns) {
  if (!mpi_built() || std::string(DDP_MPIEXEC).empty()) {
    GTEST_SKIP() << "the mpi backend is not built (no OpenMPI at configure time)";
  }
  auto env = clean_environment();
  env["DDP_BACKEND"] = "mpi";
  auto job = Subprocess::start(
      {"sh", test::paths::run_under_mpirun, DDP_MPIEXEC, "2", "--", built_program("init_allreduce_worker")},
      env);
  const auto result = job.wait(120s);
  ASSERT_FALSE(result.timed_out) << result.output;
  if (result.exit_code == 77) GTEST_SKIP() << result.output;
  EXPECT_EQ(result.exit_code, 0) << result.output;
  EXPECT_THAT(result.output, HasSubstr("rank 0 of 2: sum 3 ok"));
  EXPECT_THAT(result.output, HasSubstr("rank 1 of 2: sum 3 ok"));
}

}  // namespace DDP_UNITY_ID
}  // namespace
}  // namespace ddp
