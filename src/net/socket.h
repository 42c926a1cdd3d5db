// TCP sockets with deadlines. With fd_io.h (the raw-descriptor calls of event loops), the one
// place ddp touches the BSD socket API.
//
// Every blocking call takes a Deadline and throws TimeoutError when it passes, so nothing in ddp
// can wait forever on the network. Sockets are move-only and close on destruction. A Socket may be
// used by one thread at a time, except that one thread may send while another receives.
//
// Errors: TimeoutError (deadline), ConfigError (bad address, port in use), OutOfDescriptorsError
// (descriptors.h: a socket could not be made or accepted for want of descriptors; never retried
// until a deadline), Error (anything else from the kernel, with the errno text and the peer's
// address).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>

namespace ddp::net {

using Clock = std::chrono::steady_clock;
using Deadline = Clock::time_point;

inline Deadline deadline_after(std::chrono::milliseconds timeout, Clock::time_point now) {
  // Saturate so that "wait a very long time" cannot overflow the clock.
  if (timeout > std::chrono::duration_cast<std::chrono::milliseconds>(Deadline::max() - now)) {
    return Deadline::max();
  }
  return now + timeout;
}

inline Deadline deadline_after(std::chrono::milliseconds timeout) {
  return deadline_after(timeout, Clock::now());
}

// Milliseconds left until `deadline` (0 when passed), clamped to fit poll()'s int argument.
int poll_timeout_ms(Deadline deadline);

class Socket {
 public:
  Socket() = default;
  explicit Socket(int fd, std::string peer = {}) : fd_(fd), peer_(std::move(peer)) {}
  Socket(Socket&& other) noexcept;
  Socket& operator=(Socket&& other) noexcept;
  Socket(const Socket&) = delete;
  Socket& operator=(const Socket&) = delete;
  ~Socket();

  int fd() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  // "host:port" of the other end, for error messages.
  const std::string& peer() const { return peer_; }
  void close();

  // Sends/receives exactly `size` bytes or throws. recv_all throws Error("connection closed by
  // peer ...") on EOF.
  void send_all(const void* data, std::size_t size, Deadline deadline);
  void recv_all(void* data, std::size_t size, Deadline deadline);

  // One non-blocking attempt; returns bytes moved (0 when it would block). recv_some returns -1
  // at EOF.
  std::ptrdiff_t send_some(const void* data, std::size_t size);
  std::ptrdiff_t recv_some(void* data, std::size_t size);

  // Waits until the socket is readable (data or end of stream); false when the deadline passes
  // first.
  bool wait_readable(Deadline deadline);

  void set_nonblocking(bool on);
  void set_no_delay(bool on);
  void set_buffer_sizes(int bytes);
  // The port this socket is bound to (for listeners bound to port 0).
  std::uint16_t local_port() const;
  // Whether this connection's two ends are one address (TCP's "simultaneous open": a connect to a
  // local port nobody listens on can end connected to itself when the kernel picks that very port
  // as the source port). False when either address cannot be read.
  bool connected_to_itself() const;

 private:
  int fd_ = -1;
  std::string peer_;
};

// Listens on host:port (host "" or "0.0.0.0" = every IPv4 address, "::" = every address;
// port 0 = any free port, see Socket::local_port). Throws ConfigError when the port is in use.
Socket listen_tcp(const std::string& host, std::uint16_t port, int backlog = 1024);

// Accepts one connection or throws TimeoutError at the deadline; OutOfDescriptorsError when the
// connection waits but this process has no descriptor for it (the listener stays readable).
Socket accept_tcp(Socket& listener, Deadline deadline);

// Connects to host:port, retrying refused or unreachable attempts with growing back-off until
// `deadline` (the server may start later). Never returns a connection to itself (see
// connected_to_itself): that is retried as a refusal. Throws TimeoutError naming the address and
// the last error once the deadline passes, ConfigError when the host name does not resolve,
// OutOfDescriptorsError at once when no socket can be made.
Socket connect_tcp(const std::string& host, std::uint16_t port, Deadline deadline);

// Picks a port that is free right now on the loopback and wildcard addresses (bind to 0, read,
// close). Another process may take it before it is used: callers retry or accept the risk.
std::uint16_t pick_free_port();

// Whether every address `host` resolves to is a loopback address (127.0.0.0/8, ::1). Throws
// ConfigError when it does not resolve.
bool resolves_only_to_loopback(const std::string& host);

// This host's name (gethostname).
std::string host_name();

}  // namespace ddp::net
