// TcpMesh: a ring group's TCP connections to its peers, and the context its TCP algorithms run on
// (internal). It owns the sockets: connecting them (mesh.h: the peers of pattern_peers() when the
// group opens, any other on the first call that needs it), shutting them when the group fails,
// and looking, without reading, at what a peer sent (the cross-transport check). A group's own
// mesh and the cross-host mesh of its hierarchical allreduce are both TcpMeshes.
//
// Threads: connect() on the creating thread before any call runs; context() (whose fd() connects
// on first use), peer_with_other_call() and connected() on the thread holding the group's executor
// role; abort() on any.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <mutex>
#include <string>
#include <vector>

#include "comm/ring/mesh.h"
#include "comm/ring/tcp_algorithms.h"
#include "comm/ring/transport.h"
#include "comm/wire.h"
#include "ddp/store/store.h"
#include "net/socket.h"

namespace ddp::comm {

class TcpMesh final : public RingTransport {
 public:
  // Not connected yet (a group of one rank never is). `group` names it in messages.
  TcpMesh(std::string group, int rank, int size, std::size_t chunk_bytes,
          std::chrono::microseconds spin);
  TcpMesh(const TcpMesh&) = delete;  // the context refers to group_
  TcpMesh& operator=(const TcpMesh&) = delete;

  // Opens the mesh (params.group and .rank/.size as given here) and connects the peers of
  // pattern_peers(); the store must outlive the mesh (later connections read addresses from it).
  // Throws as PeerMesh::open.
  void connect(Store& store, const MeshParams& params, net::Deadline deadline);
  // Peers connected so far (introspection for tests and benchmarks).
  int connected() const { return mesh_.connected(); }

  const std::string& group() const { return group_; }
  int size() const { return context_.size(); }
  TcpContext& context() { return context_; }

  // RingTransport: shuts every connection both ways, so that peers blocked on this rank fail now
  // (the peers read `reason` from the store, where the group leaves it).
  void abort(const std::string& reason) noexcept override;

  // RingTransport: the first peer whose unread bytes start with a header of `mine`'s sequence
  // number but another fingerprint (it issued a different call, which this rank's TCP steps would
  // never read); by its rank in this mesh.
  int peer_with_other_call(const OpHeader& mine, OpHeader& theirs) const override;

 private:
  // A connection made on first use, for `call` (TcpContext::PeerConnector).
  void connect_on_first_use(int peer, const Call& call, net::Deadline deadline);

  const std::string group_;  // first: context_ refers to it
  PeerMesh mesh_;
  // Guards the sockets' slots between a connection made on first use (the executor) and abort()
  // (any thread); aborted_: no connection is made after abort(), and a wait for one ends.
  mutable std::mutex mutex_;
  std::atomic<bool> aborted_{false};
  TcpContext context_;
};

}  // namespace ddp::comm
