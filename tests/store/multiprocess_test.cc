// TcpStore across real processes (fork): rank 0 hosts the server, every rank is a client.
#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <fmt/format.h>

#include <algorithm>
#include <mutex>
#include <thread>

#include "ddp/error.h"
#include "ddp/store/prefix_store.h"
#include "ddp/store/tcp_store.h"
#include "net/socket.h"
#include "support/multiprocess.h"
#include "support/sanitizers.h"

namespace ddp {
namespace {

using namespace std::chrono_literals;

constexpr Milliseconds kRankTimeout{20'000};

TcpStoreOptions rank_options(int rank, int world_size) {
  return {.is_server = rank == 0,
          .timeout = kRankTimeout,
          .connect_timeout = kRankTimeout,
          .num_workers = world_size,
          .listen_host = "127.0.0.1"};
}

void require(bool condition, const std::string& what) {
  if (!condition) throw std::runtime_error(what);
}

TEST(TcpStoreProcesses, AddAndCompareSetFromEightProcesses) {
  constexpr int kWorld = 8;
  constexpr int kAddsEach = 100;
  const auto port = static_cast<std::uint16_t>(test::free_port());
  const auto results = test::run_ranks(kWorld, [&](int rank) {
    TcpStore store("127.0.0.1", port, rank_options(rank, kWorld));
    for (int i = 0; i < kAddsEach; ++i)
      store.add("total", 1);
    const std::string mine = fmt::format("rank-{}", rank);
    const bool won = store.compare_set("leader", "", mine) == mine;
    store.add("winners", won ? 1 : 0);
    store.set(fmt::format("done/{}", rank), "1");
    if (rank != 0) return;
    // Rank 0 keeps the server up until every rank is done, then checks the totals.
    std::vector<std::string> done;
    for (int r = 0; r < kWorld; ++r)
      done.push_back(fmt::format("done/{}", r));
    store.wait(done);
    const auto total = store.add("total", 0);
    require(total == kWorld * kAddsEach, fmt::format("total {} != {}", total, kWorld * kAddsEach));
    const auto winners = store.add("winners", 0);
    require(winners == 1, fmt::format("{} compare_set winners, expected exactly 1", winners));
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(TcpStoreProcesses, PrefixStoresOfTwoGroupsDoNotMeet) {
  const auto port = static_cast<std::uint16_t>(test::free_port());
  const auto results = test::run_ranks(4, [&](int rank) {
    auto base = std::make_shared<TcpStore>("127.0.0.1", port, rank_options(rank, 4));
    PrefixStore group(fmt::format("group{}", rank % 2), base);
    if (rank < 2) group.set("root", fmt::format("from-{}", rank));
    const std::string root = group.get_string("root");
    require(root == fmt::format("from-{}", rank % 2),
            "rank " + std::to_string(rank) + " saw " + root);
    if (base->add("finished", 1) == 4) base->set("all_finished", "1");
    // Rank 0 hosts the server: it must outlive every other rank's use of it.
    if (rank == 0) base->wait(std::vector<std::string>{"all_finished"});
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(TcpStoreProcesses, ServerProcessKilledGivesClientsAStoreError) {
  const auto port = static_cast<std::uint16_t>(test::free_port());
  const auto results = test::run_ranks(2, [&](int rank) {
    if (rank == 0) {
      // The server does not wait for the workers: a wait of its own would be a parked request
      // too, still counted for an instant after it is answered, and the kill could then land
      // before rank 1 is in its get.
      TcpStoreOptions options = rank_options(0, 2);
      options.wait_for_workers = false;
      TcpStore store("127.0.0.1", port, options);
      // Die abruptly once rank 1 is parked in its get (the only request that ever parks).
      const auto deadline = std::chrono::steady_clock::now() + kRankTimeout;
      while (store.server()->num_parked_requests() == 0) {
        require(std::chrono::steady_clock::now() < deadline, "rank 1 never parked");
        std::this_thread::sleep_for(1ms);  // polling a condition, with a deadline
      }
      ::raise(SIGKILL);
    }
    TcpStore store("127.0.0.1", port, rank_options(1, 2));
    const auto start = std::chrono::steady_clock::now();
    try {
      store.get("never", kRankTimeout);
    } catch (const StoreError& e) {
      require(std::string(e.what()).find("lost") != std::string::npos, e.what());
      require(std::chrono::steady_clock::now() - start < 5s, "StoreError came late");
      return;
    }
    throw std::runtime_error("get returned although the server was killed");
  });
  ASSERT_EQ(results.size(), 2u);
  EXPECT_EQ(results[0].signal, SIGKILL) << test::describe(results);
  EXPECT_TRUE(results[1].ok()) << test::describe(results);
}

// Rank 0 runs the server with a file descriptor limit that rank 1's connections exhaust. Not
// under a sanitizer (it runs in the main stage): their own checks open a pipe, which a process
// with no free descriptor cannot, and report falsely (UBSan: "invalid vptr" at the virtual calls
// of the exception that names EMFILE; tests/net/socket_test.cc skips its like).
TEST(TcpStoreProcesses, ServerOutOfFileDescriptorsKeepsServingAndRecovers) {
#if DDP_TEST_UNDER_ASAN || DDP_TEST_UNDER_TSAN
  GTEST_SKIP() << "not under a sanitizer: its own checks open a pipe, which a process with no "
                  "free descriptor cannot (false reports)";
#endif
  const auto port = static_cast<std::uint16_t>(test::free_port());
  const auto results = test::run_ranks(2, [&](int rank) {
    const TcpStoreOptions options{.timeout = 10s, .connect_timeout = 10s};
    if (rank == 0) {
      std::mutex log_mutex;
      std::vector<std::string> log;
      TcpStoreServer server(
          {.listen_host = "127.0.0.1", .port = port, .log = [&](const std::string& line) {
             std::lock_guard lock(log_mutex);
             log.push_back(line);
           }});
      TcpStore store("127.0.0.1", port, options);
      store.wait(std::vector<std::string>{"rank1/connected"});
      // Room for two more connections, then accept() fails with EMFILE.
      const int lowest_free = ::dup(0);
      ::close(lowest_free);
      rlimit limit{};
      ::getrlimit(RLIMIT_NOFILE, &limit);
      limit.rlim_cur = static_cast<rlim_t>(lowest_free + 2);
      require(::setrlimit(RLIMIT_NOFILE, &limit) == 0, "setrlimit failed");
      store.set("rank0/limit_lowered", "1");
      const auto deadline = std::chrono::steady_clock::now() + 10s;
      for (;;) {
        {
          std::lock_guard lock(log_mutex);
          if (std::ranges::any_of(
                  log, [](const auto& line) { return line.find("accept failed") != line.npos; })) {
            break;
          }
        }
        require(std::chrono::steady_clock::now() < deadline, "accept never failed");
        std::this_thread::sleep_for(1ms);  // polling a condition, with a deadline
      }
      store.set("rank0/saw_emfile", "1");
      store.wait(std::vector<std::string>{"rank1/done"});
      return;
    }
    TcpStore store("127.0.0.1", port, options);
    store.set("rank1/connected", "1");
    store.wait(std::vector<std::string>{"rank0/limit_lowered"});
    std::vector<net::Socket> raw;
    for (int i = 0; i < 6; ++i) {
      raw.push_back(net::connect_tcp("127.0.0.1", port, net::deadline_after(10s)));
    }
    store.wait(std::vector<std::string>{"rank0/saw_emfile"});
    // The server still serves the connection it has...
    store.set("still", "served");
    require(store.get_string("still") == "served", "existing client not served");
    // ...and accepts again once connections close.
    raw.clear();
    TcpStore later("127.0.0.1", port, options);
    require(later.get_string("still") == "served", "new client not served after recovery");
    store.set("rank1/done", "1");
  });
  EXPECT_ALL_RANKS_OK(results);
}

}  // namespace
}  // namespace ddp
