// The TcpStore server's event loop: one thread, one epoll set, every client on a non-blocking
// socket. This file owns sockets, buffers, timers and limits; what the bytes mean is
// ServerProtocol's business (server_protocol.h) and the keys live in its KvState (kv_state.h).
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
//
// Limits (TcpStoreLimits, docs/store.md), so that abuse costs the job nothing:
// - time: the handshake must complete within handshake_timeout of the accept; a frame within
//   frame_timeout of its first byte; a reply must be taken within frame_timeout. Each connection
//   has one deadline in `timers_`; parked and idle clients that passed the handshake have none.
// - memory: a connection holds at most kLookaheadBytes beyond the frame it is receiving, and a
//   frame is buffered only when the store's memory (keys, values, every buffer) has room for all
//   of it, judged from its header; otherwise its bytes are read and dropped and the request is
//   answered with an error.
// - connections: at most max_connections; beyond it the oldest connection still in its
//   handshake makes room, or else the newcomer is accepted and closed at once.
// Log lines about limits are rate-limited (one per kind per second, with a count of the rest).
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <thread>
#include <unordered_map>
#include <vector>

#include <fmt/format.h>

#include "ddp/error.h"
#include "ddp/tcp_store.h"
#include "ddp/tcp_store_server.h"
#include "net/descriptors.h"
#include "net/socket.h"
#include "store/fd_limit.h"
#include "store/protocol.h"
#include "store/server_protocol.h"

namespace ddp {

using store::ConnectionId;
using store::DropConnection;
using Clock = net::Clock;
using TimePoint = Clock::time_point;

static_assert(kStoreMaxKeyBytes == store::kMaxKeyBytes);
static_assert(kStoreMaxValueBytes == store::kMaxValueBytes);
static_assert(kStoreMaxKeysPerRequest == store::kMaxKeysPerRequest);

namespace {

// Reads per readiness event before handling what arrived, so one fast sender cannot starve the
// others.
constexpr std::size_t kReadChunkBytes = 256 * 1024;
constexpr int kReadsPerEvent = 16;
// What a connection may hold beyond the unit it is receiving (the next small requests, a cancel);
// a frame larger than this is admitted against the memory limit first.
constexpr std::size_t kLookaheadBytes = 16 * 1024;
// Buffers larger than this are freed once empty rather than kept for the next request.
constexpr std::size_t kKeptBufferBytes = 64 * 1024;
// After a failed accept (EMFILE...), try again after this, or as soon as a connection closes.
constexpr std::chrono::milliseconds kAcceptRetry{100};
constexpr std::chrono::seconds kLogInterval{1};
constexpr int kAcceptsPerEvent = 64;
// At the connection limit, how many of the oldest half-open connections get a last chance to
// finish their handshake (their hello may be waiting unread) before the oldest is closed.
constexpr std::size_t kEvictionCandidates = 8;
// The smallest max_memory_bytes accepted: room for the largest request's lookahead and a few keys.
constexpr std::size_t kMinMemoryBytes = 1 << 20;

struct Connection {
  ConnectionId id = 0;
  net::Socket socket;
  TimePoint accepted_at;
  std::vector<std::uint8_t> in;
  std::size_t in_offset = 0;  // bytes of `in` already handled
  std::vector<std::uint8_t> out;
  std::size_t out_offset = 0;             // bytes of `out` already sent
  TimePoint output_since;                 // when the unsent reply was queued
  std::optional<TimePoint> unit_started;  // first byte of the unit still incomplete
  std::size_t admitted = 0;               // size of the large frame being received into `in`
  std::size_t discard = 0;                // bytes of a refused frame still to read and drop
  std::size_t discard_size = 0;
  std::string discard_reason;  // the error reply once they are dropped
  bool send_failed = false;    // the peer is gone: close after the current event
  bool peer_closed = false;    // EOF or reset seen: handle what is buffered, then close
  bool close_after_flush = false;
  std::uint32_t epoll_events = 0;
  std::size_t charged = 0;  // buffer bytes counted in Impl::buffered_bytes_
  TimePoint timer = TimePoint::max();

  bool has_output() const { return out_offset < out.size(); }
  std::size_t held() const { return in.size() - in_offset; }
};

// One log line per kind and interval; the lines held back are counted into the next one.
class RateLimitedLog {
 public:
  // Returns the line to emit now (with the count of those held back), or "" to stay quiet.
  std::string admit(const std::string& kind, const std::string& line, TimePoint now) {
    auto& entry = entries_[kind];
    if (entry.last != TimePoint{} && now - entry.last < kLogInterval) {
      ++entry.held_back;
      return {};
    }
    std::string out = line;
    if (entry.held_back > 0) {
      out += fmt::format(" ({} more like this in the last {} s not logged)", entry.held_back,
                         kLogInterval.count());
    }
    entry = {now, 0};
    return out;
  }

 private:
  struct Entry {
    TimePoint last{};
    std::size_t held_back = 0;
  };
  std::map<std::string, Entry> entries_;
};

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

class TcpStoreServer::Impl final : public store::Outbox {
 public:
  explicit Impl(TcpStoreServerOptions options)
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
      throw Error(fmt::format("store server: cannot create epoll/eventfd: {}",
                              net::system_error_text(err)));
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
  std::size_t max_connections() const { return max_connections_; }
  std::size_t memory_bytes() const { return memory_bytes_.load(); }

  // store::Outbox: replies from the protocol. Never throws for a failing connection.
  void send(ConnectionId id, std::vector<std::uint8_t> frame) override {
    auto it = connections_.find(id);
    if (it == connections_.end()) return;
    Connection& conn = *it->second;
    if (conn.send_failed) return;
    if (!conn.has_output()) conn.output_since = Clock::now();
    if (conn.out.empty()) {
      conn.out = std::move(frame);
      conn.out_offset = 0;
    } else {
      conn.out.insert(conn.out.end(), frame.begin(), frame.end());
    }
    flush(conn);
    recharge(conn);
    if (id != current_) settle(conn);  // a woken waiter: no event of its own to finish it
  }
  std::size_t buffered_bytes() const override { return buffered_bytes_; }
  void refused(ConnectionId id, const std::string& reason) override {
    auto it = connections_.find(id);
    const std::string peer = it == connections_.end() ? "?" : it->second->socket.peer();
    log_limited("refused", fmt::format("refusing a request from {}: {}", peer, reason));
  }

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

  // For events a flood can repeat thousands of times (limits, timeouts).
  void log_limited(const std::string& kind, const std::string& line) {
    const std::string text = log_limiter_.admit(kind, line, Clock::now());
    if (!text.empty()) log(text);
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

  void accept_all() {
    // A bounded batch, so that the hellos of clients accepted during a flood are read (by the
    // next epoll round) before more accepts could push them out of the connection limit.
    for (int accepted = 0; accepted < kAcceptsPerEvent; ++accepted) {
      net::Socket socket;
      try {
        socket = net::accept_tcp(listener_, Clock::now());
      } catch (const TimeoutError&) {
        return;  // nothing more to accept right now
      } catch (const Error& e) {
        // EMFILE and the like. The listener stays readable, so keep it out of epoll for a while
        // (instead of spinning on it), and keep serving the clients we have.
        log_limited("accept", fmt::format("accept failed, not accepting for {} ms or until a "
                                          "connection closes: {}",
                                          kAcceptRetry.count(), e.what()));
        ::epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, listener_.fd(), nullptr);
        accept_paused_ = true;
        accept_retry_at_ = Clock::now() + kAcceptRetry;
        return;
      }
      if (connections_.size() >= max_connections_ && !make_room(socket.peer())) {
        ++num_dropped_;
        continue;  // `socket` closes here: the newcomer is refused
      }
      socket.set_nonblocking(true);
      socket.set_no_delay(true);
      auto conn = std::make_unique<Connection>();
      conn->id = next_id_++;
      conn->socket = std::move(socket);
      conn->accepted_at = Clock::now();
      conn->epoll_events = EPOLLIN;
      try {
        add_to_epoll(conn->socket.fd(), EPOLLIN, conn->id);
      } catch (const Error& e) {
        log(fmt::format("refusing connection from {}: {}", conn->socket.peer(), e.what()));
        continue;
      }
      protocol_.open(conn->id);
      handshaking_.insert(conn->id);
      Connection& added = *conn;
      connections_.emplace(conn->id, std::move(conn));
      num_connections_ = connections_.size();
      arm(added);
    }
  }

  // At the connection limit: closes the oldest connection that has not completed its handshake
  // to make room for `peer`. False when every connection is past its handshake (then the
  // newcomer is refused).
  bool make_room(const std::string& peer) {
    // A real client's hello is usually already in its socket: read it before judging.
    std::vector<ConnectionId> candidates;
    for (auto it = handshaking_.begin();
         it != handshaking_.end() && candidates.size() < kEvictionCandidates; ++it) {
      candidates.push_back(*it);
    }
    for (const ConnectionId candidate : candidates) {
      auto it = connections_.find(candidate);
      if (it == connections_.end()) continue;
      on_event(*it->second, EPOLLIN);
      close_failed();
      if (connections_.size() < max_connections_) return true;
    }
    if (handshaking_.empty()) {
      log_limited("max_connections",
                  fmt::format("refusing connection from {}: {} connections open, the limit "
                              "(TcpStoreLimits::max_connections)",
                              peer, connections_.size()));
      return false;
    }
    const ConnectionId oldest = *handshaking_.begin();
    const std::string victim = connections_.at(oldest)->socket.peer();
    log_limited("evict",
                fmt::format("closing connection from {}: {} connections open, the limit "
                            "(TcpStoreLimits::max_connections), and it had not completed the "
                            "handshake; making room for {}",
                            victim, connections_.size(), peer));
    ++num_dropped_;
    close_connection(oldest, {});
    return true;
  }

  void resume_accepting() {
    accept_retry_at_.reset();
    if (!accept_paused_ || !listener_.valid()) return;
    accept_paused_ = false;
    try {
      add_to_epoll(listener_.fd(), EPOLLIN, kListenerTag);
    } catch (const Error& e) {
      log(fmt::format("cannot resume accepting connections: {}", e.what()));
    }
  }

  void on_event(Connection& conn, std::uint32_t events) {
    const ConnectionId id = conn.id;
    current_ = id;
    try {
      if (events & EPOLLOUT) flush(conn);
      if (!conn.peer_closed) {
        pump(conn);
      } else {
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

  // Reads and handles, alternately, until the socket is drained, a reply waits to be sent
  // (back-pressure), or kReadsPerEvent reads were made. Reads only as much as the unit being
  // received may hold. EOF or an error marks the peer closed (not the connection: what it sent
  // before closing is handled first). After a failed send, reads on to pick up what the vanished
  // peer sent before going.
  void pump(Connection& conn) {
    handle_units(conn);
    for (int i = 0; i < kReadsPerEvent && !conn.peer_closed; ++i) {
      if (!conn.send_failed && (conn.has_output() || conn.close_after_flush)) break;
      std::size_t want = 0;
      if (conn.discard > 0) {
        want = std::min(conn.discard, kReadChunkBytes);
      } else {
        const std::size_t cap = std::max(conn.admitted, kLookaheadBytes);
        if (conn.held() >= cap) break;  // cannot happen: a full unit is handled at once
        want = std::min(cap - conn.held(), kReadChunkBytes);
      }
      std::ptrdiff_t n = 0;
      try {
        n = conn.socket.recv_some(scratch_.data(), want);
      } catch (const Error&) {
        n = -1;  // ECONNRESET and friends: the peer is gone, same as EOF
      }
      if (n < 0) {
        conn.peer_closed = true;
        break;
      }
      if (n == 0) break;
      const auto got = static_cast<std::size_t>(n);
      if (conn.discard > 0) {
        conn.discard -= got;
        if (conn.discard == 0) {
          conn.unit_started.reset();
          protocol_.refuse(conn.id, conn.discard_reason, *this);
        }
      } else {
        conn.in.insert(conn.in.end(), scratch_.begin(), scratch_.begin() + n);
      }
      handle_units(conn);
    }
    handle_units(conn);
  }

  // After a connection's work: close it when it is done for, else watch what it waits for.
  void settle(Connection& conn) {
    const bool finished =
        conn.send_failed || ((conn.close_after_flush || conn.peer_closed) && !conn.has_output());
    if (finished) {
      failed_.push_back(conn.id);
      return;
    }
    if (protocol_.ready(conn.id)) handshaking_.erase(conn.id);
    recharge(conn);
    arm(conn);
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

  // Why closing a connection whose peer went away is worth a log line: it left a unit unfinished.
  std::string leftover_reason(const Connection& conn) {
    const std::size_t pending = conn.held();
    if (conn.discard > 0) {
      return fmt::format("truncated frame: connection closed {} bytes short of a refused frame",
                         conn.discard);
    }
    if (pending > 0 && !protocol_.ready(conn.id)) {
      const std::size_t unit = protocol_.unit_size(conn.id, {});
      return fmt::format("connection closed in the middle of {} ({} of {} bytes)",
                         unit == store::kHelloBytes ? "the handshake" : "authentication", pending,
                         unit);
    }
    if (pending > 0) {
      return fmt::format(
          "truncated frame: connection closed with {} bytes of an incomplete frame received",
          pending);
    }
    return {};
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
    handshaking_.erase(id);
    if (conn.timer != TimePoint::max()) timers_.erase({conn.timer, id});
    buffered_bytes_ -= conn.charged;
    ::epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, conn.socket.fd(), nullptr);
    connections_.erase(it);
    num_connections_ = connections_.size();
    if (accept_paused_) resume_accepting();
  }

  // Counts the connection's buffers (their allocated size) against the memory limit.
  void recharge(Connection& conn) {
    const std::size_t now = conn.in.capacity() + conn.out.capacity();
    buffered_bytes_ = buffered_bytes_ - conn.charged + now;
    conn.charged = now;
  }

  // The connection's deadline: the handshake's, the unsent reply's or the incomplete frame's.
  void arm(Connection& conn) {
    TimePoint deadline = TimePoint::max();
    if (!protocol_.ready(conn.id)) {
      deadline = net::deadline_after(limits_.handshake_timeout, conn.accepted_at);
    } else if (conn.has_output()) {
      deadline = net::deadline_after(limits_.frame_timeout, conn.output_since);
    } else if (conn.unit_started) {
      deadline = net::deadline_after(limits_.frame_timeout, *conn.unit_started);
    }
    if (deadline == conn.timer) return;
    if (conn.timer != TimePoint::max()) timers_.erase({conn.timer, conn.id});
    conn.timer = deadline;
    if (deadline != TimePoint::max()) timers_.insert({deadline, conn.id});
  }

  void expire_timers(TimePoint now) {
    while (!timers_.empty() && timers_.begin()->first <= now) {
      const ConnectionId id = timers_.begin()->second;
      const Connection& conn = *connections_.at(id);
      std::string reason;
      if (!protocol_.ready(id)) {
        reason = fmt::format(
            "handshake not completed within {} ms of connecting ({} bytes received; "
            "TcpStoreLimits::handshake_timeout)",
            limits_.handshake_timeout.count(), conn.held());
      } else if (conn.has_output()) {
        reason = fmt::format(
            "the client did not take its {}-byte reply within {} ms "
            "(TcpStoreLimits::frame_timeout)",
            conn.out.size() - conn.out_offset, limits_.frame_timeout.count());
      } else {
        reason = fmt::format(
            "frame not completed within {} ms of its first byte ({} bytes received; "
            "TcpStoreLimits::frame_timeout)",
            limits_.frame_timeout.count(),
            conn.discard > 0 ? conn.discard_size - conn.discard : conn.held());
      }
      log_limited("timeout",
                  fmt::format("closing connection from {}: {}", conn.socket.peer(), reason));
      ++num_dropped_;
      close_connection(id, {});
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
        std::vector<std::uint8_t>().swap(conn.out);
        conn.out_offset = 0;
        return;
      }
      if (n == 0) return;
      conn.out_offset += static_cast<std::size_t>(n);
    }
    if (conn.out.capacity() > kKeptBufferBytes) {
      std::vector<std::uint8_t>().swap(conn.out);
    } else {
      conn.out.clear();
    }
    conn.out_offset = 0;
  }

  // Hands every complete unit in the read buffer to the protocol, stopping while a reply is
  // unsent unless the peer is gone (then nothing more will come, and what came must count). A
  // large incomplete frame is admitted (buffered) or refused (dropped as it arrives) from its
  // header.
  void handle_units(Connection& conn) {
    for (;;) {
      const bool gone = conn.peer_closed || conn.send_failed;
      if (conn.close_after_flush || conn.discard > 0 || (!gone && conn.has_output())) break;
      const std::span<const std::uint8_t> buffered(conn.in.data() + conn.in_offset, conn.held());
      const std::size_t size = protocol_.unit_size(conn.id, buffered);
      if (buffered.size() < size) {
        if (size > kLookaheadBytes && conn.admitted != size) admit(conn, size);
        break;
      }
      std::string close_reason = protocol_.handle(conn.id, buffered.first(size), *this);
      conn.in_offset += size;
      conn.admitted = 0;
      conn.unit_started.reset();
      if (!close_reason.empty()) {
        log(fmt::format("closing connection from {}: {}", conn.socket.peer(), close_reason));
        ++num_dropped_;
        conn.close_after_flush = true;
      }
    }
    if (conn.held() > 0 || conn.discard > 0) {
      if (!conn.unit_started) conn.unit_started = Clock::now();
    } else {
      conn.unit_started.reset();
    }
    // Compact, so the buffer does not keep handled bytes alive.
    if (conn.in_offset == conn.in.size()) {
      if (conn.in.capacity() > kKeptBufferBytes) {
        std::vector<std::uint8_t>().swap(conn.in);
      } else {
        conn.in.clear();
      }
      conn.in_offset = 0;
    } else if (conn.in_offset > 0 && conn.in_offset >= conn.in.size() / 2) {
      conn.in.erase(conn.in.begin(), conn.in.begin() + static_cast<std::ptrdiff_t>(conn.in_offset));
      conn.in_offset = 0;
    }
  }

  // A frame of `size` bytes (header included) has begun: buffer it if the store's memory has
  // room for all of it, else drop its bytes as they come and answer it with an error.
  void admit(Connection& conn, std::size_t size) {
    const std::size_t others = protocol_.state().bytes() + buffered_bytes_ - conn.charged;
    if (others + size <= limits_.max_memory_bytes) {
      if (conn.in_offset > 0) {
        conn.in.erase(conn.in.begin(),
                      conn.in.begin() + static_cast<std::ptrdiff_t>(conn.in_offset));
        conn.in_offset = 0;
      }
      conn.in.reserve(size);
      conn.admitted = size;
      recharge(conn);
      return;
    }
    conn.discard_reason = fmt::format(
        "a frame of {} bytes would take the store's memory (keys, values and connection "
        "buffers, {} bytes now) over its limit of {} bytes (TcpStoreLimits::max_memory_bytes); "
        "it was discarded unread",
        size, others + conn.charged, limits_.max_memory_bytes);
    log_limited("memory", fmt::format("refusing a frame from {}: {}", conn.socket.peer(),
                                      conn.discard_reason));
    conn.discard_size = size;
    conn.discard = size - conn.held();
    std::vector<std::uint8_t>().swap(conn.in);
    conn.in_offset = 0;
    recharge(conn);
  }

  TcpStoreServerOptions options_;
  TcpStoreLimits limits_;
  std::size_t max_connections_ = 0;
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
  std::set<ConnectionId> handshaking_;                   // oldest (smallest id) first
  std::set<std::pair<TimePoint, ConnectionId>> timers_;  // one deadline per connection at most
  std::vector<ConnectionId> failed_;                     // to close after the current event
  ConnectionId current_ = 0;  // the connection whose event is being handled
  ConnectionId next_id_ = kFirstConnectionId;
  bool accept_paused_ = false;  // the listener is out of epoll after a failed accept
  std::optional<TimePoint> accept_retry_at_;
  std::size_t buffered_bytes_ = 0;  // every connection's buffers
  RateLimitedLog log_limiter_;
  std::vector<std::uint8_t> scratch_ = std::vector<std::uint8_t>(kReadChunkBytes);

  std::atomic<std::size_t> num_connections_{0};
  std::atomic<std::size_t> num_parked_{0};
  std::atomic<std::size_t> num_dropped_{0};
  std::atomic<std::size_t> memory_bytes_{0};
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
  return impl_->max_connections();
}
std::size_t TcpStoreServer::memory_bytes() const {
  return impl_->memory_bytes();
}

}  // namespace ddp
