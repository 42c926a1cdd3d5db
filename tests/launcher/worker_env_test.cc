#include "ddprun/worker_env.h"

#include "ddprun/env_tuning.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include "support/unity_namespace.h"

namespace ddp::ddprun {
namespace {
namespace DDP_UNITY_ID {

LaunchOptions two_nodes_of_four() {
  LaunchOptions options;
  options.nproc_per_node = 4;
  options.nnodes = 2;
  options.node_rank = 1;
  options.master_addr = "10.0.0.1";
  options.master_port = 29501;
  options.max_restarts = 3;
  return options;
}

TEST(WorkerEnvironment, FollowsTorchrunsContract) {
  Environment env{{"PATH", "/bin"}};
  apply_worker_variables(
      env, two_nodes_of_four(),
      {.local_rank = 2, .restart_count = 1, .master_port = 29501, .cpu_count = 16});
  const Environment expected{
      {"PATH", "/bin"},
      {"RANK", "6"},
      {"LOCAL_RANK", "2"},
      {"WORLD_SIZE", "8"},
      {"LOCAL_WORLD_SIZE", "4"},
      {"GROUP_RANK", "1"},
      {"GROUP_WORLD_SIZE", "2"},
      {"ROLE_NAME", "default"},
      {"ROLE_RANK", "6"},
      {"ROLE_WORLD_SIZE", "8"},
      {"MASTER_ADDR", "10.0.0.1"},
      {"MASTER_PORT", "29501"},
      {"TORCHELASTIC_RESTART_COUNT", "1"},
      {"TORCHELASTIC_MAX_RESTARTS", "3"},
      {"TORCHELASTIC_RUN_ID", "none"},
      {"TORCHELASTIC_USE_AGENT_STORE", "False"},
      {"DDP_RESTART_COUNT", "1"},
      {"OMP_NUM_THREADS", "4"},
  };
  EXPECT_EQ(env, expected);
}

TEST(WorkerEnvironment, AnElasticRoundsPlacementGivesTheRanks) {
  LaunchOptions options = two_nodes_of_four();
  options.min_nnodes = 1;
  options.nnodes = 4;
  options.node_rank = -1;
  Environment env;
  // Third of three members, after nodes of 4 and 2 workers: ranks 6.. of 10.
  apply_worker_variables(env, options,
                         {.local_rank = 1,
                          .restart_count = 5,
                          .master_port = 29501,
                          .cpu_count = 4,
                          .placement = RoundPlacement{
                              .node_rank = 2, .nnodes = 3, .first_rank = 6, .world_size = 10}});
  EXPECT_EQ(env["RANK"], "7");
  EXPECT_EQ(env["ROLE_RANK"], "7");
  EXPECT_EQ(env["WORLD_SIZE"], "10");
  EXPECT_EQ(env["ROLE_WORLD_SIZE"], "10");
  EXPECT_EQ(env["GROUP_RANK"], "2");
  EXPECT_EQ(env["GROUP_WORLD_SIZE"], "3");
  EXPECT_EQ(env["LOCAL_WORLD_SIZE"], "4");
  EXPECT_EQ(env["TORCHELASTIC_RESTART_COUNT"], "5");
}

TEST(WorkerEnvironment, ReplacesInheritedRankVariables) {
  Environment env{{"RANK", "99"}, {"WORLD_SIZE", "99"}, {"MASTER_PORT", "1"}};
  apply_worker_variables(
      env, two_nodes_of_four(),
      {.local_rank = 0, .restart_count = 0, .master_port = 29501, .cpu_count = 1});
  EXPECT_EQ(env["RANK"], "4");
  EXPECT_EQ(env["WORLD_SIZE"], "8");
  EXPECT_EQ(env["MASTER_PORT"], "29501");
}

TEST(WorkerEnvironment, OmpNumThreadsIsAtLeastOneAndUserChoiceWins) {
  Environment env;
  apply_worker_variables(env, two_nodes_of_four(),
                         {.local_rank = 0, .restart_count = 0, .master_port = 1, .cpu_count = 2});
  EXPECT_EQ(env["OMP_NUM_THREADS"], "1");  // 2 CPUs / 4 workers rounds down to 0, then 1

  Environment preset{{"OMP_NUM_THREADS", "7"}};
  apply_worker_variables(preset, two_nodes_of_four(),
                         {.local_rank = 0, .restart_count = 0, .master_port = 1, .cpu_count = 64});
  EXPECT_EQ(preset["OMP_NUM_THREADS"], "7");
}

TEST(WorkerEnvironment, LogDirBecomesTheDumpDirUnlessSetAndRunIdIsPassedOn) {
  LaunchOptions options = two_nodes_of_four();
  options.run_id = "job-7";
  Environment env;
  apply_worker_variables(env, options,
                         {.local_rank = 0,
                          .restart_count = 2,
                          .master_port = 1,
                          .cpu_count = 1,
                          .dump_dir = "/logs/job-7/attempt_2"});
  EXPECT_EQ(env["DDP_DUMP_DIR"], "/logs/job-7/attempt_2");
  EXPECT_EQ(env["TORCHELASTIC_RUN_ID"], "job-7");

  Environment preset{{"DDP_DUMP_DIR", "/mine"}};
  apply_worker_variables(preset, options,
                         {.local_rank = 0,
                          .restart_count = 0,
                          .master_port = 1,
                          .cpu_count = 1,
                          .dump_dir = "/logs/job-7/attempt_0"});
  EXPECT_EQ(preset["DDP_DUMP_DIR"], "/mine");

  Environment no_log_dir;
  apply_worker_variables(no_log_dir, options,
                         {.local_rank = 0, .restart_count = 0, .master_port = 1, .cpu_count = 1});
  EXPECT_FALSE(no_log_dir.contains("DDP_DUMP_DIR"));
}

TEST(WorkerEnvironment, EnvpStringsAreKeyEqualsValue) {
  const auto strings = to_envp_strings({{"A", "1"}, {"B", "x=y"}});
  EXPECT_EQ(strings, (std::vector<std::string>{"A=1", "B=x=y"}));
}

TEST(EnvTuning, OpenBlasCoreTypeOnlyReplacesTheGenericFallback) {
  EXPECT_EQ(openblas_coretype_for("Prescott", true, true), "SkylakeX");
  EXPECT_EQ(openblas_coretype_for("prescott", false, true), "Haswell");
  EXPECT_EQ(openblas_coretype_for("Prescott", false, false), "");  // nothing better to offer
  EXPECT_EQ(openblas_coretype_for("Cooperlake", true, true), "");  // OpenBLAS knows the CPU
  EXPECT_EQ(openblas_coretype_for("Haswell", true, true), "");
  EXPECT_EQ(openblas_coretype_for("", true, true), "");  // no OpenBLAS
}

TEST(EnvTuning, AddsMallocTunablesAndLeavesVariablesTheUserSet) {
  const Environment tuning = choose_env_tuning({{"PATH", "/bin"}});
  ASSERT_TRUE(tuning.contains("GLIBC_TUNABLES"));
  EXPECT_EQ(tuning.at("GLIBC_TUNABLES"), kMallocTunables);
  EXPECT_FALSE(tuning.contains("PATH"));
  // Whatever the probe found, a forced core type is one of the two ddprun knows.
  if (tuning.contains("OPENBLAS_CORETYPE")) {
    EXPECT_TRUE(tuning.at("OPENBLAS_CORETYPE") == "SkylakeX" ||
                tuning.at("OPENBLAS_CORETYPE") == "Haswell");
  }
  const Environment preset = choose_env_tuning(
      {{"GLIBC_TUNABLES", "glibc.malloc.arena_max=1"}, {"OPENBLAS_CORETYPE", "Zen"}});
  EXPECT_TRUE(preset.empty());
}

TEST(EnvTuning, ProbeAnswersWithinASecond) {
  const auto start = std::chrono::steady_clock::now();
  const std::string core = probe_openblas_core();
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(3));
  // The test machines install OpenBLAS (scripts/install-deps.sh): it must answer with a name.
  EXPECT_FALSE(core.empty());
}

TEST(WorkerEnvironment, SecretFileReachesTheWorkersAsAPathOnly) {
  LaunchOptions options = two_nodes_of_four();
  options.secret_file = "/run/job/secret";
  Environment env{{"DDP_SECRET", "inherited from the shell"}};
  apply_worker_variables(
      env, options, {.local_rank = 0, .restart_count = 0, .master_port = 29501, .cpu_count = 1});
  EXPECT_EQ(env["DDP_SECRET_FILE"], "/run/job/secret");
  EXPECT_FALSE(env.contains("DDP_SECRET"));  // the flag wins over the inherited variable

  Environment untouched{{"DDP_SECRET", "from the shell"}};
  apply_worker_variables(untouched, two_nodes_of_four(),
                         {.local_rank = 0, .restart_count = 0, .master_port = 1, .cpu_count = 1});
  EXPECT_EQ(untouched["DDP_SECRET"], "from the shell");  // no flag: inherited as it is
  EXPECT_FALSE(untouched.contains("DDP_SECRET_FILE"));
}

}  // namespace DDP_UNITY_ID
}  // namespace
}  // namespace ddp::ddprun
