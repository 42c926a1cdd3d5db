// TcpStoreLimits under abuse, with real sockets on 127.0.0.1 and short limits so each test takes
// a second or two: idle, slow and half-sent connections are closed at their deadline with a
// logged reason; frames the memory limit cannot hold are refused from their header without the
// server's memory growing; the connection limit keeps room for real clients; the store cannot
// starve its host process of file descriptors. Throughout, legitimate clients keep working.
#include <sys/resource.h>
#include <unistd.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fcntl.h>

#include <chrono>
#include <fstream>
#include <future>
#include <mutex>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "ddp/error.h"
#include "ddp/store/tcp_store.h"
#include "net/socket.h"
#include "raw_client.h"
#include "store/fd_limit.h"
#include "store/protocol.h"
#include "support/multiprocess.h"
#include "support/unity_namespace.h"

namespace ddp::store {
namespace {
namespace DDP_UNITY_ID {

using namespace std::chrono_literals;
using test::Frame;
using test::op;
using testing::HasSubstr;

constexpr Milliseconds kTestTimeout{10'000};
constexpr Milliseconds kShort{500};  // handshake and frame deadlines in these tests

// Resident memory of this process (the server runs in it), from /proc/self/status.
std::size_t rss_bytes() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stoull(line.substr(6)) * 1024;
  }
  return 0;
}

class LimitsTest : public testing::Test {
 protected:
  void start(TcpStoreLimits limits) {
    server_ = std::make_unique<TcpStoreServer>(
        TcpStoreServerOptions{.listen_host = "127.0.0.1",
                              .log =
                                  [this](const std::string& line) {
                                    std::lock_guard lock(log_mutex_);
                                    log_.push_back(line);
                                  },
                              .limits = limits});
    healthy_ = client();
    healthy_->set("before", "1");
  }

  std::unique_ptr<TcpStore> client() {
    return std::make_unique<TcpStore>(
        "127.0.0.1", server_->port(),
        TcpStoreOptions{.timeout = kTestTimeout, .connect_timeout = kTestTimeout});
  }

  net::Socket connect() {
    return net::connect_tcp("127.0.0.1", server_->port(), net::deadline_after(kTestTimeout));
  }

  std::size_t log_lines_with(const std::string& text) {
    std::lock_guard lock(log_mutex_);
    return std::ranges::count_if(
        log_, [&](const std::string& line) { return line.find(text) != std::string::npos; });
  }

  std::string log_line_with(const std::string& text) {
    std::string found;
    test::wait_until(
        [&] {
          std::lock_guard lock(log_mutex_);
          for (const auto& line : log_) {
            if (line.find(text) != std::string::npos) {
              found = line;
              return true;
            }
          }
          return false;
        },
        kTestTimeout);
    return found;
  }

  // The client connected before the abuse still works, and so does a new one.
  void expect_healthy() {
    EXPECT_EQ(healthy_->get_string("before"), "1");
    auto fresh = client();
    fresh->add("after", 1);
    EXPECT_EQ(fresh->get_string("before"), "1");
  }

  std::mutex log_mutex_;
  std::vector<std::string> log_;
  std::unique_ptr<TcpStoreServer> server_;
  std::unique_ptr<TcpStore> healthy_;
};

TEST_F(LimitsTest, AnIdleConnectionIsClosedAtTheHandshakeDeadline) {
  start({.handshake_timeout = kShort});
  net::Socket idle = connect();
  const auto begin = net::Clock::now();
  EXPECT_TRUE(test::closed_by_server(idle, kTestTimeout));
  EXPECT_GE(net::Clock::now() - begin, kShort - 50ms);
  EXPECT_THAT(log_line_with("handshake not completed"),
              HasSubstr("within 500 ms of connecting (0 bytes received"));
  expect_healthy();
}

TEST_F(LimitsTest, ATricklingHandshakeIsClosedAtItsDeadline) {
  start({.handshake_timeout = kShort});
  net::Socket slow = connect();
  const Frame hello = test::hello();
  const auto begin = net::Clock::now();
  // One byte every 150 ms: the hello would take 1.2 s.
  for (std::size_t i = 0; i < hello.size() && net::Clock::now() - begin < 2s; ++i) {
    try {
      slow.send_all(&hello[i], 1, net::deadline_after(kTestTimeout));
    } catch (const Error&) {
      break;  // closed by the server
    }
    std::this_thread::sleep_for(150ms);
  }
  EXPECT_TRUE(test::closed_by_server(slow, kTestTimeout));
  EXPECT_THAT(log_line_with("handshake not completed"), HasSubstr("handshake_timeout"));
  expect_healthy();
}

TEST_F(LimitsTest, ASlowLorisFrameIsClosedAtTheFrameDeadlineThoughBytesKeepComing) {
  start({.frame_timeout = kShort});
  net::Socket slow = test::greeted(server_->port(), kTestTimeout);
  const Frame set = FrameWriter(op(Opcode::kSet)).bytes("k").bytes(std::string(40, 'x')).finish();
  const auto begin = net::Clock::now();
  bool closed_while_sending = false;
  for (std::size_t i = 0; i < set.size() && net::Clock::now() - begin < 3s; ++i) {
    try {
      slow.send_all(&set[i], 1, net::deadline_after(kTestTimeout));
    } catch (const Error&) {
      closed_while_sending = true;
      break;
    }
    std::this_thread::sleep_for(50ms);
  }
  EXPECT_TRUE(closed_while_sending || test::closed_by_server(slow, kTestTimeout));
  EXPECT_LT(net::Clock::now() - begin, 2500ms) << "the 1-byte-per-50-ms sender was not cut off";
  EXPECT_THAT(log_line_with("frame not completed"), HasSubstr("within 500 ms of its first byte"));
  EXPECT_FALSE(healthy_->check(std::vector<std::string>{"k"}));
  expect_healthy();
}

TEST_F(LimitsTest, AHalfSentFrameIsClosedAtTheFrameDeadline) {
  start({.frame_timeout = kShort});
  net::Socket half = test::greeted(server_->port(), kTestTimeout);
  Frame set = FrameWriter(op(Opcode::kSet)).bytes("k").bytes(std::string(1 << 20, 'x')).finish();
  set.resize(set.size() / 2);
  test::send_bytes(half, set, kTestTimeout);
  EXPECT_TRUE(test::closed_by_server(half, kTestTimeout));
  EXPECT_THAT(log_line_with("frame not completed"), HasSubstr("bytes received"));
  expect_healthy();
}

TEST_F(LimitsTest, ParkedAndIdleClientsPastTheHandshakeAreNeverCut) {
  start({.handshake_timeout = kShort, .frame_timeout = kShort});
  auto waiter = client();
  auto idle = client();
  auto got = std::async(std::launch::async, [&] { return waiter->get_string("late", 5s); });
  std::this_thread::sleep_for(4 * kShort);  // parked (and idle) for 4 deadlines
  healthy_->set("late", "worth the wait");
  EXPECT_EQ(got.get(), "worth the wait");
  EXPECT_EQ(idle->get_string("late"), "worth the wait");
  EXPECT_EQ(server_->num_dropped_connections(), 0u);
}

TEST_F(LimitsTest, AClientThatDoesNotReadItsReplyIsClosedAtTheFrameDeadline) {
  start({.frame_timeout = kShort});
  healthy_->set("big", std::string(16 << 20, 'b'));  // more than the socket buffers take
  net::Socket deaf = test::greeted(server_->port(), kTestTimeout);
  test::send_bytes(deaf, FrameWriter(op(Opcode::kGet)).bytes("big").finish(), kTestTimeout);
  std::this_thread::sleep_for(2 * kShort);  // never reads
  EXPECT_THAT(log_line_with("did not take its"), HasSubstr("frame_timeout"));
  expect_healthy();
}

// Eight connections each announce a 100 MiB set and send half of it; the store's memory limit
// (64 MiB here) cannot hold one, so each is refused from its header: the bytes are read and
// dropped, the server's memory does not grow by the frames, and the deadline closes them.
TEST_F(LimitsTest, HalfSentHundredMiBFramesAreRefusedFromTheHeaderAndCostNoMemory) {
  start({.frame_timeout = 3s, .max_memory_bytes = 64 << 20});
  constexpr std::uint32_t kDeclared = 100u << 20;
  constexpr std::size_t kSent = 50u << 20;
  const std::size_t rss_before = rss_bytes();
  std::vector<net::Socket> attackers;
  Frame chunk(1 << 20, 0x5a);
  for (int i = 0; i < 8; ++i) {
    attackers.push_back(test::greeted(server_->port(), kTestTimeout));
    Frame header(5);
    put_u32(header.data(), kDeclared);
    header[4] = op(Opcode::kSet);
    test::send_bytes(attackers.back(), header, kTestTimeout);
    for (std::size_t sent = 5; sent < kSent; sent += chunk.size()) {
      test::send_bytes(attackers.back(), chunk, kTestTimeout);
    }
  }
  const std::size_t rss_during = rss_bytes();
  EXPECT_LT(server_->memory_bytes(), std::size_t{1} << 20);
  EXPECT_LT(rss_during, rss_before + (32u << 20))
      << "8 half-sent frames of 100 MiB grew the server by " << (rss_during - rss_before)
      << " bytes";
  std::fprintf(stderr, "RSS before %zu MiB, with 8 half-sent 100 MiB frames %zu MiB\n",
               rss_before >> 20, rss_during >> 20);
  EXPECT_THAT(log_line_with("refusing a frame"), HasSubstr("max_memory_bytes"));
  for (auto& attacker : attackers)
    EXPECT_TRUE(test::closed_by_server(attacker, kTestTimeout));
  expect_healthy();
}

TEST_F(LimitsTest, SetsOverTheMemoryLimitGetAnErrorNamingItAndTheClientStaysUsable) {
  start({.max_memory_bytes = 24 << 20});
  auto writer = client();
  // Too large to buffer at all: refused from its header, discarded unread.
  try {
    writer->set("huge", std::string(32 << 20, 'h'));
    ADD_FAILURE() << "a 32 MiB set under a 24 MiB limit was accepted";
  } catch (const StoreError& e) {
    EXPECT_THAT(e.what(), HasSubstr("max_memory_bytes"));
    EXPECT_THAT(e.what(), HasSubstr("discarded unread"));
  }
  // Small enough to buffer, too large to keep next to its frame.
  try {
    writer->set("large", std::string(16 << 20, 'l'));
    ADD_FAILURE() << "a 16 MiB set under a 24 MiB limit was accepted";
  } catch (const StoreError& e) {
    EXPECT_THAT(e.what(), HasSubstr("over its limit of 25165824 bytes"));
  }
  writer->set("small", "fits");
  EXPECT_EQ(healthy_->get_string("small"), "fits");
  EXPECT_FALSE(healthy_->check(std::vector<std::string>{"huge"}));
  EXPECT_LE(server_->memory_bytes(), std::size_t{24} << 20);
}

TEST_F(LimitsTest, AtTheConnectionLimitHalfOpenConnectionsMakeRoomAndTheRestAreRefused) {
  start({.max_connections = 8});
  EXPECT_EQ(server_->max_connections(), 8u);
  std::vector<net::Socket> idle;
  for (int i = 0; i < 20; ++i)
    idle.push_back(connect());  // never say hello
  ASSERT_TRUE(test::wait_until([&] { return server_->num_connections() == 8; }, kTestTimeout));
  auto real = client();  // makes room by closing the oldest half-open connection
  real->set("real", "1");
  EXPECT_THAT(log_line_with("had not completed the handshake"), HasSubstr("max_connections"));

  // Now fill every slot with clients past their handshake: newcomers are refused at once.
  idle.clear();
  ASSERT_TRUE(test::wait_until([&] { return server_->num_connections() == 2; }, kTestTimeout));
  std::vector<net::Socket> greeted;
  for (int i = 0; i < 6; ++i)
    greeted.push_back(test::greeted(server_->port(), kTestTimeout));
  ASSERT_TRUE(test::wait_until([&] { return server_->num_connections() == 8; }, kTestTimeout));
  for (int i = 0; i < 20; ++i) {
    net::Socket refused = connect();
    EXPECT_TRUE(test::closed_by_server(refused, 2s));
  }
  EXPECT_THAT(log_line_with("refusing connection"), HasSubstr("TcpStoreLimits::max_connections"));
  EXPECT_LE(log_lines_with("refusing connection"), 3u) << "the refusals were not rate-limited";
  EXPECT_EQ(healthy_->get_string("real"), "1");
}

TEST(TcpStoreLimitsCheck, LimitsThatWouldRefuseEveryClientAreAConfigError) {
  EXPECT_THROW(TcpStoreServer({.listen_host = "127.0.0.1", .limits = {.frame_timeout = 0ms}}),
               ConfigError);
  EXPECT_THROW(TcpStoreServer({.listen_host = "127.0.0.1", .limits = {.max_memory_bytes = 1000}}),
               ConfigError);
}

TEST(FdLimit, TheAutomaticConnectionLimitLeavesHalfTheDescriptorsToTheProcess) {
  EXPECT_EQ(automatic_max_connections(1024), 512u);
  EXPECT_EQ(automatic_max_connections(1u << 20), kMaxAutomaticConnections);
  EXPECT_EQ(automatic_max_connections(1), 1u);
}

// The host (rank 0) runs with the common 1,024-descriptor limit; another process opens 1,100
// connections to its store and holds them. The store caps itself at 512 connections, a real
// client is served at once, and the host can still open files.
TEST(StoreFdExhaustion, ElevenHundredIdleConnectionsDoNotStarveTheHostOrItsClients) {
  const int port = ddp::test::free_port();
  const auto results = ddp::test::run_ranks(
      2,
      [&](int rank) {
        const auto deadline = 30s;
        if (rank == 0) {
          const rlimit low{1024, 1024};
          if (::setrlimit(RLIMIT_NOFILE, &low) != 0) throw Error("setrlimit failed");
          TcpStoreServer server({.listen_host = "127.0.0.1",
                                 .port = static_cast<std::uint16_t>(port),
                                 .log = [](const std::string&) {}});
          if (server.max_connections() != 512) {
            throw Error(fmt::format("max_connections {} instead of 512", server.max_connections()));
          }
          TcpStore coordinator("127.0.0.1", server.port(),
                               {.timeout = deadline, .connect_timeout = deadline});
          coordinator.get_string("flood/ready");
          const auto begin = net::Clock::now();
          TcpStore legit("127.0.0.1", server.port(),
                         {.timeout = deadline, .connect_timeout = deadline});
          legit.set("legit", "1");
          const auto value = legit.get_string("legit");
          const auto served = std::chrono::duration<double, std::milli>(net::Clock::now() - begin);
          std::vector<int> files;
          for (int i = 0; i < 200; ++i) {
            const int fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
            if (fd < 0)
              throw Error(fmt::format("the host could not open file {}: errno {}", i, errno));
            files.push_back(fd);
          }
          for (int fd : files)
            ::close(fd);
          std::fprintf(stderr,
                       "with 1,100 idle connections: %zu held by the store (limit %zu), a new "
                       "client served in %.1f ms, the host opened 200 files\n",
                       server.num_connections(), server.max_connections(), served.count());
          coordinator.set("flood/done", "1");
          if (value != "1") throw Error("wrong value");
        } else {
          std::vector<net::Socket> flood;
          for (int i = 0; i < 1100; ++i) {
            flood.push_back(net::connect_tcp("127.0.0.1", static_cast<std::uint16_t>(port),
                                             net::deadline_after(deadline)));
          }
          TcpStore coordinator("127.0.0.1", static_cast<std::uint16_t>(port),
                               {.timeout = deadline, .connect_timeout = deadline});
          coordinator.set("flood/ready", "1");
          coordinator.get_string("flood/done");
        }
      },
      60s);
  EXPECT_ALL_RANKS_OK(results);
}

}  // namespace DDP_UNITY_ID
}  // namespace
}  // namespace ddp::store
