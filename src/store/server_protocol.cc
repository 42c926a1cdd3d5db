#include "store/server_protocol.h"

#include <algorithm>

#include <fmt/format.h>

#include "ddp/error.h"

namespace ddp::store {

namespace {

// Replies this small are always sent, whatever the memory limit says: refusing them would save
// nothing (an error reply is as large).
constexpr std::size_t kSmallReplyBytes = 4096;

std::uint8_t code(Status status) {
  return static_cast<std::uint8_t>(status);
}

std::vector<std::uint8_t> ok_frame() {
  return FrameWriter(code(Status::kOk)).finish();
}

}  // namespace

ServerProtocol::ServerProtocol(ServerProtocolOptions options) : options_(std::move(options)) {
  if (!options_.auth_secret.empty()) auth::require_auth();
}

void ServerProtocol::open(ConnectionId id) {
  sessions_[id] = Session{};
}

void ServerProtocol::close(ConnectionId id) {
  state_.unpark(id);
  sessions_.erase(id);
}

bool ServerProtocol::ready(ConnectionId id) const {
  auto it = sessions_.find(id);
  return it != sessions_.end() && it->second.phase == Phase::kReady;
}

ServerProtocol::Session& ServerProtocol::session(ConnectionId id) {
  auto it = sessions_.find(id);
  if (it == sessions_.end()) throw DropConnection{"internal error: unknown connection"};
  return it->second;
}

std::size_t ServerProtocol::unit_size(ConnectionId id,
                                      std::span<const std::uint8_t> buffered) const {
  auto it = sessions_.find(id);
  if (it == sessions_.end()) throw DropConnection{"internal error: unknown connection"};
  switch (it->second.phase) {
    case Phase::kHello:
      return kHelloBytes;
    case Phase::kAuth:
      return kAuthBytes;
    case Phase::kReady:
      break;
  }
  if (buffered.size() < 4) return 4;
  const std::uint32_t length = get_u32(buffered.data());
  if (length == 0) throw DropConnection{"empty frame (length 0, no opcode)"};
  if (length > kMaxFrameBytes) {
    throw DropConnection{
        fmt::format("frame of {} bytes exceeds the limit of {} bytes", length, kMaxFrameBytes)};
  }
  return 4 + std::size_t{length};
}

std::string ServerProtocol::handle(ConnectionId id, std::span<const std::uint8_t> unit,
                                   Outbox& out) {
  Session& s = session(id);
  switch (s.phase) {
    case Phase::kHello:
      return handle_hello(id, s, unit.data(), out);
    case Phase::kAuth:
      return handle_auth(id, s, unit.data(), out);
    case Phase::kReady:
      handle_frame(id, unit.subspan(4), out);
      return {};
  }
  return {};
}

std::string ServerProtocol::handle_hello(ConnectionId id, Session& s, const std::uint8_t* data,
                                         Outbox& out) {
  const std::uint32_t magic = get_u32(data);
  const std::uint32_t version = get_u32(data + 4);
  if (magic != kMagic) {
    throw DropConnection{
        fmt::format("bad handshake: magic 0x{:08x}, expected 0x{:08x} (not a ddp store client?)",
                    magic, kMagic)};
  }
  std::vector<std::uint8_t> reply(kHelloReplyBytes);
  put_u32(reply.data(), kMagic);
  put_u32(reply.data() + 4, kProtocolVersion);
  if (version != kProtocolVersion) {
    reply[8] = static_cast<std::uint8_t>(HelloStatus::kVersionMismatch);
    out.send(id, std::move(reply));
    return fmt::format("client speaks store protocol version {}, this server speaks version {}",
                       version, kProtocolVersion);
  }
  if (!options_.auth_secret.empty()) {
    reply[8] = static_cast<std::uint8_t>(HelloStatus::kAuthRequired);
    s.nonce = auth::random_nonce();
    s.phase = Phase::kAuth;
    reply.insert(reply.end(), s.nonce.begin(), s.nonce.end());
  } else {
    reply[8] = static_cast<std::uint8_t>(HelloStatus::kAccepted);
    s.phase = Phase::kReady;
  }
  out.send(id, std::move(reply));
  return {};
}

std::string ServerProtocol::handle_auth(ConnectionId id, Session& s, const std::uint8_t* data,
                                        Outbox& out) {
  const std::span<const std::uint8_t> client_mac(data, auth::kMacBytes);
  const std::span<const std::uint8_t> client_nonce(data + auth::kMacBytes, auth::kNonceBytes);
  const auto expected = auth::auth_mac(options_.auth_secret, kClientRole, s.nonce);
  if (!auth::macs_equal(client_mac, expected)) {
    out.send(id, {static_cast<std::uint8_t>(AuthStatus::kRejected)});
    return "authentication failed (wrong shared secret)";
  }
  const auto proof = auth::auth_mac(options_.auth_secret, kServerRole, client_nonce);
  std::vector<std::uint8_t> reply{static_cast<std::uint8_t>(AuthStatus::kAccepted)};
  reply.insert(reply.end(), proof.begin(), proof.end());
  s.phase = Phase::kReady;
  out.send(id, std::move(reply));
  return {};
}

void ServerProtocol::handle_frame(ConnectionId id, std::span<const std::uint8_t> body,
                                  Outbox& out) {
  const std::uint8_t opcode = body[0];
  if (opcode == 0 || opcode > kMaxOpcode) {
    throw DropConnection{fmt::format("unknown opcode {}", opcode)};
  }
  const auto op = static_cast<Opcode>(opcode);
  if (const auto parked_op = state_.parked_op(id); parked_op && op != Opcode::kCancel) {
    throw DropConnection{fmt::format(
        "'{}' request while a '{}' is still pending (one request at a time per connection)",
        opcode_name(op), opcode_name(*parked_op))};
  }
  FrameReader reader(body.subspan(1));
  try {
    dispatch(id, op, reader, out);
  } catch (const ProtocolError& e) {
    throw DropConnection{fmt::format("malformed '{}' frame: {}", opcode_name(op), e.what())};
  }
}

void ServerProtocol::refuse(ConnectionId id, const std::string& reason, Outbox& out) {
  if (const auto parked_op = state_.parked_op(id)) {
    throw DropConnection{
        fmt::format("a large frame while a '{}' is still pending", opcode_name(*parked_op))};
  }
  refuse_request(id, reason, out);
}

void ServerProtocol::dispatch(ConnectionId id, Opcode op, FrameReader& reader, Outbox& out) {
  switch (op) {
    case Opcode::kSet: {
      const std::string key = reader.string("key", kMaxKeyBytes);
      const auto value = reader.bytes("value", kMaxValueBytes);
      reader.expect_end("set");
      if (auto refusal = over_memory_limit("set", key, value.size(), out); !refusal.empty()) {
        refuse_request(id, refusal, out);
        return;
      }
      // Apply and wake first: the requester may be gone by the time its reply is sent.
      wake(state_.set(key, value), out);
      out.send(id, ok_frame());
      return;
    }
    case Opcode::kGet: {
      const std::string key = reader.string("key", kMaxKeyBytes);
      reader.expect_end("get");
      if (const Bytes* value = state_.find(key)) {
        reply_value(id, *value, out);
      } else {
        const std::string keys[] = {key};
        state_.park(id, op, keys);
      }
      return;
    }
    case Opcode::kAdd: {
      const std::string key = reader.string("key", kMaxKeyBytes);
      const std::int64_t delta = reader.i64("delta");
      reader.expect_end("add");
      if (auto refusal = over_memory_limit("add", key, 20, out); !refusal.empty()) {
        refuse_request(id, refusal, out);
        return;
      }
      auto result = state_.add(key, delta);
      if (!result.value) {
        reply_error(id, result.error, out);
        return;
      }
      wake(result.woken, out);
      out.send(id, FrameWriter(code(Status::kOk)).i64(*result.value).finish());
      return;
    }
    case Opcode::kCompareSet: {
      const std::string key = reader.string("key", kMaxKeyBytes);
      const auto expected = reader.bytes("expected", kMaxValueBytes);
      const auto desired = reader.bytes("desired", kMaxValueBytes);
      reader.expect_end("compare_set");
      if (auto refusal = over_memory_limit("compare_set", key, desired.size(), out);
          !refusal.empty()) {
        refuse_request(id, refusal, out);
        return;
      }
      auto result = state_.compare_set(key, expected, desired);
      wake(result.woken, out);
      reply_value(id, result.value, out);
      return;
    }
    case Opcode::kCheck:
    case Opcode::kWait: {
      const std::uint32_t count = reader.u32("key count");
      if (count > kMaxKeysPerRequest) {
        throw ProtocolError(
            fmt::format("{} keys, over the limit of {}", count, kMaxKeysPerRequest));
      }
      std::vector<std::string> keys;
      keys.reserve(count);
      for (std::uint32_t i = 0; i < count; ++i) {
        keys.push_back(reader.string("key", kMaxKeyBytes));
      }
      reader.expect_end(opcode_name(op));
      if (op == Opcode::kCheck) {
        const bool all_exist =
            std::ranges::all_of(keys, [&](const std::string& k) { return state_.contains(k); });
        out.send(id, FrameWriter(code(Status::kOk)).u8(all_exist ? 1 : 0).finish());
      } else if (keys.empty() || !state_.park(id, op, keys)) {
        out.send(id, ok_frame());
      }
      return;
    }
    case Opcode::kDelete: {
      const std::string key = reader.string("key", kMaxKeyBytes);
      reader.expect_end("delete_key");
      const bool existed = state_.erase(key);
      out.send(id, FrameWriter(code(Status::kOk)).u8(existed ? 1 : 0).finish());
      return;
    }
    case Opcode::kNumKeys: {
      reader.expect_end("num_keys");
      out.send(id, FrameWriter(code(Status::kOk))
                       .i64(static_cast<std::int64_t>(state_.num_keys()))
                       .finish());
      return;
    }
    case Opcode::kCancel: {
      reader.expect_end("cancel");
      // Without a parked request the answer already went out (the key arrived as the client
      // gave up); the client reads that answer instead, so there is nothing to do.
      auto missing = state_.unpark(id);
      if (!missing) return;
      FrameWriter reply(code(Status::kCancelled));
      reply.u32(static_cast<std::uint32_t>(missing->size()));
      for (const auto& key : *missing)
        reply.bytes(key);
      out.send(id, reply.finish());
      return;
    }
  }
}

void ServerProtocol::wake(const std::vector<Wakeup>& woken, Outbox& out) {
  for (const Wakeup& w : woken) {
    if (w.op == Opcode::kGet) {
      const Bytes* value = state_.find(w.key);
      reply_value(w.waiter,
                  value ? std::span<const std::uint8_t>(*value) : std::span<const std::uint8_t>{},
                  out);
    } else {
      out.send(w.waiter, ok_frame());
    }
  }
}

void ServerProtocol::reply_value(ConnectionId id, std::span<const std::uint8_t> value,
                                 Outbox& out) {
  const std::size_t size = value.size() + 9;
  if (size > kSmallReplyBytes &&
      state_.bytes() + out.buffered_bytes() + size > options_.max_memory_bytes) {
    const std::string reason = fmt::format(
        "a reply of {} bytes would take the store's memory (keys, values and connection buffers, "
        "{} bytes now) over its limit of {} bytes (TcpStoreLimits::max_memory_bytes); try again "
        "later",
        size, state_.bytes() + out.buffered_bytes(), options_.max_memory_bytes);
    refuse_request(id, reason, out);
    return;
  }
  out.send(id, FrameWriter(code(Status::kOk)).bytes(value).finish());
}

std::string ServerProtocol::over_memory_limit(std::string_view op, std::string_view key,
                                              std::size_t value_size, const Outbox& out) const {
  const std::size_t stored = state_.bytes_after_store(key, value_size);
  const std::size_t after = stored + out.buffered_bytes();
  if (after <= options_.max_memory_bytes || stored <= state_.bytes()) return {};
  return fmt::format(
      "{}('{}') of {} bytes would take the store's memory (keys, values and connection buffers) "
      "to {} bytes, over its limit of {} bytes (TcpStoreLimits::max_memory_bytes); delete keys "
      "or raise the limit",
      op, printable(key), value_size, after, options_.max_memory_bytes);
}

void ServerProtocol::refuse_request(ConnectionId id, const std::string& reason, Outbox& out) {
  out.refused(id, reason);
  reply_error(id, reason, out);
}

void ServerProtocol::reply_error(ConnectionId id, const std::string& message, Outbox& out) {
  out.send(id, FrameWriter(code(Status::kError)).bytes(message).finish());
}

}  // namespace ddp::store
