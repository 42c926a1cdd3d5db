// The point-to-point connections of a ring group (internal): one TCP connection per pair of
// ranks, separate from the collective mesh so that point-to-point bytes never interleave with a
// collective's streams. Set up like the mesh (lower ranks accept, higher ranks connect, addresses
// in the store under `key_prefix`), each authenticated by the mesh handshake
// (comm/mesh_handshake.h) under the group name params.group (the caller gives it a suffix, so a
// p2p connection can never pass for a mesh connection or the reverse).
//
// Throws CommError naming the peer that could not be reached by the deadline.
#pragma once

#include <chrono>
#include <string>
#include <vector>

#include "comm/ring/mesh_handshake.h"
#include "ddp/store.h"
#include "net/socket.h"

namespace ddp::comm::p2p {

struct ConnectOptions {
  std::string key_prefix;      // store keys of this group instance's p2p addresses
  std::string advertise_host;  // the address peers connect to
  int socket_buffer_bytes = 0;
  std::chrono::milliseconds timeout{0};  // for messages
};

// Returns a socket per rank (invalid for params.rank), non-blocking, with TCP_NODELAY.
std::vector<net::Socket> connect_p2p_peers(Store& store, const HandshakeParams& params,
                                           const ConnectOptions& options, net::Deadline deadline);

}  // namespace ddp::comm::p2p
