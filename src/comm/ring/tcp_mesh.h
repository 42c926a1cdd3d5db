// TcpMesh: a ring group's TCP connection to every peer, and the context its TCP algorithms run on
// (internal). It owns the sockets: connecting them (mesh.h), shutting them when the group fails,
// and looking, without reading, at what a peer sent (the cross-transport check). A group's own
// mesh and the cross-host mesh of its hierarchical allreduce are both TcpMeshes.
//
// Threads: connect() on the creating thread before any call runs; context() and
// peer_with_other_call() on the thread holding the group's executor role; abort() on any.
#pragma once

#include <chrono>
#include <cstddef>
#include <string>
#include <vector>

#include "comm/ring/mesh.h"
#include "comm/ring/tcp_algorithms.h"
#include "comm/ring/transport.h"
#include "comm/wire.h"
#include "ddp/store.h"
#include "net/socket.h"

namespace ddp::comm {

class TcpMesh final : public RingTransport {
 public:
  // Not connected yet (a group of one rank never is). `group` names it in messages.
  TcpMesh(std::string group, int rank, int size, std::size_t chunk_bytes,
          std::chrono::microseconds spin);
  TcpMesh(const TcpMesh&) = delete;  // the context refers to group_
  TcpMesh& operator=(const TcpMesh&) = delete;

  // Connects to every peer (params.group and .rank/.size as given here); throws as
  // connect_full_mesh.
  void connect(Store& store, const MeshParams& params, net::Deadline deadline);

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
  const std::string group_;  // first: context_ refers to it
  std::vector<net::Socket> sockets_;
  TcpContext context_;
};

}  // namespace ddp::comm
