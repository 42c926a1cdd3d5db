// The TcpStore server's start, stop and event loop, and the public TcpStoreServer over its Impl
// (tcp_store_server_internal.h: the class, and how the server works).
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <optional>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "ddp/error.h"
#include "ddp/store/tcp_store.h"
#include "ddp/store/tcp_store_server.h"
#include "net/descriptors.h"
#include "net/socket.h"
#include "store/fd_limit.h"
#include "store/protocol.h"
#include "store/server_protocol.h"
#include "store/tcp_store_server_internal.h"

namespace ddp {
static_assert(kStoreMaxKeyBytes == store::kMaxKeyBytes);
static_assert(kStoreMaxValueBytes == store::kMaxValueBytes);
static_assert(kStoreMaxKeysPerRequest == store::kMaxKeysPerRequest);

namespace {

// The smallest max_memory_bytes accepted: room for the largest request's lookahead and a few keys.
constexpr std::size_t kMinMemoryBytes = 1 << 20;

// Limits that would refuse every client are configuration mistakes, not hardening.
void check_limits(const TcpStoreLimits& limits) {
  if (limits.handshake_timeout.count() <= 0 || limits.frame_timeout.count() <= 0) {
    throw ConfigError(fmt::format(
        "TcpStoreLimits: handshake_timeout ({} ms) and frame_timeout ({} ms) must be positive",
        limits.handshake_timeout.count(), limits.frame_timeout.count()));
  }
  if (limits.max_memory_bytes < kMinMemoryBytes) {
    throw ConfigError(fmt::format(
        "TcpStoreLimits: max_memory_bytes ({}) must be at least {} bytes to serve any client",
        limits.max_memory_bytes, kMinMemoryBytes));
  }
}

}  // namespace

TcpStoreServer::Impl::Impl(TcpStoreServerOptions options)
    : options_(std::move(options)),
      limits_(options_.limits),
      protocol_({.auth_secret = options_.auth_secret,
                 .max_memory_bytes = options_.limits.max_memory_bytes}) {
  if (!options_.log) {
    options_.log = [](const std::string& line) { std::fprintf(stderr, "%s\n", line.c_str()); };
  }
  check_limits(limits_);
  const std::size_t open_files = store::raise_open_files_limit();
  max_connections_ = limits_.max_connections > 0 ? limits_.max_connections
                                                 : store::automatic_max_connections(open_files);
  listener_ = net::listen_tcp(options_.listen_host, options_.port);
  listener_.set_nonblocking(true);
  port_ = listener_.local_port();

  epoll_fd_ = ::epoll_create1(EPOLL_CLOEXEC);
  wake_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (epoll_fd_ < 0 || wake_fd_ < 0) {
    const int err = errno;
    close_fds();
    throw Error(
        fmt::format("store server: cannot create epoll/eventfd: {}", net::system_error_text(err)));
  }
  try {
    add_to_epoll(listener_.fd(), EPOLLIN, kListenerTag);
    add_to_epoll(wake_fd_, EPOLLIN, kWakeTag);
    thread_ = std::thread([this] { run(); });
  } catch (...) {
    close_fds();
    throw;
  }
}

TcpStoreServer::Impl::~Impl() {
  stop(options_.drain_timeout);
  close_fds();
}

void TcpStoreServer::Impl::stop(std::chrono::milliseconds drain) {
  std::lock_guard lock(stop_mutex_);
  if (!thread_.joinable()) return;
  drain_ms_ = std::max<std::int64_t>(0, drain.count());
  const std::uint64_t one = 1;
  [[maybe_unused]] const auto n = ::write(wake_fd_, &one, sizeof one);
  thread_.join();
}

void TcpStoreServer::Impl::close_fds() {
  if (epoll_fd_ >= 0) ::close(epoll_fd_);
  if (wake_fd_ >= 0) ::close(wake_fd_);
  epoll_fd_ = wake_fd_ = -1;
}

void TcpStoreServer::Impl::add_to_epoll(int fd, std::uint32_t events, std::uint64_t tag) {
  epoll_event ev{};
  ev.events = events;
  ev.data.u64 = tag;
  if (::epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd, &ev) != 0) {
    throw Error(fmt::format("store server: epoll_ctl failed: {}", std::strerror(errno)));
  }
}

void TcpStoreServer::Impl::log(const std::string& line) {
  try {
    options_.log(fmt::format("ddp store server (port {}): {}", port_, line));
  } catch (...) {
    // A failing log sink must not take the server down.
  }
}

// For events a flood can repeat thousands of times (limits, timeouts).
void TcpStoreServer::Impl::log_limited(const std::string& kind, const std::string& line) {
  const std::string text = log_limiter_.admit(kind, line, Clock::now());
  if (!text.empty()) log(text);
}

void TcpStoreServer::Impl::run() {
  try {
    loop();
  } catch (const std::exception& e) {
    log(fmt::format("event loop failed, stopping the server: {}", e.what()));
  }
  // Closing every socket tells each client its store is gone (StoreError, not a hang), and
  // closing the listener makes late clients fail to connect instead of waiting on a backlog.
  listener_.close();
  for (auto& [id, conn] : connections_)
    protocol_.close(id);
  connections_.clear();
  num_connections_ = 0;
  num_parked_ = 0;
}

void TcpStoreServer::Impl::loop() {
  std::vector<epoll_event> events(64);
  std::optional<net::Deadline> drain_deadline;
  for (;;) {
    if (drain_deadline && (connections_.empty() || Clock::now() >= *drain_deadline)) return;
    TimePoint next = timers_.empty() ? TimePoint::max() : timers_.begin()->first;
    if (drain_deadline) next = std::min(next, *drain_deadline);
    if (accept_retry_at_) next = std::min(next, *accept_retry_at_);
    const int timeout_ms = next == TimePoint::max() ? -1 : net::poll_timeout_ms(next);
    const int n =
        ::epoll_wait(epoll_fd_, events.data(), static_cast<int>(events.size()), timeout_ms);
    if (n < 0) {
      if (errno == EINTR) continue;
      throw Error(fmt::format("epoll_wait failed: {}", std::strerror(errno)));
    }
    for (int i = 0; i < n; ++i) {
      const std::uint64_t tag = events[i].data.u64;
      if (tag == kWakeTag) {
        const auto drain = std::chrono::milliseconds(drain_ms_.load());
        if (drain.count() == 0 || drain_deadline) return;
        // Stop accepting, but let the connected clients finish their last requests: the
        // process hosting the store often exits a moment before the others are done with it.
        std::uint64_t value = 0;
        [[maybe_unused]] const auto r = ::read(wake_fd_, &value, sizeof value);
        if (!accept_paused_) ::epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, listener_.fd(), nullptr);
        listener_.close();
        accept_paused_ = false;  // nothing to resume: the listener is gone
        accept_retry_at_.reset();
        drain_deadline = net::deadline_after(drain);
        continue;
      }
      if (tag == kListenerTag) {
        accept_all();
        continue;
      }
      auto it = connections_.find(tag);
      if (it == connections_.end()) continue;  // closed earlier in this batch
      on_event(*it->second, events[i].events);
    }
    close_failed();
    expire_timers(Clock::now());
    if (accept_retry_at_ && Clock::now() >= *accept_retry_at_) resume_accepting();
    num_parked_ = protocol_.state().num_parked();
    memory_bytes_ = protocol_.state().bytes() + buffered_bytes_;
  }
}

TcpStoreServer::TcpStoreServer(TcpStoreServerOptions options)
    : impl_(std::make_unique<Impl>(std::move(options))) {}

TcpStoreServer::~TcpStoreServer() = default;

std::uint16_t TcpStoreServer::port() const {
  return impl_->port();
}
void TcpStoreServer::stop() {
  impl_->stop(std::chrono::milliseconds(0));
}

void TcpStoreServer::stop(std::chrono::milliseconds drain) {
  impl_->stop(drain);
}
std::size_t TcpStoreServer::num_connections() const {
  return impl_->num_connections();
}
std::size_t TcpStoreServer::num_parked_requests() const {
  return impl_->num_parked();
}
std::size_t TcpStoreServer::num_dropped_connections() const {
  return impl_->num_dropped();
}
std::size_t TcpStoreServer::max_connections() const {
  return impl_->max_connections();
}
std::size_t TcpStoreServer::memory_bytes() const {
  return impl_->memory_bytes();
}

}  // namespace ddp
