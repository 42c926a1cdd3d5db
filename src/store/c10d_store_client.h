// C10dStoreClient: ddp's Store interface over PyTorch's c10d TCPStore protocol (the client side
// only), so that a ddp program started by PyTorch 2.x's torchrun can join through the store that
// torchrun's agent already runs (TORCHELASTIC_USE_AGENT_STORE=True, see rendezvous.cc).
//
//   ddp::C10dStoreClient store("127.0.0.1", 29500, {.timeout = 60s});
//   store.set("addr/3", "10.0.0.7:4100");          // Python sees it as store.get("addr/3")
//   auto v = store.get_string("addr/0");           // waits on the server, at most 60 s
//
// Wire protocol (PyTorch 2.x, torch/csrc/distributed/c10d/TCPStore.cpp and its backends): each
// request is a one-byte query type followed by its fields, in the host's byte order (ddp writes
// little-endian); strings and byte vectors are a u64 length and the bytes. The connection opens
// with VALIDATE (the magic 0x3C85F7CE) and a PING whose u32 nonce the server echoes; a server that
// does not echo it is not a PyTorch 2.x c10d store and gets a named StoreError (or TimeoutError if
// it says nothing). Like c10d's own client, every key is sent with a leading "/", so keys are the
// same ones Python's TCPStore sees. get = WAIT then GET; a wait past its deadline sends
// CANCEL_WAIT and reads the answer the server owes, so the connection stays in step.
//
// Differences from ddp's TcpStore: no authentication (c10d has none); keys up to 8 KiB and values
// up to 8 MiB (the limits of c10d's libuv server; ConfigError before sending); add's value is
// c10d's decimal text too. compare_set keeps ddp's contract (a missing key compared with a
// non-empty `expected` gives an empty result, where c10d answers `expected`).
//
// Threads: one connection and one mutex, as TcpStore. After a timeout in the middle of a reply,
// a lost connection or a reply that breaks the protocol, every later call throws StoreError.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "ddp/store/store.h"

namespace ddp {

inline constexpr std::size_t kC10dMaxKeyBytes = 8 * 1024 - 1;  // plus c10d's leading "/"
inline constexpr std::size_t kC10dMaxValueBytes = 8 * 1024 * 1024;
inline constexpr std::size_t kC10dMaxKeysPerRequest = 64 * 1024;

struct C10dStoreOptions {
  // Default deadline of every call (Store::timeout()).
  Milliseconds timeout = kDefaultTimeout;
  // How long to keep retrying the connection (the server may start later) and to wait for the
  // handshake's answer.
  Milliseconds connect_timeout = kDefaultTimeout;
};

class C10dStoreClient final : public Store {
 public:
  // Connects and runs the handshake. Throws TimeoutError (nothing accepted the connection within
  // connect_timeout, or the server did not answer the handshake), StoreError (the server closed
  // the connection or answered something else: not a PyTorch 2.x c10d TCPStore), ConfigError
  // (the host name does not resolve).
  C10dStoreClient(std::string host, std::uint16_t port, C10dStoreOptions options = {});
  ~C10dStoreClient() override;
  C10dStoreClient(const C10dStoreClient&) = delete;
  C10dStoreClient& operator=(const C10dStoreClient&) = delete;

  using Store::compare_set;
  using Store::get;
  using Store::set;
  using Store::wait;
  void set(std::string_view key, std::span<const std::uint8_t> value) override;
  Bytes get(std::string_view key, Milliseconds timeout) override;
  std::int64_t add(std::string_view key, std::int64_t delta) override;
  Bytes compare_set(std::string_view key, std::span<const std::uint8_t> expected,
                    std::span<const std::uint8_t> desired) override;
  bool check(std::span<const std::string> keys) override;
  void wait(std::span<const std::string> keys, Milliseconds timeout) override;
  bool delete_key(std::string_view key) override;
  std::int64_t num_keys() override;

  const std::string& host() const;
  std::uint16_t port() const;

 private:
  class Connection;
  std::unique_ptr<Connection> connection_;
};

}  // namespace ddp
