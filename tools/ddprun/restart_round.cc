#include "ddprun/restart_round.h"

#include <algorithm>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "ddp/error.h"

namespace ddp::ddprun {
namespace {

using Clock = std::chrono::steady_clock;
constexpr Milliseconds kBeatInterval{500};
constexpr Milliseconds kPollInterval{50};

}  // namespace

RestartRounds::RestartRounds(RestartRoundsOptions options) : options_(std::move(options)) {
  store_ = std::make_unique<TcpStore>(options_.host, static_cast<std::uint16_t>(options_.port),
                                      TcpStoreOptions{.is_server = options_.node_rank == 0,
                                                      .timeout = options_.join_timeout,
                                                      .connect_timeout = options_.join_timeout,
                                                      .listen_host = options_.listen_host,
                                                      .auth_secret = options_.secret});
  if (elastic()) {
    // Agent 0 serves the store and never asks; the others count themselves in: 1, 2, ...
    agent_id_ = options_.node_rank == 0 ? 0 : static_cast<int>(store_->add(key("agents"), 1));
  } else {
    agent_id_ = options_.node_rank;
  }
}

RestartRounds::~RestartRounds() = default;

std::string RestartRounds::key(const std::string& name) const {
  return fmt::format("ddprun/{}/{}", options_.run_id, name);
}

void RestartRounds::join(int round) {
  store_->set(key(fmt::format("round/{}/node/{}", round, options_.node_rank)), "1");
  std::vector<std::string> keys;
  for (int node = 0; node < options_.nnodes; ++node)
    keys.push_back(key(fmt::format("round/{}/node/{}", round, node)));
  const auto deadline = Clock::now() + options_.join_timeout;
  // Polled rather than one long wait, so that the heartbeat goes on while nodes come in.
  for (;;) {
    beat();
    if (store_->check(keys)) return;
    if (Clock::now() >= deadline) {
      std::vector<int> missing;
      for (int node = 0; node < options_.nnodes; ++node) {
        const std::string one[] = {keys[static_cast<std::size_t>(node)]};
        if (!store_->check(one)) missing.push_back(node);
      }
      throw TimeoutError(fmt::format(
          "restart round {}: node(s) {} did not join within {} s (their ddprun is gone "
          "or cannot reach {}:{}); giving up",
          round, fmt::join(missing, ", "),
          std::chrono::duration_cast<std::chrono::seconds>(options_.join_timeout).count(),
          options_.host, options_.port));
    }
    std::this_thread::sleep_for(kPollInterval);
  }
}

int RestartRounds::current_round() {
  return static_cast<int>(store_->add(key("round"), 0));
}

std::string RestartRounds::report_failure(int round, const std::string& what) {
  const std::string failure_key = key(fmt::format("round/{}/failure", round));
  if (elastic() && current_round() > round) {
    // The job left the round already (a membership change stopped the workers, and this failure
    // is its consequence): it must not turn that round into a failed one.
    return failure(round);
  }
  // First writer wins: sets only while the key is absent.
  const std::string recorded = store_->compare_set(failure_key, "", what);
  const std::string before = std::to_string(round);
  const std::string after = std::to_string(round + 1);
  if (round == 0) {
    // "round" may not exist yet (add(…, 0) in current_round creates it as "0").
    store_->add(key("round"), 0);
  }
  store_->compare_set(key("round"), before, after);
  return recorded;
}

std::string RestartRounds::failure(int round) {
  const std::string failure_key = key(fmt::format("round/{}/failure", round));
  const std::string keys[] = {failure_key};
  return store_->check(keys) ? store_->get_string(failure_key) : std::string();
}

void RestartRounds::report_success(int round) {
  store_->add(key(fmt::format("round/{}/succeeded", round)), 1);
}

bool RestartRounds::all_succeeded(int round) {
  const std::int64_t needed = elastic() ? static_cast<std::int64_t>(members_.size())
                                        : static_cast<std::int64_t>(options_.nnodes);
  return store_->add(key(fmt::format("round/{}/succeeded", round)), 0) >= needed;
}

int RestartRounds::beat() {
  const auto now = Clock::now();
  if (now - last_beat_ < kBeatInterval) return -1;
  last_beat_ = now;
  store_->add(key(fmt::format("heartbeat/{}", agent_id_)), 1);
  if (options_.node_rank != 0) return -1;
  // Elastic: every agent that ever registered is watched (close_round asks who is alive); only
  // members of the current round are reported.
  const int watched =
      elastic() ? static_cast<int>(store_->add(key("agents"), 0)) + 1 : options_.nnodes;
  int silent = -1;
  for (int node = 1; node < watched; ++node) {
    const std::int64_t count = store_->add(key(fmt::format("heartbeat/{}", node)), 0);
    Heard& heard = heard_[node];
    if (count != heard.count) {
      heard = {count, now};
    } else if (now - heard.since > options_.heartbeat_timeout && silent < 0) {
      const bool member =
          !elastic() || std::any_of(members_.begin(), members_.end(),
                                    [node](const RoundMember& m) { return m.agent == node; });
      if (member) silent = node;
    }
  }
  return silent;
}

std::string RestartRounds::describe_node(int id) const {
  if (!elastic()) return fmt::format("node {}", id);
  const RoundPlacement placement = place(members_, id);
  return placement.node_rank >= 0 ? fmt::format("node {} (agent {})", placement.node_rank, id)
                                  : fmt::format("agent {}", id);
}

void RestartRounds::leave() {
  if (options_.node_rank != 0) {
    store_->add(key("left"), 1);
    return;
  }
  const std::int64_t others = elastic() ? expected_leavers_ : options_.nnodes - 1;
  const auto deadline = Clock::now() + kLeaveWait;
  while (store_->add(key("left"), 0) < others && Clock::now() < deadline) {
    std::this_thread::sleep_for(kPollInterval);
  }
}

// ---------------------------------------------------------------------------------------------
// Elastic rounds

void RestartRounds::register_arrival(int round) {
  const std::int64_t index = store_->add(key(fmt::format("round/{}/arrivals", round)), 1) - 1;
  store_->set(key(fmt::format("round/{}/arrival/{}", round, index)),
              encode_member({.agent = agent_id_, .nproc = options_.nproc}));
}

int RestartRounds::read_arrivals(int round, std::vector<RoundMember>& arrivals) {
  const std::int64_t count = store_->add(key(fmt::format("round/{}/arrivals", round)), 0);
  int added = 0;
  for (auto index = static_cast<std::int64_t>(arrivals.size()); index < count; ++index) {
    // An agent counts itself in before it writes its entry: stop at the first one not written.
    const std::string entry[] = {key(fmt::format("round/{}/arrival/{}", round, index))};
    if (!store_->check(entry)) break;
    arrivals.push_back(parse_member(store_->get_string(entry[0])));
    ++added;
  }
  return added;
}

std::vector<int> RestartRounds::live_absentees(const std::vector<RoundMember>& arrivals) {
  std::vector<int> live;
  const auto now = Clock::now();
  const int registered = static_cast<int>(store_->add(key("agents"), 0)) + 1;
  for (int agent = 1; agent < registered; ++agent) {
    const bool arrived = std::any_of(arrivals.begin(), arrivals.end(),
                                     [agent](const RoundMember& m) { return m.agent == agent; });
    if (arrived) continue;
    const auto it = heard_.find(agent);
    // Not yet watched for heartbeat_timeout: it may be alive.
    if (it == heard_.end() || now - it->second.since <= options_.heartbeat_timeout) {
      live.push_back(agent);
    }
  }
  return live;
}

void RestartRounds::end_job(int round, const std::string& message, int exit_code, int readers) {
  store_->set(key(fmt::format("round/{}/members", round)),
              encode_verdict({.end_message = message, .end_exit_code = exit_code}));
  expected_leavers_ = readers;
  leave();
  throw JobEnded(message, exit_code);
}

Verdict RestartRounds::close_round(int round) {
  // The restarts used before this round: those of the previous verdict, plus one if the previous
  // round failed (rather than ended by a membership change).
  int restarts_used = restarts_used_;
  std::string last_failure;
  if (round > 0) {
    last_failure = failure(round - 1);
    if (!last_failure.empty()) ++restarts_used;
  }
  std::vector<RoundMember> arrivals;
  auto last_newcomer = Clock::now();
  const auto deadline = Clock::now() + options_.join_timeout;
  const auto others_arrived = [&] { return static_cast<int>(arrivals.size()) - 1; };
  for (;;) {
    beat();
    if (read_arrivals(round, arrivals) > 0) last_newcomer = Clock::now();
    const int count = static_cast<int>(arrivals.size());
    const bool settled = Clock::now() - last_newcomer >= options_.last_call;
    const bool full = count >= options_.nnodes;
    if (full || (count >= options_.min_nodes && settled)) break;
    if (settled && live_absentees(arrivals).empty()) {
      end_job(
          round,
          fmt::format(
              "elastic round {}: {} node(s) left, fewer than the {} of --nnodes {}:{} (the "
              "others' ddprun is gone: no heartbeat for {} s); the job ends",
              round, count, options_.min_nodes, options_.min_nodes, options_.nnodes,
              std::chrono::duration_cast<std::chrono::seconds>(options_.heartbeat_timeout).count()),
          1, others_arrived());
    }
    if (Clock::now() >= deadline) {
      end_job(round,
              fmt::format(
                  "elastic round {}: only {} node(s) came within {} s, fewer than the {} "
                  "of --nnodes {}:{}; the job ends",
                  round, count,
                  std::chrono::duration_cast<std::chrono::seconds>(options_.join_timeout).count(),
                  options_.min_nodes, options_.min_nodes, options_.nnodes),
              1, others_arrived());
    }
    std::this_thread::sleep_for(kPollInterval);
  }
  if (restarts_used > options_.max_restarts) {
    end_job(round,
            fmt::format("giving up after {} restarts; the job's last failure: {}",
                        options_.max_restarts, last_failure),
            1, others_arrived());
  }
  Verdict verdict{.members = order_members(members_, arrivals, options_.nnodes),
                  .restarts_used = restarts_used};
  restarts_used_ = restarts_used;
  store_->set(key(fmt::format("round/{}/members", round)), encode_verdict(verdict));
  return verdict;
}

JoinedRound RestartRounds::join_elastic(int round) {
  const auto deadline = Clock::now() + options_.join_timeout + options_.last_call;
  for (;; ++round) {
    register_arrival(round);
    Verdict verdict;
    if (options_.node_rank == 0) {
      verdict = close_round(round);
    } else {
      const std::string members_key[] = {key(fmt::format("round/{}/members", round))};
      for (;;) {
        beat();
        if (store_->check(members_key)) break;
        if (Clock::now() >= deadline) {
          throw TimeoutError(fmt::format(
              "no round of the elastic job took this node within {} s (waiting for round "
              "{} at {}:{}: the job may have --nnodes MAX nodes already); giving up",
              std::chrono::duration_cast<std::chrono::seconds>(options_.join_timeout).count(),
              round, options_.host, options_.port));
        }
        std::this_thread::sleep_for(kPollInterval);
      }
      verdict = parse_verdict(store_->get_string(members_key[0]));
      if (verdict.ends_job()) {
        store_->add(key("left"), 1);
        throw JobEnded(verdict.end_message, verdict.end_exit_code);
      }
    }
    const RoundPlacement placement = place(verdict.members, agent_id_);
    if (placement.node_rank < 0) continue;  // full or closed before this agent came: next round
    members_ = verdict.members;
    return JoinedRound{.round = round,
                       .placement = placement,
                       .restarts_used = verdict.restarts_used,
                       .members = verdict.members};
  }
}

bool RestartRounds::admit_waiting(int round) {
  if (static_cast<int>(members_.size()) >= options_.nnodes) return false;
  if (current_round() != round) return false;  // moved on already (a failure)
  const std::int64_t waiting = store_->add(key(fmt::format("round/{}/arrivals", round + 1)), 0);
  if (waiting <= 0) return false;
  // The reason first, so that whoever sees the round move finds it.
  store_->set(key(fmt::format("round/{}/change", round)),
              fmt::format("{} node(s) waiting to join", waiting));
  store_->compare_set(key("round"), std::to_string(round), std::to_string(round + 1));
  return current_round() > round;
}

std::string RestartRounds::membership_change(int round) {
  const std::string change_key = key(fmt::format("round/{}/change", round));
  const std::string keys[] = {change_key};
  return store_->check(keys) ? store_->get_string(change_key) : std::string();
}

void RestartRounds::finish(int round) {
  // Agents that came for the next round read this and exit; the members leave() as usual.
  std::vector<RoundMember> waiting;
  read_arrivals(round + 1, waiting);
  store_->set(key(fmt::format("round/{}/members", round + 1)),
              encode_verdict({.end_message = "the job finished before this node could join",
                              .end_exit_code = 0}));
  expected_leavers_ = static_cast<int>(members_.size()) - 1 + static_cast<int>(waiting.size());
}

}  // namespace ddp::ddprun
