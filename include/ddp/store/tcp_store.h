// TcpStore: the Store served over TCP by one server (in rank 0, or in the ddprun launcher) to a
// client in every process.
//
//   // rank 0 (also runs the server on a thread); port 0 picks a free port, see port()
//   ddp::TcpStore store("10.0.0.1", 29500, {.is_server = true, .num_workers = world_size});
//   // every other rank
//   ddp::TcpStore store("10.0.0.1", 29500, {.num_workers = world_size});
//   store.set("addr/3", "10.0.0.7:4100");
//   auto addr0 = store.get_string("addr/0");   // parked on the server until rank 0 sets it
//
// Threads: every TcpStore method may be called from any thread. One client holds one connection
// and one mutex, so calls from several threads on the same TcpStore run one after another (a
// thread blocked in get/wait holds the others up); use one TcpStore per thread where that
// matters. The server (TcpStoreServer, ddp/store/tcp_store_server.h) runs on its own thread.
//
// Errors: ConfigError for a port already in use or keys/values over the limits below (nothing is
// sent); TimeoutError naming the key(s) and the timeout when a deadline passes (including connect
// after connect_timeout); StoreError when the server is gone ("connection to store at H:P lost"),
// speaks another protocol version, disagrees about the shared secret, or refuses a request (e.g.
// add on a non-integer value). After a StoreError, or a TimeoutError that left the connection out
// of step, every later call on that TcpStore throws StoreError: make a new one.
//
// The wire protocol (binary, little-endian, length-prefixed, versioned) is in docs/store.md.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "ddp/store/store.h"
#include "ddp/store/tcp_store_server.h"

// Exported by ddp's shared libraries, which hide the rest (src/CMakeLists.txt).
#pragma GCC visibility push(default)
namespace ddp {

// Limits of the protocol; requests beyond them throw ConfigError on the client, and a peer that
// sends them anyway is disconnected by the server.
inline constexpr std::size_t kStoreMaxKeyBytes = 4 * 1024;
inline constexpr std::size_t kStoreMaxValueBytes = 64 * 1024 * 1024;
inline constexpr std::size_t kStoreMaxKeysPerRequest = 64 * 1024;

struct TcpStoreOptions {
  // This object also runs the server on a thread, listening on listen_host:port; its own client
  // then connects to host:port like any other, so `host` must reach this machine. The server
  // dies with this object: keep it alive until no other process needs the store.
  bool is_server = false;
  // Default deadline of every call (Store::timeout()).
  Milliseconds timeout = kDefaultTimeout;
  // How long the client keeps retrying to connect (the server may start later) and to complete
  // the handshake.
  Milliseconds connect_timeout = kDefaultTimeout;
  // When set, every client counts itself in on construction, and the server's own client (with
  // wait_for_workers) waits until num_workers clients, itself included, have done so. Uses the
  // keys "__ddp_store/workers" and "__ddp_store/workers_ready". Give it to one TcpStore per
  // process: each one constructed with it counts.
  std::optional<int> num_workers;
  bool wait_for_workers = true;
  // Address the server listens on: "" = every IPv4 address, "::" = every address.
  std::string listen_host;
  // Shared secret; when non-empty, client and server prove to each other that they know it
  // (HMAC-SHA256 challenge, see docs/store.md) and the server turns away clients that do not.
  // Both sides must agree: a mismatch is a StoreError. Needs a build with OpenSSL (ConfigError).
  std::string auth_secret;
  // Limits of the embedded server (is_server): deadlines, connections, memory.
  TcpStoreLimits server_limits;
};

class TcpStore final : public Store {
 public:
  // Connects to host:port (starting the server first when options.is_server). Throws
  // ConfigError (port in use, bad address), TimeoutError (no server within connect_timeout, or
  // fewer than num_workers clients within timeout), StoreError (protocol version mismatch).
  TcpStore(std::string host, std::uint16_t port, TcpStoreOptions options = {});
  ~TcpStore() override;
  TcpStore(const TcpStore&) = delete;
  TcpStore& operator=(const TcpStore&) = delete;

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
  // The server's port (the real one when is_server was given port 0).
  std::uint16_t port() const;
  // The embedded server, or nullptr when this object is only a client.
  TcpStoreServer* server();

 private:
  class Client;
  std::unique_ptr<TcpStoreServer> server_;  // destroyed after client_ (declared first)
  std::unique_ptr<Client> client_;
};

// A TCP port that is free right now on this host (bind to 0, read, close), for a store server or
// a MASTER_PORT. Another process may take it before it is used: callers retry or accept the risk.
std::uint16_t pick_free_port();

}  // namespace ddp
#pragma GCC visibility pop
