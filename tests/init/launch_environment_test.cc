#include "ddp/launch/launch_environment.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <map>

#include "ddp/error.h"
#include "init/agent_store.h"
#include "support/unity_namespace.h"

namespace ddp {
namespace {
namespace DDP_UNITY_ID {

using ::testing::HasSubstr;
using Env = std::map<std::string, std::string>;

LaunchEnvironment resolve(const Env& env, const LaunchOptions& options = {}) {
  return resolve_launch_environment(options,
                                    [&](const std::string& name) -> std::optional<std::string> {
                                      const auto it = env.find(name);
                                      if (it == env.end()) return std::nullopt;
                                      return it->second;
                                    });
}

// Expects ConfigError whose message contains every fragment.
void expect_config_error(const Env& env, std::initializer_list<const char*> fragments,
                         const LaunchOptions& options = {}) {
  try {
    resolve(env, options);
    ADD_FAILURE() << "expected a ConfigError";
  } catch (const ConfigError& e) {
    for (const char* fragment : fragments)
      EXPECT_THAT(e.what(), HasSubstr(fragment));
  }
}

const Env kTorchrun = {{"RANK", "3"},
                       {"WORLD_SIZE", "8"},
                       {"LOCAL_RANK", "1"},
                       {"LOCAL_WORLD_SIZE", "2"},
                       {"MASTER_ADDR", "node0"},
                       {"MASTER_PORT", "29400"},
                       {"TORCHELASTIC_RESTART_COUNT", "2"}};

TEST(LaunchEnvironment, NoLauncherIsAJobOfOne) {
  const auto e = resolve({});
  EXPECT_EQ(e.rank, 0);
  EXPECT_EQ(e.world_size, 1);
  EXPECT_EQ(e.local_rank, 0);
  EXPECT_EQ(e.local_world_size, 1);
  EXPECT_EQ(e.master_port, 0);
  EXPECT_EQ(e.launcher, "none");
}

TEST(LaunchEnvironment, ReadsTorchrunAndDdprunVariables) {
  const auto e = resolve(kTorchrun);
  EXPECT_EQ(e.rank, 3);
  EXPECT_EQ(e.world_size, 8);
  EXPECT_EQ(e.local_rank, 1);
  EXPECT_EQ(e.local_world_size, 2);
  EXPECT_EQ(e.master_addr, "node0");
  EXPECT_EQ(e.master_port, 29400);
  EXPECT_EQ(e.restart_count, 2);
  EXPECT_EQ(e.launcher, "ddprun/torchrun");
}

// torchrun 2.x's default: its agent hosts the store at MASTER_ADDR:MASTER_PORT and ddp joins
// through it under a prefix of its own, fresh for every restart and world size.
TEST(LaunchEnvironment, TorchrunsAgentStoreIsJoinedUnderAPrefixOfItsOwn) {
  Env env = kTorchrun;
  env["TORCHELASTIC_USE_AGENT_STORE"] = "True";
  const auto lookup = [&](const std::string& name) -> std::optional<std::string> {
    const auto it = env.find(name);
    if (it == env.end()) return std::nullopt;
    return it->second;
  };
  const auto e = resolve(env);  // no longer refused
  EXPECT_EQ(e.master_port, 29400);
  EXPECT_EQ(init::torchrun_agent_store_prefix({}, e, lookup), "ddp/torchrun/attempt_2/world_8");
  // An explicit master address or port is not the agent's store (as PyTorch's own check).
  EXPECT_EQ(init::torchrun_agent_store_prefix({.master_port = 1234}, e, lookup), std::nullopt);
  EXPECT_EQ(init::torchrun_agent_store_prefix({.master_addr = "h"}, e, lookup), std::nullopt);
  env["TORCHELASTIC_USE_AGENT_STORE"] = "False";  // ddprun, or TORCH_DISABLE_SHARE_RDZV_TCP_STORE
  EXPECT_EQ(init::torchrun_agent_store_prefix({}, resolve(env), lookup), std::nullopt);
}

TEST(LaunchEnvironment, ReadsOpenMpiVariables) {
  const auto e = resolve({{"OMPI_COMM_WORLD_RANK", "5"},
                          {"OMPI_COMM_WORLD_SIZE", "6"},
                          {"OMPI_COMM_WORLD_LOCAL_RANK", "2"},
                          {"OMPI_COMM_WORLD_LOCAL_SIZE", "3"},
                          {"MASTER_ADDR", "10.1.2.3"},
                          {"MASTER_PORT", "4000"}});
  EXPECT_EQ(e.rank, 5);
  EXPECT_EQ(e.world_size, 6);
  EXPECT_EQ(e.local_rank, 2);
  EXPECT_EQ(e.local_world_size, 3);
  EXPECT_EQ(e.master_addr, "10.1.2.3");
  EXPECT_EQ(e.master_port, 4000);
  EXPECT_EQ(e.launcher, "mpirun");
}

TEST(LaunchEnvironment, OneNodeMpirunNeedsNoMaster) {
  const auto e = resolve({{"OMPI_COMM_WORLD_RANK", "1"},
                          {"OMPI_COMM_WORLD_SIZE", "2"},
                          {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                          {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}});
  EXPECT_EQ(e.master_addr, "127.0.0.1");
  EXPECT_EQ(e.master_port, 29500);
}

TEST(LaunchEnvironment, MultiNodeMpirunWithoutMasterNamesTheFix) {
  expect_config_error({{"OMPI_COMM_WORLD_RANK", "1"},
                       {"OMPI_COMM_WORLD_SIZE", "4"},
                       {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                       {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}},
                      {"MASTER_ADDR", "mpirun -x MASTER_ADDR"});
}

TEST(LaunchEnvironment, ReadsSlurmVariables) {
  const auto e = resolve({{"SLURM_PROCID", "4"},
                          {"SLURM_NTASKS", "5"},
                          {"SLURM_LOCALID", "0"},
                          {"SLURM_NODEID", "2"},
                          {"SLURM_TASKS_PER_NODE", "2(x2),1"},
                          {"MASTER_ADDR", "n0"},
                          {"MASTER_PORT", "29500"}});
  EXPECT_EQ(e.rank, 4);
  EXPECT_EQ(e.world_size, 5);
  EXPECT_EQ(e.local_rank, 0);
  EXPECT_EQ(e.local_world_size, 1);  // third node of "2(x2),1"
  EXPECT_EQ(e.launcher, "srun");
}

TEST(LaunchEnvironment, SlurmNtasksPerNodeWins) {
  const auto e = resolve({{"SLURM_PROCID", "1"},
                          {"SLURM_NTASKS", "4"},
                          {"SLURM_LOCALID", "1"},
                          {"SLURM_NTASKS_PER_NODE", "2"},
                          {"SLURM_TASKS_PER_NODE", "garbage"},
                          {"MASTER_ADDR", "n0"},
                          {"MASTER_PORT", "29500"}});
  EXPECT_EQ(e.local_world_size, 2);
}

TEST(LaunchEnvironment, MalformedSlurmTasksPerNode) {
  expect_config_error({{"SLURM_PROCID", "0"},
                       {"SLURM_NTASKS", "2"},
                       {"SLURM_LOCALID", "0"},
                       {"SLURM_TASKS_PER_NODE", "2(y2)"}},
                      {"SLURM_TASKS_PER_NODE", "2(y2)"});
}

TEST(LaunchEnvironment, TorchrunTakesPrecedenceOverMpiAndSlurm) {
  Env env = kTorchrun;
  env["OMPI_COMM_WORLD_RANK"] = "0";
  env["OMPI_COMM_WORLD_SIZE"] = "1";
  env["SLURM_PROCID"] = "0";
  env["SLURM_NTASKS"] = "1";
  EXPECT_EQ(resolve(env).rank, 3);
}

TEST(LaunchEnvironment, ExplicitOptionsOverrideTheEnvironment) {
  const auto e = resolve(kTorchrun, {.rank = 0,
                                     .world_size = 2,
                                     .local_rank = 0,
                                     .local_world_size = 2,
                                     .master_addr = "127.0.0.1",
                                     .master_port = 1234});
  EXPECT_EQ(e.rank, 0);
  EXPECT_EQ(e.world_size, 2);
  EXPECT_EQ(e.master_addr, "127.0.0.1");
  EXPECT_EQ(e.master_port, 1234);
}

TEST(LaunchEnvironment, OptionsAloneDescribeAJob) {
  const auto e = resolve({}, {.rank = 1, .world_size = 3, .master_port = 5000});
  EXPECT_EQ(e.rank, 1);
  EXPECT_EQ(e.world_size, 3);
  EXPECT_EQ(e.launcher, "options");
  expect_config_error({}, {"options.rank and options.world_size"}, {.rank = 1});
}

TEST(LaunchEnvironment, MissingWorldSizeNamesTheVariable) {
  expect_config_error({{"RANK", "0"}}, {"WORLD_SIZE is not set", "ddprun/torchrun"});
}

TEST(LaunchEnvironment, MissingRankNamesTheVariable) {
  expect_config_error({{"WORLD_SIZE", "2"}}, {"RANK is not set"});
}

TEST(LaunchEnvironment, NonNumericVariablesAreNamed) {
  Env env = kTorchrun;
  env["RANK"] = "three";
  expect_config_error(env, {"RANK='three' is not an integer"});
  env = kTorchrun;
  env["WORLD_SIZE"] = "8x";
  expect_config_error(env, {"WORLD_SIZE='8x'"});
  env = kTorchrun;
  env["MASTER_PORT"] = "";
  expect_config_error(env, {"MASTER_PORT=''"});
  env = kTorchrun;
  env["LOCAL_RANK"] = "-";
  expect_config_error(env, {"LOCAL_RANK='-'"});
}

TEST(LaunchEnvironment, RankMustBeBelowWorldSize) {
  Env env = kTorchrun;
  env["RANK"] = "8";
  expect_config_error(env, {"RANK=8 is outside the world", "WORLD_SIZE=8", "0 to 7"});
  env["RANK"] = "-1";
  expect_config_error(env, {"RANK=-1"});
}

TEST(LaunchEnvironment, WorldSizeZeroIsRejected) {
  Env env = kTorchrun;
  env["WORLD_SIZE"] = "0";
  expect_config_error(env, {"WORLD_SIZE=0", "at least one process"});
}

TEST(LaunchEnvironment, LocalRankMustFitLocalWorld) {
  Env env = kTorchrun;
  env["LOCAL_RANK"] = "2";
  expect_config_error(env, {"LOCAL_RANK=2", "LOCAL_WORLD_SIZE=2"});
  env = kTorchrun;
  env["LOCAL_WORLD_SIZE"] = "9";
  expect_config_error(env, {"LOCAL_WORLD_SIZE=9", "WORLD_SIZE=8"});
}

TEST(LaunchEnvironment, MissingMasterForMultiProcessTorchrunJob) {
  Env env = kTorchrun;
  env.erase("MASTER_ADDR");
  expect_config_error(env, {"MASTER_ADDR is not set"});
  env = kTorchrun;
  env.erase("MASTER_PORT");
  expect_config_error(env, {"MASTER_PORT is not set"});
}

TEST(LaunchEnvironment, PortOutOfRange) {
  Env env = kTorchrun;
  env["MASTER_PORT"] = "70000";
  expect_config_error(env, {"MASTER_PORT=70000 is not a TCP port"});
  env["MASTER_PORT"] = "0";
  expect_config_error(env, {"MASTER_PORT=0 only works for a job of one process"});
}

TEST(LaunchEnvironment, EmptyMasterAddrIsRejected) {
  Env env = kTorchrun;
  env["MASTER_ADDR"] = "";
  expect_config_error(env, {"MASTER_ADDR is set but empty"});
}

TEST(LaunchEnvironment, MissingLocalVariablesAssumeOneHost) {
  const auto e =
      resolve({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "1"}});
  EXPECT_EQ(e.local_rank, 1);
  EXPECT_EQ(e.local_world_size, 2);
}

TEST(LaunchEnvironment, ReadsTheRealProcessEnvironment) {
  ::setenv("DDP_TEST_VARIABLE", "42", 1);
  EXPECT_EQ(process_environment("DDP_TEST_VARIABLE"), "42");
  ::unsetenv("DDP_TEST_VARIABLE");
  EXPECT_EQ(process_environment("DDP_TEST_VARIABLE"), std::nullopt);
}

}  // namespace DDP_UNITY_ID
}  // namespace
}  // namespace ddp
