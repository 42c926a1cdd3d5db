// Full-mesh bootstrap of a ring group (internal).
//
// Every rank listens on an ephemeral port and publishes "host:port" in the store under
// `<prefix>addr/<rank>`; rank r connects to every rank below it and accepts every rank above it,
// each connection opening with the checked (and, with a secret, authenticated) handshake of
// mesh_handshake.h. Connections that fail the handshake are refused and logged; the wait goes on.
// Point-to-point connections (ring/p2p) are set up the same way under a group name and prefix of
// their own.
#pragma once

#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include "ddp/store.h"
#include "net/socket.h"

namespace ddp::comm {

struct MeshParams {
  std::string group;   // the group's name (handshake, messages)
  std::string prefix;  // store keys of this incarnation of the group
  int rank = 0;
  int size = 1;
  std::string advertise_host;  // how peers reach this rank
  int socket_buffer_bytes = 0;
  std::string secret;                                // "" = no authentication
  std::function<void(const std::string& line)> log;  // refused connections; null = stderr
  std::chrono::milliseconds timeout{0};              // for the accept loop's messages
};

// Returns one connected socket per rank (an invalid one for this rank), by rank. Throws CommError
// naming the peer that could not be reached or failed the handshake, TimeoutError when the store
// or the peers do not answer by `deadline`.
std::vector<net::Socket> connect_full_mesh(Store& store, const MeshParams& params,
                                           net::Deadline deadline);

}  // namespace ddp::comm
