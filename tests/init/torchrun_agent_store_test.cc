// ddp programs under PyTorch 2.x's torchrun with its default environment
// (TORCHELASTIC_USE_AGENT_STORE=True: MASTER_PORT is torchrun's own c10d store), and the named
// errors when that store cannot be used. Real torchrun, real worker processes
// (init_allreduce_worker: init, allreduce, check); skipped without the PyTorch environment.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <thread>

#include <fmt/format.h>

#include "ddp/store/tcp_store.h"
#include "support/subprocess.h"
#include "support/temp_dir.h"
#include "support/unity_namespace.h"

namespace ddp {
namespace {
namespace DDP_UNITY_ID {

using namespace std::chrono_literals;
using test::built_program;
using test::Subprocess;
using ::testing::HasSubstr;
using ::testing::Not;

const std::string kTorchrun = std::string(DDP_PYTORCH_VENV) + "/bin/torchrun";

#define SKIP_WITHOUT_TORCHRUN()                                                               \
  if (!std::filesystem::exists(kTorchrun)) {                                                  \
    GTEST_SKIP() << "no PyTorch 2.x torchrun at " << kTorchrun                                \
                 << "; scripts/install-deps.sh installs it (scripts/pytorch-python runs it)"; \
  }

// torchrun's environment as it is by default: nothing that turns off its shared store.
std::map<std::string, std::optional<std::string>> default_environment() {
  return {{"TORCH_DISABLE_SHARE_RDZV_TCP_STORE", std::nullopt},
          {"DDP_SECRET", std::nullopt},
          {"DDP_SECRET_FILE", std::nullopt},
          {"OMP_NUM_THREADS", "1"},
          {"DDP_TIMEOUT", "60"}};
}

TEST(TorchrunAgentStore, DefaultTorchrunCommandLineRunsAJob) {
  SKIP_WITHOUT_TORCHRUN();
  auto job = Subprocess::start(
      {kTorchrun, "--nproc-per-node", "2", "--no-python", built_program("init_allreduce_worker")},
      default_environment());
  const auto result = job.wait(150s);
  ASSERT_FALSE(result.timed_out) << result.output;
  EXPECT_EQ(result.exit_code, 0) << result.output;
  EXPECT_THAT(result.output, HasSubstr("rank 0 of 2: sum 3 ok"));
  EXPECT_THAT(result.output, HasSubstr("rank 1 of 2: sum 3 ok"));
  EXPECT_THAT(result.output, Not(HasSubstr("TORCH_DISABLE_SHARE_RDZV_TCP_STORE")));
}

// torchrun's store outlives a restart; the restarted workers join under a fresh prefix.
TEST(TorchrunAgentStore, RestartedWorkersJoinAgain) {
  SKIP_WITHOUT_TORCHRUN();
  test::TempDir dumps("ddp-torchrun-restart");  // the failed attempt's flight-recorder dumps
  auto env = default_environment();
  env["INIT_WORKER_FAIL_ATTEMPT"] = "0";
  env["DDP_DUMP_DIR"] = dumps.path().string();
  auto job = Subprocess::start({kTorchrun, "--nproc-per-node", "2", "--max-restarts", "1",
                                "--no-python", built_program("init_allreduce_worker")},
                               env);
  const auto result = job.wait(170s);
  ASSERT_FALSE(result.timed_out) << result.output;
  EXPECT_EQ(result.exit_code, 0) << result.output;
  EXPECT_THAT(result.output, HasSubstr("rank 1 fails attempt 0 on purpose"));
  EXPECT_THAT(result.output, HasSubstr("rank 0 of 2: sum 3 ok"));
  EXPECT_THAT(result.output, HasSubstr("rank 1 of 2: sum 3 ok"));
}

// The agent store has no authentication: a job secret is refused by name, not silently dropped.
TEST(TorchrunAgentStore, JobSecretIsRefusedByName) {
  SKIP_WITHOUT_TORCHRUN();
  auto env = default_environment();
  env["DDP_SECRET"] = "0123456789abcdef0123456789abcdef";
  auto job = Subprocess::start(
      {kTorchrun, "--nproc-per-node", "2", "--no-python", built_program("init_allreduce_worker")},
      env);
  const auto result = job.wait(150s);
  ASSERT_FALSE(result.timed_out) << result.output;
  EXPECT_NE(result.exit_code, 0) << result.output;
  EXPECT_THAT(result.output, HasSubstr("has no authentication"));
  EXPECT_THAT(result.output, HasSubstr("TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"));
}

// torchrun's store outlives its workers: a claim left there by an earlier round under the same
// restart count is named as such (with the way out), not only as two processes claiming a rank.
TEST(TorchrunAgentStore, ClaimLeftByAnEarlierRoundIsExplained) {
  const std::string python = std::string(DDP_PYTORCH_VENV) + "/bin/python";
  if (!std::filesystem::exists(python)) {
    GTEST_SKIP() << "no PyTorch 2.x environment at " << DDP_PYTORCH_VENV
                 << "; scripts/install-deps.sh installs it";
  }
  // torchrun's store, as its agent runs it, holding an earlier worker's claim of rank 0.
  auto store = Subprocess::start(
      {python, "-c",
       "import time, torch.distributed as d\n"
       "s = d.TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False)\n"
       "s.set('ddp/torchrun/attempt_0/world_1/ddp/rendezvous/0/rank/0', 'host pid 1 (old)')\n"
       "print('PORT', s.port, flush=True)\n"
       "time.sleep(60)\n"},
      {{"PYTHONUNBUFFERED", "1"}});
  std::string port;
  for (int i = 0; i < 3000 && port.empty(); ++i) {
    const auto& out = store.output_so_far();
    if (const auto at = out.find("PORT ");
        at != std::string::npos && out.find('\n', at) != std::string::npos) {
      port = out.substr(at + 5, out.find('\n', at) - at - 5);
    } else {
      std::this_thread::sleep_for(20ms);
    }
  }
  ASSERT_FALSE(port.empty()) << store.output_so_far();
  auto worker = Subprocess::start({built_program("init_allreduce_worker")},
                                  {{"RANK", "0"},
                                   {"WORLD_SIZE", "1"},
                                   {"MASTER_ADDR", "127.0.0.1"},
                                   {"MASTER_PORT", port},
                                   {"TORCHELASTIC_USE_AGENT_STORE", "True"},
                                   {"TORCHELASTIC_RESTART_COUNT", "0"},
                                   {"DDP_SECRET", std::nullopt},
                                   {"DDP_SECRET_FILE", std::nullopt},
                                   {"DDP_TIMEOUT", "10"}});
  const auto result = worker.wait(30s);
  ASSERT_FALSE(result.timed_out) << result.output;
  EXPECT_EQ(result.exit_code, 1) << result.output;
  EXPECT_THAT(result.output, HasSubstr("two processes claim rank 0: host pid 1 (old) and"));
  EXPECT_THAT(result.output, HasSubstr("a worker of an earlier round left under the same "
                                       "TORCHELASTIC_RESTART_COUNT"));
}

// Without torchrun: TORCHELASTIC_USE_AGENT_STORE=True but MASTER_PORT is a ddp store server.
TEST(TorchrunAgentStore, StoreThatIsNotC10dIsANamedError) {
  TcpStoreServer server({.listen_host = "127.0.0.1", .log = [](const std::string&) {}});
  auto worker = Subprocess::start({built_program("init_allreduce_worker")},
                                  {{"RANK", "0"},
                                   {"WORLD_SIZE", "2"},
                                   {"MASTER_ADDR", "127.0.0.1"},
                                   {"MASTER_PORT", std::to_string(server.port())},
                                   {"TORCHELASTIC_USE_AGENT_STORE", "True"},
                                   {"DDP_SECRET", std::nullopt},
                                   {"DDP_SECRET_FILE", std::nullopt},
                                   {"DDP_TIMEOUT", "10"}});
  const auto result = worker.wait(30s);
  ASSERT_FALSE(result.timed_out) << result.output;
  EXPECT_EQ(result.exit_code, 1) << result.output;
  EXPECT_THAT(result.output,
              HasSubstr(fmt::format("the store at 127.0.0.1:{} does not speak the c10d TCPStore "
                                    "protocol",
                                    server.port())));
  EXPECT_THAT(result.output, HasSubstr("TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"));
}

// Nothing listens at MASTER_PORT: a named error within DDP_TIMEOUT, not a hang.
TEST(TorchrunAgentStore, UnreachableStoreIsANamedErrorWithinTheTimeout) {
  const auto port = pick_free_port();
  const auto start = std::chrono::steady_clock::now();
  auto worker = Subprocess::start({built_program("init_allreduce_worker")},
                                  {{"RANK", "1"},
                                   {"WORLD_SIZE", "2"},
                                   {"MASTER_ADDR", "127.0.0.1"},
                                   {"MASTER_PORT", std::to_string(port)},
                                   {"TORCHELASTIC_USE_AGENT_STORE", "True"},
                                   {"DDP_SECRET", std::nullopt},
                                   {"DDP_SECRET_FILE", std::nullopt},
                                   {"DDP_TIMEOUT", "2"}});
  const auto result = worker.wait(30s);
  ASSERT_FALSE(result.timed_out) << result.output;
  EXPECT_EQ(result.exit_code, 1) << result.output;
  EXPECT_THAT(result.output, HasSubstr("could not join through torchrun's store at 127.0.0.1:" +
                                       std::to_string(port)));
  EXPECT_LT(std::chrono::steady_clock::now() - start, 10s);
}

}  // namespace DDP_UNITY_ID
}  // namespace
}  // namespace ddp

#undef SKIP_WITHOUT_TORCHRUN
