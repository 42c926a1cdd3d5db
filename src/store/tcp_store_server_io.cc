// The TcpStore server's work on one connection: its events, reads, the units handed to the
// protocol, the replies it sends and the buffers it is charged for (tcp_store_server_internal.h).
#include <sys/epoll.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "ddp/error.h"
#include "net/socket.h"
#include "store/server_protocol.h"
#include "store/tcp_store_server_internal.h"

namespace ddp {
namespace {

// What a connection may hold beyond the unit it is receiving (the next small requests, a cancel);
// a frame larger than this is admitted against the memory limit first.
constexpr std::size_t kLookaheadBytes = 16 * 1024;
// Buffers larger than this are freed once empty rather than kept for the next request.
constexpr std::size_t kKeptBufferBytes = 64 * 1024;

}  // namespace

void TcpStoreServer::Impl::send(ConnectionId id, std::vector<std::uint8_t> frame) {
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

void TcpStoreServer::Impl::refused(ConnectionId id, const std::string& reason) {
  auto it = connections_.find(id);
  const std::string peer = it == connections_.end() ? "?" : it->second->socket.peer();
  log_limited("refused", fmt::format("refusing a request from {}: {}", peer, reason));
}

void TcpStoreServer::Impl::on_event(Connection& conn, std::uint32_t events) {
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
void TcpStoreServer::Impl::pump(Connection& conn) {
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
void TcpStoreServer::Impl::settle(Connection& conn) {
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

// Counts the connection's buffers (their allocated size) against the memory limit.
void TcpStoreServer::Impl::recharge(Connection& conn) {
  const std::size_t now = conn.in.capacity() + conn.out.capacity();
  buffered_bytes_ = buffered_bytes_ - conn.charged + now;
  conn.charged = now;
}

void TcpStoreServer::Impl::update_interest(Connection& conn) {
  // Read only when nothing is waiting to be sent (back-pressure, see tcp_store_server_internal.h).
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
void TcpStoreServer::Impl::flush(Connection& conn) {
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
void TcpStoreServer::Impl::handle_units(Connection& conn) {
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
void TcpStoreServer::Impl::admit(Connection& conn, std::size_t size) {
  const std::size_t others = protocol_.state().bytes() + buffered_bytes_ - conn.charged;
  if (others + size <= limits_.max_memory_bytes) {
    if (conn.in_offset > 0) {
      conn.in.erase(conn.in.begin(), conn.in.begin() + static_cast<std::ptrdiff_t>(conn.in_offset));
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
  log_limited("memory",
              fmt::format("refusing a frame from {}: {}", conn.socket.peer(), conn.discard_reason));
  conn.discard_size = size;
  conn.discard = size - conn.held();
  std::vector<std::uint8_t>().swap(conn.in);
  conn.in_offset = 0;
  recharge(conn);
}

}  // namespace ddp
