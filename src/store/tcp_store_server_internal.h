// The TcpStore server's event loop (internal to store/): its class TcpStoreServer::Impl, a
// connection's state and the rate-limited log, which tcp_store_server*.cc share.
//
// One thread, one epoll set, every client on a non-blocking socket. The loop owns sockets,
// buffers, timers and limits; what the bytes mean is ServerProtocol's business
// (server_protocol.h) and the keys live in its KvState (kv_state.h).
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
//
// Its parts: tcp_store_server.cc (start, stop, the loop, the public class),
// tcp_store_server_connections.cc (accepting, closing, deadlines) and tcp_store_server_io.cc (a
// connection's reads, units, replies and buffers).
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "ddp/store/tcp_store_server.h"
#include "net/socket.h"
#include "store/server_protocol.h"

namespace ddp::store {

using Clock = net::Clock;
using TimePoint = Clock::time_point;

inline constexpr std::chrono::seconds kLogInterval{1};

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

}  // namespace ddp::store

namespace ddp {

class TcpStoreServer::Impl final : public store::Outbox {
  using Clock = store::Clock;
  using TimePoint = store::TimePoint;
  using Connection = store::Connection;
  using ConnectionId = store::ConnectionId;
  using DropConnection = store::DropConnection;

 public:
  explicit Impl(TcpStoreServerOptions options);
  ~Impl() override;

  void stop(std::chrono::milliseconds drain);

  std::uint16_t port() const { return port_; }
  std::size_t num_connections() const { return num_connections_.load(); }
  std::size_t num_parked() const { return num_parked_.load(); }
  std::size_t num_dropped() const { return num_dropped_.load(); }
  std::size_t max_connections() const { return max_connections_; }
  std::size_t memory_bytes() const { return memory_bytes_.load(); }

  // store::Outbox: replies from the protocol. Never throws for a failing connection.
  void send(ConnectionId id, std::vector<std::uint8_t> frame) override;
  std::size_t buffered_bytes() const override { return buffered_bytes_; }
  void refused(ConnectionId id, const std::string& reason) override;

 private:
  static constexpr std::uint64_t kListenerTag = 0;
  static constexpr std::uint64_t kWakeTag = 1;
  static constexpr std::uint64_t kFirstConnectionId = 2;
  // Reads per readiness event before handling what arrived, so one fast sender cannot starve the
  // others.
  static constexpr std::size_t kReadChunkBytes = 256 * 1024;
  static constexpr int kReadsPerEvent = 16;

  // Start, stop and the loop (tcp_store_server.cc).
  void close_fds();
  void add_to_epoll(int fd, std::uint32_t events, std::uint64_t tag);
  void log(const std::string& line);
  void log_limited(const std::string& kind, const std::string& line);
  void run();
  void loop();

  // Accepting, closing and deadlines (tcp_store_server_connections.cc).
  void accept_all();
  bool make_room(const std::string& peer);
  void resume_accepting();
  void close_failed();
  std::string leftover_reason(const Connection& conn);
  void close_connection(ConnectionId id, const std::string& reason);
  void arm(Connection& conn);
  void expire_timers(TimePoint now);

  // A connection's reads, units, replies and buffers (tcp_store_server_io.cc).
  void on_event(Connection& conn, std::uint32_t events);
  void pump(Connection& conn);
  void settle(Connection& conn);
  void recharge(Connection& conn);
  void update_interest(Connection& conn);
  void flush(Connection& conn);
  void handle_units(Connection& conn);
  void admit(Connection& conn, std::size_t size);

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
  store::RateLimitedLog log_limiter_;
  std::vector<std::uint8_t> scratch_ = std::vector<std::uint8_t>(kReadChunkBytes);

  std::atomic<std::size_t> num_connections_{0};
  std::atomic<std::size_t> num_parked_{0};
  std::atomic<std::size_t> num_dropped_{0};
  std::atomic<std::size_t> memory_bytes_{0};
};

}  // namespace ddp
