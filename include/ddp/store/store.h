// Store: the rendezvous key-value store that processes use to find each other.
//
// Keys are strings, values are bytes. Every call has a deadline: `timeout()` unless the call takes
// its own. Implementations are thread-safe: several threads may share one Store.
//
//   auto store = std::make_shared<ddp::TcpStore>("127.0.0.1", 29500,
//                                                ddp::TcpStoreOptions{.is_server = rank == 0});
//   store->set("addr/3", "10.0.0.7:4100");
//   auto value = store->get("addr/0");          // blocks until rank 0 has set it
//
// Throws TimeoutError when a deadline passes, StoreError when the server refuses a request or is
// gone, ConfigError for arguments outside the documented limits (see tcp_store.h). Implementations:
// TcpStore (tcp_store.h), PrefixStore (prefix_store.h); the protocol is in docs/store.md.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "ddp/timeouts.h"

// Exported by ddp's shared libraries, which hide the rest (src/CMakeLists.txt).
#pragma GCC visibility push(default)
namespace ddp {

using Bytes = std::vector<std::uint8_t>;

class Store {
 public:
  virtual ~Store() = default;

  // Stores `value` under `key`, replacing any earlier value, and wakes waiters on `key`.
  virtual void set(std::string_view key, std::span<const std::uint8_t> value) = 0;
  void set(std::string_view key, std::string_view value);

  // Returns the value of `key`, waiting until it exists or `timeout` passes (TimeoutError).
  virtual Bytes get(std::string_view key, Milliseconds timeout) = 0;
  Bytes get(std::string_view key) { return get(key, timeout()); }
  std::string get_string(std::string_view key) { return get_string(key, timeout()); }
  std::string get_string(std::string_view key, Milliseconds timeout);

  // Adds `delta` to the 64-bit counter at `key` (created as 0) and returns the new value.
  virtual std::int64_t add(std::string_view key, std::int64_t delta) = 0;

  // Atomically: if the current value of `key` equals `expected` (a missing key equals an empty
  // `expected`), sets it to `desired`. Returns the value held afterwards, so the caller won
  // exactly when the result equals `desired`.
  virtual Bytes compare_set(std::string_view key, std::span<const std::uint8_t> expected,
                            std::span<const std::uint8_t> desired) = 0;
  std::string compare_set(std::string_view key, std::string_view expected,
                          std::string_view desired);

  // True when every key exists; does not wait.
  virtual bool check(std::span<const std::string> keys) = 0;

  // Waits until every key exists or `timeout` passes (TimeoutError naming the missing keys).
  virtual void wait(std::span<const std::string> keys, Milliseconds timeout) = 0;
  void wait(std::span<const std::string> keys) { wait(keys, timeout()); }

  // Deletes `key`; returns whether it existed.
  virtual bool delete_key(std::string_view key) = 0;

  // Number of keys the server holds (all prefixes included).
  virtual std::int64_t num_keys() = 0;

  Milliseconds timeout() const { return timeout_; }
  void set_timeout(Milliseconds timeout) { timeout_ = timeout; }

 protected:
  Milliseconds timeout_ = kDefaultTimeout;
};

}  // namespace ddp
#pragma GCC visibility pop
