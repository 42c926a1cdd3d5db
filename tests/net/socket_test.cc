#include "net/socket.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <stdexcept>
#include <thread>

#include "ddp/error.h"
#include "support/multiprocess.h"
#include "support/sanitizers.h"
#include "support/unity_namespace.h"

namespace ddp::net {
namespace {
namespace DDP_UNITY_ID {

using namespace std::chrono_literals;

TEST(Socket, RoundTripOverLoopback) {
  Socket listener = listen_tcp("127.0.0.1", 0);
  const auto port = listener.local_port();
  std::thread server([&] {
    Socket conn = accept_tcp(listener, deadline_after(5s));
    char buf[5];
    conn.recv_all(buf, sizeof buf, deadline_after(5s));
    conn.send_all(buf, sizeof buf, deadline_after(5s));
  });
  Socket client = connect_tcp("127.0.0.1", port, deadline_after(5s));
  client.send_all("hello", 5, deadline_after(5s));
  char echo[5];
  client.recv_all(echo, sizeof echo, deadline_after(5s));
  server.join();
  EXPECT_EQ(std::string(echo, 5), "hello");
}

TEST(Socket, ConnectToClosedPortTimesOutWithAddressInMessage) {
  const auto port = pick_free_port();
  const auto start = Clock::now();
  try {
    connect_tcp("127.0.0.1", port, deadline_after(300ms));
    FAIL() << "connect should have failed";
  } catch (const TimeoutError& e) {
    EXPECT_NE(std::string(e.what()).find("127.0.0.1:" + std::to_string(port)), std::string::npos)
        << e.what();
  }
  EXPECT_LT(Clock::now() - start, 3s);
}

TEST(Socket, ListenOnBusyPortNamesThePort) {
  Socket first = listen_tcp("127.0.0.1", 0);
  const auto port = first.local_port();
  try {
    listen_tcp("127.0.0.1", port);
    FAIL() << "second listen should have failed";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("already in use"), std::string::npos) << e.what();
  }
}

TEST(Socket, RecvTimesOutWhenPeerIsSilent) {
  Socket listener = listen_tcp("127.0.0.1", 0);
  Socket client = connect_tcp("127.0.0.1", listener.local_port(), deadline_after(5s));
  Socket conn = accept_tcp(listener, deadline_after(5s));
  char byte;
  EXPECT_THROW(client.recv_all(&byte, 1, deadline_after(100ms)), TimeoutError);
}

TEST(Socket, RecvReportsClosedPeer) {
  Socket listener = listen_tcp("127.0.0.1", 0);
  Socket client = connect_tcp("127.0.0.1", listener.local_port(), deadline_after(5s));
  { Socket conn = accept_tcp(listener, deadline_after(5s)); }
  char byte;
  EXPECT_THROW(client.recv_all(&byte, 1, deadline_after(5s)), Error);
}

TEST(Socket, WaitReadableTimesOutThenSeesDataAndEndOfStream) {
  Socket listener = listen_tcp("127.0.0.1", 0);
  Socket client = connect_tcp("127.0.0.1", listener.local_port(), deadline_after(5s));
  Socket conn = accept_tcp(listener, deadline_after(5s));
  const auto start = Clock::now();
  EXPECT_FALSE(client.wait_readable(deadline_after(50ms)));
  EXPECT_GE(Clock::now() - start, 50ms);
  conn.send_all("x", 1, deadline_after(5s));
  EXPECT_TRUE(client.wait_readable(deadline_after(5s)));
  char byte;
  client.recv_all(&byte, 1, deadline_after(5s));
  EXPECT_FALSE(client.wait_readable(deadline_after(10ms)));  // read: nothing left
  conn.close();
  EXPECT_TRUE(client.wait_readable(deadline_after(5s)));
}

TEST(Socket, ConnectedToItselfOnlyWhenBothEndsAreOneAddress) {
  Socket listener = listen_tcp("127.0.0.1", 0);
  Socket client = connect_tcp("127.0.0.1", listener.local_port(), deadline_after(5s));
  Socket conn = accept_tcp(listener, deadline_after(5s));
  EXPECT_FALSE(client.connected_to_itself());
  EXPECT_FALSE(conn.connected_to_itself());
  EXPECT_FALSE(listener.connected_to_itself());  // no peer address

  // TCP's simultaneous open: a socket bound to a port and connected to that same port.
  Socket self(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  ASSERT_TRUE(self.valid());
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::bind(self.fd(), reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  addr.sin_port = htons(self.local_port());
  ASSERT_EQ(::connect(self.fd(), reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  EXPECT_TRUE(self.connected_to_itself());
}

TEST(Socket, UnresolvableHostIsAConfigError) {
  EXPECT_THROW(connect_tcp("no-such-host.invalid", 1, deadline_after(1s)), ConfigError);
}

TEST(Socket, LoopbackNamesAreRecognised) {
  EXPECT_TRUE(net::resolves_only_to_loopback("127.0.0.1"));
  EXPECT_TRUE(net::resolves_only_to_loopback("127.0.1.1"));
  EXPECT_TRUE(net::resolves_only_to_loopback("::1"));
  EXPECT_TRUE(net::resolves_only_to_loopback("localhost"));
  EXPECT_FALSE(net::resolves_only_to_loopback("10.1.2.3"));
  EXPECT_FALSE(net::resolves_only_to_loopback("0.0.0.0"));
  EXPECT_THROW(net::resolves_only_to_loopback("no-such-host.invalid"), ConfigError);
}

// RLIMIT_NOFILE at the lowest free descriptor, so that the next one cannot be made (in a child
// process of run_ranks: the limit is its own).
void use_up_descriptors() {
  const int lowest_free = ::dup(0);
  ::close(lowest_free);
  rlimit limit{};
  ::getrlimit(RLIMIT_NOFILE, &limit);
  limit.rlim_cur = static_cast<rlim_t>(lowest_free);
  if (::setrlimit(RLIMIT_NOFILE, &limit) != 0) throw std::runtime_error("setrlimit failed");
}

void expect_names_the_limit(const std::string& what, const char* call) {
  for (const char* needle : {"out of file descriptors (EMFILE", "ulimit -n", call}) {
    if (what.find(needle) == std::string::npos) {
      throw std::runtime_error(std::string("'") + needle + "' is not named: " + what);
    }
  }
}

// The tests that use up this process's descriptors: a sanitizer's own checks open a pipe, which a
// process with no free descriptor cannot, and report falsely.
#if DDP_TEST_UNDER_ASAN || DDP_TEST_UNDER_TSAN
#define SKIP_UNDER_SANITIZERS()                                                                 \
  GTEST_SKIP() << "not under a sanitizer: its own checks open a pipe, which a process with no " \
                  "free descriptor cannot (false reports)"
#else
#define SKIP_UNDER_SANITIZERS() static_cast<void>(0)
#endif

// A socket that cannot be made for want of descriptors is named at once: no retry until the
// deadline frees one (before, connect_tcp retried for the whole deadline and then blamed the
// master's address).
TEST(Socket, ConnectOutOfDescriptorsFailsAtOnceNamingTheLimit) {
  SKIP_UNDER_SANITIZERS();
  const auto results = test::run_ranks(
      1,
      [](int) {
        Socket listener = listen_tcp("127.0.0.1", 0);
        use_up_descriptors();
        const auto start = Clock::now();
        try {
          connect_tcp("127.0.0.1", listener.local_port(), deadline_after(5s));
        } catch (const Error& e) {
          expect_names_the_limit(e.what(), "cannot connect to 127.0.0.1");
          if (Clock::now() - start > 1s) throw std::runtime_error("named only after retrying");
          return;
        }
        throw std::runtime_error("connected without a descriptor");
      },
      30s);
  EXPECT_ALL_RANKS_OK(results);
}

// A connection that waits while this process has no descriptor to accept it.
TEST(Socket, AcceptOutOfDescriptorsNamesTheLimit) {
  SKIP_UNDER_SANITIZERS();
  const auto results = test::run_ranks(
      1,
      [](int) {
        Socket listener = listen_tcp("127.0.0.1", 0);
        Socket client = connect_tcp("127.0.0.1", listener.local_port(), deadline_after(5s));
        use_up_descriptors();
        try {
          accept_tcp(listener, deadline_after(5s));
        } catch (const TimeoutError& e) {
          throw std::runtime_error(std::string("timed out instead: ") + e.what());
        } catch (const Error& e) {
          expect_names_the_limit(e.what(), "accept failed");
          return;
        }
        throw std::runtime_error("accepted without a descriptor");
      },
      30s);
  EXPECT_ALL_RANKS_OK(results);
}

}  // namespace DDP_UNITY_ID
}  // namespace
}  // namespace ddp::net

#undef SKIP_UNDER_SANITIZERS
