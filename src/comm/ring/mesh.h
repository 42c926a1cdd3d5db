// Bootstrap of a ring group's TCP connections (internal): a mesh that connects some peers when
// it opens and the others on first use.
//
// Every rank listens on an ephemeral port for the life of the mesh and publishes "host:port" in
// the store under `<prefix>addr/<rank>`. Of each pair of ranks the higher connects and the lower
// accepts, each connection opening with the checked (and, with a secret, authenticated)
// handshake of mesh_handshake.h; connections that fail the handshake are refused and logged, and
// the wait goes on.
//
// open() connects the peers it is given (a set that must be symmetric: r names p exactly when p
// names r), each rank connecting to those below it while a thread of open() accepts those above
// it, so every rank answers from the start and no rank waits on another's connections.
// connect_peer() connects any other peer when an operation first needs it: below this rank, it
// connects (the peer's acceptor, in its own connect_peer() or in a later one, answers); above, it
// accepts until that peer arrives, keeping any other peer that arrives meanwhile. Both ranks of a
// pair reach the same matched operation, so the higher one connects while the lower one waits; the
// argument of open() holds for each operation. A peer that died before connecting is a refused
// connection (CommError on the connector at once) or a missing one (CommError naming it at the
// acceptor's deadline).
//
// Point-to-point connections (ring/p2p) are a full mesh (connect_full_mesh) under a group name
// and prefix of their own.
//
// Threads: one thread at a time (the creating thread, then the group's executor); open() runs its
// accepts on a thread of its own, joined before it returns (`log` may be called there).
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "comm/ring/mesh_handshake.h"
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

// The peers `rank` of `size` connects when a group opens: everything the group's TCP algorithms
// use for their usual calls, i.e. rank +- 2^k (mod size) for every k (the ring's neighbours, the
// chains, and the binomial trees of any root) and the recursive-doubling partners (of the
// largest power of two <= size, with the extra ranks folded onto a neighbour). Symmetric, sorted,
// at most about 3 log2(size) peers. Alltoall, gather and scatter partners are connected on first
// use.
std::vector<int> pattern_peers(int rank, int size);

class PeerMesh {
 public:
  PeerMesh() = default;
  PeerMesh(const PeerMesh&) = delete;
  PeerMesh& operator=(const PeerMesh&) = delete;
  ~PeerMesh();

  // Listens, publishes this rank's address, and connects `eager` (symmetric across the ranks; see
  // above). Throws CommError naming the peer that could not be reached or failed the handshake,
  // TimeoutError/CommError when the store or the peers do not answer by `deadline`.
  void open(Store& store, const MeshParams& params, const std::vector<int>& eager,
            net::Deadline deadline);

  // Connects `peer` if it is not yet (see above). `wait` says for what and until when. The store
  // passed to open() must still be alive. Throws CommError naming the peer.
  void connect_peer(int peer, const AcceptWait& wait);

  // The connection to each rank, by rank (invalid for this rank and for peers not connected yet).
  std::vector<net::Socket>& sockets() { return sockets_; }
  // How many peers are connected.
  int connected() const;
  // Stops listening (the group failed): connections not yet accepted are reset and an accept wait
  // wakes. Any thread; never throws.
  void shutdown_listener() noexcept;

 private:
  void connect_to_lower(int peer, net::Deadline deadline);

  Store* store_ = nullptr;
  MeshParams params_;
  HandshakeParams handshake_;
  net::Socket listener_;
  std::unique_ptr<MeshAcceptor> acceptor_;
  std::vector<net::Socket> sockets_;
};

// Returns one connected socket per rank (an invalid one for this rank), by rank: every pair
// connected at once. Throws as PeerMesh::open.
std::vector<net::Socket> connect_full_mesh(Store& store, const MeshParams& params,
                                           net::Deadline deadline);

}  // namespace ddp::comm
