// The c10d TCPStore client (c10d_store_client.h): one blocking connection, one mutex, a deadline
// on every read and write.
#include "store/c10d_store_client.h"

#include <algorithm>
#include <mutex>
#include <random>
#include <vector>

#include <fmt/format.h>

#include "ddp/error.h"
#include "net/socket.h"
#include "store/protocol.h"

namespace ddp {
namespace {

// c10d's QueryType (torch/csrc/distributed/c10d/TCPStoreBackend.hpp, PyTorch 2.x).
enum class Query : std::uint8_t {
  kValidate = 0,
  kSet = 1,
  kCompareSet = 2,
  kGet = 3,
  kAdd = 4,
  kCheck = 5,
  kWait = 6,
  kGetNumKeys = 7,
  kDeleteKey = 8,
  kCancelWait = 12,
  kPing = 13,
};
constexpr std::uint32_t kValidationMagic = 0x3C85F7CE;
constexpr std::uint8_t kCheckReady = 0;     // CheckResponseType::READY
constexpr std::uint8_t kCheckNotReady = 1;  // CheckResponseType::NOT_READY
constexpr std::uint8_t kStopWaiting = 0;    // WaitResponseType::STOP_WAITING
constexpr std::uint8_t kWaitCanceled = 1;   // WaitResponseType::WAIT_CANCELED

// After a cancel, how long to wait for the server's last answer; the least time the handshake's
// answer gets even when connecting used up connect_timeout.
constexpr Milliseconds kGrace{10'000};
// Largest value accepted in a reply (a value another client set, possibly through c10d's classic
// server, which has no limit of its own); beyond it the reply is taken for garbage.
constexpr std::uint64_t kMaxReplyBytes = 256ull * 1024 * 1024;

class Request {
 public:
  explicit Request(Query query) { bytes_.push_back(static_cast<std::uint8_t>(query)); }
  Request& u32(std::uint32_t v) { return little_endian(v, 4); }
  Request& u64(std::uint64_t v) { return little_endian(v, 8); }
  Request& i64(std::int64_t v) { return little_endian(static_cast<std::uint64_t>(v), 8); }
  // c10d's client puts "/" before every key (TCPStore::keyPrefix_).
  Request& key(std::string_view key) {
    u64(key.size() + 1);
    bytes_.push_back('/');
    bytes_.insert(bytes_.end(), key.begin(), key.end());
    return *this;
  }
  Request& data(std::span<const std::uint8_t> value) {
    u64(value.size());
    bytes_.insert(bytes_.end(), value.begin(), value.end());
    return *this;
  }
  const std::vector<std::uint8_t>& bytes() const { return bytes_; }

 private:
  Request& little_endian(std::uint64_t v, int size) {
    for (int i = 0; i < size; ++i)
      bytes_.push_back(static_cast<std::uint8_t>(v >> (8 * i)));
    return *this;
  }
  std::vector<std::uint8_t> bytes_;
};

std::uint64_t get_le(const std::uint8_t* p, int size) {
  std::uint64_t v = 0;
  for (int i = size - 1; i >= 0; --i)
    v = (v << 8) | p[i];
  return v;
}

void check_c10d_key(std::string_view key) {
  if (key.size() > kC10dMaxKeyBytes) {
    throw ConfigError(
        fmt::format("store key '{}' is {} bytes, over the c10d TCPStore limit of {} bytes",
                    store::printable(key, 60), key.size(), kC10dMaxKeyBytes));
  }
}

void check_c10d_value(std::string_view key, std::size_t size) {
  if (size > kC10dMaxValueBytes) {
    throw ConfigError(fmt::format(
        "store value for key '{}' is {} bytes, over the c10d TCPStore limit of {} bytes; store "
        "large data elsewhere and put its location in the store",
        store::printable(key, 60), size, kC10dMaxValueBytes));
  }
}

void check_c10d_keys(std::span<const std::string> keys) {
  if (keys.size() > kC10dMaxKeysPerRequest) {
    throw ConfigError(fmt::format("{} keys in one store request, over the limit of {}", keys.size(),
                                  kC10dMaxKeysPerRequest));
  }
  for (const auto& key : keys)
    check_c10d_key(key);
}

}  // namespace

class C10dStoreClient::Connection {
 public:
  Connection(std::string host, std::uint16_t port, Milliseconds connect_timeout)
      : host_(std::move(host)), port_(port) {
    const auto deadline = net::deadline_after(connect_timeout);
    try {
      socket_ = net::connect_tcp(host_, port_, deadline);  // never connected to itself
    } catch (const TimeoutError& e) {
      throw TimeoutError(fmt::format(
          "no c10d TCPStore (torchrun's store) accepted a connection at {}:{} within {} ms: {}",
          host_, port_, connect_timeout.count(), e.what()));
    }
    socket_.set_no_delay(true);
    // The answer gets what is left of connect_timeout, and at least min(connect_timeout, 10 s).
    const auto answer_deadline =
        std::max(deadline, net::deadline_after(std::min(connect_timeout, kGrace)));
    handshake(answer_deadline,
              std::chrono::duration_cast<Milliseconds>(answer_deadline - net::Clock::now()));
  }

  const std::string& host() const { return host_; }
  std::uint16_t port() const { return port_; }

  // Runs `body(deadline)` under the lock with the connection's error handling: a timeout or a
  // protocol violation leaves the connection out of step and marks it broken.
  template <class F>
  auto call(const std::string& what, Milliseconds timeout, F&& body) {
    std::lock_guard lock(mutex_);
    ensure_usable(what);
    try {
      return body(net::deadline_after(timeout));
    } catch (const TimeoutError& e) {
      mark_broken("a request timed out half-way, leaving the connection out of step");
      throw TimeoutError(fmt::format("c10d store {} timed out after {} ms (store at {}:{}): {}",
                                     what, timeout.count(), host_, port_, e.what()));
    } catch (const ProtocolError& e) {
      mark_broken(e.what());
      throw StoreError(fmt::format(
          "the store at {}:{} answered {} with bytes that break the c10d TCPStore protocol ({})",
          host_, port_, what, e.what()));
    } catch (const StoreError&) {
      throw;
    } catch (const ConfigError&) {
      throw;
    } catch (const Error& e) {
      mark_broken(fmt::format("connection lost: {}", e.what()));
      throw StoreError(fmt::format(
          "connection to the c10d store at {}:{} lost during {}: {}; torchrun's agent (which "
          "hosts it) has probably exited",
          host_, port_, what, e.what()));
    }
  }

  void send(const Request& request, net::Deadline deadline) {
    socket_.send_all(request.bytes().data(), request.bytes().size(), deadline);
  }
  std::uint8_t recv_u8(net::Deadline deadline) {
    std::uint8_t v = 0;
    socket_.recv_all(&v, 1, deadline);
    return v;
  }
  std::int64_t recv_i64(net::Deadline deadline) {
    std::uint8_t b[8];
    socket_.recv_all(b, 8, deadline);
    return static_cast<std::int64_t>(get_le(b, 8));
  }
  Bytes recv_vector(net::Deadline deadline) {
    std::uint8_t b[8];
    socket_.recv_all(b, 8, deadline);
    const std::uint64_t size = get_le(b, 8);
    if (size > kMaxReplyBytes) {
      throw ProtocolError(fmt::format("a value of {} bytes announced", size));
    }
    Bytes value(size);
    if (size > 0) socket_.recv_all(value.data(), value.size(), deadline);
    return value;
  }
  bool wait_readable(net::Deadline deadline) { return socket_.wait_readable(deadline); }

 private:
  void handshake(net::Deadline deadline, Milliseconds allowed) {
    // The nonce's third byte has its top bit set: a PyTorch 1.x server reads VALIDATE as SET and
    // the magic plus this nonce as a key length above 2^63, which it refuses and closes at once
    // instead of trying to allocate it.
    std::random_device random;
    const std::uint32_t nonce = (random() & 0xff7fffffu) | 0x00800000u;
    Request hello(Query::kValidate);
    hello.u32(kValidationMagic);
    Request ping(Query::kPing);
    ping.u32(nonce);
    std::vector<std::uint8_t> both = hello.bytes();
    both.insert(both.end(), ping.bytes().begin(), ping.bytes().end());
    std::uint8_t answer[4];
    const std::string not_c10d = fmt::format(
        "the store at {}:{} does not speak the c10d TCPStore protocol of PyTorch 2.x "
        "(MASTER_ADDR/MASTER_PORT with TORCHELASTIC_USE_AGENT_STORE=True must be torchrun's own "
        "store)",
        host_, port_);
    try {
      socket_.send_all(both.data(), both.size(), deadline);
      socket_.recv_all(answer, sizeof answer, deadline);
    } catch (const TimeoutError&) {
      throw TimeoutError(fmt::format(
          "{}: it accepted the connection but did not answer the handshake (validate + ping) "
          "within {} ms",
          not_c10d, allowed.count()));
    } catch (const Error& e) {
      throw StoreError(fmt::format(
          "{}: it closed the connection during the handshake ({}); a ddp store server and "
          "PyTorch 1.x's TCPStore do so",
          not_c10d, e.what()));
    }
    const auto echoed = static_cast<std::uint32_t>(get_le(answer, 4));
    if (echoed != nonce) {
      throw StoreError(
          fmt::format("{}: it answered the ping with 0x{:08x} instead of the nonce 0x{:08x}",
                      not_c10d, echoed, nonce));
    }
  }

  void ensure_usable(const std::string& what) const {
    if (!broken_reason_.empty()) {
      throw StoreError(
          fmt::format("c10d store {} refused: the connection to the store at {}:{} is unusable "
                      "({}); create a new client",
                      what, host_, port_, broken_reason_));
    }
  }

  void mark_broken(std::string reason) {
    broken_reason_ = std::move(reason);
    socket_.close();
  }

  std::string host_;
  std::uint16_t port_;
  std::mutex mutex_;
  net::Socket socket_;
  std::string broken_reason_;
};

C10dStoreClient::C10dStoreClient(std::string host, std::uint16_t port, C10dStoreOptions options)
    : connection_(std::make_unique<Connection>(std::move(host), port, options.connect_timeout)) {
  timeout_ = options.timeout;
}

C10dStoreClient::~C10dStoreClient() = default;

const std::string& C10dStoreClient::host() const {
  return connection_->host();
}
std::uint16_t C10dStoreClient::port() const {
  return connection_->port();
}

void C10dStoreClient::set(std::string_view key, std::span<const std::uint8_t> value) {
  check_c10d_key(key);
  check_c10d_value(key, value.size());
  Request request(Query::kSet);
  request.key(key).data(value);
  connection_->call(store::key_call("set", key), timeout(),
                    [&](net::Deadline deadline) { connection_->send(request, deadline); });
}

Bytes C10dStoreClient::get(std::string_view key, Milliseconds timeout) {
  check_c10d_key(key);
  const std::string keys[] = {std::string(key)};
  wait(keys, timeout);
  Request request(Query::kGet);
  request.key(key);
  return connection_->call(store::key_call("get", key), this->timeout(),
                           [&](net::Deadline deadline) {
                             connection_->send(request, deadline);
                             return connection_->recv_vector(deadline);
                           });
}

std::int64_t C10dStoreClient::add(std::string_view key, std::int64_t delta) {
  check_c10d_key(key);
  Request request(Query::kAdd);
  request.key(key).i64(delta);
  return connection_->call(store::key_call("add", key), timeout(), [&](net::Deadline deadline) {
    connection_->send(request, deadline);
    return connection_->recv_i64(deadline);
  });
}

Bytes C10dStoreClient::compare_set(std::string_view key, std::span<const std::uint8_t> expected,
                                   std::span<const std::uint8_t> desired) {
  check_c10d_key(key);
  check_c10d_value(key, expected.size());
  check_c10d_value(key, desired.size());
  Request request(Query::kCompareSet);
  request.key(key).data(expected).data(desired);
  Bytes result = connection_->call(store::key_call("compare_set", key), timeout(),
                                   [&](net::Deadline deadline) {
                                     connection_->send(request, deadline);
                                     return connection_->recv_vector(deadline);
                                   });
  // c10d answers `expected` for a missing key compared with a non-empty `expected`. When the key
  // exists and equals `expected` it becomes `desired` and the answer is `desired`; so `expected`
  // back, differing from `desired`, means the key is missing. When they are equal the request
  // changed nothing either way and check() tells.
  const bool same = std::equal(result.begin(), result.end(), expected.begin(), expected.end());
  if (!expected.empty() && same) {
    const bool no_op = std::equal(expected.begin(), expected.end(), desired.begin(), desired.end());
    const std::string keys[] = {std::string(key)};
    if (!no_op || !check(keys)) return {};
  }
  return result;
}

bool C10dStoreClient::check(std::span<const std::string> keys) {
  check_c10d_keys(keys);
  if (keys.empty()) return true;  // c10d's servers read keys[0] of every check
  Request request(Query::kCheck);
  request.u64(keys.size());
  for (const auto& key : keys)
    request.key(key);
  return connection_->call(
      fmt::format("check({})", store::quoted_keys(keys)), timeout(), [&](net::Deadline deadline) {
        connection_->send(request, deadline);
        const std::uint8_t answer = connection_->recv_u8(deadline);
        if (answer != kCheckReady && answer != kCheckNotReady) {
          throw ProtocolError(fmt::format("check answered {}, expected 0 or 1", answer));
        }
        return answer == kCheckReady;
      });
}

void C10dStoreClient::wait(std::span<const std::string> keys, Milliseconds timeout) {
  check_c10d_keys(keys);
  if (keys.empty()) return;  // nothing to wait for (and c10d's servers read keys[0])
  Request request(Query::kWait);
  request.u64(keys.size());
  for (const auto& key : keys)
    request.key(key);
  const std::string what = fmt::format("wait({})", store::quoted_keys(keys));
  const bool arrived = connection_->call(what, timeout, [&](net::Deadline deadline) {
    connection_->send(request, deadline);
    const auto expect_stop = [](std::uint8_t answer) {
      if (answer != kStopWaiting) {
        throw ProtocolError(fmt::format("wait answered {}, expected 0 (stop waiting)", answer));
      }
    };
    if (connection_->wait_readable(deadline)) {
      expect_stop(connection_->recv_u8(net::deadline_after(kGrace)));
      return true;
    }
    // Past the deadline: cancel; the server answers WAIT_CANCELED, after STOP_WAITING when the
    // keys arrived as we gave up (then they are there, and we say so).
    const auto grace = net::deadline_after(kGrace);
    connection_->send(Request(Query::kCancelWait), grace);
    const std::uint8_t first = connection_->recv_u8(grace);
    if (first == kWaitCanceled) return false;
    expect_stop(first);
    if (connection_->recv_u8(grace) != kWaitCanceled) {
      throw ProtocolError("no WAIT_CANCELED answer after a cancel");
    }
    return true;
  });
  if (arrived) return;
  std::vector<std::string> missing;
  for (const auto& key : keys) {
    const std::string one[] = {key};
    if (missing.size() < 9 && !check(one)) missing.push_back(key);
  }
  throw TimeoutError(fmt::format(
      "store {} timed out after {} ms; keys still missing: {} (c10d store at {}:{}); the process "
      "that should set them may have failed or be slower than the timeout",
      what, timeout.count(), store::quoted_keys(missing), host(), port()));
}

bool C10dStoreClient::delete_key(std::string_view key) {
  check_c10d_key(key);
  Request request(Query::kDeleteKey);
  request.key(key);
  return connection_->call(store::key_call("delete_key", key), timeout(),
                           [&](net::Deadline deadline) {
                             connection_->send(request, deadline);
                             return connection_->recv_i64(deadline) > 0;
                           });
}

std::int64_t C10dStoreClient::num_keys() {
  const Request request(Query::kGetNumKeys);
  return connection_->call("num_keys()", timeout(), [&](net::Deadline deadline) {
    connection_->send(request, deadline);
    return connection_->recv_i64(deadline);
  });
}

}  // namespace ddp
