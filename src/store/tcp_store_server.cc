// The TcpStore server: one thread, one epoll loop, every client on a non-blocking socket.
//
// Each connection has a read buffer (bytes not yet parsed into frames) and a write buffer
// (responses not yet accepted by the kernel). A frame is handled once it is complete; a get/wait
// whose keys are missing is "parked": the connection is recorded under each missing key and
// answered when a set/add/compare_set creates the last of them, so no client ever blocks another.
// A client handles one request at a time, so a connection has at most one parked request; while
// it is parked the only frame the client may send is kCancel (its own deadline passed).
//
// Back-pressure: a connection's next frame is not handled (and its socket not read) while its
// write buffer holds an unsent response, so a client that sends requests without reading the
// answers cannot make the server buffer without bound.
//
// Anything that breaks the protocol (bad handshake, oversized or malformed frame, unknown opcode,
// a request while one is parked, EOF inside a frame) closes that connection only, with one logged
// line naming the peer and the reason.
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <optional>
#include <set>
#include <thread>
#include <unordered_map>
#include <vector>

#include <fmt/format.h>

#include "ddp/error.h"
#include "ddp/tcp_store.h"
#include "net/socket.h"
#include "store/auth.h"
#include "store/protocol.h"

namespace ddp {

using store::FrameReader;
using store::FrameWriter;
using store::Opcode;
using store::Status;

static_assert(kStoreMaxKeyBytes == store::kMaxKeyBytes);
static_assert(kStoreMaxValueBytes == store::kMaxValueBytes);
static_assert(kStoreMaxKeysPerRequest == store::kMaxKeysPerRequest);

namespace {

// Reads per readiness event before handling what arrived, so one fast sender cannot starve the
// others.
constexpr std::size_t kReadChunkBytes = 256 * 1024;
constexpr int kReadsPerEvent = 16;

struct ParkedRequest {
  Opcode op;
  std::string first_key;               // for get: the key whose value is the answer
  std::set<std::string> missing_keys;  // ordered, so a cancelled wait lists them stably
};

enum class Phase {
  kHello,  // waiting for magic and version
  kAuth,   // waiting for the client's MAC and nonce (servers with a secret)
  kReady,  // frames
};

struct Connection {
  std::uint64_t id = 0;
  net::Socket socket;
  Phase phase = Phase::kHello;
  store::Nonce nonce{};  // the challenge sent to this client
  std::vector<std::uint8_t> in;
  std::size_t in_offset = 0;  // bytes of `in` already handled
  std::vector<std::uint8_t> out;
  std::size_t out_offset = 0;  // bytes of `out` already sent
  bool close_after_flush = false;
  std::optional<ParkedRequest> parked;
  std::uint32_t epoll_events = 0;

  bool has_output() const { return out_offset < out.size(); }
};

// Thrown inside the loop to close one connection with a reason worth logging.
struct DropConnection {
  std::string reason;
};

std::string_view as_text(std::span<const std::uint8_t> bytes) {
  return {reinterpret_cast<const char*>(bytes.data()), bytes.size()};
}

}  // namespace

class TcpStoreServer::Impl {
 public:
  explicit Impl(TcpStoreServerOptions options) : options_(std::move(options)) {
    if (!options_.auth_secret.empty()) store::require_auth();
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

  ~Impl() {
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
    connections_.clear();
    waiters_.clear();
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
      connections_.emplace(conn->id, std::move(conn));
      num_connections_ = connections_.size();
    }
  }

  void on_event(Connection& conn, std::uint32_t events) {
    const std::uint64_t id = conn.id;
    try {
      if (events & EPOLLOUT) flush(conn);
      if ((events & (EPOLLIN | EPOLLHUP | EPOLLERR)) && !conn.has_output()) {
        if (!read_available(conn)) return;  // closed
      }
      handle_frames(conn);
      if (conn.close_after_flush && !conn.has_output()) {
        close_connection(id, {});
        return;
      }
      update_interest(conn);
    } catch (const DropConnection& drop) {
      close_connection(id, drop.reason);
    } catch (const std::exception& e) {
      // Out of memory for a large frame and the like: lose this client, keep serving the rest.
      close_connection(id, fmt::format("internal error: {}", e.what()));
    }
  }

  // Returns false when the connection was closed.
  bool read_available(Connection& conn) {
    for (int i = 0; i < kReadsPerEvent; ++i) {
      std::ptrdiff_t n = 0;
      try {
        n = conn.socket.recv_some(scratch_.data(), scratch_.size());
      } catch (const Error&) {
        n = -1;  // ECONNRESET and friends: the peer is gone, same as EOF
      }
      if (n > 0) conn.in.insert(conn.in.end(), scratch_.begin(), scratch_.begin() + n);
      if (n < 0) {
        on_peer_closed(conn);
        return false;
      }
      if (n == 0) break;
    }
    return true;
  }

  void on_peer_closed(Connection& conn) {
    const std::size_t pending = conn.in.size() - conn.in_offset;
    std::string reason;
    if (pending > 0 && conn.phase == Phase::kHello) {
      reason = fmt::format("connection closed in the middle of the handshake ({} of {} bytes)",
                           pending, store::kHelloBytes);
    } else if (pending > 0 && conn.phase == Phase::kAuth) {
      reason = fmt::format("connection closed in the middle of authentication ({} of {} bytes)",
                           pending, store::kAuthBytes);
    } else if (pending > 0) {
      reason = fmt::format(
          "truncated frame: connection closed with {} bytes of an incomplete "
          "frame received",
          pending);
    }
    close_connection(conn.id, reason);
  }

  void close_connection(std::uint64_t id, const std::string& reason) {
    auto it = connections_.find(id);
    if (it == connections_.end()) return;
    Connection& conn = *it->second;
    if (!reason.empty()) {
      log(fmt::format("closing connection from {}: {}", conn.socket.peer(), reason));
      ++num_dropped_;
    }
    unpark(conn);
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
    const std::uint32_t wanted = conn.has_output() ? EPOLLOUT : EPOLLIN;
    if (wanted == conn.epoll_events) return;
    epoll_event ev{};
    ev.events = wanted;
    ev.data.u64 = conn.id;
    if (::epoll_ctl(epoll_fd_, EPOLL_CTL_MOD, conn.socket.fd(), &ev) != 0) {
      throw DropConnection{fmt::format("epoll_ctl failed: {}", std::strerror(errno))};
    }
    conn.epoll_events = wanted;
  }

  void flush(Connection& conn) {
    while (conn.has_output()) {
      std::ptrdiff_t n = 0;
      try {
        n = conn.socket.send_some(conn.out.data() + conn.out_offset,
                                  conn.out.size() - conn.out_offset);
      } catch (const Error&) {
        // The peer went away; not a protocol violation, so close without a log line.
        throw DropConnection{};
      }
      if (n == 0) return;
      conn.out_offset += static_cast<std::size_t>(n);
    }
    conn.out.clear();
    conn.out_offset = 0;
  }

  void send(Connection& conn, std::vector<std::uint8_t> frame) {
    if (conn.out.empty()) {
      conn.out = std::move(frame);
      conn.out_offset = 0;
    } else {
      conn.out.insert(conn.out.end(), frame.begin(), frame.end());
    }
    flush(conn);
  }

  // Handles every complete frame in the read buffer, stopping while a response is unsent.
  void handle_frames(Connection& conn) {
    while (!conn.close_after_flush && !conn.has_output()) {
      const std::size_t available = conn.in.size() - conn.in_offset;
      const std::uint8_t* data = conn.in.data() + conn.in_offset;
      if (conn.phase == Phase::kHello) {
        if (available < store::kHelloBytes) break;
        conn.in_offset += store::kHelloBytes;
        handle_hello(conn, data);
        continue;
      }
      if (conn.phase == Phase::kAuth) {
        if (available < store::kAuthBytes) break;
        conn.in_offset += store::kAuthBytes;
        handle_auth(conn, data);
        continue;
      }
      if (available < 4) break;
      const std::uint32_t length = store::get_u32(data);
      if (length == 0) throw DropConnection{"empty frame (length 0, no opcode)"};
      if (length > store::kMaxFrameBytes) {
        throw DropConnection{fmt::format("frame of {} bytes exceeds the limit of {} bytes", length,
                                         store::kMaxFrameBytes)};
      }
      if (available < 4 + std::size_t{length}) break;
      handle_frame(conn, {data + 4, length});
      conn.in_offset += 4 + std::size_t{length};
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

  void handle_hello(Connection& conn, const std::uint8_t* data) {
    const std::uint32_t magic = store::get_u32(data);
    const std::uint32_t version = store::get_u32(data + 4);
    if (magic != store::kMagic) {
      throw DropConnection{
          fmt::format("bad handshake: magic 0x{:08x}, expected 0x{:08x} (not a ddp store client?)",
                      magic, store::kMagic)};
    }
    std::uint8_t reply[store::kHelloReplyBytes];
    store::put_u32(reply, store::kMagic);
    store::put_u32(reply + 4, store::kProtocolVersion);
    if (version != store::kProtocolVersion) {
      reply[8] = static_cast<std::uint8_t>(store::HelloStatus::kVersionMismatch);
      log(
          fmt::format("closing connection from {}: client speaks store protocol version {}, this "
                      "server speaks version {}",
                      conn.socket.peer(), version, store::kProtocolVersion));
      ++num_dropped_;
      conn.close_after_flush = true;
    } else if (!options_.auth_secret.empty()) {
      reply[8] = static_cast<std::uint8_t>(store::HelloStatus::kAuthRequired);
      conn.nonce = store::random_nonce();
      conn.phase = Phase::kAuth;
      std::vector<std::uint8_t> challenge(reply, reply + sizeof reply);
      challenge.insert(challenge.end(), conn.nonce.begin(), conn.nonce.end());
      send(conn, std::move(challenge));
      return;
    } else {
      reply[8] = static_cast<std::uint8_t>(store::HelloStatus::kAccepted);
      conn.phase = Phase::kReady;
    }
    send(conn, {reply, reply + sizeof reply});
  }

  void handle_auth(Connection& conn, const std::uint8_t* data) {
    const std::span<const std::uint8_t> client_mac(data, store::kMacBytes);
    const std::span<const std::uint8_t> client_nonce(data + store::kMacBytes, store::kNonceBytes);
    const auto expected = store::auth_mac(options_.auth_secret, store::kClientRole, conn.nonce);
    if (!store::macs_equal(client_mac, expected)) {
      log(fmt::format("closing connection from {}: authentication failed (wrong shared secret)",
                      conn.socket.peer()));
      ++num_dropped_;
      conn.close_after_flush = true;
      send(conn, {static_cast<std::uint8_t>(store::AuthStatus::kRejected)});
      return;
    }
    const auto proof = store::auth_mac(options_.auth_secret, store::kServerRole, client_nonce);
    std::vector<std::uint8_t> reply{static_cast<std::uint8_t>(store::AuthStatus::kAccepted)};
    reply.insert(reply.end(), proof.begin(), proof.end());
    conn.phase = Phase::kReady;
    send(conn, std::move(reply));
  }

  void handle_frame(Connection& conn, std::span<const std::uint8_t> body) {
    const std::uint8_t code = body[0];
    if (code == 0 || code > store::kMaxOpcode) {
      throw DropConnection{fmt::format("unknown opcode {}", code)};
    }
    const auto op = static_cast<Opcode>(code);
    if (conn.parked && op != Opcode::kCancel) {
      throw DropConnection{fmt::format(
          "'{}' request while a '{}' is still pending (one request at a time per connection)",
          store::opcode_name(op), store::opcode_name(conn.parked->op))};
    }
    FrameReader reader(body.subspan(1));
    try {
      dispatch(conn, op, reader);
    } catch (const ProtocolError& e) {
      throw DropConnection{
          fmt::format("malformed '{}' frame: {}", store::opcode_name(op), e.what())};
    }
  }

  void dispatch(Connection& conn, Opcode op, FrameReader& reader) {
    switch (op) {
      case Opcode::kSet: {
        std::string key = reader.string("key", store::kMaxKeyBytes);
        const auto value = reader.bytes("value", store::kMaxValueBytes);
        reader.expect_end("set");
        auto& slot = data_[key];
        slot.assign(value.begin(), value.end());
        send(conn, FrameWriter(code(Status::kOk)).finish());
        wake_waiters(key);
        return;
      }
      case Opcode::kGet: {
        std::string key = reader.string("key", store::kMaxKeyBytes);
        reader.expect_end("get");
        auto it = data_.find(key);
        if (it != data_.end()) {
          send(conn, FrameWriter(code(Status::kOk)).bytes(it->second).finish());
        } else {
          park(conn, op, {std::move(key)});
        }
        return;
      }
      case Opcode::kAdd: {
        std::string key = reader.string("key", store::kMaxKeyBytes);
        const std::int64_t delta = reader.i64("delta");
        reader.expect_end("add");
        handle_add(conn, key, delta);
        return;
      }
      case Opcode::kCompareSet: {
        std::string key = reader.string("key", store::kMaxKeyBytes);
        const auto expected = reader.bytes("expected", store::kMaxValueBytes);
        const auto desired = reader.bytes("desired", store::kMaxValueBytes);
        reader.expect_end("compare_set");
        auto it = data_.find(key);
        const bool matches =
            it == data_.end() ? expected.empty() : std::ranges::equal(it->second, expected);
        if (!matches) {
          const std::span<const std::uint8_t> current =
              it == data_.end() ? std::span<const std::uint8_t>{} : it->second;
          send(conn, FrameWriter(code(Status::kOk)).bytes(current).finish());
          return;
        }
        data_[key].assign(desired.begin(), desired.end());
        send(conn, FrameWriter(code(Status::kOk)).bytes(desired).finish());
        wake_waiters(key);
        return;
      }
      case Opcode::kCheck:
      case Opcode::kWait: {
        const std::uint32_t count = reader.u32("key count");
        if (count > store::kMaxKeysPerRequest) {
          throw ProtocolError(
              fmt::format("{} keys, over the limit of {}", count, store::kMaxKeysPerRequest));
        }
        std::vector<std::string> keys;
        keys.reserve(count);
        for (std::uint32_t i = 0; i < count; ++i) {
          keys.push_back(reader.string("key", store::kMaxKeyBytes));
        }
        reader.expect_end(store::opcode_name(op));
        const bool all_exist =
            std::ranges::all_of(keys, [&](const std::string& k) { return data_.contains(k); });
        if (op == Opcode::kCheck) {
          send(conn, FrameWriter(code(Status::kOk)).u8(all_exist ? 1 : 0).finish());
        } else if (all_exist) {
          send(conn, FrameWriter(code(Status::kOk)).finish());
        } else {
          park(conn, op, std::move(keys));
        }
        return;
      }
      case Opcode::kDelete: {
        std::string key = reader.string("key", store::kMaxKeyBytes);
        reader.expect_end("delete_key");
        const bool existed = data_.erase(key) > 0;
        send(conn, FrameWriter(code(Status::kOk)).u8(existed ? 1 : 0).finish());
        return;
      }
      case Opcode::kNumKeys: {
        reader.expect_end("num_keys");
        send(conn,
             FrameWriter(code(Status::kOk)).i64(static_cast<std::int64_t>(data_.size())).finish());
        return;
      }
      case Opcode::kCancel: {
        reader.expect_end("cancel");
        // Without a parked request the answer already went out (the key arrived as the client
        // gave up); the client reads that answer instead, so there is nothing to do.
        if (!conn.parked) return;
        FrameWriter reply(code(Status::kCancelled));
        reply.u32(static_cast<std::uint32_t>(conn.parked->missing_keys.size()));
        for (const auto& key : conn.parked->missing_keys)
          reply.bytes(key);
        unpark(conn);
        send(conn, reply.finish());
        return;
      }
    }
  }

  void handle_add(Connection& conn, const std::string& key, std::int64_t delta) {
    std::int64_t current = 0;
    auto it = data_.find(key);
    if (it != data_.end()) {
      const auto text = as_text(it->second);
      const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), current);
      if (ec != std::errc{} || end != text.data() + text.size() || text.empty()) {
        send(conn, error_frame(fmt::format(
                       "add: the value of key '{}' is not a decimal integer ('{}'); add only "
                       "works on keys written by add",
                       store::printable(key), store::printable(text, 40))));
        return;
      }
    }
    std::int64_t result = 0;
    if (__builtin_add_overflow(current, delta, &result)) {
      send(conn, error_frame(fmt::format("add: {} + {} overflows the 64-bit counter '{}'", current,
                                         delta, store::printable(key))));
      return;
    }
    const std::string text = std::to_string(result);
    data_[key].assign(text.begin(), text.end());
    send(conn, FrameWriter(code(Status::kOk)).i64(result).finish());
    wake_waiters(key);
  }

  static std::uint8_t code(Status status) { return static_cast<std::uint8_t>(status); }

  static std::vector<std::uint8_t> error_frame(const std::string& message) {
    return FrameWriter(code(Status::kError)).bytes(message).finish();
  }

  void park(Connection& conn, Opcode op, std::vector<std::string> keys) {
    ParkedRequest parked{op, keys.front(), {}};
    for (auto& key : keys) {
      if (data_.contains(key)) continue;
      if (parked.missing_keys.insert(key).second) waiters_[key].push_back(conn.id);
    }
    conn.parked = std::move(parked);
    ++num_parked_;
  }

  void unpark(Connection& conn) {
    if (!conn.parked) return;
    for (const auto& key : conn.parked->missing_keys) {
      auto it = waiters_.find(key);
      if (it == waiters_.end()) continue;
      std::erase(it->second, conn.id);
      if (it->second.empty()) waiters_.erase(it);
    }
    conn.parked.reset();
    --num_parked_;
  }

  // `key` now exists: answer every parked request for which it was the last missing key.
  void wake_waiters(const std::string& key) {
    auto node = waiters_.extract(key);
    if (node.empty()) return;
    for (const std::uint64_t id : node.mapped()) {
      auto it = connections_.find(id);
      if (it == connections_.end()) continue;
      Connection& conn = *it->second;
      if (!conn.parked) continue;
      conn.parked->missing_keys.erase(key);
      if (!conn.parked->missing_keys.empty()) continue;
      const Opcode op = conn.parked->op;
      const std::string first_key = conn.parked->first_key;
      conn.parked.reset();
      --num_parked_;
      try {
        if (op == Opcode::kGet) {
          send(conn, FrameWriter(code(Status::kOk)).bytes(data_.at(first_key)).finish());
        } else {
          send(conn, FrameWriter(code(Status::kOk)).finish());
        }
        // Not handle_frames(): the only frame a parked client may have sent is a kCancel that
        // crossed this answer, a no-op handled with the connection's next readable event.
        update_interest(conn);
      } catch (const DropConnection& drop) {
        close_connection(id, drop.reason);
      } catch (const std::exception& e) {
        close_connection(id, fmt::format("internal error: {}", e.what()));
      }
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
  std::unordered_map<std::string, Bytes> data_;
  std::unordered_map<std::uint64_t, std::unique_ptr<Connection>> connections_;
  std::unordered_map<std::string, std::vector<std::uint64_t>> waiters_;
  std::uint64_t next_id_ = kFirstConnectionId;
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

}  // namespace ddp
