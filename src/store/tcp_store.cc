// The TcpStore client: one blocking connection guarded by one mutex; every call has a deadline.
//
// A get/wait is parked on the server, so the client waits for the answer itself: when its
// deadline passes it sends kCancel and reads the one answer the server owes it (kCancelled with
// the keys still missing, or the value, when the key arrived as the client gave up). The
// connection therefore stays in step after a timeout. Any other failure (a timeout in the middle
// of a frame, the server gone, a reply that breaks the protocol) marks the client broken: later
// calls throw StoreError at once instead of reading a stream that is out of step.
#include <algorithm>
#include <mutex>

#include <fmt/format.h>

#include "ddp/error.h"
#include "ddp/store/tcp_store.h"
#include "net/socket.h"
#include "store/auth.h"
#include "store/protocol.h"

namespace ddp {

using store::FrameReader;
using store::FrameWriter;
using store::key_call;
using store::Opcode;
using store::quoted_keys;
using store::Status;

namespace {

// After a cancel, how long to wait for the server's last answer before giving up on it.
constexpr Milliseconds kCancelGrace{10'000};

constexpr const char* kWorkersKey = "__ddp_store/workers";
constexpr const char* kWorkersReadyKey = "__ddp_store/workers_ready";

void check_key(std::string_view key) {
  if (key.size() > store::kMaxKeyBytes) {
    throw ConfigError(fmt::format("store key '{}' is {} bytes, over the limit of {} bytes",
                                  store::printable(key, 60), key.size(), store::kMaxKeyBytes));
  }
}

void check_value(std::string_view key, std::size_t size) {
  if (size > store::kMaxValueBytes) {
    throw ConfigError(fmt::format(
        "store value for key '{}' is {} bytes, over the limit of {} bytes; store large data "
        "elsewhere and put its location in the store",
        store::printable(key, 60), size, store::kMaxValueBytes));
  }
}

void check_keys(std::span<const std::string> keys) {
  if (keys.size() > store::kMaxKeysPerRequest) {
    throw ConfigError(fmt::format("{} keys in one store request, over the limit of {}", keys.size(),
                                  store::kMaxKeysPerRequest));
  }
  std::size_t total = 0;
  for (const auto& key : keys) {
    check_key(key);
    total += key.size() + 4;
  }
  if (total + store::kFrameOverheadBytes > store::kMaxFrameBytes) {
    throw ConfigError(fmt::format("store request with {} keys is {} bytes, over the frame limit",
                                  keys.size(), total));
  }
}

}  // namespace

class TcpStore::Client {
 public:
  Client(std::string host, std::uint16_t port, Milliseconds connect_timeout,
         const std::string& secret)
      : host_(std::move(host)), port_(port) {
    const auto deadline = net::deadline_after(connect_timeout);
    try {
      socket_ = net::connect_tcp(host_, port_, deadline);  // never connected to itself
    } catch (const TimeoutError& e) {
      throw TimeoutError(fmt::format("store client: no store server answered within {} ms: {}",
                                     connect_timeout.count(), e.what()));
    }
    handshake(deadline, connect_timeout, secret);
  }

  const std::string& host() const { return host_; }
  std::uint16_t port() const { return port_; }

  // Sends one request and returns its reply (status byte first, see fields_of); a kError reply
  // becomes StoreError. `what` describes the call for messages, e.g. "get('addr/0')".
  std::vector<std::uint8_t> call(std::vector<std::uint8_t> frame, const std::string& what,
                                 Milliseconds timeout) {
    std::lock_guard lock(mutex_);
    ensure_usable(what);
    const auto deadline = net::deadline_after(timeout);
    try {
      socket_.send_all(frame.data(), frame.size(), deadline);
      return check_status(receive_frame(deadline), what);
    } catch (const TimeoutError&) {
      mark_broken("a request timed out half-way, leaving the connection out of step");
      throw TimeoutError(fmt::format("store {} timed out after {} ms (store at {}:{})", what,
                                     timeout.count(), host_, port_));
    } catch (const StoreError&) {
      throw;
    } catch (const Error& e) {
      throw lost(what, e);
    }
  }

  // Like call(), for requests the server parks (get, wait). On timeout, cancels the request and
  // throws TimeoutError listing the keys still missing.
  std::vector<std::uint8_t> call_parked(std::vector<std::uint8_t> frame, const std::string& what,
                                        Milliseconds timeout) {
    std::lock_guard lock(mutex_);
    ensure_usable(what);
    const auto deadline = net::deadline_after(timeout);
    std::vector<std::string> missing;
    try {
      socket_.send_all(frame.data(), frame.size(), deadline);
      if (socket_.wait_readable(deadline)) {
        // The answer (or EOF) is arriving; the rest of it gets at least the cancel grace.
        return check_status(receive_frame(net::deadline_after(std::max(timeout, kCancelGrace))),
                            what);
      }
      const auto cancel = FrameWriter(static_cast<std::uint8_t>(Opcode::kCancel)).finish();
      const auto grace = net::deadline_after(kCancelGrace);
      socket_.send_all(cancel.data(), cancel.size(), grace);
      auto reply = receive_frame(grace);
      if (reply.at(0) != static_cast<std::uint8_t>(Status::kCancelled)) {
        return check_status(std::move(reply), what);  // the answer crossed our cancel
      }
      FrameReader reader({reply.data() + 1, reply.size() - 1});
      const std::uint32_t count = reader.u32("key count");
      if (count > store::kMaxKeysPerRequest) {
        throw ProtocolError(fmt::format("the server listed {} missing keys", count));
      }
      missing.resize(count);
      for (auto& key : missing)
        key = reader.string("key", store::kMaxKeyBytes);
    } catch (const TimeoutError&) {
      mark_broken("a request timed out half-way, leaving the connection out of step");
      throw TimeoutError(fmt::format("store {} timed out after {} ms (store at {}:{})", what,
                                     timeout.count(), host_, port_));
    } catch (const StoreError&) {
      throw;
    } catch (const Error& e) {
      throw lost(what, e);
    }
    throw TimeoutError(fmt::format(
        "store {} timed out after {} ms; keys still missing: {} (store at {}:{}); the process "
        "that should set them may have failed or be slower than the timeout",
        what, timeout.count(), quoted_keys(missing), host_, port_));
  }

 private:
  void handshake(net::Deadline deadline, Milliseconds connect_timeout, const std::string& secret) {
    std::uint8_t hello[store::kHelloBytes];
    store::put_u32(hello, store::kMagic);
    store::put_u32(hello + 4, store::kProtocolVersion);
    std::uint8_t reply[store::kHelloReplyBytes];
    try {
      socket_.send_all(hello, sizeof hello, deadline);
      socket_.recv_all(reply, sizeof reply, deadline);
    } catch (const TimeoutError&) {
      throw TimeoutError(fmt::format(
          "store client: the server at {}:{} accepted the connection but did not answer the "
          "handshake within {} ms; is it a ddp store server?",
          host_, port_, connect_timeout.count()));
    } catch (const Error& e) {
      throw StoreError(fmt::format(
          "store client: the server at {}:{} closed the connection during the handshake ({}); "
          "is it a ddp store server of the same version?",
          host_, port_, e.what()));
    }
    const std::uint32_t magic = store::get_u32(reply);
    const std::uint32_t version = store::get_u32(reply + 4);
    if (magic != store::kMagic) {
      throw StoreError(fmt::format(
          "store client: {}:{} answered the handshake with magic 0x{:08x}, not a ddp store "
          "server; check MASTER_ADDR/MASTER_PORT",
          host_, port_, magic));
    }
    if (reply[8] == static_cast<std::uint8_t>(store::HelloStatus::kVersionMismatch) ||
        version != store::kProtocolVersion) {
      throw StoreError(fmt::format(
          "store protocol version mismatch: this client speaks version {}, the server at {}:{} "
          "speaks version {}; run the same ddp version on every node",
          store::kProtocolVersion, host_, port_, version));
    }
    if (reply[8] == static_cast<std::uint8_t>(store::HelloStatus::kAuthRequired)) {
      authenticate(deadline, connect_timeout, secret);
      return;
    }
    if (reply[8] != static_cast<std::uint8_t>(store::HelloStatus::kAccepted)) {
      throw StoreError(fmt::format("store client: {}:{} answered the handshake with status {}",
                                   host_, port_, reply[8]));
    }
    if (!secret.empty()) {
      throw StoreError(fmt::format(
          "store client: this client has a shared secret but the store server at {}:{} does not "
          "ask for one; give the server the same secret (or none to either side)",
          host_, port_));
    }
  }

  void authenticate(net::Deadline deadline, Milliseconds connect_timeout,
                    const std::string& secret) {
    if (secret.empty()) {
      throw StoreError(fmt::format(
          "store client: the store server at {}:{} requires a shared secret and this client has "
          "none; set the same secret on every process (TcpStoreOptions::auth_secret)",
          host_, port_));
    }
    try {
      auth::Nonce server_nonce;
      socket_.recv_all(server_nonce.data(), server_nonce.size(), deadline);
      const auto mac = auth::auth_mac(secret, store::kClientRole, server_nonce);
      const auto my_nonce = auth::random_nonce();
      std::uint8_t answer[store::kAuthBytes];
      std::copy(mac.begin(), mac.end(), answer);
      std::copy(my_nonce.begin(), my_nonce.end(), answer + auth::kMacBytes);
      socket_.send_all(answer, sizeof answer, deadline);
      std::uint8_t status = 0;
      socket_.recv_all(&status, 1, deadline);
      if (status != static_cast<std::uint8_t>(store::AuthStatus::kAccepted)) {
        throw StoreError(fmt::format(
            "store client: the store server at {}:{} rejected this client's shared secret; "
            "every process must use the same secret",
            host_, port_));
      }
      auth::Mac proof;
      socket_.recv_all(proof.data(), proof.size(), deadline);
      if (!auth::macs_equal(proof, auth::auth_mac(secret, store::kServerRole, my_nonce))) {
        throw StoreError(fmt::format(
            "store client: the store server at {}:{} could not prove it knows the shared secret; "
            "it is not the store of this job, or it has another secret",
            host_, port_));
      }
    } catch (const TimeoutError&) {
      throw TimeoutError(fmt::format(
          "store client: authentication with the store server at {}:{} did not finish within "
          "{} ms",
          host_, port_, connect_timeout.count()));
    } catch (const StoreError&) {
      throw;
    } catch (const ConfigError&) {
      throw;
    } catch (const Error& e) {
      throw StoreError(
          fmt::format("store client: the store server at {}:{} closed the connection during "
                      "authentication ({})",
                      host_, port_, e.what()));
    }
  }

  void ensure_usable(const std::string& what) const {
    if (!broken_reason_.empty()) {
      throw StoreError(
          fmt::format("store {} refused: the connection to the store at {}:{} is "
                      "unusable ({}); create a new TcpStore",
                      what, host_, port_, broken_reason_));
    }
  }

  void mark_broken(std::string reason) {
    broken_reason_ = std::move(reason);
    socket_.close();
  }

  StoreError lost(const std::string& what, const std::exception& cause) {
    mark_broken(fmt::format("connection lost: {}", cause.what()));
    return StoreError(fmt::format(
        "connection to store at {}:{} lost during {}: {}; the store server (rank 0 or the "
        "launcher) has probably exited",
        host_, port_, what, cause.what()));
  }

  // Returns the frame body (status byte first).
  std::vector<std::uint8_t> receive_frame(net::Deadline deadline) {
    std::uint8_t prefix[4];
    socket_.recv_all(prefix, sizeof prefix, deadline);
    const std::uint32_t length = store::get_u32(prefix);
    if (length == 0 || length > store::kMaxFrameBytes) {
      throw ProtocolError(fmt::format("the server sent a reply frame of {} bytes", length));
    }
    std::vector<std::uint8_t> body(length);
    socket_.recv_all(body.data(), body.size(), deadline);
    return body;
  }

  // Returns the reply (status byte first) when the status is kOk.
  std::vector<std::uint8_t> check_status(std::vector<std::uint8_t> body, const std::string& what) {
    const auto status = static_cast<Status>(body[0]);
    if (status == Status::kOk) {
      return body;
    }
    if (status == Status::kError) {
      FrameReader reader({body.data() + 1, body.size() - 1});
      throw StoreError(fmt::format("store {} refused by the server at {}:{}: {}", what, host_,
                                   port_, reader.string("message", store::kMaxFrameBytes)));
    }
    throw ProtocolError(fmt::format("unexpected reply status {}", body[0]));
  }

  std::string host_;
  std::uint16_t port_;
  std::mutex mutex_;
  net::Socket socket_;
  std::string broken_reason_;  // non-empty once the connection must not be used again
};

namespace {

std::uint8_t opcode(Opcode op) {
  return static_cast<std::uint8_t>(op);
}

// The fields of a kOk reply: everything after its status byte (a view, not a copy: a value can be
// 64 MiB).
FrameReader fields_of(const std::vector<std::uint8_t>& reply) {
  return FrameReader(std::span<const std::uint8_t>(reply).subspan(1));
}

}  // namespace

TcpStore::TcpStore(std::string host, std::uint16_t port, TcpStoreOptions options) {
  timeout_ = options.timeout;
  if (options.num_workers && *options.num_workers < 1) {
    throw ConfigError(
        fmt::format("TcpStore: num_workers must be at least 1, got {}", *options.num_workers));
  }
  if (!options.auth_secret.empty()) auth::require_auth();
  if (options.is_server) {
    try {
      server_ =
          std::make_unique<TcpStoreServer>(TcpStoreServerOptions{.listen_host = options.listen_host,
                                                                 .port = port,
                                                                 .auth_secret = options.auth_secret,
                                                                 .limits = options.server_limits});
    } catch (const ConfigError& e) {
      throw ConfigError(fmt::format("cannot start the store server: {}", e.what()));
    }
    port = server_->port();
  }
  client_ =
      std::make_unique<Client>(std::move(host), port, options.connect_timeout, options.auth_secret);

  if (options.num_workers) {
    const int expected = *options.num_workers;
    if (add(kWorkersKey, 1) == expected) set(kWorkersReadyKey, "1");
    if (options.is_server && options.wait_for_workers) {
      const std::string ready[] = {kWorkersReadyKey};
      try {
        wait(ready, options.timeout);
      } catch (const TimeoutError&) {
        throw TimeoutError(fmt::format(
            "store server waited {} ms for {} workers to connect, but only {} did; check that "
            "every rank was started and reaches {}:{}",
            options.timeout.count(), expected, get_string(kWorkersKey), client_->host(),
            client_->port()));
      }
    }
  }
}

TcpStore::~TcpStore() = default;

const std::string& TcpStore::host() const {
  return client_->host();
}
std::uint16_t TcpStore::port() const {
  return client_->port();
}
TcpStoreServer* TcpStore::server() {
  return server_.get();
}

void TcpStore::set(std::string_view key, std::span<const std::uint8_t> value) {
  check_key(key);
  check_value(key, value.size());
  client_->call(FrameWriter(opcode(Opcode::kSet)).bytes(key).bytes(value).finish(),
                key_call("set", key), timeout());
}

Bytes TcpStore::get(std::string_view key, Milliseconds timeout) {
  check_key(key);
  const auto reply = client_->call_parked(FrameWriter(opcode(Opcode::kGet)).bytes(key).finish(),
                                          key_call("get", key), timeout);
  FrameReader reader = fields_of(reply);
  const auto value = reader.bytes("value", store::kMaxValueBytes);
  return {value.begin(), value.end()};
}

std::int64_t TcpStore::add(std::string_view key, std::int64_t delta) {
  check_key(key);
  const auto reply = client_->call(FrameWriter(opcode(Opcode::kAdd)).bytes(key).i64(delta).finish(),
                                   key_call("add", key), timeout());
  FrameReader reader = fields_of(reply);
  return reader.i64("value");
}

Bytes TcpStore::compare_set(std::string_view key, std::span<const std::uint8_t> expected,
                            std::span<const std::uint8_t> desired) {
  check_key(key);
  check_value(key, expected.size());
  check_value(key, desired.size());
  const auto reply = client_->call(
      FrameWriter(opcode(Opcode::kCompareSet)).bytes(key).bytes(expected).bytes(desired).finish(),
      key_call("compare_set", key), timeout());
  FrameReader reader = fields_of(reply);
  const auto value = reader.bytes("value", store::kMaxValueBytes);
  return {value.begin(), value.end()};
}

bool TcpStore::check(std::span<const std::string> keys) {
  check_keys(keys);
  FrameWriter frame(opcode(Opcode::kCheck));
  frame.u32(static_cast<std::uint32_t>(keys.size()));
  for (const auto& key : keys)
    frame.bytes(key);
  const auto reply =
      client_->call(frame.finish(), fmt::format("check({})", quoted_keys(keys)), timeout());
  FrameReader reader = fields_of(reply);
  return reader.u8("result") != 0;
}

void TcpStore::wait(std::span<const std::string> keys, Milliseconds timeout) {
  check_keys(keys);
  FrameWriter frame(opcode(Opcode::kWait));
  frame.u32(static_cast<std::uint32_t>(keys.size()));
  for (const auto& key : keys)
    frame.bytes(key);
  client_->call_parked(frame.finish(), fmt::format("wait({})", quoted_keys(keys)), timeout);
}

bool TcpStore::delete_key(std::string_view key) {
  check_key(key);
  const auto reply = client_->call(FrameWriter(opcode(Opcode::kDelete)).bytes(key).finish(),
                                   key_call("delete_key", key), timeout());
  FrameReader reader = fields_of(reply);
  return reader.u8("result") != 0;
}

std::int64_t TcpStore::num_keys() {
  const auto reply =
      client_->call(FrameWriter(opcode(Opcode::kNumKeys)).finish(), "num_keys()", timeout());
  FrameReader reader = fields_of(reply);
  return reader.i64("count");
}

std::uint16_t pick_free_port() {
  return net::pick_free_port();
}

}  // namespace ddp
