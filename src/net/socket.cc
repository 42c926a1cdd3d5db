#include "net/socket.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <thread>
#include <utility>

#include <fmt/format.h>

#include "ddp/error.h"
#include "net/descriptors.h"

namespace ddp::net {
namespace {

std::string errno_text(int err) {
  return fmt::format("{} (errno {})", std::strerror(err), err);
}

std::string address_text(const sockaddr* addr) {
  char host[NI_MAXHOST] = {};
  char port[NI_MAXSERV] = {};
  const socklen_t len = addr->sa_family == AF_INET6 ? sizeof(sockaddr_in6) : sizeof(sockaddr_in);
  if (getnameinfo(addr, len, host, sizeof host, port, sizeof port,
                  NI_NUMERICHOST | NI_NUMERICSERV) != 0) {
    return "?";
  }
  return addr->sa_family == AF_INET6 ? fmt::format("[{}]:{}", host, port)
                                     : fmt::format("{}:{}", host, port);
}

struct AddrInfoDeleter {
  void operator()(addrinfo* info) const { freeaddrinfo(info); }
};
using AddrInfoPtr = std::unique_ptr<addrinfo, AddrInfoDeleter>;

AddrInfoPtr resolve(const std::string& host, std::uint16_t port, bool passive) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = passive ? AI_PASSIVE : 0;
  const std::string service = std::to_string(port);
  const char* node = host.empty() ? nullptr : host.c_str();
  addrinfo* result = nullptr;
  const int rc = getaddrinfo(node, service.c_str(), &hints, &result);
  if (rc != 0) {
    throw ConfigError(fmt::format("cannot resolve host '{}': {}; check the address (MASTER_ADDR)",
                                  host, gai_strerror(rc)));
  }
  return AddrInfoPtr(result);
}

// Waits until `fd` is ready for `events` or the deadline passes. Returns false on timeout.
bool wait_ready(int fd, short events, Deadline deadline) {
  for (;;) {
    pollfd pfd{fd, events, 0};
    const int rc = ::poll(&pfd, 1, poll_timeout_ms(deadline));
    if (rc > 0) return true;
    if (rc == 0) {
      if (Clock::now() >= deadline) return false;
      continue;  // poll's timeout was clamped; keep waiting
    }
    if (errno != EINTR) throw Error(fmt::format("poll failed: {}", errno_text(errno)));
  }
}

}  // namespace

int poll_timeout_ms(Deadline deadline) {
  const auto now = Clock::now();
  if (deadline <= now) return 0;
  const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - now).count();
  return static_cast<int>(std::min<long long>(left, 1'000'000'000));
}

Socket::Socket(Socket&& other) noexcept
    : fd_(std::exchange(other.fd_, -1)), peer_(std::move(other.peer_)) {}

Socket& Socket::operator=(Socket&& other) noexcept {
  if (this != &other) {
    close();
    fd_ = std::exchange(other.fd_, -1);
    peer_ = std::move(other.peer_);
  }
  return *this;
}

Socket::~Socket() {
  close();
}

void Socket::close() {
  if (fd_ >= 0) {
    ::close(fd_);
    fd_ = -1;
  }
}

std::ptrdiff_t Socket::send_some(const void* data, std::size_t size) {
  for (;;) {
    const ssize_t n = ::send(fd_, data, size, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n >= 0) return n;
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
    throw Error(fmt::format("send to {} failed: {}", peer_, errno_text(errno)));
  }
}

std::ptrdiff_t Socket::recv_some(void* data, std::size_t size) {
  for (;;) {
    const ssize_t n = ::recv(fd_, data, size, MSG_DONTWAIT);
    if (n > 0) return n;
    if (n == 0) return size == 0 ? 0 : -1;
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
    throw Error(fmt::format("receive from {} failed: {}", peer_, errno_text(errno)));
  }
}

bool Socket::wait_readable(Deadline deadline) {
  return wait_ready(fd_, POLLIN, deadline);
}

void Socket::send_all(const void* data, std::size_t size, Deadline deadline) {
  auto* bytes = static_cast<const std::uint8_t*>(data);
  while (size > 0) {
    const auto n = send_some(bytes, size);
    if (n > 0) {
      bytes += n;
      size -= static_cast<std::size_t>(n);
    } else if (!wait_ready(fd_, POLLOUT, deadline)) {
      throw TimeoutError(fmt::format("timed out sending to {}", peer_));
    }
  }
}

void Socket::recv_all(void* data, std::size_t size, Deadline deadline) {
  auto* bytes = static_cast<std::uint8_t*>(data);
  while (size > 0) {
    const auto n = recv_some(bytes, size);
    if (n < 0) throw Error(fmt::format("connection closed by peer {}", peer_));
    if (n > 0) {
      bytes += n;
      size -= static_cast<std::size_t>(n);
    } else if (!wait_ready(fd_, POLLIN, deadline)) {
      throw TimeoutError(fmt::format("timed out receiving from {}", peer_));
    }
  }
}

void Socket::set_nonblocking(bool on) {
  const int flags = ::fcntl(fd_, F_GETFL, 0);
  ::fcntl(fd_, F_SETFL, on ? (flags | O_NONBLOCK) : (flags & ~O_NONBLOCK));
}

void Socket::set_no_delay(bool on) {
  const int value = on ? 1 : 0;
  ::setsockopt(fd_, IPPROTO_TCP, TCP_NODELAY, &value, sizeof value);
}

void Socket::set_buffer_sizes(int bytes) {
  ::setsockopt(fd_, SOL_SOCKET, SO_SNDBUF, &bytes, sizeof bytes);
  ::setsockopt(fd_, SOL_SOCKET, SO_RCVBUF, &bytes, sizeof bytes);
}

std::uint16_t Socket::local_port() const {
  sockaddr_storage addr{};
  socklen_t len = sizeof addr;
  if (::getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    throw Error(fmt::format("getsockname failed: {}", errno_text(errno)));
  }
  if (addr.ss_family == AF_INET6) {
    return ntohs(reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port);
  }
  return ntohs(reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
}

bool Socket::connected_to_itself() const {
  sockaddr_storage local{};
  sockaddr_storage peer{};
  socklen_t local_size = sizeof local;
  socklen_t peer_size = sizeof peer;
  if (::getsockname(fd_, reinterpret_cast<sockaddr*>(&local), &local_size) != 0 ||
      ::getpeername(fd_, reinterpret_cast<sockaddr*>(&peer), &peer_size) != 0) {
    return false;
  }
  return local_size == peer_size && std::memcmp(&local, &peer, local_size) == 0;
}

Socket listen_tcp(const std::string& host, std::uint16_t port, int backlog) {
  const std::string bind_host = host.empty() ? "0.0.0.0" : host;
  auto info = resolve(bind_host, port, /*passive=*/true);
  int last_error = 0;
  for (addrinfo* ai = info.get(); ai != nullptr; ai = ai->ai_next) {
    const int fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
    if (fd < 0) {
      last_error = errno;
      continue;
    }
    Socket sock(fd, address_text(ai->ai_addr));
    const int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (::bind(fd, ai->ai_addr, ai->ai_addrlen) != 0) {
      last_error = errno;
      continue;
    }
    if (::listen(fd, backlog) != 0) {
      last_error = errno;
      continue;
    }
    return sock;
  }
  throw_if_out_of_descriptors(last_error, fmt::format("cannot listen on {}:{}", bind_host, port));
  if (last_error == EADDRINUSE) {
    throw ConfigError(fmt::format(
        "port {} is already in use on {}: pick another port (MASTER_PORT, or 0 for any free "
        "port) or stop the process that holds it",
        port, bind_host));
  }
  throw ConfigError(
      fmt::format("cannot listen on {}:{}: {}", bind_host, port, errno_text(last_error)));
}

Socket accept_tcp(Socket& listener, Deadline deadline) {
  for (;;) {
    if (!wait_ready(listener.fd(), POLLIN, deadline)) {
      throw TimeoutError("timed out waiting for a connection");
    }
    sockaddr_storage addr{};
    socklen_t len = sizeof addr;
    const int fd = ::accept4(listener.fd(), reinterpret_cast<sockaddr*>(&addr), &len,
                             SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd >= 0) {
      Socket sock(fd, address_text(reinterpret_cast<sockaddr*>(&addr)));
      // Accepted sockets must not inherit O_NONBLOCK semantics the caller did not ask for.
      sock.set_nonblocking(false);
      return sock;
    }
    if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR && errno != ECONNABORTED) {
      const int err = errno;
      throw_if_out_of_descriptors(err, "accept failed");
      throw Error(fmt::format("accept failed: {}", errno_text(err)));
    }
  }
}

Socket connect_tcp(const std::string& host, std::uint16_t port, Deadline deadline) {
  auto backoff = std::chrono::milliseconds(10);
  std::string last_error = "no attempt made";
  for (;;) {
    auto info = resolve(host, port, /*passive=*/false);
    for (addrinfo* ai = info.get(); ai != nullptr; ai = ai->ai_next) {
      const int fd =
          ::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, ai->ai_protocol);
      if (fd < 0) {
        // No retry frees a descriptor: say so now, not as the last error at the deadline.
        throw_if_out_of_descriptors(errno, fmt::format("cannot connect to {}:{}", host, port));
        last_error = errno_text(errno);
        continue;
      }
      Socket sock(fd, address_text(ai->ai_addr));
      int rc = ::connect(fd, ai->ai_addr, ai->ai_addrlen);
      if (rc != 0 && errno == EINPROGRESS) {
        // Bound the attempt by the deadline but also by a few seconds, so that one dropped SYN
        // does not consume the whole budget.
        const auto attempt_deadline = std::min(deadline, Clock::now() + std::chrono::seconds(5));
        if (!wait_ready(fd, POLLOUT, attempt_deadline)) {
          last_error = "connect attempt timed out";
          continue;
        }
        int err = 0;
        socklen_t len = sizeof err;
        ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
        rc = err == 0 ? 0 : -1;
        errno = err;
      }
      if (rc == 0 && sock.connected_to_itself()) {
        // A connect to a local port nobody listens on can end in TCP's "simultaneous open" with
        // itself, when the kernel picks that very port as the source port: a peer that answers
        // nothing. It is a refusal, and retried as one.
        last_error = "connected to itself: nothing listens on the port yet";
        continue;
      }
      if (rc == 0) {
        sock.set_nonblocking(false);
        sock.set_no_delay(true);
        return sock;
      }
      last_error = errno_text(errno);
    }
    const auto now = Clock::now();
    if (now >= deadline) {
      throw TimeoutError(fmt::format(
          "cannot connect to {}:{} before the deadline (last error: {}); check that the master "
          "is running and that MASTER_ADDR/MASTER_PORT point at it",
          host, port, last_error));
    }
    std::this_thread::sleep_for(std::min<Clock::duration>(backoff, deadline - now));
    backoff = std::min(backoff * 2, std::chrono::milliseconds(1000));
  }
}

std::uint16_t pick_free_port() {
  Socket sock = listen_tcp("0.0.0.0", 0, 1);
  return sock.local_port();
}

bool resolves_only_to_loopback(const std::string& host) {
  const auto info = resolve(host, 0, /*passive=*/false);
  for (const addrinfo* ai = info.get(); ai != nullptr; ai = ai->ai_next) {
    if (ai->ai_family == AF_INET) {
      const auto* in = reinterpret_cast<const sockaddr_in*>(ai->ai_addr);
      if ((ntohl(in->sin_addr.s_addr) >> 24) != 127) return false;
    } else if (ai->ai_family == AF_INET6) {
      const auto* in6 = reinterpret_cast<const sockaddr_in6*>(ai->ai_addr);
      if (!IN6_IS_ADDR_LOOPBACK(&in6->sin6_addr)) return false;
    } else {
      return false;
    }
  }
  return true;
}

std::string host_name() {
  char name[256] = {};
  if (::gethostname(name, sizeof name - 1) != 0) return "localhost";
  return name;
}

}  // namespace ddp::net
