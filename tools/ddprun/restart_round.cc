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
                                                      .auth_secret = options_.secret});
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
          "ddprun: restart round {}: node(s) {} did not join within {} s (their ddprun is gone "
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
  return store_->add(key(fmt::format("round/{}/succeeded", round)), 0) >= options_.nnodes;
}

int RestartRounds::beat() {
  const auto now = Clock::now();
  if (now - last_beat_ < kBeatInterval) return -1;
  last_beat_ = now;
  store_->add(key(fmt::format("heartbeat/{}", options_.node_rank)), 1);
  if (options_.node_rank != 0) return -1;
  for (int node = 1; node < options_.nnodes; ++node) {
    const std::int64_t count = store_->add(key(fmt::format("heartbeat/{}", node)), 0);
    Heard& heard = heard_[node];
    if (count != heard.count) {
      heard = {count, now};
    } else if (now - heard.since > options_.heartbeat_timeout) {
      return node;
    }
  }
  return -1;
}

void RestartRounds::leave() {
  if (options_.node_rank != 0) {
    store_->add(key("left"), 1);
    return;
  }
  const auto deadline = Clock::now() + kLeaveWait;
  while (store_->add(key("left"), 0) < options_.nnodes - 1 && Clock::now() < deadline) {
    std::this_thread::sleep_for(kPollInterval);
  }
}

}  // namespace ddp::ddprun
