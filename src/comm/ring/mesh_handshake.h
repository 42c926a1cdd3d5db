// The handshake that opens every connection of the ring backend's meshes (internal; mesh.h).
//
// Lower ranks accept, higher ranks connect. Without a secret (the wire format of protocol 1):
//   connector -> acceptor   Hello{"DDPR", version, size, from, to, name length} + group name
//   acceptor  -> connector  the same, from the acceptor
// With the job's secret, a mutual HMAC-SHA256 challenge-response bound to the group instance:
//   connector -> acceptor   Hello{"DDPA", ...} + group name + Nc            (Nc: 32 random bytes)
//   acceptor  -> connector  Hello{"DDPA", ...} + group name + Na + HMAC(secret, "ddp-ring
//                           acceptor" || T)                                 (Na: 32 random bytes)
//   connector -> acceptor   HMAC(secret, "ddp-ring connector" || T)
// where T = session || group name || size || connector rank || acceptor rank || Nc || Na (each
// variable-length field length-prefixed) and `session` is a random id one rank of the group
// instance drew and published in the store. Each side accepts the other only after checking its
// MAC (constant-time compare), so neither a stranger nor a replayed handshake (the other side's
// nonce is new every time) gets a connection, and a MAC from one group, job or direction is
// worthless in another. Nothing is encrypted: see docs/security.md for what this protects.
//
// The acceptor runs every pending handshake at once (non-blocking, one poll loop): a connection
// that sends garbage, a bad hello or a wrong MAC, or that stays silent, is refused (closed and
// logged with its address) without holding up the real peers; the loop keeps accepting until
// every expected rank has passed or the deadline passes.
//
// Threads: plain functions; one call per listener / socket at a time.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "net/socket.h"

namespace ddp::comm {

inline constexpr std::uint32_t kAuthHandshakeMagic = 0x41504444;  // "DDPA": with a secret
inline constexpr std::uint32_t kMaxGroupNameBytes = 4096;

// The first bytes each side sends.
struct Hello {
  std::uint32_t magic = 0;
  std::uint32_t version = 0;
  std::int32_t size = 0;
  std::int32_t from_rank = 0;
  std::int32_t to_rank = 0;
  std::uint32_t name_length = 0;
};
static_assert(sizeof(Hello) == 24);

struct HandshakeParams {
  std::string group;  // the group's name
  int size = 0;
  int rank = 0;         // this rank
  std::string secret;   // "" = no authentication
  std::string session;  // with a secret: the group instance's id, equal on every rank
  // One line per refused connection (never null).
  std::function<void(const std::string&)> log;
  // Set: a hello from a rank below this one (for this group, size and rank) is a knock, that
  // rank asking this one to connect to it (send_knock; point to point, p2p_connector.h): the
  // acceptor calls on_knock(from) and closes the connection. It is not authenticated, and needs
  // not be: all it can make this rank do is connect, with the checked handshake, to the address
  // the store holds for that rank. Null: such a hello is refused.
  std::function<void(int from)> on_knock;
};

// Connector side, on a socket connected to `peer`: sends the hello, checks the answer (and with a
// secret, that the peer proves it knows it, then proves it too). Throws CommError naming the
// peer and what was wrong; TimeoutError becomes CommError too.
void connect_handshake(net::Socket& socket, const HandshakeParams& params, int peer,
                       net::Deadline deadline);

// On a socket connected to `peer`'s listener (a rank above this one): asks it to connect to this
// rank (HandshakeParams::on_knock). The peer closes the connection once it has taken the knock
// (end of stream); a process that exits with it still unread resets it. Throws Error when the
// bytes cannot be written by `deadline`.
void send_knock(net::Socket& socket, const HandshakeParams& params, int peer,
                net::Deadline deadline);

// How long, and for what, MeshAcceptor::accept_until waits.
struct AcceptWait {
  net::Deadline deadline;
  std::chrono::milliseconds timeout{0};  // the configured timeout, for the message
  // "" = the group's set-up; else the operation that needs the connection (a connection made on
  // first use), named with `sequence` in the timeout's CommError.
  std::string op;
  std::uint64_t sequence = 0;
  // Called at least every 10 ms while nothing arrives (null: never); may throw. The ring group
  // passes the cross-transport mismatch check here, as to a collective's wait.
  const std::function<void()>* idle = nullptr;
  // Ends the wait early, without an error (the caller checks `peers`):
  //   wake_fd          once this descriptor is readable (it is not read), -1 = never;
  //   return_on_first  once a connection has passed its handshake.
  int wake_fd = -1;
  bool return_on_first = false;
  // Keep accepting (knocks, other ranks) once every wanted rank is connected, until wake_fd or
  // the deadline (which throws as ever).
  bool until_woken = false;
  // Ranks whose connection this listener accepted before and that were handed elsewhere (one
  // entry per rank, may be null): another connection from them is refused as a duplicate.
  const std::vector<char>* taken = nullptr;
};

// The acceptor side of one listener for the life of a mesh: the set-up's accepts and, later,
// those of connections made on first use (mesh.h). Handshakes still in progress when a wait ends
// are kept for the next one (a connector may finish its side before this rank looks again).
class MeshAcceptor {
 public:
  explicit MeshAcceptor(HandshakeParams params);
  ~MeshAcceptor();
  MeshAcceptor(const MeshAcceptor&) = delete;
  MeshAcceptor& operator=(const MeshAcceptor&) = delete;

  // Accepts on `listener` until every rank of `wanted` (all above params.rank) holds a socket in
  // `peers` (one entry per rank), refusing (closing and logging) every connection that fails the
  // handshake. Any other rank above params.rank that completes its handshake meanwhile is kept in
  // `peers` too. It returns earlier, without an error, when `wait` says so (wake_fd,
  // return_on_first). Sockets are blocking, with TCP_NODELAY. At the deadline throws CommError
  // (kTimeout) naming the ranks still missing and the last refusal. When connections wait but
  // this process has no descriptor to accept them (EMFILE/ENFILE) and no handshake in progress
  // to drop for room, throws CommError (kSetup) naming the limit within about a second, not at
  // the deadline.
  void accept_until(net::Socket& listener, std::vector<net::Socket>& peers,
                    const std::vector<int>& wanted, const AcceptWait& wait);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Acceptor side: accepts on `listener` until every rank above params.rank has completed the
// handshake, refusing every connection that fails it. Returns the sockets indexed by rank
// (invalid for ranks <= params.rank), blocking and with TCP_NODELAY. At the deadline throws
// CommError naming the ranks still missing and the last refusal; `timeout` is the configured
// timeout, for the message.
std::vector<net::Socket> accept_peers(net::Socket& listener, const HandshakeParams& params,
                                      net::Deadline deadline, std::chrono::milliseconds timeout);

// The MAC each side sends with a secret (exposed for tests that play an attacker or replay).
// `acceptor_side`: the acceptor's proof, else the connector's.
std::vector<std::uint8_t> handshake_mac(const HandshakeParams& params, bool acceptor_side,
                                        int connector, int acceptor,
                                        const std::uint8_t* connector_nonce,
                                        const std::uint8_t* acceptor_nonce);

}  // namespace ddp::comm
