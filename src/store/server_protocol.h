// ServerProtocol: the store server's side of the wire protocol, without sockets: it turns the
// bytes of one connection (handshake, authentication, request frames) into operations on the
// KvState and reply frames for an Outbox. The event loop (tcp_store_server.cc) owns sockets,
// buffers and timers and feeds this one unit at a time; tests can feed it directly.
//
//   ServerProtocol protocol({.auth_secret = ""});
//   protocol.open(id);
//   std::size_t n = protocol.unit_size(id, buffered);      // bytes the next unit needs
//   if (buffered.size() >= n) protocol.handle(id, buffered.first(n), outbox);
//
// Order of effects: a request's mutation is applied, and the parked requests it completes are
// answered, before the requester's own reply is queued; Outbox::send never throws for a
// connection that is gone. So a client that resets its connection right after a set cannot make
// another client miss its wake-up.
//
// Errors: a unit that breaks the protocol throws DropConnection with the reason to log; the
// caller closes that connection only. Not thread-safe (the event loop's thread owns it).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "store/auth.h"
#include "store/kv_state.h"
#include "store/protocol.h"

namespace ddp::store {

using ConnectionId = std::uint64_t;

// Close this connection (only), logging `reason` unless it is empty.
struct DropConnection {
  std::string reason;
};

// Where replies go: the event loop's write buffers, or a test's record.
class Outbox {
 public:
  virtual ~Outbox() = default;
  // Queues `frame` for connection `id`. Must not throw because that connection is gone or its
  // send failed: answering one client must never stop the processing of another.
  virtual void send(ConnectionId id, std::vector<std::uint8_t> frame) = 0;
  // Bytes held in connection buffers now; counted with the keys and values against
  // max_memory_bytes.
  virtual std::size_t buffered_bytes() const = 0;
  // A request refused because of a limit (answered with an error frame); worth a log line.
  virtual void refused(ConnectionId id, const std::string& reason) = 0;
};

struct ServerProtocolOptions {
  std::string auth_secret;  // non-empty: clients must pass the HMAC challenge (auth.h)
  // Keys, values and connection buffers together; sets and replies beyond it are refused with
  // an error reply naming the limit.
  std::size_t max_memory_bytes = SIZE_MAX;
};

class ServerProtocol {
 public:
  explicit ServerProtocol(ServerProtocolOptions options);

  void open(ConnectionId id);
  // Forgets the connection and drops its parked request, if any.
  void close(ConnectionId id);
  // Whether the connection completed the handshake (and authentication).
  bool ready(ConnectionId id) const;
  bool parked(ConnectionId id) const { return state_.parked_op(id).has_value(); }

  // The size of the next unit at the front of `buffered`: the hello (8 bytes), the
  // authentication (64) or a frame (4 + length), and 4 while less than a frame header is there.
  // Throws DropConnection for a frame header that can never be accepted (length 0 or over
  // kMaxFrameBytes), judged from the header alone before any of the body is buffered.
  std::size_t unit_size(ConnectionId id, std::span<const std::uint8_t> buffered) const;

  // Handles one complete unit (exactly unit_size() bytes). Returns a reason when the connection
  // must be closed once its replies are sent (version mismatch, failed authentication): the
  // caller logs it. Throws DropConnection for a protocol violation.
  std::string handle(ConnectionId id, std::span<const std::uint8_t> unit, Outbox& out);

  // Answers a frame that the transport read and discarded instead of buffering it (over the
  // memory limit) with an error reply carrying `reason`. Throws DropConnection when the
  // connection has a parked request (then only a cancel may come).
  void refuse(ConnectionId id, const std::string& reason, Outbox& out);

  const KvState& state() const { return state_; }
  std::size_t max_memory_bytes() const { return options_.max_memory_bytes; }

 private:
  enum class Phase {
    kHello,  // waiting for magic and version
    kAuth,   // waiting for the client's MAC and nonce (servers with a secret)
    kReady,  // frames
  };
  struct Session {
    Phase phase = Phase::kHello;
    auth::Nonce nonce{};  // the challenge sent to this client
  };

  Session& session(ConnectionId id);
  std::string handle_hello(ConnectionId id, Session& session, const std::uint8_t* data,
                           Outbox& out);
  std::string handle_auth(ConnectionId id, Session& session, const std::uint8_t* data, Outbox& out);
  void handle_frame(ConnectionId id, std::span<const std::uint8_t> body, Outbox& out);
  void dispatch(ConnectionId id, Opcode op, FrameReader& reader, Outbox& out);
  void wake(const std::vector<Wakeup>& woken, Outbox& out);
  // Replies kOk + `value`, or an error when the reply would take the store over its memory limit.
  void reply_value(ConnectionId id, std::span<const std::uint8_t> value, Outbox& out);
  // Empty when storing `value_size` bytes under `key` fits the memory limit, else the refusal.
  std::string over_memory_limit(std::string_view op, std::string_view key, std::size_t value_size,
                                const Outbox& out) const;
  void reply_error(ConnectionId id, const std::string& message, Outbox& out);
  // reply_error() for a request refused by a limit, also reported to Outbox::refused.
  void refuse_request(ConnectionId id, const std::string& reason, Outbox& out);

  ServerProtocolOptions options_;
  KvState state_;
  std::unordered_map<ConnectionId, Session> sessions_;
};

}  // namespace ddp::store
