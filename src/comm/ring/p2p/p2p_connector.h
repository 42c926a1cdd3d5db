// P2pConnector: the connections of a P2pEngine, made on first use (internal).
//
// A group starts with no point-to-point connection: a rank connects to a peer only when it first
// exchanges a message with it, so a rank holds one connection per peer it talks to, not N-1 (a
// full mesh at world 512 is 130,816 handshakes before the first collective).
//
// Of each pair the higher rank connects and the lower accepts, with the ring mesh's checked (and,
// with the job's secret, authenticated) handshake (mesh.h). Either rank may need the connection
// first, when it posts an operation naming the other: the higher then connects; the lower knocks
// (it asks the higher, over a short connection of its own, to connect to it: send_knock) and its
// operations wait for the connection, which the higher makes whatever it is doing. So a small send
// still completes without the receiver having posted anything, and crossing connections cannot
// happen. A receive from any source needs every connection (p2p_engine.h). A knock is not
// authenticated: all it makes a rank do is connect, with the checked
// handshake, to the address the store holds for the knocking rank.
//
// A thread of its own accepts the ranks above (and their knocks) as they come and connects or
// knocks as the engine asks (request()), handing each connection to the engine
// (P2pEngine::adopt). A rank that cannot be reached (it died or destroyed its group: a refused
// connection; a handshake that fails) fails the operations with it, with a CommError naming it
// (P2pEngine::fail_connection); a rank that never answers a knock fails them at their deadline.
//
// Threads: request() from any thread (it only queues: the engine calls it under its lock);
// start() and stop() from the owner (the engine).
#pragma once

#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "comm/ring/mesh.h"

namespace ddp::comm::p2p {

class P2pEngine;

class P2pConnector {
 public:
  // Listens and publishes this rank's address under params.prefix (connects nothing). Throws as
  // PeerMesh::open. `store` must outlive the connector.
  P2pConnector(Store& store, const MeshParams& params, net::Deadline deadline);
  ~P2pConnector();
  P2pConnector(const P2pConnector&) = delete;
  P2pConnector& operator=(const P2pConnector&) = delete;

  // Starts the thread, which hands connections to `engine` (it must outlive stop()).
  void start(P2pEngine& engine);
  // The connection with `peer` is needed: connect to it (below this rank) or knock (above).
  void request(int peer);
  // Stops the thread: at once while it waits, else once the connection it is making succeeds or
  // fails (bounded by the group's timeout). Idempotent.
  void stop() noexcept;

 private:
  void run();
  void connect_below(int peer);
  void knock_above(int peer);
  // Looks at the knocks not yet taken: taken ones are done, reset ones fail their peer.
  void check_knocks();
  void give_up(int peer, std::exception_ptr error);
  void hand_over_from_above();

  // A knock whose peer has not closed its connection yet (taken the knock), or reset it (gone).
  struct Knock {
    int peer;
    net::Socket socket;
    net::Clock::time_point given_up_at;  // then it counts as taken (a peer slow to look)
  };

  PeerMesh mesh_;
  MeshParams params_;
  P2pEngine* engine_ = nullptr;
  std::vector<Knock> knocks_;  // this thread's
  // By rank, this thread's: peers found gone (their operations failed); later requests and
  // knocks for them are ignored, so that a flood of knocks naming a dead rank costs nothing.
  std::vector<char> gone_;
  int wake_fd_ = -1;
  std::mutex mutex_;
  std::vector<int> requests_;  // under mutex_
  bool stopping_ = false;      // under mutex_
  std::thread thread_;
};

}  // namespace ddp::comm::p2p
