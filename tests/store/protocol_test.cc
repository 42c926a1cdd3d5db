// The store's wire protocol, spoken through raw sockets: the documented frames work, and every
// kind of broken input closes only the offending connection, with a logged line naming the peer
// and the reason, while the server and its other clients carry on.
#include "store/protocol.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "ddp/error.h"
#include "ddp/store/tcp_store.h"
#include "net/socket.h"
#include "support/unity_namespace.h"

namespace ddp::store {
namespace {
namespace DDP_UNITY_ID {

using namespace std::chrono_literals;
using net::Clock;
using testing::HasSubstr;

constexpr Milliseconds kTestTimeout{5'000};

using Frame = std::vector<std::uint8_t>;

Frame hello(std::uint32_t magic = kMagic, std::uint32_t version = kProtocolVersion) {
  Frame out(kHelloBytes);
  put_u32(out.data(), magic);
  put_u32(out.data() + 4, version);
  return out;
}

Frame raw_header(std::uint32_t length, std::uint8_t code) {
  Frame out(5);
  put_u32(out.data(), length);
  out[4] = code;
  return out;
}

std::uint8_t op(Opcode code) {
  return static_cast<std::uint8_t>(code);
}

class ProtocolTest : public testing::Test {
 protected:
  ProtocolTest()
      : server_({.listen_host = "127.0.0.1",
                 .log =
                     [this](const std::string& line) {
                       std::lock_guard lock(log_mutex_);
                       log_.push_back(line);
                     }}),
        healthy_("127.0.0.1", server_.port(),
                 {.timeout = kTestTimeout, .connect_timeout = kTestTimeout}) {
    healthy_.set("before", "1");
  }

  net::Socket connect() {
    return net::connect_tcp("127.0.0.1", server_.port(), net::deadline_after(kTestTimeout));
  }

  net::Socket connect_and_greet() {
    net::Socket socket = connect();
    send(socket, hello());
    std::uint8_t reply[kHelloReplyBytes];
    socket.recv_all(reply, sizeof reply, net::deadline_after(kTestTimeout));
    EXPECT_EQ(reply[8], static_cast<std::uint8_t>(HelloStatus::kAccepted));
    return socket;
  }

  static void send(net::Socket& socket, const Frame& bytes) {
    socket.send_all(bytes.data(), bytes.size(), net::deadline_after(kTestTimeout));
  }

  // Reads one reply frame body (status byte first).
  static Frame receive(net::Socket& socket) {
    std::uint8_t prefix[4];
    socket.recv_all(prefix, sizeof prefix, net::deadline_after(kTestTimeout));
    Frame body(get_u32(prefix));
    socket.recv_all(body.data(), body.size(), net::deadline_after(kTestTimeout));
    return body;
  }

  // True when the server closes `socket` (EOF) within the test timeout; bytes before EOF are
  // ignored.
  static bool closed_by_server(net::Socket& socket) {
    const auto deadline = net::deadline_after(kTestTimeout);
    std::uint8_t byte;
    try {
      for (;;)
        socket.recv_all(&byte, 1, deadline);
    } catch (const TimeoutError&) {
      return false;
    } catch (const Error&) {
      return true;
    }
  }

  // Waits for a log line containing `text` and returns it ("" when none came).
  std::string log_line_with(const std::string& text) {
    const auto deadline = Clock::now() + kTestTimeout;
    while (Clock::now() < deadline) {
      {
        std::lock_guard lock(log_mutex_);
        for (const auto& line : log_) {
          if (line.find(text) != std::string::npos) return line;
        }
      }
      std::this_thread::sleep_for(1ms);
    }
    return "";
  }

  // The server still serves the client connected before the bad one, and new ones.
  void expect_server_healthy() {
    EXPECT_EQ(healthy_.get_string("before"), "1");
    healthy_.add("after", 1);
    TcpStore fresh("127.0.0.1", server_.port(),
                   {.timeout = kTestTimeout, .connect_timeout = kTestTimeout});
    EXPECT_EQ(fresh.get_string("before"), "1");
  }

  // One bad connection: sends `bytes` (after the handshake when `greet`), expects the server to
  // close it and log a line with `reason`.
  void expect_dropped(const Frame& bytes, const std::string& reason, bool greet = true) {
    net::Socket socket = greet ? connect_and_greet() : connect();
    send(socket, bytes);
    EXPECT_TRUE(closed_by_server(socket));
    const std::string line = log_line_with(reason);
    EXPECT_THAT(line, HasSubstr("closing connection from 127.0.0.1:"))
        << "no log line with '" << reason << "'";
    EXPECT_EQ(server_.num_dropped_connections(), 1u);
    expect_server_healthy();
  }

  std::mutex log_mutex_;
  std::vector<std::string> log_;
  TcpStoreServer server_;
  TcpStore healthy_;
};

TEST_F(ProtocolTest, RawClientSpeaksTheDocumentedProtocol) {
  net::Socket socket = connect();
  send(socket, hello());
  std::uint8_t reply[kHelloReplyBytes];
  socket.recv_all(reply, sizeof reply, net::deadline_after(kTestTimeout));
  EXPECT_EQ(get_u32(reply), 0x53504444u);  // "DDPS"
  EXPECT_EQ(get_u32(reply + 4), kProtocolVersion);
  EXPECT_EQ(reply[8], 0);

  // set("ab", "xyz"): [u32 len=14][u8 1][u32 2]"ab"[u32 3]"xyz", little-endian.
  const Frame set_frame = {14, 0, 0, 0, 1, 2, 0, 0, 0, 'a', 'b', 3, 0, 0, 0, 'x', 'y', 'z'};
  send(socket, set_frame);
  EXPECT_EQ(receive(socket), Frame({0}));
  // add("n", 258) -> [status 0][i64 258]
  send(socket, FrameWriter(op(Opcode::kAdd)).bytes("n").i64(258).finish());
  EXPECT_EQ(receive(socket), Frame({0, 2, 1, 0, 0, 0, 0, 0, 0}));
  EXPECT_EQ(healthy_.get_string("ab"), "xyz");
  // A parked get, then cancel: kCancelled naming the missing key.
  send(socket, FrameWriter(op(Opcode::kGet)).bytes("missing").finish());
  send(socket, FrameWriter(op(Opcode::kCancel)).finish());
  const Frame cancelled = FrameWriter(1).u32(1).bytes("missing").finish();
  EXPECT_EQ(receive(socket), Frame(cancelled.begin() + 4, cancelled.end()));
  EXPECT_EQ(server_.num_dropped_connections(), 0u);
}

TEST_F(ProtocolTest, BadMagicClosesTheConnection) {
  const std::string http = "GET / HTTP/1.1\r\n\r\n";
  expect_dropped({http.begin(), http.end()}, "bad handshake: magic 0x20544547", /*greet=*/false);
}

TEST_F(ProtocolTest, WrongVersionIsAnsweredWithTheServerVersionThenClosed) {
  net::Socket socket = connect();
  send(socket, hello(kMagic, 99));
  std::uint8_t reply[kHelloReplyBytes];
  socket.recv_all(reply, sizeof reply, net::deadline_after(kTestTimeout));
  EXPECT_EQ(get_u32(reply + 4), kProtocolVersion);
  EXPECT_EQ(reply[8], static_cast<std::uint8_t>(HelloStatus::kVersionMismatch));
  EXPECT_TRUE(closed_by_server(socket));
  EXPECT_THAT(log_line_with("version 99"), HasSubstr("this server speaks version 1"));
  expect_server_healthy();
}

TEST_F(ProtocolTest, GarbageBytesAfterTheHandshakeCloseTheConnection) {
  expect_dropped(Frame(64, 0xff), "exceeds the limit");
}

TEST_F(ProtocolTest, TruncatedFrameThenCloseIsLogged) {
  net::Socket socket = connect_and_greet();
  Frame partial = raw_header(100, op(Opcode::kSet));
  partial.resize(20, 0);
  send(socket, partial);
  socket.close();
  EXPECT_THAT(log_line_with("truncated frame"), HasSubstr("20 bytes"));
  expect_server_healthy();
}

TEST_F(ProtocolTest, HandshakeCutShortIsLogged) {
  net::Socket socket = connect();
  send(socket, Frame{0x44, 0x44});
  socket.close();
  EXPECT_THAT(log_line_with("middle of the handshake"), HasSubstr("2 of 8 bytes"));
  expect_server_healthy();
}

TEST_F(ProtocolTest, OversizedLengthClosesWithoutWaitingForTheBody) {
  expect_dropped(raw_header(static_cast<std::uint32_t>(kMaxFrameBytes + 1), op(Opcode::kSet)),
                 "exceeds the limit");
}

TEST_F(ProtocolTest, EmptyFrameClosesTheConnection) {
  expect_dropped(Frame{0, 0, 0, 0}, "empty frame");
}

TEST_F(ProtocolTest, UnknownOpcodeClosesTheConnection) {
  expect_dropped(raw_header(1, 200), "unknown opcode 200");
}

TEST_F(ProtocolTest, FieldLongerThanItsFrameClosesTheConnection) {
  // A set whose key claims 1000 bytes inside a 9-byte frame.
  Frame frame = raw_header(9, op(Opcode::kSet));
  const Frame key_length = {0xe8, 0x03, 0, 0, 'a', 'b', 'c', 'd'};
  frame.insert(frame.end(), key_length.begin(), key_length.end());
  expect_dropped(frame, "malformed 'set' frame: truncated field 'key'");
}

TEST_F(ProtocolTest, KeyOverTheLimitClosesTheConnection) {
  expect_dropped(FrameWriter(op(Opcode::kGet)).bytes(std::string(kMaxKeyBytes + 1, 'k')).finish(),
                 "over the limit of 4096 bytes");
}

TEST_F(ProtocolTest, TrailingBytesCloseTheConnection) {
  expect_dropped(FrameWriter(op(Opcode::kNumKeys)).u32(0).finish(), "unexpected trailing bytes");
}

TEST_F(ProtocolTest, SecondRequestWhileOneIsParkedClosesTheConnection) {
  Frame frames = FrameWriter(op(Opcode::kGet)).bytes("missing").finish();
  const Frame second = FrameWriter(op(Opcode::kNumKeys)).finish();
  frames.insert(frames.end(), second.begin(), second.end());
  expect_dropped(frames, "while a 'get' is still pending");
  EXPECT_EQ(server_.num_parked_requests(), 0u);
}

TEST_F(ProtocolTest, CancelThatCrossesTheAnswerIsIgnored) {
  net::Socket socket = connect_and_greet();
  send(socket, FrameWriter(op(Opcode::kGet)).bytes("soon").finish());
  const auto deadline = Clock::now() + kTestTimeout;
  while (server_.num_parked_requests() != 1 && Clock::now() < deadline) {
    std::this_thread::sleep_for(1ms);
  }
  healthy_.set("soon", "v");
  // The answer went out; a cancel sent now (as a client whose deadline just passed would) must
  // produce no second reply: the next reply on the wire belongs to the next request.
  EXPECT_EQ(receive(socket), Frame({0, 1, 0, 0, 0, 'v'}));  // status ok, bytes "v"
  send(socket, FrameWriter(op(Opcode::kCancel)).finish());
  send(socket, FrameWriter(op(Opcode::kNumKeys)).finish());
  EXPECT_EQ(receive(socket), Frame({0, 2, 0, 0, 0, 0, 0, 0, 0}));  // "before" and "soon"
  EXPECT_EQ(server_.num_dropped_connections(), 0u);
}

TEST_F(ProtocolTest, ClientVanishingWhileParkedReleasesItsWait) {
  {
    net::Socket socket = connect_and_greet();
    send(socket, FrameWriter(op(Opcode::kWait)).u32(1).bytes("never").finish());
    const auto deadline = Clock::now() + kTestTimeout;
    while (server_.num_parked_requests() != 1 && Clock::now() < deadline) {
      std::this_thread::sleep_for(1ms);
    }
    EXPECT_EQ(server_.num_parked_requests(), 1u);
  }
  const auto deadline = Clock::now() + kTestTimeout;
  while (server_.num_parked_requests() != 0 && Clock::now() < deadline) {
    std::this_thread::sleep_for(1ms);
  }
  EXPECT_EQ(server_.num_parked_requests(), 0u);
  // Setting the key now must not touch the closed connection.
  healthy_.set("never", "1");
  EXPECT_EQ(server_.num_dropped_connections(), 0u);  // an orderly close is not a violation
  expect_server_healthy();
}

TEST(FrameReader, RejectsShortAndOversizedFields) {
  const Frame body = FrameWriter(0).u32(3).finish();  // [len][0][u32 3]
  FrameReader reader({body.data() + 5, body.size() - 5});
  EXPECT_THROW(reader.bytes("key", 10), ProtocolError);
  FrameReader limited({body.data() + 5, body.size() - 5});
  EXPECT_THROW(limited.bytes("key", 2), ProtocolError);
}

TEST(Printable, EscapesControlBytesAndCutsLongText) {
  EXPECT_EQ(printable(std::string_view("a\nb\0", 4)), "a\\x0ab\\x00");
  EXPECT_EQ(printable(std::string(300, 'x'), 10), std::string(10, 'x') + "...");
}

}  // namespace DDP_UNITY_ID
}  // namespace
}  // namespace ddp::store
