#include "ddp/torch/api/join.h"

#include <exception>
#include <functional>
#include <string>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "ddp/error.h"
#include "torch/core/fingerprint.h"
#include "torch/core/host_values.h"

namespace ddp {
namespace {

constexpr const char* kEarlyTermination =
    "Join: at least one rank exhausted its inputs (throw_on_early_termination is set), so every "
    "rank stops here. Give every rank the same number of steps, or leave "
    "throw_on_early_termination off to let the ranks that finished early shadow the others";

std::int32_t allreduce_sum(ProcessGroup& group, std::int32_t value) {
  detail::HostValues(group)->allreduce(&value, 1, DType::kInt32, ReduceOp::kSum)->wait();
  return value;
}

// The fingerprint as the int64 the collectives exchange.
std::int64_t fingerprint(const std::string& text) {
  return static_cast<std::int64_t>(detail::fingerprint(std::string_view(text)));
}

}  // namespace

Join::Join(std::vector<std::reference_wrapper<Joinable>> joinables, JoinOptions options)
    : joinables_(std::move(joinables)),
      state_(std::make_shared<JoinState>()),
      uncaught_at_start_(std::uncaught_exceptions()) {
  if (joinables_.empty()) throw ConfigError("Join: pass at least one joinable");
  state_->options = options;
  group_ = &joinables_.front().get().join_process_group();
  std::string description;
  for (std::size_t i = 0; i < joinables_.size(); ++i) {
    Joinable& joinable = joinables_[i].get();
    if (&joinable.join_process_group() != group_) {
      throw ConfigError(fmt::format(
          "Join: joinable {} ({}) uses another process group than the first one; every joinable "
          "of a Join must share one group",
          i, joinable.join_description()));
    }
    if (joinable.join_state_) {
      throw ConfigError(fmt::format("Join: {} is already in another Join; Joins do not nest",
                                    joinable.join_description()));
    }
    description += (i == 0 ? "" : ", ") + joinable.join_description();
  }
  // The same list on every rank (checked below, or a disabled Join), so every rank throws alike.
  bool gradients_left = false;
  for (auto& joinable : joinables_) {
    if (joinable.get().join_needs_gradients() && !gradients_left) {
      throw ConfigError(fmt::format(
          "Join: {} steps with the gradients of each shadowed step, so a joinable that leaves "
          "them (the DistributedDataParallel) must come before it: write Join({{*model, "
          "optimizer}}), not Join({{optimizer, *model}})",
          joinable.get().join_description()));
    }
    gradients_left = gradients_left || joinable.get().join_leaves_gradients();
  }
  state_->initial_world_size = group_->size();
  state_->nonjoined = group_->size();
  if (!options.enable) return;

  // Every rank must shadow the same collectives: check that the joinables agree.
  std::int64_t mine = fingerprint(description);
  std::vector<std::int64_t> all(static_cast<std::size_t>(group_->size()));
  detail::HostValues(*group_)->allgather(&mine, all.data(), 1, DType::kInt64)->wait();
  std::vector<int> differing;
  for (int r = 0; r < group_->size(); ++r) {
    if (all[static_cast<std::size_t>(r)] != all[0]) differing.push_back(r);
  }
  if (!differing.empty()) {
    throw Error(fmt::format(
        "Join: the ranks joined different joinables: rank(s) {} differ from rank 0 (rank {} has "
        "[{}]). Every rank must enter Join with the same kinds of joinables in the same order",
        fmt::join(differing, ", "), group_->rank(), description));
  }
  for (std::size_t i = 0; i < joinables_.size(); ++i) {
    joinables_[i].get().join_state_ = state_;
    joinables_[i].get().first_joinable_ = i == 0;
  }
}

Join::~Join() noexcept(false) {
  // Leaving by an exception: the other ranks will fail on their own (their peers are gone or
  // their deadline passes); waiting for them here would only delay the error.
  const bool unwinding = std::uncaught_exceptions() > uncaught_at_start_;
  if (!finished_ && !unwinding && state_->options.enable) {
    finish();  // detaches, also when it throws
    return;
  }
  detach();
}

void Join::detach() noexcept {
  for (auto& joinable : joinables_) {
    if (joinable.get().join_state_ == state_) {
      joinable.get().join_state_.reset();
      joinable.get().first_joinable_ = false;
    }
  }
}

void Join::finish() {
  if (finished_) return;
  finished_ = true;
  if (!state_->options.enable) {
    detach();
    return;
  }
  try {
    bool is_last_joiner = true;
    while (true) {
      const std::int32_t nonjoined = allreduce_sum(*group_, 0);
      if (nonjoined == 0) break;
      state_->nonjoined = nonjoined;
      if (state_->options.throw_on_early_termination) {
        allreduce_sum(*group_, 1);  // matches the check in notify_join_context
        throw Error(kEarlyTermination);
      }
      for (auto& joinable : joinables_)
        joinable.get().join_main_hook();
      is_last_joiner = false;
    }
    state_->nonjoined = 0;
    for (auto& joinable : joinables_)
      joinable.get().join_post_hook(is_last_joiner);
  } catch (...) {
    detach();
    throw;
  }
  detach();
}

int Join::notify_join_context(Joinable& joinable) {
  const auto& state = joinable.join_state_;
  if (!state || !state->options.enable) return 0;
  if (!joinable.first_joinable_) return state->nonjoined;
  ProcessGroup& group = joinable.join_process_group();
  state->nonjoined = allreduce_sum(group, 1);
  if (state->options.throw_on_early_termination && allreduce_sum(group, 0) != 0) {
    throw Error(kEarlyTermination);
  }
  return state->nonjoined;
}

}  // namespace ddp
