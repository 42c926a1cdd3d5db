// P2pEngine: the ring backend's point-to-point sends and receives (internal).
//
// Sends and receives progress independently of each other, of other peers and of the group's
// collective queue: a progress thread polls one TCP connection per peer, writes posted sends as
// the socket takes them and reads into posted receives as bytes arrive. So a cycle in which every
// rank sends before it receives completes whatever the message size. The connections are made on
// first use (p2p_connector.h: the higher rank of a pair connects when it first posts an operation
// naming the lower); operations posted before theirs is made wait for it, within their deadline.
//
// Matching (as MPI): a receive from `src` with `tag` takes the earliest message from `src` with
// that tag that no earlier receive took; messages from one sender with one tag match in posting
// order. Messages with other tags do not block it. Count and dtype must then agree: otherwise both
// calls fail with a CommError naming both (the receive buffer is left untouched).
//
// Protocol (frames: p2p_frame.h): a message of up to kEagerMaxBytes goes eagerly while the sender
// holds credit for it, so a small send completes without waiting for the receiver (once the pair
// is connected); the receiver
// buffers such a message when no receive is posted yet. Each sender starts with kEagerWindowBytes
// of credit per peer and gets it back as its eager messages are delivered (each costs its payload
// plus its 32-byte frame): a receiver never buffers more than that per peer. Larger messages, and
// any message without credit, send their header only; the payload follows once the receiver has
// posted the matching receive, straight into its buffer (the sender's memory is the back-pressure,
// no copy on either side).
//
// Completion: a send once its bytes are written to the socket; a receive once its buffer is
// filled. Deadlines: each operation fails at its timeout (CallOptions, or the group's), counted
// from when it was posted; the channel to that peer is then failed (its socket shut, so the peer
// fails too) since the order of the streams can no longer be trusted. A closed connection fails
// the operations with that peer, naming it: sends at once (also when a write finds the peer gone),
// receives once everything the peer sent before it closed has been read and matched (a peer that
// sends and exits at once loses no message). abort() fails everything (the group's poisoning).
//
// Threads: send/recv/abort from any thread. Works complete on the progress thread, on the posting
// thread when they can complete at once, or on a thread in Work::wait() (see spin); callbacks run
// there.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "ddp/comm/process_group.h"
#include "ddp/comm/types.h"
#include "ddp/comm/work.h"
#include "net/socket.h"

namespace ddp::comm::p2p {

inline constexpr std::size_t kEagerMaxBytes = std::size_t{64} << 10;
inline constexpr std::size_t kEagerWindowBytes = std::size_t{4} << 20;

struct EngineOptions {
  std::string group;  // the group's name, for messages
  int rank = 0;
  std::chrono::milliseconds timeout{0};  // the group's timeout (CallOptions::timeout == 0)
  // Work::wait() drives the operation's connection itself for up to this long before it sleeps
  // (no hand-off from the progress thread for a message that arrives meanwhile); 0 = never.
  std::chrono::microseconds spin{0};
  // The reason `peer` left in the store when it failed, or "" (may be null). Called on the
  // progress thread when a connection closes.
  std::function<std::string(int peer)> reason_of;
};

class P2pConnector;

class P2pEngine {
 public:
  // Among `size` ranks, with no connection yet: `connector` makes them (it is started here and
  // stopped by the destructor). Starts the progress thread.
  P2pEngine(int size, std::unique_ptr<P2pConnector> connector, EngineOptions options);
  // Waits for the pending operations (each bounded by its deadline), then stops the connector and
  // the thread and closes the connections.
  ~P2pEngine();
  P2pEngine(const P2pEngine&) = delete;
  P2pEngine& operator=(const P2pEngine&) = delete;

  // Arguments are checked by the group (buffer, peer); these check dtype and the timeout.
  std::shared_ptr<Work> send(const void* buf, std::size_t count, DType dtype, int dst, int tag,
                             CallOptions options);
  std::shared_ptr<Work> recv(void* buf, std::size_t count, DType dtype, int src, int tag,
                             CallOptions options);
  // A receive from whichever peer's message with `tag` comes first (arrival order for messages
  // already here; a receive from that peer posted earlier takes a message first). `*source` is
  // set to the sender's rank before the Work completes. It fails at its deadline, when no peer is
  // left, or with abort(); a failing connection fails it only once it is bound to that peer.
  std::shared_ptr<Work> recv_any_source(void* buf, std::size_t count, DType dtype, int* source,
                                        int tag, CallOptions options);

  // Fails every pending and later operation with `error` and shuts the connections.
  void abort(std::exception_ptr error);

  // How many peers are connected now.
  int connections() const;

  // The connector's side (its thread). `peer`'s connection, made: the operations waiting for it
  // go on (a second connection, or one to a peer that failed meanwhile, is closed).
  void adopt(int peer, net::Socket socket);
  // `peer` cannot be reached: its operations, pending and later, fail with `error`.
  void fail_connection(int peer, std::exception_ptr error);

 private:
  struct State;
  std::shared_ptr<State> state_;  // shared with the progress thread (see the destructor)
  std::unique_ptr<P2pConnector> connector_;
  std::thread thread_;
};

}  // namespace ddp::comm::p2p
