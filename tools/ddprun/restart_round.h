// RestartRounds: how every node's ddprun restarts the whole job together (--nnodes > 1 with
// --max-restarts K), through a small store that node 0's ddprun serves on --agent-port.
//
//   RestartRounds rounds({.host = addr, .port = agent_port, .nnodes = 2, .node_rank = r, ...});
//   for (int round = 0;; ++round) {
//     rounds.join(round);                        // every node is here (deadline)
//     start the workers with TORCHELASTIC_RESTART_COUNT=round;
//     while they run: rounds.beat(); if (rounds.current_round() > round) stop them, go on;
//     a worker failed: rounds.report_failure(round, "rank 3 (node 1) exited with code 1");
//     all succeeded:   rounds.report_success(round), then poll all_succeeded(round) / round moved;
//   }
//   rounds.leave();                              // node 0 keeps the store until the others left
//
// The protocol (keys under "ddprun/<run id>/"):
// - "round": the job's restart round, an integer that only grows, by compare-and-set from r to
//   r + 1, so that several nodes failing at once move the job on by one round, not several.
// - "round/<r>/failure": what failed first in round r (first writer wins; compare-and-set on an
//   absent key), so every node names the same cause when it restarts or gives up.
// - "round/<r>/node/<n>": node n joined round r; join waits for every node's key.
// - "round/<r>/succeeded": how many nodes' workers all exited with 0 in round r; the job is done
//   when it reaches nnodes.
// - "heartbeat/<n>": node n adds 1 about every 500 ms while it waits or supervises; node 0 calls
//   a node whose count stood still for heartbeat_timeout gone (a node whose ddprun died), and
//   the other nodes notice node 0's death as the loss of their store connection.
// - "left": nodes other than 0 add 1 as they exit, so node 0 keeps the store until they have read
//   the outcome (at most kLeaveWait).
//
// Elastic jobs (--nnodes MIN:MAX, options.min_nodes < options.nnodes) use join_elastic instead of
// join, and node ranks are assigned per round (round_membership.h). Agent 0 is the ddprun with
// --node-rank 0, which serves the store; every other one takes an agent id from "agents" when it
// connects, and its heartbeat is "heartbeat/<agent id>". More keys:
// - "round/<r>/arrivals" (a counter) and "round/<r>/arrival/<i>" = "<agent>:<nproc>": the agents
//   that came for round r, in order.
// - "round/<r>/members": agent 0's verdict (round_membership.h): the members in node-rank order
//   and the restarts used so far, or "end <exit code> <why>" (the job finished, gave up after
//   --max-restarts, or fewer than MIN agents are left). Agent 0 writes it when MAX agents are in,
//   or when at least MIN are and last_call passed without a newcomer; with fewer than MIN, when
//   last_call passed and every agent that has not come is silent (no heartbeat for
//   heartbeat_timeout), or at join_timeout. An agent not among the members waits for round r + 1.
// - "round/<r>/change": why agent 0 moved the job past round r without a failure (agents wait for
//   round r + 1 and the round has room): such a round costs no restart. A failure of round r
//   (the first one recorded while the job is still in round r) costs one; the verdict of round
//   r + 1 counts them and ends the job when they exceed --max-restarts.
// Agent 0 leaving ends the job: the others lose the store (StoreError), as with torchrun's c10d
// rendezvous, whose store lives in one agent too.
//
// Workers see each round as a new TORCHELASTIC_RESTART_COUNT, which is in their own rendezvous
// keys (ddp/rendezvous/<count>), so nothing of an earlier round is read again.
//
// Threads: one thread (ddprun's). Errors: ddp::Error (StoreError, TimeoutError) naming the store
// address, the round and the nodes that are missing or silent.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "ddp/error.h"
#include "ddp/store/tcp_store.h"
#include "ddprun/round_membership.h"

namespace ddp::ddprun {

struct RestartRoundsOptions {
  std::string host;  // --master-addr
  int port = 0;      // --agent-port
  // Where node 0's store listens ("" = every IPv4 address); see agent_listen_host (launcher.cc).
  std::string listen_host;
  int nnodes = 1;
  int node_rank = 0;
  std::string run_id = "none";
  std::string secret;  // the job's secret ("" = none), as for the workers' store
  // How long join may wait for every node, and how long the connection may take.
  Milliseconds join_timeout = kDefaultTimeout;
  // How long node 0 accepts a node's heartbeat standing still.
  Milliseconds heartbeat_timeout{30'000};
  // Elastic jobs: nnodes is MAX, min_nodes MIN (0 = nnodes: a static job); this agent's nproc;
  // how long a round waits for newcomers once MIN are in; --max-restarts.
  int min_nodes = 0;
  int nproc = 1;
  Milliseconds last_call{3000};
  int max_restarts = 0;
};

// The end of an elastic job as agent 0 decided it (the verdict of a round): every ddprun that
// reads it says why and exits with exit_code().
class JobEnded : public Error {
 public:
  JobEnded(const std::string& what, int exit_code) : Error(what), exit_code_(exit_code) {}
  int exit_code() const { return exit_code_; }

 private:
  int exit_code_;
};

// An elastic round this agent takes part in.
struct JoinedRound {
  int round = 0;  // may be later than asked for: a late agent waits for the next round
  RoundPlacement placement;
  int restarts_used = 0;
  std::vector<RoundMember> members;
};

class RestartRounds {
 public:
  explicit RestartRounds(RestartRoundsOptions options);
  ~RestartRounds();
  RestartRounds(const RestartRounds&) = delete;
  RestartRounds& operator=(const RestartRounds&) = delete;

  // Marks this node as present in `round` and waits until every node is (TimeoutError naming the
  // missing nodes after join_timeout). Static jobs only.
  void join(int round);
  // Elastic jobs: comes for `round` (or the first later one that has room) and returns this
  // agent's place in it once agent 0 closed it. Throws JobEnded when agent 0 decided that the job
  // ends, TimeoutError when no round took this agent within join_timeout, StoreError when
  // agent 0 is gone.
  JoinedRound join_elastic(int round);
  // Agent 0 of an elastic job, while the workers of `round` run: when agents wait for the next
  // round and this one has fewer than MAX members, moves the job to the next round (recording
  // why in "round/<r>/change") and returns true.
  bool admit_waiting(int round);
  // Why the job left `round` without a failure ("" if it did not).
  std::string membership_change(int round);
  // Agent 0 of an elastic job, after every member of `round` succeeded: tells agents waiting for
  // the next round that the job is over (they exit with 0).
  void finish(int round);
  // How beat()'s silent node is named: "node 1" (static), "node 2 (agent 3)" (elastic).
  std::string describe_node(int id) const;
  bool elastic() const { return options_.min_nodes > 0 && options_.min_nodes < options_.nnodes; }
  // The job's round as the store has it now.
  int current_round();
  // A worker of this node failed in `round`: records `what` unless another failure of the round
  // was recorded first, and moves the job to round + 1 (unless a node did already). Returns the
  // round's recorded failure (the first one).
  std::string report_failure(int round, const std::string& what);
  // The recorded failure of `round` ("" if none).
  std::string failure(int round);
  void report_success(int round);
  bool all_succeeded(int round);
  // Adds to this node's heartbeat at most every 500 ms; on node 0, also returns the first node
  // whose heartbeat stood still for heartbeat_timeout (-1: every node is alive); elastic jobs:
  // the first member of the current round (its agent id).
  int beat();
  // Before ddprun exits: nodes other than 0 say they are leaving; node 0 waits (at most kLeaveWait)
  // for them, so that they can read the outcome from its store first.
  void leave();

  static constexpr Milliseconds kLeaveWait{10'000};

 private:
  std::string key(const std::string& name) const;
  void register_arrival(int round);
  // Agent 0: waits for the agents of `round` and writes its verdict.
  Verdict close_round(int round);
  // Agent 0: reads arrivals of `round` beyond those in `arrivals`, returns how many were new.
  int read_arrivals(int round, std::vector<RoundMember>& arrivals);
  // Agent 0: agents that registered, have not arrived, and whose heartbeat still moves.
  std::vector<int> live_absentees(const std::vector<RoundMember>& arrivals);
  // Agent 0: publishes an ending verdict for `round`, waits for those who will read it, throws.
  [[noreturn]] void end_job(int round, const std::string& message, int exit_code, int readers);

  RestartRoundsOptions options_;
  std::unique_ptr<TcpStore> store_;
  std::chrono::steady_clock::time_point last_beat_{};
  struct Heard {
    std::int64_t count = -1;
    std::chrono::steady_clock::time_point since{};
  };
  std::map<int, Heard> heard_;  // node 0: each node's last heartbeat count and when it changed
  // Elastic jobs.
  int agent_id_ = 0;
  std::vector<RoundMember> members_;  // of the round this agent is in (or last was)
  int restarts_used_ = 0;             // agent 0: as written in the last verdict
  int expected_leavers_ = 0;          // agent 0: how many others leave() waits for
};

}  // namespace ddp::ddprun
