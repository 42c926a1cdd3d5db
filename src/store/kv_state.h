// KvState: the store's keys and values and its parked get/wait requests, with no sockets, threads
// or wire format, so that unit tests can drive every operation directly.
//
//   store::KvState state;
//   const std::string keys[] = {"addr/0"};
//   state.park(7, Opcode::kGet, keys);          // waiter 7 parks: the key is missing
//   auto woken = state.set("addr/0", bytes);    // -> {Wakeup{7, kGet, "addr/0"}}
//
// A mutation applies first and returns the parked requests it completed; answering them is the
// caller's job. Nothing here depends on the requester being reachable, so a client that vanishes
// right after a set can never make the store lose the wake-up of another.
//
// Waiters are opaque ids (the server uses connection ids); each has at most one parked request.
// Not thread-safe: one thread (the server's event loop) owns it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "ddp/store/store.h"
#include "store/protocol.h"

namespace ddp::store {

using WaiterId = std::uint64_t;

// A parked request whose keys all exist now: answer `waiter` (for a get, with the value of `key`).
struct Wakeup {
  WaiterId waiter = 0;
  Opcode op = Opcode::kGet;  // kGet or kWait
  std::string key;           // the get's key (the first key of a wait)

  bool operator==(const Wakeup&) const = default;
};

class KvState {
 public:
  // Charged per key on top of its key and value bytes (hash node, vector header), so a flood of
  // empty values still counts against the memory limit.
  static constexpr std::size_t kEntryOverheadBytes = 64;

  // nullptr when the key does not exist. Valid until the next mutation.
  const Bytes* find(std::string_view key) const;
  bool contains(std::string_view key) const { return find(key) != nullptr; }
  std::size_t num_keys() const { return data_.size(); }
  // Memory held by keys and values (with kEntryOverheadBytes each).
  std::size_t bytes() const { return bytes_; }
  // bytes() once `key` holds a value of `value_size` bytes.
  std::size_t bytes_after_store(std::string_view key, std::size_t value_size) const;

  // Stores the value; returns the parked requests this completed.
  std::vector<Wakeup> set(std::string_view key, std::span<const std::uint8_t> value);

  struct AddResult {
    std::optional<std::int64_t> value;  // the new value; empty when refused
    std::string error;                  // why it was refused (not an integer, overflow)
    std::vector<Wakeup> woken;
  };
  // Adds to the decimal counter (a missing key counts as 0).
  AddResult add(std::string_view key, std::int64_t delta);

  struct CompareSetResult {
    Bytes value;  // the value held afterwards (empty for a missing key)
    std::vector<Wakeup> woken;
  };
  // When the value equals `expected` (a missing key equals an empty `expected`) it becomes
  // `desired`.
  CompareSetResult compare_set(std::string_view key, std::span<const std::uint8_t> expected,
                               std::span<const std::uint8_t> desired);

  // Whether the key existed. Parked requests are untouched (they wait for it to come back).
  bool erase(std::string_view key);

  // Parks `waiter`'s get (one key) or wait on the missing ones of `keys`; returns false, parking
  // nothing, when all exist. REQUIRES: keys non-empty, waiter not parked.
  bool park(WaiterId waiter, Opcode op, std::span<const std::string> keys);
  // Drops the waiter's parked request and returns the keys it was still missing (sorted), or
  // nullopt when it had none. Call it when the waiter cancels or goes away.
  std::optional<std::vector<std::string>> unpark(WaiterId waiter);
  // The op of the waiter's parked request, if any.
  std::optional<Opcode> parked_op(WaiterId waiter) const;
  std::size_t num_parked() const { return parked_.size(); }

 private:
  struct Parked {
    Opcode op;
    std::string first_key;
    std::set<std::string> missing;  // ordered, so a cancelled wait lists them stably
  };
  struct Hash {
    using is_transparent = void;
    std::size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
  };

  void store(std::string_view key, std::span<const std::uint8_t> value);
  // `key` exists now: every request for which it was the last missing key completes.
  std::vector<Wakeup> key_created(std::string_view key);

  std::unordered_map<std::string, Bytes, Hash, std::equal_to<>> data_;
  std::unordered_map<std::string, std::vector<WaiterId>, Hash, std::equal_to<>> waiters_;
  std::unordered_map<WaiterId, Parked> parked_;
  std::size_t bytes_ = 0;
};

}  // namespace ddp::store
