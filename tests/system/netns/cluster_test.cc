// scripts/cluster.sh, the simulated cluster: hosts that are network namespaces behind a bridge,
// links shaped with tbf. Runs the script itself (up, run, down) as a user would, with a prefix of
// its own (ddpt<pid>) so that it never touches a cluster someone else has up. Needs root and
// `ip netns`; skips with the script's reason otherwise (exit code 77).
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <filesystem>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "support/subprocess.h"
#include "support/temp_dir.h"

namespace ddp::test {
namespace {

using namespace std::chrono_literals;

constexpr int kSkipped = 77;  // cluster.sh's "cannot run here"

std::string cluster_script() {
  return std::string(DDP_SOURCE_DIR) + "/scripts/cluster.sh";
}

// The build tree this test belongs to: cluster.sh takes ddprun from $DDP_BUILD_DIR/bin.
std::string build_dir() {
  return std::filesystem::path(built_program("ddprun")).parent_path().parent_path().string();
}

// A cluster with a prefix of its own; `down` in the destructor, also when an assertion failed.
class Cluster {
 public:
  Cluster() : prefix_(fmt::format("ddpt{}", ::getpid())) {}
  ~Cluster() { script({"down"}, 60s); }
  Cluster(const Cluster&) = delete;
  Cluster& operator=(const Cluster&) = delete;

  ExitStatus script(std::vector<std::string> args, std::chrono::milliseconds timeout) const {
    args.insert(args.begin(), cluster_script());
    return Subprocess::start(args,
                             {{"DDP_CLUSTER_PREFIX", prefix_}, {"DDP_BUILD_DIR", build_dir()}})
        .wait(timeout);
  }

  // Namespaces whose name starts with this cluster's prefix.
  std::vector<std::string> namespaces() const {
    const auto r = Subprocess::start({"ip", "netns", "list"}).wait(10s);
    std::vector<std::string> found;
    std::size_t begin = 0;
    while (begin < r.output.size()) {
      std::size_t end = r.output.find('\n', begin);
      if (end == std::string::npos) end = r.output.size();
      const std::string line = r.output.substr(begin, end - begin);
      if (line.rfind(prefix_ + "-", 0) == 0) found.push_back(line.substr(0, line.find(' ')));
      begin = end + 1;
    }
    return found;
  }

  const std::string& prefix() const { return prefix_; }

 private:
  std::string prefix_;
};

// Brings the cluster up, or says why the test must skip (empty string: it is up).
std::string up(const Cluster& cluster, const std::vector<std::string>& args) {
  std::vector<std::string> all = {"up"};
  all.insert(all.end(), args.begin(), args.end());
  const auto r = cluster.script(all, 60s);
  if (r.exit_code == kSkipped) return r.output;
  EXPECT_EQ(r.exit_code, 0) << r.output;
  return r.exit_code == 0 ? "" : "up failed: " + r.output;
}

// The JSON rows of ddp-bench --json in cluster.sh run's output ("[h0] [0] {...}").
std::vector<nlohmann::json> json_rows(const std::string& output) {
  std::vector<nlohmann::json> rows;
  std::size_t begin = 0;
  while (begin < output.size()) {
    std::size_t end = output.find('\n', begin);
    if (end == std::string::npos) end = output.size();
    const std::string line = output.substr(begin, end - begin);
    if (const auto brace = line.find('{'); brace != std::string::npos) {
      rows.push_back(nlohmann::json::parse(line.substr(brace)));
    }
    begin = end + 1;
  }
  return rows;
}

TEST(ClusterScript, AllreduceAcrossTwoHostsRunsAtTheShapedRate) {
  Cluster cluster;
  if (const auto why = up(cluster, {"--hosts", "2", "--rate", "200mbit"}); !why.empty()) {
    GTEST_SKIP() << why;
  }
  ASSERT_EQ(cluster.namespaces().size(), 3u) << "two hosts and the bridge's namespace";
  const auto r = cluster.script(
      {"run", "--timeout", "60", "--", build_dir() + "/bin/ddp-bench", "--sizes", "8M", "--iters",
       "3", "--warmup", "1", "--check", "--json", "--timeout", "30"},
      90s);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto rows = json_rows(r.output);
  ASSERT_EQ(rows.size(), 1u) << r.output;
  EXPECT_EQ(rows[0]["wrong"], 0) << r.output;
  EXPECT_EQ(rows[0]["world_size"], 2);
  // 200 Mbit/s = 0.025 GB/s each way. Two ranks: busbw = algbw = what each link carried. Below
  // the rate (headers count against it too), and not far below (the shaping, not the CPU, set it).
  const double rate_gbps = 200e6 / 8 / 1e9;
  const double busbw = rows[0]["busbw_gbps"];
  EXPECT_LT(busbw, rate_gbps) << "faster than the shaped link: the shaping is not in the path";
  EXPECT_GT(busbw, 0.5 * rate_gbps) << r.output;
  std::cout << fmt::format("busbw {:.4f} GB/s over a 200mbit link ({:.0f}% of it)\n", busbw,
                           100 * busbw / rate_gbps);

  const auto down = cluster.script({"down"}, 60s);
  EXPECT_EQ(down.exit_code, 0) << down.output;
  EXPECT_TRUE(cluster.namespaces().empty()) << "down left namespaces behind";
}

TEST(ClusterScript, AFailingRunNamesTheHostAndDownLeavesNothingBehind) {
  Cluster cluster;
  if (const auto why = up(cluster, {"--hosts", "2", "--rate", "1gbit"}); !why.empty()) {
    GTEST_SKIP() << why;
  }
  const auto again = cluster.script({"up", "--hosts", "2", "--rate", "1gbit"}, 30s);
  EXPECT_EQ(again.exit_code, 1) << again.output;
  EXPECT_NE(again.output.find("already up"), std::string::npos) << again.output;

  // Host 1's rank fails at once; host 0's would wait for ever: run stops it and fails.
  const auto r = cluster.script({"run", "--timeout", "60", "--", "sh", "-c",
                                 "if [ \"$RANK\" = 1 ]; then exit 3; fi; sleep 60"},
                                90s);
  EXPECT_FALSE(r.timed_out);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find(fmt::format("host 1 ({}-h1) exited with code", cluster.prefix())),
            std::string::npos)
      << r.output;

  const auto down = cluster.script({"down"}, 60s);
  EXPECT_EQ(down.exit_code, 0) << down.output;
  EXPECT_TRUE(cluster.namespaces().empty()) << "down left namespaces behind";
  const auto twice = cluster.script({"down"}, 60s);
  EXPECT_EQ(twice.exit_code, 0) << "down must be safe to repeat: " << twice.output;
  const auto status = cluster.script({"status"}, 30s);
  EXPECT_EQ(status.exit_code, 3) << status.output;
}

TEST(ClusterScript, AnInterruptedRunStopsEveryHost) {
  Cluster cluster;
  if (const auto why = up(cluster, {"--hosts", "2", "--rate", "1gbit"}); !why.empty()) {
    GTEST_SKIP() << why;
  }
  // The hosts' ddpruns run in sessions of their own, out of reach of the caller's signals:
  // the script must stop them itself when it is terminated.
  auto run = Subprocess::start(
      {cluster_script(), "run", "--timeout", "60", "--", "sh", "-c", "echo started; sleep 60"},
      {{"DDP_CLUSTER_PREFIX", cluster.prefix()}, {"DDP_BUILD_DIR", build_dir()}});
  const auto started = std::chrono::steady_clock::now();
  while (run.output_so_far().find("started") == std::string::npos &&
         std::chrono::steady_clock::now() - started < 20s) {
    std::this_thread::sleep_for(50ms);
  }
  ::kill(run.pid(), SIGTERM);  // the script only, as a service manager would
  const auto r = run.wait(30s);
  EXPECT_FALSE(r.timed_out) << r.output;
  EXPECT_EQ(r.exit_code, 143) << r.output;
  EXPECT_NE(r.output.find("interrupted; stopping every host's ddprun"), std::string::npos)
      << r.output;
  for (int host = 0; host < 2; ++host) {
    const auto pids =
        Subprocess::start({"ip", "netns", "pids", fmt::format("{}-h{}", cluster.prefix(), host)})
            .wait(10s);
    EXPECT_EQ(pids.output, "") << "processes left in host " << host;
  }
}

// Waits until `run` has printed `marker` (up to `marker_deadline`), pulls host 1's cable, and
// waits up to 60 s for the run to end; *result gets its exit status, *took the time it took to
// end after the cut. Fatal failure when the marker never comes or the cut fails.
void cut_link_once_seen(const Cluster& cluster, Subprocess& run, const std::string& marker,
                        std::chrono::seconds marker_deadline, ExitStatus* result,
                        std::chrono::steady_clock::duration* took) {
  const auto started = std::chrono::steady_clock::now();
  while (run.output_so_far().find(marker) == std::string::npos &&
         std::chrono::steady_clock::now() - started < marker_deadline) {
    std::this_thread::sleep_for(50ms);
  }
  ASSERT_NE(run.output_so_far().find(marker), std::string::npos) << run.output_so_far();
  const auto cut = cluster.script({"link", "1", "down"}, 30s);
  ASSERT_EQ(cut.exit_code, 0) << cut.output;
  const auto cut_at = std::chrono::steady_clock::now();
  *result = run.wait(60s);
  *took = std::chrono::steady_clock::now() - cut_at;
}

TEST(ClusterScript, ACutLinkFailsTheRunWithANamedTimeoutInsteadOfAHang) {
  Cluster cluster;
  if (const auto why = up(cluster, {"--hosts", "2", "--rate", "1gbit"}); !why.empty()) {
    GTEST_SKIP() << why;
  }
  // 1 KiB first: its row says the group is up and collectives flow; then 64 MiB allreduces (about
  // 0.6 s each at 1gbit) are running when host 1's cable is pulled.
  auto run = Subprocess::start(
      {cluster_script(), "run", "--timeout", "60", "--", build_dir() + "/bin/ddp-bench", "--sizes",
       "1K,64M", "--iters", "50", "--warmup", "0", "--json", "--timeout", "5"},
      {{"DDP_CLUSTER_PREFIX", cluster.prefix()}, {"DDP_BUILD_DIR", build_dir()}});
  ExitStatus r;
  std::chrono::steady_clock::duration took{};
  ASSERT_NO_FATAL_FAILURE(cut_link_once_seen(cluster, run, "\"bytes\":1024", 30s, &r, &took));
  EXPECT_FALSE(r.timed_out) << r.output;
  EXPECT_EQ(r.exit_code, 1) << r.output;
  // Both ranks name the collective, the peer and the deadline (ddp-bench --timeout 5). The cut
  // lands in a 64 MiB allreduce, or in the barrier before the first one when the ranks are still
  // filling their buffers as it comes.
  const bool named = r.output.find("timed out after 5000 ms in allreduce") != std::string::npos ||
                     r.output.find("timed out after 5000 ms in barrier") != std::string::npos;
  EXPECT_TRUE(named) << r.output;
  EXPECT_LT(took, 25s) << "the run took too long to fail after the cut";
  const auto status = cluster.script({"status"}, 30s);
  EXPECT_NE(status.output.find("link DOWN"), std::string::npos) << status.output;
}

// The same fault in the main job with a comm hook: train-fashion-mnist with PowerSGD (two
// allreduces per bucket, the second from the hook's finish step) on two hosts, host 1's cable
// pulled once training runs. Every rank must fail within the collective timeout with a named
// error, and no accuracy may be reported.
TEST(ClusterScript, ACutLinkDuringPowerSgdTrainingFailsWithANamedTimeoutAndNoResult) {
#ifndef DDP_TRAINER_PROGRAM
  GTEST_SKIP() << "this build has no train-fashion-mnist (DDP_BUILD_TORCH=OFF)";
#else
  if (!std::filesystem::exists(std::string(DDP_FMNIST_DIR) + "/train-images-idx3-ubyte.gz")) {
    GTEST_SKIP() << DDP_FMNIST_DIR << " has no Fashion-MNIST files; install Debian's "
                 << "dataset-fashion-mnist to run this test";
  }
  Cluster cluster;
  if (const auto why = up(cluster, {"--hosts", "2", "--rate", "1gbit"}); !why.empty()) {
    GTEST_SKIP() << why;
  }
  // A full epoch (469 steps per rank) takes far longer than the test waits: the cut comes
  // mid-epoch, after rank 0 reported 5 steps (PowerSGD compresses from step 2). The failing
  // ranks' flight-recorder dumps go to a folder of the test's own.
  const TempDir dumps("ddp-cluster-cut");
  auto run = Subprocess::start(
      {cluster_script(), "run", "--timeout", "90", "--", build_dir() + "/bin/train-fashion-mnist",
       "--comm-hook", "powersgd", "--powersgd-rank", "2", "--powersgd-start-iter", "2", "--epochs",
       "1", "--log-every", "5"},
      {{"DDP_CLUSTER_PREFIX", cluster.prefix()},
       {"DDP_BUILD_DIR", build_dir()},
       {"DDP_TIMEOUT", "5"},
       {"DDP_DUMP_DIR", dumps.path().string()},
       {"OMP_NUM_THREADS", "1"}});
  ExitStatus r;
  std::chrono::steady_clock::duration took{};
  ASSERT_NO_FATAL_FAILURE(cut_link_once_seen(cluster, run, "epoch 1 [", 60s, &r, &took));
  EXPECT_FALSE(r.timed_out) << r.output;
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_LT(took, 25s) << "the run took too long to fail after the cut";
  // Every host exits non-zero. The first rank to fail names the collective, the timeout
  // (DDP_TIMEOUT=5) and the peer; cluster.sh run then stops the other hosts (as ddprun stops its
  // workers), so a later rank may be stopped before its own timeout: every error printed must
  // name the timeout, and at least one must be printed.
  for (int host = 0; host < 2; ++host) {
    const auto exited =
        fmt::format("host {} ({}-h{}) exited with code ", host, cluster.prefix(), host);
    EXPECT_NE(r.output.find(exited), std::string::npos) << r.output;
    EXPECT_EQ(r.output.find(exited + "0\n"), std::string::npos) << r.output;
  }
  int errors = 0;
  std::istringstream lines(r.output);
  for (std::string line; std::getline(lines, line);) {
    if (line.find("train-fashion-mnist: error: ") == std::string::npos) continue;
    ++errors;
    // In a gradient bucket's allreduce, or in the divergence guard's allgather between forward
    // and backward, whichever collective the cut link catches first.
    const bool named =
        line.find("timed out after 5000 ms in allreduce") != std::string::npos ||
        line.find("timed out after 5000 ms in allgather(int32 x 1 per rank)") != std::string::npos;
    EXPECT_TRUE(named) << line;
    EXPECT_NE(line.find("waiting for data from rank"), std::string::npos) << line;
  }
  EXPECT_GE(errors, 1) << r.output;
  EXPECT_EQ(r.output.find("final test_accuracy"), std::string::npos)
      << "an accuracy was reported after the link was cut:\n"
      << r.output;
#endif
}

TEST(ClusterScript, DelayNeedsNetemAndIsRefusedWithTheReasonWithoutIt) {
  Cluster cluster;
  const auto r = cluster.script({"up", "--hosts", "2", "--rate", "1gbit", "--delay", "1ms"}, 60s);
  if (r.exit_code == 0) {
    // This kernel has netem: the delay is on every host's egress.
    const auto status = cluster.script({"status"}, 30s);
    EXPECT_NE(status.output.find("netem"), std::string::npos) << status.output;
    return;
  }
  if (::geteuid() != 0) GTEST_SKIP() << r.output;
  EXPECT_EQ(r.exit_code, kSkipped) << r.output;
  EXPECT_NE(r.output.find("--delay needs the kernel's netem"), std::string::npos) << r.output;
  EXPECT_TRUE(cluster.namespaces().empty()) << "a refused up must remove what it created";
}

TEST(ClusterScript, WithoutRootItSaysSoAndExitsWithTheSkipCode) {
  if (::geteuid() != 0) {
    // Already unprivileged: the script's own answer is what is tested.
    const auto r = Cluster().script({"up", "--hosts", "2", "--rate", "1gbit"}, 30s);
    EXPECT_EQ(r.exit_code, kSkipped) << r.output;
    EXPECT_NE(r.output.find("needs root"), std::string::npos) << r.output;
    return;
  }
  // As root: run it as the user nobody.
  const auto r =
      Subprocess::start({"setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "bash",
                         cluster_script(), "up", "--hosts", "2", "--rate", "1gbit"},
                        {{"DDP_CLUSTER_PREFIX", "ddptnobody"}})
          .wait(30s);
  if (r.exit_code == 127 || r.output.find("setpriv:") != std::string::npos) {
    GTEST_SKIP() << "cannot drop privileges with setpriv: " << r.output;
  }
  EXPECT_EQ(r.exit_code, kSkipped) << r.output;
  EXPECT_NE(r.output.find("needs root"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace ddp::test
