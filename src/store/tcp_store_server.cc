// The TcpStore server's event loop: one thread, one epoll set, every client on a non-blocking
// socket. This file owns sockets, buffers and the loop; what the bytes mean is ServerProtocol's
// business (server_protocol.h) and the keys live in its KvState (kv_state.h).
//
// Each connection has a read buffer (bytes not yet handled) and a write buffer (replies not yet
// accepted by the kernel). A unit (hello, authentication, frame) is handed to the protocol once it
// is complete.
//
// Back-pressure: a connection's next unit is not handled (and its socket not read) while its
// write buffer holds an unsent reply, so a client that sends requests without reading the answers
// cannot make the server buffer without bound.
//
// Replies never fail on the spot: a send error marks the connection for closing after the
// current event, so one vanished client cannot stop the server from answering the others (the
// wake-ups a request causes are applied before its own reply is queued).
//
// A peer that is gone (EOF, reset, failed send) still has every complete request it sent before
// going handled, back-pressure or not: "hello + set + close" in one write sets the key. Only
// then is the connection closed (after sending what is left, for a peer that merely shut down
// its sending side).
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_map>
#include <vector>

#include <fmt/format.h>

#include "ddp/error.h"
#include "ddp/tcp_store.h"
#include "ddp/tcp_store_server.h"
#include "net/socket.h"
#include "store/protocol.h"
#include "store/server_protocol.h"

namespace ddp {

using store::ConnectionId;
using store::DropConnection;

static_assert(kStoreMaxKeyBytes == store::kMaxKeyBytes);
static_assert(kStoreMaxValueBytes == store::kMaxValueBytes);
static_assert(kStoreMaxKeysPerRequest == store::kMaxKeysPerRequest);

namespace {

// Reads per readiness event before handling what arrived, so one fast sender cannot starve the
// others.
constexpr std::size_t kReadChunkBytes = 256 * 1024;
constexpr int kReadsPerEvent = 16;

struct Connection {
  ConnectionId id = 0;
  net::Socket socket;
  std::vector<std::uint8_t> in;
  std::size_t in_offset = 0;  // bytes of `in` already handled
  std::vector<std::uint8_t> out;
  std::size_t out_offset = 0;  // bytes of `out` already sent
  bool send_failed = false;    // the peer is gone: close after the current event
  bool peer_closed = false;    // EOF or reset seen: handle what is buffered, then close
  std::string close_reason;    // close once `out` is sent (version mismatch, failed auth)
  bool close_after_flush = false;
  std::uint32_t epoll_events = 0;

  bool has_output() const { return out_offset < out.size(); }
};

}  // namespace

class TcpStoreServer::Impl final : public store::Outbox {
 public:
  explicit Impl(TcpStoreServerOptions options)
      : options_(std::move(options)), protocol_({.auth_secret = options_.auth_secret}) {
    if (!options_.log) {
      options_.log = [](const std::string& line) { std::fprintf(stderr, "%s\n", line.c_str()); };
    }
    listener_ = net::listen_tcp(options_.listen_host, options_.port);
    listener_.set_nonblocking(true);
    port_ = listener_.local_port();

    epoll_fd_ = ::epoll_create1(EPOLL_CLOEXEC);
    wake_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (epoll_fd_ < 0 || wake_fd_ < 0) {
      const int err = errno;
      close_fds();
      throw Error(fmt::format("store server: cannot create epoll/eventfd: {}", std::strerror(err)));
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

  ~Impl() override {
    stop(options_.drain_timeout);
    close_fds();
  }

  void stop(std::chrono::milliseconds drain) {
    std::lock_guard lock(stop_mutex_);
    if (!thread_.joinable()) return;
    drain_ms_ = std::max<std::int64_t>(0, drain.count());
    const std::uint64_t one = 1;
    [[maybe_unused]] const auto n = ::write(wake_fd_, &one, sizeof one);
    thread_.join();
  }

  std::uint16_t port() const { return port_; }
  std::size_t num_connections() const { return num_connections_.load(); }
  std::size_t num_parked() const { return num_parked_.load(); }
  std::size_t num_dropped() const { return num_dropped_.load(); }

  // store::Outbox: replies from the protocol. Never throws for a failing connection.
  void send(ConnectionId id, std::vector<std::uint8_t> frame) override {
    auto it = connections_.find(id);
    if (it == connections_.end()) return;
    Connection& conn = *it->second;
    if (conn.send_failed) return;
    if (conn.out.empty()) {
      conn.out = std::move(frame);
      conn.out_offset = 0;
    } else {
      conn.out.insert(conn.out.end(), frame.begin(), frame.end());
    }
    flush(conn);
    if (id != current_) settle(conn);  // a woken waiter: no event of its own to finish it
  }
  std::size_t buffered_bytes() const override { return 0; }
  void refused(ConnectionId, const std::string&) override {}

 private:
  static constexpr std::uint64_t kListenerTag = 0;
  static constexpr std::uint64_t kWakeTag = 1;
  static constexpr std::uint64_t kFirstConnectionId = 2;

  void close_fds() {
    if (epoll_fd_ >= 0) ::close(epoll_fd_);
    if (wake_fd_ >= 0) ::close(wake_fd_);
    epoll_fd_ = wake_fd_ = -1;
  }

  void add_to_epoll(int fd, std::uint32_t events, std::uint64_t tag) {
    epoll_event ev{};
    ev.events = events;
    ev.data.u64 = tag;
    if (::epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd, &ev) != 0) {
      throw Error(fmt::format("store server: epoll_ctl failed: {}", std::strerror(errno)));
    }
  }

  void log(const std::string& line) {
    try {
      options_.log(fmt::format("ddp store server (port {}): {}", port_, line));
    } catch (...) {
      // A failing log sink must not take the server down.
    }
  }

  void run() {
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

  void loop() {
    std::vector<epoll_event> events(64);
    std::optional<net::Deadline> drain_deadline;
    for (;;) {
      if (drain_deadline && (connections_.empty() || net::Clock::now() >= *drain_deadline)) return;
      const int timeout_ms = drain_deadline ? net::poll_timeout_ms(*drain_deadline) : -1;
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
          ::epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, listener_.fd(), nullptr);
          listener_.close();
          accept_paused_ = false;  // nothing to resume: the listener is gone
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
      num_parked_ = protocol_.state().num_parked();
    }
  }

  void accept_all() {
    for (;;) {
      net::Socket socket;
      try {
        socket = net::accept_tcp(listener_, net::Clock::now());
      } catch (const TimeoutError&) {
        return;  // nothing more to accept right now
      } catch (const Error& e) {
        // EMFILE and the like. The listener stays readable, so keep it out of epoll until a
        // connection closes (instead of spinning on it), and keep serving the clients we have.
        log(fmt::format("accept failed, not accepting until a connection closes: {}", e.what()));
        ::epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, listener_.fd(), nullptr);
        accept_paused_ = true;
        return;
      }
      socket.set_nonblocking(true);
      socket.set_no_delay(true);
      auto conn = std::make_unique<Connection>();
      conn->id = next_id_++;
      conn->socket = std::move(socket);
      conn->epoll_events = EPOLLIN;
      try {
        add_to_epoll(conn->socket.fd(), EPOLLIN, conn->id);
      } catch (const Error& e) {
        log(fmt::format("refusing connection from {}: {}", conn->socket.peer(), e.what()));
        continue;
      }
      protocol_.open(conn->id);
      connections_.emplace(conn->id, std::move(conn));
      num_connections_ = connections_.size();
    }
  }

  void on_event(Connection& conn, std::uint32_t events) {
    const ConnectionId id = conn.id;
    current_ = id;
    try {
      if (events & EPOLLOUT) flush(conn);
      if ((events & (EPOLLIN | EPOLLHUP | EPOLLERR)) && !conn.peer_closed &&
          (!conn.has_output() || conn.send_failed)) {
        read_available(conn);
      }
      handle_units(conn);
      if (conn.send_failed && !conn.peer_closed) {
        // The peer is gone: the complete requests it sent before going still count.
        read_available(conn);
        handle_units(conn);
      }
      settle(conn);
    } catch (const DropConnection& drop) {
      close_connection(id, drop.reason);
    } catch (const std::exception& e) {
      // Out of memory for a large frame and the like: lose this client, keep serving the rest.
      close_connection(id, fmt::format("internal error: {}", e.what()));
    }
    current_ = 0;
  }

  // After a connection's work: close it when it is done for, else watch what it waits for.
  void settle(Connection& conn) {
    const bool finished =
        conn.send_failed || ((conn.close_after_flush || conn.peer_closed) && !conn.has_output());
    if (finished) {
      failed_.push_back(conn.id);
      return;
    }
    update_interest(conn);
  }

  // Closes the connections whose send failed or that finished their last reply; done between
  // events so that no caller holds a reference to one.
  void close_failed() {
    for (const ConnectionId id : failed_) {
      auto it = connections_.find(id);
      if (it == connections_.end()) continue;
      const Connection& conn = *it->second;
      close_connection(id, conn.close_after_flush ? std::string() : leftover_reason(conn));
    }
    failed_.clear();
  }

  // Reads what the socket holds; EOF or an error marks the peer closed (not the connection: what
  // it sent before closing is handled first).
  void read_available(Connection& conn) {
    for (int i = 0; i < kReadsPerEvent; ++i) {
      std::ptrdiff_t n = 0;
      try {
        n = conn.socket.recv_some(scratch_.data(), scratch_.size());
      } catch (const Error&) {
        n = -1;  // ECONNRESET and friends: the peer is gone, same as EOF
      }
      if (n > 0) conn.in.insert(conn.in.end(), scratch_.begin(), scratch_.begin() + n);
      if (n < 0) {
        conn.peer_closed = true;
        return;
      }
      if (n == 0) return;
    }
  }

  // Why closing a connection whose peer went away is worth a log line: it left a unit unfinished.
  std::string leftover_reason(const Connection& conn) {
    const std::size_t pending = conn.in.size() - conn.in_offset;
    std::string reason;
    if (pending > 0 && !protocol_.ready(conn.id)) {
      const std::size_t unit = protocol_.unit_size(conn.id, {});
      reason = fmt::format("connection closed in the middle of {} ({} of {} bytes)",
                           unit == store::kHelloBytes ? "the handshake" : "authentication", pending,
                           unit);
    } else if (pending > 0) {
      reason = fmt::format(
          "truncated frame: connection closed with {} bytes of an incomplete frame received",
          pending);
    }
    return reason;
  }

  void close_connection(ConnectionId id, const std::string& reason) {
    auto it = connections_.find(id);
    if (it == connections_.end()) return;
    Connection& conn = *it->second;
    if (!reason.empty()) {
      log(fmt::format("closing connection from {}: {}", conn.socket.peer(), reason));
      ++num_dropped_;
    }
    protocol_.close(id);
    ::epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, conn.socket.fd(), nullptr);
    connections_.erase(it);
    num_connections_ = connections_.size();
    if (accept_paused_) {
      accept_paused_ = false;
      try {
        add_to_epoll(listener_.fd(), EPOLLIN, kListenerTag);
      } catch (const Error& e) {
        log(fmt::format("cannot resume accepting connections: {}", e.what()));
      }
    }
  }

  void update_interest(Connection& conn) {
    // Read only when nothing is waiting to be sent (back-pressure, see the file comment).
    const std::uint32_t wanted =
        conn.has_output() ? EPOLLOUT : (conn.peer_closed ? 0u : std::uint32_t{EPOLLIN});
    if (wanted == conn.epoll_events) return;
    epoll_event ev{};
    ev.events = wanted;
    ev.data.u64 = conn.id;
    if (::epoll_ctl(epoll_fd_, EPOLL_CTL_MOD, conn.socket.fd(), &ev) != 0) {
      conn.send_failed = true;
      failed_.push_back(conn.id);
      return;
    }
    conn.epoll_events = wanted;
  }

  // Sends what the kernel takes now. A send error marks the connection failed (the peer is gone:
  // not a protocol violation, so it closes without a log line); it never throws.
  void flush(Connection& conn) {
    while (conn.has_output()) {
      std::ptrdiff_t n = 0;
      try {
        n = conn.socket.send_some(conn.out.data() + conn.out_offset,
                                  conn.out.size() - conn.out_offset);
      } catch (const Error&) {
        conn.send_failed = true;
        conn.out.clear();
        conn.out_offset = 0;
        return;
      }
      if (n == 0) return;
      conn.out_offset += static_cast<std::size_t>(n);
    }
    conn.out.clear();
    conn.out_offset = 0;
  }

  // Hands every complete unit in the read buffer to the protocol, stopping while a reply is
  // unsent unless the peer is gone (then nothing more will come, and what came must count).
  void handle_units(Connection& conn) {
    for (;;) {
      const bool gone = conn.peer_closed || conn.send_failed;
      if (conn.close_after_flush || (!gone && conn.has_output())) break;
      const std::span<const std::uint8_t> buffered(conn.in.data() + conn.in_offset,
                                                   conn.in.size() - conn.in_offset);
      const std::size_t size = protocol_.unit_size(conn.id, buffered);
      if (buffered.size() < size) break;
      std::string close_reason = protocol_.handle(conn.id, buffered.first(size), *this);
      conn.in_offset += size;
      if (!close_reason.empty()) {
        log(fmt::format("closing connection from {}: {}", conn.socket.peer(), close_reason));
        ++num_dropped_;
        conn.close_after_flush = true;
      }
    }
    // Compact, so the buffer does not keep handled bytes alive.
    if (conn.in_offset == conn.in.size()) {
      conn.in.clear();
      conn.in_offset = 0;
    } else if (conn.in_offset > 0 && conn.in_offset >= conn.in.size() / 2) {
      conn.in.erase(conn.in.begin(), conn.in.begin() + static_cast<std::ptrdiff_t>(conn.in_offset));
      conn.in_offset = 0;
    }
  }

  TcpStoreServerOptions options_;
  net::Socket listener_;
  std::uint16_t port_ = 0;
  int epoll_fd_ = -1;
  int wake_fd_ = -1;
  std::mutex stop_mutex_;
  std::atomic<std::int64_t> drain_ms_{0};  // stop() may be called from several threads
  std::thread thread_;

  // Owned by the server thread.
  store::ServerProtocol protocol_;
  std::unordered_map<ConnectionId, std::unique_ptr<Connection>> connections_;
  std::vector<ConnectionId> failed_;  // to close after the current event
  ConnectionId current_ = 0;          // the connection whose event is being handled
  ConnectionId next_id_ = kFirstConnectionId;
  bool accept_paused_ = false;  // the listener is out of epoll after a failed accept
  std::vector<std::uint8_t> scratch_ = std::vector<std::uint8_t>(kReadChunkBytes);

  std::atomic<std::size_t> num_connections_{0};
  std::atomic<std::size_t> num_parked_{0};
  std::atomic<std::size_t> num_dropped_{0};
};

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
  return 0;
}
std::size_t TcpStoreServer::memory_bytes() const {
  return 0;
}

}  // namespace ddp
