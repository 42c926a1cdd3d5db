// Helpers shared by the fuzz harnesses that play a peer over loopback TCP.
//
// send_and_drain writes the input to `fd`, half-closes it (so the other side sees the end of the
// input at once instead of waiting for more) and reads whatever comes back until the other side
// closes or `timeout` passes. With `quiet` > 0 it half-closes only once all is sent and nothing
// has come back for that long, so a server that answers requests before it notices the close
// gets to answer them. Returns false when the timeout passed: the harness then reports a hang
// (the code under test must fail fast on a closed, malformed stream).
#pragma once

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

namespace ddp::fuzz {

inline bool send_and_drain(int fd, const std::uint8_t* data, std::size_t size,
                           std::chrono::milliseconds timeout,
                           std::chrono::milliseconds quiet = std::chrono::milliseconds(0)) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  auto left_ms = [&] {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    return static_cast<int>(std::max<std::int64_t>(0, left.count()));
  };
  std::size_t sent = 0;
  bool write_open = true;
  char sink[64 * 1024];
  while (true) {
    pollfd p{.fd = fd, .events = static_cast<short>(POLLIN | (write_open ? POLLOUT : 0))};
    // All sent: wait for POLLIN only, at most `quiet` before half-closing.
    const bool all_sent = sent == size;
    if (all_sent) p.events = POLLIN;
    const int ms =
        write_open && all_sent ? std::min(left_ms(), static_cast<int>(quiet.count())) : left_ms();
    if (ms == 0 && !(write_open && all_sent)) return false;
    const int n = ::poll(&p, 1, ms);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return false;
    if (n == 0) {
      if (!(write_open && all_sent)) return false;
      ::shutdown(fd, SHUT_WR);  // quiet for long enough: end the input
      write_open = false;
      continue;
    }
    if (write_open && !all_sent && (p.revents & POLLOUT)) {
      const ssize_t w = ::send(fd, data + sent, size - sent, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (w > 0) sent += static_cast<std::size_t>(w);
      if (w < 0 && errno != EAGAIN && errno != EINTR) write_open = false;  // peer gone
    }
    if (p.revents & (POLLIN | POLLHUP | POLLERR)) {
      const ssize_t r = ::recv(fd, sink, sizeof sink, MSG_DONTWAIT);
      if (r == 0) return true;                                      // the other side closed: done
      if (r < 0 && errno != EAGAIN && errno != EINTR) return true;  // reset: closed too
    }
  }
}

// A hang is a finding: print what hung and abort so libFuzzer saves the input.
[[noreturn]] inline void report_hang(const char* what) {
  std::fprintf(stderr, "fuzz harness: %s did not close the connection in time\n", what);
  std::abort();
}

}  // namespace ddp::fuzz
