// The hierarchical allreduce of a ring group spanning hosts (costs in docs/algorithms.md).
#include "comm/ring/hierarchical.h"

#include <cstring>

#include <fmt/format.h>

#include "ddp/comm/comm_error.h"

namespace ddp::comm {
namespace {

// Allreduce of the cross-host group on `buf` (in place), with this operation's sequence number;
// an average divides by the whole group's size. Errors name this group's ranks.
void cross_host_allreduce(Hierarchy& h, std::byte* buf, std::size_t count, const Call& a,
                          net::Deadline deadline) {
  Call x;
  x.kind = Collective::kAllreduce;
  x.send = buf;
  x.recv = buf;
  x.count = count;
  x.dtype = a.dtype;
  x.op = a.op;
  x.avg_divisor = h.group_size;
  x.timeout = a.timeout;
  x.header = a.header;
  x.header.count = count;
  x.header.algorithm = tcp_allreduce_algorithm(count * dtype_size(a.dtype), count, h.cross->size(),
                                               h.small_message_bytes);
  x.label = fmt::format("{} (step across hosts, group '{}')", a.description(), h.cross->group());
  try {
    run_tcp(*h.cross, x, deadline);
  } catch (const PeerClosedError& e) {
    const int peer = e.peer() >= 0 ? h.cross_members[static_cast<std::size_t>(e.peer())] : -1;
    throw PeerClosedError(fmt::format("{} [{}]", e.what(), h.cross_ranks_note(e.peer())), h.group,
                          a.description(), a.header.sequence, peer);
  } catch (const CommError& e) {
    // The cross-host group numbers its members 0..H-1: name this group's ranks too.
    const int peer = e.peer() >= 0 ? h.cross_members[static_cast<std::size_t>(e.peer())] : -1;
    throw CommError(e.kind(), fmt::format("{} [{}]", e.what(), h.cross_ranks_note(e.peer())),
                    h.group, a.description(), a.header.sequence, peer);
  }
}

}  // namespace

// For errors of the cross-host group, whose members are numbered 0..H-1: which ranks of this
// group they are, e.g. "rank 1 of 'default/cross0' is rank 2 of 'default'".
std::string Hierarchy::cross_ranks_note(int cross_peer) const {
  if (cross_peer >= 0 && static_cast<std::size_t>(cross_peer) < cross_members.size()) {
    return fmt::format("rank {} of '{}' is rank {} of '{}'", cross_peer, cross->group(),
                       cross_members[static_cast<std::size_t>(cross_peer)], group);
  }
  std::string members;
  for (std::size_t i = 0; i < cross_members.size(); ++i)
    members += fmt::format("{}{} is rank {}", i == 0 ? "" : ", ", i, cross_members[i]);
  return fmt::format("ranks of '{}' in '{}': {}", cross->group(), group, members);
}

// Hierarchical allreduce for groups spanning hosts (costs in docs/algorithms.md):
//  - leaders: reduce inside each host to its leader over shared memory, allreduce among the
//    leaders over TCP, broadcast inside each host;
//  - slices (every host has the same number L of ranks, message above the small-message size):
//    reduce_scatter inside each host so that local rank i holds the host's sum of slice i,
//    allreduce slice i with the ranks of local index i on the other hosts (L rings at once, each
//    carrying 1/L of the data), allgather inside each host; the count % L elements left over
//    take the leaders' path.
// Each element is reduced in one fixed order (local ranks in rank order, then hosts by the
// cross-host algorithm, which gives the same bits to all of its ranks) and then copied, so every
// rank gets bit-identical results. avg sums and divides once, by the whole group's size.
void allreduce_hierarchical(Hierarchy& h, const Call& a, net::Deadline deadline) {
  const std::size_t esz = dtype_size(a.dtype);
  const ReduceOp local_op = a.op == ReduceOp::kAvg ? ReduceOp::kSum : a.op;
  const auto local_size = h.local.size();
  auto header = [&](Collective kind, std::size_t count, int root) {
    OpHeader h = a.header;
    h.kind = kind;
    h.count = count;
    h.root = root;
    return h;
  };
  auto leaders_path = [&](std::size_t first, std::size_t count) {
    const std::byte* in = a.send + first * esz;
    std::byte* out = a.recv + first * esz;
    if (h.domain) {
      h.domain->reduce(in, out, count, a.dtype, local_op, 0, header(Collective::kReduce, count, 0),
                       deadline);
    } else if (in != out && count > 0) {
      std::memcpy(out, in, count * esz);
    }
    if (h.local_rank == 0) cross_host_allreduce(h, out, count, a, deadline);
    if (h.domain) {
      h.domain->broadcast(out, count, a.dtype, 0, header(Collective::kBroadcast, count, 0),
                          deadline);
    }
  };
  const std::size_t per = a.count / local_size;
  if (!h.slices || local_size == 1 || a.count * esz <= h.small_message_bytes || per == 0) {
    return leaders_path(0, a.count);
  }
  std::byte* slice = h.scratch_for(per * esz);
  h.domain->reduce_scatter(a.send, slice, per, a.dtype, local_op,
                           header(Collective::kReduceScatter, per, -1), deadline);
  cross_host_allreduce(h, slice, per, a, deadline);
  h.domain->allgather(slice, a.recv, per, a.dtype, header(Collective::kAllgather, per, -1),
                      deadline);
  const std::size_t tail = a.count - per * local_size;
  if (tail > 0) leaders_path(per * local_size, tail);
}

}  // namespace ddp::comm
