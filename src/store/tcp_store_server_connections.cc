// The TcpStore server's connections: accepting them (and making room at the limit), closing them,
// and their deadlines (tcp_store_server_internal.h).
#include <sys/epoll.h>

#include <chrono>
#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "ddp/error.h"
#include "net/socket.h"
#include "store/protocol.h"
#include "store/server_protocol.h"
#include "store/tcp_store_server_internal.h"

namespace ddp {
namespace {

// After a failed accept (EMFILE...), try again after this, or as soon as a connection closes.
constexpr std::chrono::milliseconds kAcceptRetry{100};
constexpr int kAcceptsPerEvent = 64;
// At the connection limit, how many of the oldest half-open connections get a last chance to
// finish their handshake (their hello may be waiting unread) before the oldest is closed.
constexpr std::size_t kEvictionCandidates = 8;

}  // namespace

void TcpStoreServer::Impl::accept_all() {
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
bool TcpStoreServer::Impl::make_room(const std::string& peer) {
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

void TcpStoreServer::Impl::resume_accepting() {
  accept_retry_at_.reset();
  if (!accept_paused_ || !listener_.valid()) return;
  accept_paused_ = false;
  try {
    add_to_epoll(listener_.fd(), EPOLLIN, kListenerTag);
  } catch (const Error& e) {
    log(fmt::format("cannot resume accepting connections: {}", e.what()));
  }
}

// Closes the connections whose send failed or that finished their last reply; done between
// events so that no caller holds a reference to one.
void TcpStoreServer::Impl::close_failed() {
  for (const ConnectionId id : failed_) {
    auto it = connections_.find(id);
    if (it == connections_.end()) continue;
    const Connection& conn = *it->second;
    close_connection(id, conn.close_after_flush ? std::string() : leftover_reason(conn));
  }
  failed_.clear();
}

// Why closing a connection whose peer went away is worth a log line: it left a unit unfinished.
std::string TcpStoreServer::Impl::leftover_reason(const Connection& conn) {
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

void TcpStoreServer::Impl::close_connection(ConnectionId id, const std::string& reason) {
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

// The connection's deadline: the handshake's, the unsent reply's or the incomplete frame's.
void TcpStoreServer::Impl::arm(Connection& conn) {
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

void TcpStoreServer::Impl::expire_timers(TimePoint now) {
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

}  // namespace ddp
