// RingProcessGroup: the ring backend behind the one front (internal). The front (group_front.h)
// checks and records every call; this class says which algorithm a call takes and runs it over
// its transports: the TCP mesh (tcp_mesh.h, algorithms in tcp_algorithms.h), the host's
// shared-memory domain (shm/shm_domain.h) and, for groups spanning hosts, the hierarchical
// allreduce (hierarchical.h) over the domain and a cross-host TCP mesh.
//   ring_group_setup.cc   options, connecting the mesh, locality (shm / TCP / hierarchical), p2p
//   ring_group.cc         running a call, the cross-transport mismatch check, failure handling
//   ring_shared_buffers.cc  allocate_shared_buffer (the zero-copy allreduce's memory)
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "comm/group_front.h"
#include "comm/ring/hierarchical.h"
#include "comm/ring/p2p/p2p_engine.h"
#include "comm/ring/shm/shm_domain.h"
#include "comm/ring/tcp_mesh.h"
#include "comm/ring/topology.h"
#include "ddp/comm/ring_process_group.h"

namespace ddp::comm {

class RingProcessGroup final : public GroupFront,
                               public std::enable_shared_from_this<RingProcessGroup> {
 public:
  RingProcessGroup(std::shared_ptr<Store> store, int rank, int size, RingOptions options);
  ~RingProcessGroup() override;

  // Creation, in this order (make_ring_process_group): the mesh and locality, point to point,
  // then the queue's worker.
  void connect();
  void start_p2p();
  void start() { start_queue(weak_from_this()); }
  std::string transport_description() const { return transport_text_; }
  // See ring_collective_connections_of().
  int collective_connections() const {
    return mesh_.connected() + (cross_mesh_ ? cross_mesh_->connected() : 0);
  }
  // See ring_point_to_point_connections_of().
  int point_to_point_connections() const { return p2p_ ? p2p_->connections() : 0; }

  // See ring_shared_buffer_allreduces_of() and the two after it.
  long long shared_buffer_allreduces() const;
  long long shared_buffer_reduce_scatters() const;
  long long shared_buffer_allgathers() const;

  std::string_view backend() const override { return "ring"; }
  // ring_shared_buffers.cc: over the host's shared-memory domain (kShm), else none.
  std::shared_ptr<void> allocate_shared_buffer(std::size_t bytes, std::string* why_not) override;
  // Only the shared-memory domain reads and writes the pieces where they lie; the TCP and
  // hierarchical algorithms work on one buffer, packed by the front.
  bool allreduce_segments_in_place() const override { return mode_ == Mode::kShm; }
  // From the host identities exchanged at creation (a group of one rank: 0 of 1).
  int local_rank() const override { return topology_.local_rank; }
  int local_size() const override {
    return topology_.local.empty() ? 1 : static_cast<int>(topology_.local.size());
  }

 protected:
  // GroupFront: the backend's part of each call.
  void run_call(Call& call, net::Deadline deadline) override;
  void on_poison(const std::string& reason) noexcept override;
  Algorithm algorithm_for(const Call& call) const override;
  // Not queued: see start_p2p.
  std::shared_ptr<Work> post_send(const void* buf, std::size_t count, DType dtype, int dst, int tag,
                                  CallOptions options) override {
    return p2p_->send(buf, count, dtype, dst, tag, options);
  }
  std::shared_ptr<Work> post_recv(void* buf, std::size_t count, DType dtype, int src, int tag,
                                  CallOptions options) override {
    return p2p_->recv(buf, count, dtype, src, tag, options);
  }
  std::shared_ptr<Work> post_recv_any_source(void* buf, std::size_t count, DType dtype, int* source,
                                             int tag, CallOptions options) override {
    return p2p_->recv_any_source(buf, count, dtype, source, tag, options);
  }
  std::shared_ptr<ProcessGroup> make_subgroup(std::vector<int> ranks) override;

 private:
  enum class Mode {
    kTcp,           // everything over TCP
    kShm,           // one host: the shared-memory domain runs the collectives it has
    kHierarchical,  // several hosts, several ranks on some: allreduce inside hosts, then across
  };
  void set_up_locality(Transport transport, net::Deadline deadline);
  // Fails (CommError kSetup) within the creation, before any connection, when this process may
  // not open the descriptors the group needs (after raising its soft limit to the hard one where
  // that is too low), naming `ulimit -n` and the number: `local` ranks share this host (1 while
  // unknown), `cross_peers` are the ranks of its cross-host mesh but this one, and the number
  // advised covers `may_share` ranks on this host (while unknown: as many as could).
  void check_descriptor_limit(int local, int cross_peers, int may_share) const;
  void connect_cross_host_mesh(net::Deadline deadline);
  // Runs `call` on the executing thread (the algorithm its header names); throws CommError.
  void run_op(const Call& call, net::Deadline deadline);
  void run_shm(const Call& call, net::Deadline deadline);
  // What `peer` left in the store when it aborted the group ("" when nothing).
  std::string abort_reason_of(int peer);

  // A call that one rank runs over shared memory and another over TCP is invisible to both
  // transports' own checks: while a step of one sleeps, this looks at the other (a TCP step at the
  // domain's peers, a shared-memory step at what peers sent over TCP; docs/algorithms.md,
  // "Transports") and throws the mismatch.
  void check_for_other_call(const RingTransport& other);
  [[noreturn]] void fail_cross_transport_mismatch(int peer, const OpHeader& theirs);
  std::byte* scratch(std::size_t bytes) {
    if (shm_scratch_.size() < bytes) shm_scratch_.resize(bytes);
    return shm_scratch_.data();
  }

  std::shared_ptr<Store> store_;
  RingOptions options_;
  std::string prefix_;           // store keys of this incarnation of the group
  std::size_t open_before_ = 0;  // descriptors this process had open when creation began
  std::chrono::microseconds spin_{0};
  // DDP_WAIT_WARN_SECONDS: a collective waiting this long for a peer says so (0: never).
  std::chrono::milliseconds wait_warning_{0};
  std::atomic<int> subgroups_created_{0};

  // Touched only by the thread holding the executor role (after creation): the TCP mesh with its
  // exchange and scratch pool, and the shared-memory dispatch's temporary.
  TcpMesh mesh_;
  std::vector<std::byte> shm_scratch_;

  // Locality (fixed at creation): which ranks share a host, and what runs where.
  Mode mode_ = Mode::kTcp;
  std::string transport_text_ = "tcp";
  Topology topology_;
  // The ranks of this host that share memory (kShm: all; kHierarchical: this host's), or null.
  std::unique_ptr<shm::ShmDomain> domain_;
  // kHierarchical: this rank's cross-host mesh (the ranks of its local index on every host, or
  // the leaders; null when it is in none), and what the allreduce runs over.
  std::unique_ptr<TcpMesh> cross_mesh_;
  Hierarchy hierarchy_;
  // The operation the executor is running (for the cross-transport check).
  const Call* current_ = nullptr;

  // Point to point (start_p2p): declared last, so it is gone before what its callbacks use.
  std::unique_ptr<p2p::P2pEngine> p2p_;
};

}  // namespace ddp::comm
