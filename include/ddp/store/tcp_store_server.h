// TcpStoreServer: the rendezvous store's server, run alone (ddprun, tests) or embedded in rank 0
// by TcpStore{.is_server = true}.
//
//   ddp::TcpStoreServer server({.listen_host = "127.0.0.1", .port = 0,
//                               .limits = {.max_connections = 256}});
//   ddp::TcpStore client("127.0.0.1", server.port());
//
// One thread runs an epoll loop over non-blocking sockets; a get/wait on a missing key is parked
// and answered when the key is set. Stops (and joins its thread) on stop() or destruction;
// clients then see their connection lost.
//
// Abuse: every connection is bounded in time and memory by TcpStoreLimits. A connection that
// breaks a limit is closed, or its request refused with an error reply, with a logged reason
// (rate-limited where a flood could fill the log); the other clients carry on. See docs/store.md.
//
// Threads: the methods may be called from any thread. Errors: the constructor throws ConfigError
// when the port is in use or the address is bad.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "ddp/store/store.h"

// Exported by ddp's shared libraries, which hide the rest (src/CMakeLists.txt).
#pragma GCC visibility push(default)
namespace ddp {

// How much time and memory the server grants a connection. The defaults never bother a
// TcpStore client; lower them to shed abusers faster.
struct TcpStoreLimits {
  // A new connection must complete the hello (and, with a secret, the authentication) within
  // this, or it is closed. This is also the idle timeout of unauthenticated connections; clients
  // that completed the handshake may stay idle or parked in get/wait for as long as they like.
  Milliseconds handshake_timeout{10'000};
  // A frame must arrive in full within this of its first byte, and a reply must be taken by the
  // client within this of being queued (a 1 byte/s sender or a half-sent frame is closed).
  Milliseconds frame_timeout{30'000};
  // Connections beyond this are refused (accepted and closed at once, after first closing the
  // oldest one that has not completed its handshake, if any). 0 = automatic: half the process's
  // file descriptor limit (RLIMIT_NOFILE, whose soft limit the server raises to the hard one),
  // at most 16,384, so that the store never starves the process hosting it of descriptors.
  std::size_t max_connections = 0;
  // Keys, values and connection buffers together. A frame that would need more is read and
  // discarded instead of buffered, and a set or reply that would exceed it is refused; both are
  // answered with an error naming this limit.
  std::size_t max_memory_bytes = std::size_t{512} << 20;
};

struct TcpStoreServerOptions {
  std::string listen_host;  // "" = every IPv4 address, "::" = every address
  std::uint16_t port = 0;   // 0 = any free port, see TcpStoreServer::port()
  std::string auth_secret;  // non-empty: clients must prove they know it (TcpStoreOptions)
  // Receives one line per dropped connection and other events; default: stderr.
  std::function<void(const std::string& line)> log;
  // On destruction (and stop(drain)), stop accepting but keep serving the connected clients until
  // they disconnect or this much time passes: the process hosting the store (rank 0) often exits a
  // moment before the other ranks have sent their last requests. 0 = close at once.
  Milliseconds drain_timeout{5000};
  TcpStoreLimits limits;
};

class TcpStoreServer {
 public:
  // Throws ConfigError when the port is in use or the address is bad.
  explicit TcpStoreServer(TcpStoreServerOptions options);
  ~TcpStoreServer();
  TcpStoreServer(const TcpStoreServer&) = delete;
  TcpStoreServer& operator=(const TcpStoreServer&) = delete;

  // The port actually listened on.
  std::uint16_t port() const;
  // Closes every connection at once and joins the server thread. Idempotent.
  void stop();
  // Stops accepting, serves the connected clients until they all disconnect or `drain` passes,
  // then closes and joins. Idempotent.
  void stop(Milliseconds drain);

  // Observations for tests and diagnostics (updated by the server thread).
  std::size_t num_connections() const;
  std::size_t num_parked_requests() const;
  std::size_t num_dropped_connections() const;  // closed for a protocol violation or a limit
  // The connection limit in force (max_connections, or the automatic value).
  std::size_t max_connections() const;
  // Keys, values and connection buffers, as counted against max_memory_bytes.
  std::size_t memory_bytes() const;

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace ddp
#pragma GCC visibility pop
