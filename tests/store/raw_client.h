// Raw-socket helpers for store tests that play misbehaving clients: the handshake bytes, a
// greeted connection, a reset instead of a close, and "did the server close this?".
#pragma once

#include <sys/socket.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "ddp/error.h"
#include "net/socket.h"
#include "store/protocol.h"

namespace ddp::store::test {

using Frame = std::vector<std::uint8_t>;

inline Frame hello() {
  Frame out(kHelloBytes);
  put_u32(out.data(), kMagic);
  put_u32(out.data() + 4, kProtocolVersion);
  return out;
}

inline std::uint8_t op(Opcode code) {
  return static_cast<std::uint8_t>(code);
}

inline void send_bytes(net::Socket& socket, const Frame& bytes, std::chrono::milliseconds timeout) {
  socket.send_all(bytes.data(), bytes.size(), net::deadline_after(timeout));
}

// Connects and completes the hello (no secret).
inline net::Socket greeted(std::uint16_t port, std::chrono::milliseconds timeout) {
  net::Socket socket = net::connect_tcp("127.0.0.1", port, net::deadline_after(timeout));
  send_bytes(socket, hello(), timeout);
  std::uint8_t reply[kHelloReplyBytes];
  socket.recv_all(reply, sizeof reply, net::deadline_after(timeout));
  if (reply[8] != static_cast<std::uint8_t>(HelloStatus::kAccepted)) {
    throw Error("the store did not accept the hello");
  }
  return socket;
}

// Closes with a TCP reset instead of a FIN (SO_LINGER with a zero timeout).
inline void reset(net::Socket& socket) {
  const linger abort{.l_onoff = 1, .l_linger = 0};
  ::setsockopt(socket.fd(), SOL_SOCKET, SO_LINGER, &abort, sizeof abort);
  socket.close();
}

// True when the server closes `socket` (EOF or reset) within `timeout`; bytes before are ignored.
inline bool closed_by_server(net::Socket& socket, std::chrono::milliseconds timeout) {
  const auto deadline = net::deadline_after(timeout);
  std::vector<std::uint8_t> sink(64 * 1024);
  for (;;) {
    std::ptrdiff_t n = 0;
    try {
      n = socket.recv_some(sink.data(), sink.size());
    } catch (const Error&) {
      return true;
    }
    if (n < 0) return true;
    if (n == 0) {
      if (net::Clock::now() >= deadline) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
}

// Polls `done` until it holds or `timeout` passes.
inline bool wait_until(const std::function<bool()>& done, std::chrono::milliseconds timeout) {
  const auto deadline = net::Clock::now() + timeout;
  while (net::Clock::now() < deadline) {
    if (done()) return true;
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  return done();
}

}  // namespace ddp::store::test
