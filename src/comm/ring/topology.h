// Topology: which ranks of a group share a host (internal to the ring backend).
//
// Every rank publishes its host identity at group creation; from all of them each rank derives
// the same grouping: the ranks of each host, and its own host's ranks and index. The ring backend
// chooses shared memory, TCP or the hierarchical allreduce from it, and answers
// ProcessGroup::local_rank()/local_size().
#pragma once

#include <cstddef>
#include <string>
#include <vector>

namespace ddp::comm {

// What makes two ranks "on one host": the same kernel (boot id; the host name alone can repeat
// across containers) and the same network namespace, so that namespaces on one kernel, used as
// hosts by tests and some container setups, count as different hosts. `explicit_id` (DDP_HOST_ID;
// for setups where the detection is wrong, and for tests that give ranks of one machine different
// "hosts") replaces the detection when not empty.
std::string host_identity(const std::string& explicit_id);

struct Topology {
  // The ranks of each host, sorted; hosts ordered by their lowest rank (the host's leader).
  std::vector<std::vector<int>> hosts;
  // This rank's host, and its index there.
  std::vector<int> local;
  int local_rank = 0;

  // `identity_of[r]`: rank r's host identity. Pure: equal inputs give equal results on every rank.
  static Topology from_identities(const std::vector<std::string>& identity_of, int rank);
  std::size_t largest_host() const;
  bool equal_hosts() const;  // every host has the same number of ranks
};

}  // namespace ddp::comm
