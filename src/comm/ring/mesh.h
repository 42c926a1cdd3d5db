// Bootstrap of a ring group's TCP connections (internal): a mesh that connects some peers when
// it opens and the others on first use.
//
// Every rank listens on an ephemeral port and publishes "host:port" in the store under
// `<prefix>addr/<rank>`; a mesh without knocks stops listening once every rank above it has
// connected (nothing else may connect then). Of each pair of ranks the higher connects and the
// lower accepts, each connection opening with the checked (and, with a secret, authenticated)
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
// Point-to-point connections (ring/p2p) use a mesh of their own (group name and prefix), opened
// with no eager peer and connected on first use by p2p_connector.h, which hands each connection to
// the point-to-point engine (take()) and accepts those from above as they come
// (accept_from_above()).
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
#include "ddp/store/store.h"
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
  // Point to point: HandshakeParams::on_knock (a rank below asks this one to connect to it).
  std::function<void(int from)> on_knock;
  // Once a peer's address is in the store, how long connecting to it may be refused before the
  // peer counts as gone (its listener is up before its address is published); 0: until the
  // deadline.
  std::chrono::milliseconds refused_for{0};
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

  // Accepts every rank above this one that connects, and the knocks of those below, until `wait`
  // ends (its deadline, which is no error here, its wake_fd, or return_on_first); `taken` and
  // `until_woken` are filled in. Throws CommError when polling fails.
  void accept_from_above(AcceptWait wait);
  // Hands `peer`'s connection over; another connection from that rank is then a duplicate.
  net::Socket take(int peer);
  // Asks `peer`, a rank above this one whose mesh has on_knock, to connect to this rank
  // (send_knock), without waiting for it; returns the knock's connection, non-blocking, which the
  // peer closes once it has taken the knock. Throws CommError naming the peer when it cannot be
  // reached (kPeerGone: nothing listens at its address).
  net::Socket knock(int peer, net::Deadline deadline);

  // The connection to each rank, by rank (invalid for this rank, for peers not connected yet and
  // for those taken).
  std::vector<net::Socket>& sockets() { return sockets_; }
  // How many peers are connected (not counting those taken).
  int connected() const;
  // Stops listening (the group failed, or every rank above has connected): connections not yet
  // accepted are reset, later ones refused, and an accept wait wakes. Any thread; never throws.
  void shutdown_listener() noexcept;

 private:
  void connect_to_lower(int peer, net::Deadline deadline);
  // Stops listening once every rank above this one is connected, unless ranks below may knock
  // (on_knock): a collective mesh then needs its port no more.
  void stop_listening_once_complete() noexcept;
  // A TCP connection to `peer`'s listener (its address from the store), before any handshake.
  net::Socket dial(int peer, net::Deadline deadline);

  Store* store_ = nullptr;
  MeshParams params_;
  HandshakeParams handshake_;
  net::Socket listener_;
  std::unique_ptr<MeshAcceptor> acceptor_;
  std::vector<net::Socket> sockets_;
  std::vector<char> taken_;  // by rank: handed over by take()
};

}  // namespace ddp::comm
