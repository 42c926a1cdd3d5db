// The hierarchical allreduce of a ring group whose ranks span several hosts (internal).
//
// Inside each host over the host's shared-memory domain, across hosts over TCP among one rank per
// host (the leaders) or, when every host has the same number of ranks, among the ranks of each
// local index (slices). Prose and costs above allreduce_hierarchical in hierarchical.cc and in
// docs/algorithms.md. Runs on the thread holding the group's executor role.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "comm/call.h"
#include "comm/ring/shm/shm_domain.h"
#include "comm/ring/tcp_algorithms.h"
#include "net/socket.h"

namespace ddp::comm {

// The part of a group's topology the hierarchical allreduce works over (fixed at creation).
struct Hierarchy {
  std::string group;  // this group's name, for messages
  int group_size = 0;
  shm::ShmDomain* domain = nullptr;  // this host's ranks; null when this rank is alone on it
  std::vector<int> local;            // this host's ranks (in this group's numbering)
  int local_rank = 0;
  bool slices = false;  // equal hosts: every local index runs its own cross-host allreduce
  std::size_t small_message_bytes = 0;  // up to this, the leaders' path only
  // This rank's cross-host group (the ranks of its local index on every host, or the leaders),
  // null when it is in none; and the ranks of this group its members are, by their cross rank.
  TcpContext* cross = nullptr;
  std::vector<int> cross_members;

  // For errors of the cross-host group, whose members are numbered 0..H-1: which ranks of this
  // group they are, e.g. "rank 1 of 'default/cross0' is rank 2 of 'default'".
  std::string cross_ranks_note(int cross_peer) const;
  std::byte* scratch_for(std::size_t bytes) {
    if (scratch.size() < bytes) scratch.resize(bytes);
    return scratch.data();
  }
  std::vector<std::byte> scratch;  // pooled, reused across operations
};

// Allreduce of `a` (kind kAllreduce, algorithm kHierarchical) over the hosts; bit-identical
// results on every rank. Throws CommError naming this group's ranks.
void allreduce_hierarchical(Hierarchy& h, const Call& a, net::Deadline deadline);

}  // namespace ddp::comm
