// The handshake that opens every connection of the ring backend's full mesh (internal).
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
};

// Connector side, on a socket connected to `peer`: sends the hello, checks the answer (and with a
// secret, that the peer proves it knows it, then proves it too). Throws CommError naming the
// peer and what was wrong; TimeoutError becomes CommError too.
void connect_handshake(net::Socket& socket, const HandshakeParams& params, int peer,
                       net::Deadline deadline);

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
