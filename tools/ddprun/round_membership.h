// RoundMembership: who takes part in one round of an elastic job (ddprun --nnodes MIN:MAX), in
// which order, and how that is written into the store.
//
//   std::vector<RoundMember> members = order_members(previous, arrivals, max_nodes);
//   store.set(key, encode_verdict(Verdict{.members = members, .restarts_used = 1}));
//   Verdict verdict = parse_verdict(store.get_string(key));   // on every agent
//   RoundPlacement placement = place(verdict.members, agent_id);  // this node's ranks
//
// An agent is one ddprun process, named by its agent id (0 for the one that serves the store;
// the others get 1, 2, ... in the order they first connect). A round's node ranks are positions
// in its member list: the agents of the previous round that came back keep their order, newcomers
// follow in the order they arrived, and agent 0 is always first (its host runs global rank 0,
// which serves the workers' store on --master-addr).
//
// Pure functions over values: any thread may call them. parse_verdict throws StoreError for a
// value this file did not write.
#pragma once

#include <string>
#include <vector>

namespace ddp::ddprun {

struct RoundMember {
  int agent = 0;  // agent id
  int nproc = 1;  // its --nproc-per-node
  bool operator==(const RoundMember&) const = default;
};

// Node 0's decision about a round, read by every agent that arrived for it.
struct Verdict {
  // Empty when the job ends instead (`end_message` says why; `end_exit_code` is what every
  // ddprun that reads it exits with).
  std::vector<RoundMember> members;
  // Failed rounds so far (each costs one of --max-restarts; membership changes cost none).
  int restarts_used = 0;
  std::string end_message;
  int end_exit_code = 1;
  bool ends_job() const { return members.empty(); }
};

// Where one agent's workers sit in a round.
struct RoundPlacement {
  int node_rank = 0;   // GROUP_RANK
  int nnodes = 1;      // GROUP_WORLD_SIZE
  int first_rank = 0;  // global rank of its local rank 0
  int world_size = 1;  // sum of the members' nproc
  bool operator==(const RoundPlacement&) const = default;
};

// The members of a round: those of `previous` that are in `arrivals` (their order kept), then the
// other arrivals in arrival order, agent 0 first, at most `max_nodes` of them.
std::vector<RoundMember> order_members(const std::vector<RoundMember>& previous,
                                       const std::vector<RoundMember>& arrivals, int max_nodes);

// `agent`'s place among `members` (node_rank -1 when it is not one of them).
RoundPlacement place(const std::vector<RoundMember>& members, int agent);

// "ok <restarts_used> <agent>:<nproc> ..." or "end <exit code> <message>".
std::string encode_verdict(const Verdict& verdict);
Verdict parse_verdict(const std::string& text);

// "<agent>:<nproc>", the value of an arrival key.
std::string encode_member(const RoundMember& member);
RoundMember parse_member(const std::string& text);

}  // namespace ddp::ddprun
