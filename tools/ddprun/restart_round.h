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

#include "ddp/tcp_store.h"

namespace ddp::ddprun {

struct RestartRoundsOptions {
  std::string host;  // --master-addr
  int port = 0;      // --agent-port
  int nnodes = 1;
  int node_rank = 0;
  std::string run_id = "none";
  std::string secret;  // the job's secret ("" = none), as for the workers' store
  // How long join may wait for every node, and how long the connection may take.
  Milliseconds join_timeout = kDefaultTimeout;
  // How long node 0 accepts a node's heartbeat standing still.
  Milliseconds heartbeat_timeout{30'000};
};

class RestartRounds {
 public:
  explicit RestartRounds(RestartRoundsOptions options);
  ~RestartRounds();
  RestartRounds(const RestartRounds&) = delete;
  RestartRounds& operator=(const RestartRounds&) = delete;

  // Marks this node as present in `round` and waits until every node is (TimeoutError naming the
  // missing nodes after join_timeout).
  void join(int round);
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
  // whose heartbeat stood still for heartbeat_timeout (-1: every node is alive).
  int beat();
  // Before ddprun exits: nodes other than 0 say they are leaving; node 0 waits (at most kLeaveWait)
  // for them, so that they can read the outcome from its store first.
  void leave();

  static constexpr Milliseconds kLeaveWait{10'000};

 private:
  std::string key(const std::string& name) const;

  RestartRoundsOptions options_;
  std::unique_ptr<TcpStore> store_;
  std::chrono::steady_clock::time_point last_beat_{};
  struct Heard {
    std::int64_t count = -1;
    std::chrono::steady_clock::time_point since{};
  };
  std::map<int, Heard> heard_;  // node 0: each node's last heartbeat count and when it changed
};

}  // namespace ddp::ddprun
