#include "net/socket.h"

#include <gtest/gtest.h>

#include <thread>

#include "ddp/error.h"

namespace ddp::net {
namespace {

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

}  // namespace
}  // namespace ddp::net
