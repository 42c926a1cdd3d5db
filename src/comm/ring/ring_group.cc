// Running a ring group's calls: the algorithm of each, the transport it runs on, the
// cross-transport mismatch check, and failures (a peer's reason, telling the peers on poison).
#include <cstring>

#include <fmt/format.h>

#include "comm/ring/ring_group.h"
#include "ddp/error.h"

namespace ddp::comm {

using std::chrono::milliseconds;

Algorithm RingProcessGroup::algorithm_for(const Call& call) const {
  if (mode_ == Mode::kShm) {
    // The domain has every collective but the direct ones.
    const bool direct = call.kind == Collective::kGather || call.kind == Collective::kScatter ||
                        call.kind == Collective::kAlltoall;
    return direct ? Algorithm::kDirect : Algorithm::kSharedMemory;
  }
  const std::size_t bytes = call.count * dtype_size(call.dtype);
  switch (call.kind) {
    case Collective::kAllreduce:
      return mode_ == Mode::kHierarchical
                 ? Algorithm::kHierarchical
                 : tcp_allreduce_algorithm(bytes, call.count, size(), options_.small_message_bytes);
    case Collective::kBroadcast:
      return tcp_broadcast_algorithm(bytes, options_.small_message_bytes);
    case Collective::kReduce:
      return Algorithm::kChain;
    case Collective::kAllgather:
    case Collective::kReduceScatter:
      return Algorithm::kRing;
    case Collective::kBarrier:
      return Algorithm::kRecursiveDoubling;
    default:
      return Algorithm::kDirect;
  }
}

std::string RingProcessGroup::abort_reason_of(int peer) {
  if (peer < 0) return {};
  try {
    const std::string key = fmt::format("{}abort/{}", prefix_, peer);
    const std::vector<std::string> keys{key};
    if (!store_->check(keys)) return {};
    return store_->get_string(key, milliseconds(200));
  } catch (const std::exception&) {
    return {};
  }
}

// Runs one operation for the queue; turns a peer's failure into a CommError that carries the
// reason the peer left in the store, if any.
void RingProcessGroup::run_call(Call& args, net::Deadline deadline) {
  current_ = &args;
  struct ClearCurrent {
    const Call*& current;
    ~ClearCurrent() { current = nullptr; }
  } clear_current{current_};
  try {
    run_op(args, deadline);
  } catch (const shm::ShmPeerError& e) {
    // A local peer died or aborted: the domain's message names it; add the reason it left in the
    // store when the error does not carry it already (an abort does).
    std::string message = e.what();
    const std::string reason =
        e.kind() != CommErrorKind::kAborted ? abort_reason_of(e.peer()) : std::string();
    if (!reason.empty()) message += fmt::format("; rank {} reported: {}", e.peer(), reason);
    throw CommError(reason.empty() ? e.kind() : CommErrorKind::kAborted, message, e.group(), e.op(),
                    e.sequence(), e.peer());
  } catch (const PeerClosedError& e) {
    const std::string reason = abort_reason_of(e.peer());
    std::string message = e.what();
    message += reason.empty() ? fmt::format(" (rank {} left no reason: it probably died)", e.peer())
                              : fmt::format("; rank {} reported: {}", e.peer(), reason);
    throw CommError(reason.empty() ? CommErrorKind::kPeerGone : CommErrorKind::kAborted, message,
                    e.group(), e.op(), e.sequence(), e.peer());
  }
}

// The group is poisoned (the queue failed what was pending): leave the reason in the store for
// the peers, and shut the connections so that peers blocked on this rank fail now instead of at
// their deadline.
void RingProcessGroup::on_poison(const std::string& reason) noexcept {
  try {
    store_->set(fmt::format("{}abort/{}", prefix_, rank()), reason);
  } catch (const std::exception&) {
    // Best effort: the store may be gone with the rank that hosted it.
  }
  // Peers waiting on this rank in any transport (the mesh, the cross-host step's mesh, the
  // shared-memory segment) fail now.
  for (RingTransport* transport :
       {static_cast<RingTransport*>(&mesh_), static_cast<RingTransport*>(cross_mesh_.get()),
        static_cast<RingTransport*>(domain_.get())}) {
    if (transport != nullptr) transport->abort(reason);
  }
  try {
    if (p2p_)
      p2p_->abort(std::make_exception_ptr(
          CommError(CommErrorKind::kAborted, reason, name(), "point to point", 0, -1)));
  } catch (const std::exception&) {
    // Best effort, as the store above.
  }
}

void RingProcessGroup::run_op(const Call& a, net::Deadline deadline) {
  if (a.header.algorithm == Algorithm::kSharedMemory) return run_shm(a, deadline);
  if (a.header.algorithm == Algorithm::kHierarchical) {
    return allreduce_hierarchical(hierarchy_, a, deadline);
  }
  run_tcp(mesh_.context(), a, deadline);
}

// The collectives of a one-host group, through the shared-memory domain (docs/shared-memory.md).
void RingProcessGroup::run_shm(const Call& a, net::Deadline deadline) {
  auto& d = *domain_;
  switch (a.kind) {
    case Collective::kAllreduce:
      if (!a.segments.empty()) {
        return d.allreduce_segments(a.segments, a.dtype, a.op, a.header, deadline);
      }
      return d.allreduce(a.send, a.recv, a.count, a.dtype, a.op, a.header, deadline);
    case Collective::kBroadcast:
      return d.broadcast(a.recv, a.count, a.dtype, a.root, a.header, deadline);
    case Collective::kReduce:
      return d.reduce(a.send, a.recv, a.count, a.dtype, a.op, a.root, a.header, deadline);
    case Collective::kAllgather:
      return d.allgather(a.send, a.recv, a.count, a.dtype, a.header, deadline);
    case Collective::kReduceScatter: {
      // The domain reads every block of `send` until the end: an overlapping recv goes through a
      // pooled temporary.
      const std::size_t block = a.count * dtype_size(a.dtype);
      const std::byte* send_end = a.send + block * static_cast<std::size_t>(size());
      const bool overlaps = a.recv < send_end && a.send < a.recv + block;
      if (!overlaps) {
        return d.reduce_scatter(a.send, a.recv, a.count, a.dtype, a.op, a.header, deadline);
      }
      std::byte* temp = scratch(block);
      d.reduce_scatter(a.send, temp, a.count, a.dtype, a.op, a.header, deadline);
      std::memcpy(a.recv, temp, block);
      return;
    }
    case Collective::kBarrier:
      return d.barrier(a.header, deadline);
    default:
      throw CommError(CommErrorKind::kInternal,
                      fmt::format("rank {}: {} has no shared-memory path", rank(), a.description()),
                      name(), a.description(), a.header.sequence, -1);
  }
}

void RingProcessGroup::fail_cross_transport_mismatch(int peer, const OpHeader& theirs) {
  const OpHeader& mine = current_->header;
  throw CommError(
      CommErrorKind::kMismatch,
      fmt::format("collective mismatch in group '{}': rank {} called {} [{}] but rank {} called "
                  "{} [{}]; every rank must issue the same collectives in the same order with "
                  "the same count, dtype, op and root",
                  name(), rank(), describe(mine), to_string(mine.algorithm), peer, describe(theirs),
                  to_string(theirs.algorithm)),
      name(), current_->description(), mine.sequence, peer);
}

// While a step of one transport sleeps: a peer in a call of the other transport with this call's
// sequence number runs a different collective (it would never send what this step waits for).
void RingProcessGroup::check_for_other_call(const RingTransport& other) {
  if (current_ == nullptr) return;
  OpHeader theirs;
  const int peer = other.peer_with_other_call(current_->header, theirs);
  if (peer >= 0) fail_cross_transport_mismatch(peer, theirs);
}

}  // namespace ddp::comm
