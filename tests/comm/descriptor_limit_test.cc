// File descriptors as a limit the ring backend names: a group whose ranks may not open what it
// needs fails at creation, at once, naming `ulimit -n` and the number; a soft limit that is too
// low is raised to the hard one; and a mesh that cannot accept its peers' connections for want
// of descriptors says so within about a second instead of retrying silently until its timeout
// and blaming the peers.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <unistd.h>

#include <chrono>
#include <mutex>
#include <regex>
#include <stdexcept>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "comm/comm_test_util.h"
#include "comm/file_store.h"
#include "comm/ring/mesh_handshake.h"
#include "ddp/comm/comm_error.h"
#include "net/socket.h"
#include "support/multiprocess.h"
#include "support/sanitizers.h"
#include "support/temp_dir.h"
#include "support/unity_namespace.h"

namespace ddp::test {
namespace {
namespace DDP_UNITY_ID {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

// The RLIMIT_NOFILE under which this process can open exactly `free` more descriptors (new
// ones take the lowest free numbers, which must lie below the limit).
rlim_t limit_leaving_free(int free) {
  int fd = 0;
  for (int found = 0;; ++fd) {
    if (::fcntl(fd, F_GETFD) >= 0) continue;
    if (found == free) return static_cast<rlim_t>(fd);  // the first one it cannot have
    ++found;
  }
}

// Sets this process's RLIMIT_NOFILE (soft, and hard unless `hard` is 0).
void set_open_files_limit(rlim_t soft, rlim_t hard) {
  rlimit limit{};
  ::getrlimit(RLIMIT_NOFILE, &limit);
  limit.rlim_cur = soft;
  if (hard != 0) limit.rlim_max = hard;
  if (::setrlimit(RLIMIT_NOFILE, &limit) != 0) throw std::runtime_error("setrlimit failed");
}

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// World 8, every rank limited (soft and hard) to 6 descriptors more than it has open: enough for
// the store's files, far too few for 7 peers. Every rank fails at creation within a second or two
// of a 20 s timeout, naming `ulimit -n` and a number above its limit. (Before, the mesh ran out of
// descriptors, retried accepts silently and the ranks timed out asking whether every rank created
// the group.)
TEST(DescriptorLimit, AGroupThatCannotOpenWhatItNeedsFailsAtOnceNamingUlimit) {
  constexpr int kWorld = 8;
  TempDir dir;
  const auto results = run_ranks(
      kWorld,
      [&](int rank) {
        const rlim_t limit = limit_leaving_free(6);
        set_open_files_limit(limit, limit);
        const auto start = Clock::now();
        try {
          make_group(dir.path(), rank, kWorld, RingOptions{.timeout = 20s});
        } catch (const CommError& e) {
          const std::string what = e.what();
          std::smatch needed;
          if (!std::regex_search(what, needed, std::regex("ulimit -n (\\d+) or more"))) {
            throw std::runtime_error("the error does not name ulimit -n and a number: " + what);
          }
          if (std::stoul(needed[1]) <= limit) {
            throw std::runtime_error(
                fmt::format("the number named is not above the limit of {}: {}", limit, what));
          }
          if (what.find(fmt::format("this process may open {} file descriptors", limit)) ==
              std::string::npos) {
            throw std::runtime_error("the error does not name the limit: " + what);
          }
          if (e.kind() != CommErrorKind::kSetup) {
            throw std::runtime_error("not a set-up error: " + what);
          }
          if (seconds_since(start) > 3) {
            throw std::runtime_error(fmt::format("failed after {:.1f} s of a 20 s timeout: {}",
                                                 seconds_since(start), what));
          }
          return;
        }
        throw std::runtime_error("the group was created with too few descriptors");
      },
      60s);
  EXPECT_ALL_RANKS_OK(results);
}

// The same low soft limit under an ample hard one: creating the group raises the soft limit to the
// hard one, and the group works (every transport's descriptors, shared memory included).
TEST(DescriptorLimit, ASoftLimitTooLowForTheGroupIsRaisedToTheHardOne) {
  constexpr int kWorld = 4;
  TempDir dir;
  const auto results = run_ranks(
      kWorld,
      [&](int rank) {
        rlimit before{};
        ::getrlimit(RLIMIT_NOFILE, &before);
        if (before.rlim_max != RLIM_INFINITY && before.rlim_max < 256) {
          throw std::runtime_error("the hard limit is too low for this test");
        }
        set_open_files_limit(limit_leaving_free(4), 0);
        auto pg = make_group(dir.path(), rank, kWorld, RingOptions{.timeout = 20s});
        std::vector<float> data(1000, static_cast<float>(rank + 1));
        pg->allreduce(data.data(), data.size(), DType::kFloat32, ReduceOp::kSum)->wait();
        if (data[0] != 10.0f) throw std::runtime_error(fmt::format("sum is {}", data[0]));
        rlimit after{};
        ::getrlimit(RLIMIT_NOFILE, &after);
        if (after.rlim_cur != before.rlim_max && after.rlim_cur < 256) {
          throw std::runtime_error(fmt::format("soft limit {} was not raised", after.rlim_cur));
        }
      },
      60s);
  EXPECT_ALL_RANKS_OK(results);
}

// The acceptor of a mesh with rank 1's connection waiting in its listener's queue, and no
// descriptor left to accept it: the wait fails within about a second naming the limit, and the
// log says it once (before, accept_until slept and retried until its deadline, then asked whether
// every rank created the group).
TEST(DescriptorLimit, AnAcceptorOutOfDescriptorsFailsNamingTheLimitNotAtItsDeadline) {
#if DDP_TEST_UNDER_ASAN || DDP_TEST_UNDER_TSAN
  GTEST_SKIP() << "not under a sanitizer: its own checks open a pipe, which a process with no "
                  "free descriptor cannot (false reports)";
#endif
  TempDir dir;
  const auto results = run_ranks(
      2,
      [&](int rank) {
        FileStore store(dir.path(), 20s);
        if (rank == 1) {
          const auto port = static_cast<std::uint16_t>(std::stoi(store.get_string("port")));
          net::Socket socket = net::connect_tcp("127.0.0.1", port, net::deadline_after(10s));
          store.set("connected", "1");
          store.get_string("done");  // the connection stays in rank 0's queue until then
          return;
        }
        net::Socket listener = net::listen_tcp("127.0.0.1", 0);
        store.set("port", std::to_string(listener.local_port()));
        store.get_string("connected");
        std::mutex log_mutex;
        std::vector<std::string> log;
        comm::HandshakeParams params{
            .group = "g", .size = 2, .rank = 0, .log = [&](const std::string& line) {
              std::lock_guard lock(log_mutex);
              log.push_back(line);
            }};
        std::vector<net::Socket> peers(2);
        rlimit saved{};
        ::getrlimit(RLIMIT_NOFILE, &saved);
        set_open_files_limit(limit_leaving_free(0), 0);
        const auto start = Clock::now();
        std::string what;
        try {
          comm::MeshAcceptor(params).accept_until(
              listener, peers, {1}, {.deadline = net::deadline_after(8s), .timeout = 8s});
        } catch (const CommError& e) {
          what = e.what();
        }
        const double took = seconds_since(start);
        ::setrlimit(RLIMIT_NOFILE, &saved);
        store.set("done", "1");
        if (what.empty()) throw std::runtime_error("accepted without a descriptor");
        for (const char* needle : {"cannot accept the connections of ranks 1",
                                   "out of file descriptors (EMFILE", "ulimit -n"}) {
          if (what.find(needle) == std::string::npos) {
            throw std::runtime_error(fmt::format("'{}' is not named: {}", needle, what));
          }
        }
        if (took > 4) {
          throw std::runtime_error(fmt::format("failed after {:.1f} s: {}", took, what));
        }
        std::lock_guard lock(log_mutex);
        if (log.size() != 1 || log[0].find("cannot accept a connection: accept failed: out of "
                                           "file descriptors") == std::string::npos) {
          throw std::runtime_error(fmt::format("the log has {} lines, the first '{}'", log.size(),
                                               log.empty() ? "" : log[0]));
        }
      },
      60s);
  EXPECT_ALL_RANKS_OK(results);
}

}  // namespace DDP_UNITY_ID
}  // namespace
}  // namespace ddp::test
