// The ring backend's TCP algorithms: free functions over a TcpContext (internal).
//
// Each algorithm describes its steps as streams of an Exchange (exchange.h) over the group's full
// mesh and runs them on the calling thread; prose and costs (steps, bytes on the wire) are above
// each function in tcp_algorithms.cc and in docs/algorithms.md. They throw CommError
// (PeerClosedError when a peer's connection closed) naming the group, the call and the peer.
//
// Threads: a TcpContext and the algorithms that use it run on one thread at a time (the thread
// holding the group's executor role, see op_queue.h).
#pragma once

#include <chrono>
#include <cstddef>
#include <functional>
#include <string>
#include <vector>

#include "comm/call.h"
#include "comm/ring/exchange.h"
#include "comm/wire.h"
#include "net/socket.h"

namespace ddp::comm {

// What a TCP algorithm needs of its group: rank, size, the connection to every peer, the exchange
// and the pooled scratch memory (no allocation on the hot path once warm).
class TcpContext {
 public:
  // `group` must outlive the context; `peer_fds` has one entry per rank (-1 for this rank).
  TcpContext(const std::string& group, int rank, int size, std::size_t chunk_bytes,
             std::chrono::microseconds spin);

  int rank() const { return rank_; }
  int size() const { return size_; }
  const std::string& group() const { return group_; }
  // The sockets of the mesh, by rank (-1 for this rank and for peers not connected yet); set once
  // the mesh is open. set_peer_fd() fills in one entry in place (the exchange of a step in
  // progress points at the table).
  void set_peer_fds(std::vector<int> fds) { peer_fds_ = std::move(fds); }
  void set_peer_fd(int peer, int fd) { peer_fds_[static_cast<std::size_t>(peer)] = fd; }
  const std::vector<int>& peer_fds() const { return peer_fds_; }
  // Connects a peer on first use (null: every peer is connected when the mesh opens). Called by
  // fd() with the peer and the running call's deadline; must set_peer_fd() or throw CommError.
  using PeerConnector = std::function<void(int peer, const Call& call, net::Deadline deadline)>;
  void set_peer_connector(PeerConnector connect) { connect_ = std::move(connect); }
  // The socket to `peer`, connected first if this is the first call that needs it. Both ranks of
  // a pair ask for it in the same step of the same call, so the lazy connection meets its peer
  // (mesh.h). Only between begin() and finish() of a run_tcp() call.
  int fd(int peer) {
    const int fd = peer_fds_[static_cast<std::size_t>(peer)];
    if (fd >= 0 || !connect_ || current_ == nullptr) return fd;
    connect_(peer, *current_, deadline_);
    return peer_fds_[static_cast<std::size_t>(peer)];
  }
  // The call run_tcp() runs and its deadline, for fd()'s connections on first use.
  void set_current(const Call* call, net::Deadline deadline) {
    current_ = call;
    deadline_ = deadline;
  }
  // Called while a connection made on first use waits (see AcceptWait::idle).
  const std::function<void()>* idle_check() const { return idle_check_ ? &idle_check_ : nullptr; }
  // Called while a collective's step sleeps (see ExchangeContext::idle_check); null: none.
  void set_idle_check(std::function<void()> check) { idle_check_ = std::move(check); }
  // See ExchangeContext::wait_warning.
  void set_wait_warning(std::chrono::milliseconds after,
                        std::function<void(const std::string&)> warn) {
    wait_warning_ = after;
    warn_ = std::move(warn);
  }

  // One step of `a`: reset() the exchange, add streams to exchange(), then finish().
  Exchange& begin(const Call& a);
  void finish(const Call& a, net::Deadline deadline);
  Exchange& exchange() { return exchange_; }

  // The receive chunk reductions go through (RingOptions::chunk_bytes).
  std::byte* chunk() { return chunk_.data(); }
  std::size_t chunk_bytes() const { return chunk_.size(); }
  // Two pooled temporaries of at least `bytes` (reused across operations).
  std::byte* temp_a(std::size_t bytes) { return grow(temp_a_, bytes); }
  std::byte* temp_b(std::size_t bytes) { return grow(temp_b_, bytes); }

 private:
  static std::byte* grow(std::vector<std::byte>& pool, std::size_t bytes) {
    if (pool.size() < bytes) pool.resize(bytes);
    return pool.data();
  }

  const std::string& group_;
  const int rank_;
  const int size_;
  const std::chrono::microseconds spin_;
  std::vector<int> peer_fds_;
  PeerConnector connect_;
  const Call* current_ = nullptr;
  net::Deadline deadline_{};
  std::function<void()> idle_check_;
  std::chrono::milliseconds wait_warning_{0};
  std::function<void(const std::string&)> warn_;
  Exchange exchange_;
  std::string op_text_;  // the description of the step running (the exchange refers to it)
  std::vector<std::byte> chunk_;
  std::vector<std::byte> temp_a_;
  std::vector<std::byte> temp_b_;
};

// allreduce: recursive doubling up to `small_message_bytes` (twice that in a group of two, where
// the ring only wins once splitting the reduction pays for its extra step), the ring above.
Algorithm tcp_allreduce_algorithm(std::size_t bytes, std::size_t count, int size,
                                  std::size_t small_message_bytes);
// broadcast: a binomial tree up to `small_message_bytes`, a pipelined chain above.
Algorithm tcp_broadcast_algorithm(std::size_t bytes, std::size_t small_message_bytes);

// Runs `a` over TCP with the algorithm its header names.
void run_tcp(TcpContext& tcp, const Call& a, net::Deadline deadline);

void allreduce_ring(TcpContext& tcp, const Call& a, net::Deadline deadline);
void allreduce_recursive_doubling(TcpContext& tcp, const Call& a, net::Deadline deadline);
void broadcast_tree(TcpContext& tcp, const Call& a, net::Deadline deadline);
void reduce_chain(TcpContext& tcp, const Call& a, net::Deadline deadline);
void allgather_ring(TcpContext& tcp, const Call& a, net::Deadline deadline);
void reduce_scatter_ring(TcpContext& tcp, const Call& a, net::Deadline deadline);
void gather_direct(TcpContext& tcp, const Call& a, net::Deadline deadline);
void scatter_direct(TcpContext& tcp, const Call& a, net::Deadline deadline);
void alltoall_direct(TcpContext& tcp, const Call& a, net::Deadline deadline);

}  // namespace ddp::comm
