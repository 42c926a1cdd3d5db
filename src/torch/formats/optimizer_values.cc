// Optimizer values checked where they come from a file (optimizer_values.h). The ranges are
// PyTorch's own constructor checks (torch/optim/{sgd,adam,adamw,adagrad,rmsprop}.py), plus
// finiteness, which PyTorch does not check and which is what a damaged file breaks.
#include "torch/formats/optimizer_values.h"

#include <cmath>

#include <fmt/format.h>

namespace ddp::detail {
namespace {

[[noreturn]] void refuse(const ValueError& fail, const std::string& what) {
  fail(what);
  throw Error(what);  // a fail that returned
}

const char* range_text(ValueRange range) {
  switch (range) {
    case ValueRange::kFinite:
      return "a finite number";
    case ValueRange::kNonNegative:
      return "a finite number >= 0";
    case ValueRange::kUnitInterval:
      return "a number in [0, 1)";
  }
  return "?";
}

template <class Options>
void check_betas(const Options& o, const std::string& where, const ValueError& fail) {
  check_value(std::get<0>(o.betas()), ValueRange::kUnitInterval, where + " betas[0]", fail);
  check_value(std::get<1>(o.betas()), ValueRange::kUnitInterval, where + " betas[1]", fail);
  check_value(o.eps(), ValueRange::kNonNegative, where + " eps", fail);
  check_value(o.weight_decay(), ValueRange::kNonNegative, where + " weight_decay", fail);
}

}  // namespace

void check_value(double value, ValueRange range, const std::string& what, const ValueError& fail) {
  const bool ok = std::isfinite(value) && (range == ValueRange::kFinite || value >= 0) &&
                  (range != ValueRange::kUnitInterval || value < 1);
  if (!ok) refuse(fail, fmt::format("{} is {}; it must be {}", what, value, range_text(range)));
}

std::int64_t checked_step(double value, const std::string& what, const ValueError& fail) {
  constexpr double kLargestExact = 9007199254740992.0;  // 2^53
  if (!std::isfinite(value) || value < 0 || value > kLargestExact || std::trunc(value) != value) {
    refuse(fail,
           fmt::format("{} is {}; a step count must be a whole number in [0, 2^53]", what, value));
  }
  return static_cast<std::int64_t>(value);
}

void check_optimizer_values(const torch::optim::Optimizer& optimizer, const ValueError& fail) {
  namespace optim = torch::optim;
  const auto& groups = optimizer.param_groups();
  for (std::size_t i = 0; i < groups.size(); ++i) {
    const std::string where = fmt::format("param group {}'s", i);
    const auto& options = groups[i].options();
    check_value(options.get_lr(), ValueRange::kNonNegative, where + " lr", fail);
    if (const auto* o = dynamic_cast<const optim::SGDOptions*>(&options)) {
      check_value(o->momentum(), ValueRange::kNonNegative, where + " momentum", fail);
      check_value(o->dampening(), ValueRange::kFinite, where + " dampening", fail);
      check_value(o->weight_decay(), ValueRange::kNonNegative, where + " weight_decay", fail);
    } else if (const auto* adam = dynamic_cast<const optim::AdamOptions*>(&options)) {
      check_betas(*adam, where, fail);
    } else if (const auto* adamw = dynamic_cast<const optim::AdamWOptions*>(&options)) {
      check_betas(*adamw, where, fail);
    } else if (const auto* adagrad = dynamic_cast<const optim::AdagradOptions*>(&options)) {
      check_value(adagrad->lr_decay(), ValueRange::kNonNegative, where + " lr_decay", fail);
      check_value(adagrad->weight_decay(), ValueRange::kNonNegative, where + " weight_decay", fail);
      check_value(adagrad->eps(), ValueRange::kNonNegative, where + " eps", fail);
      check_value(adagrad->initial_accumulator_value(), ValueRange::kNonNegative,
                  where + " initial_accumulator_value", fail);
    } else if (const auto* rms = dynamic_cast<const optim::RMSpropOptions*>(&options)) {
      check_value(rms->alpha(), ValueRange::kNonNegative, where + " alpha", fail);
      check_value(rms->eps(), ValueRange::kNonNegative, where + " eps", fail);
      check_value(rms->momentum(), ValueRange::kNonNegative, where + " momentum", fail);
      check_value(rms->weight_decay(), ValueRange::kNonNegative, where + " weight_decay", fail);
    }
  }
  std::size_t index = 0;
  for (const auto& [key, state] : optimizer.state()) {
    std::int64_t step = 0;
    if (const auto* adam = dynamic_cast<const optim::AdamParamState*>(state.get())) {
      step = adam->step();
    } else if (const auto* adamw = dynamic_cast<const optim::AdamWParamState*>(state.get())) {
      step = adamw->step();
    } else if (const auto* adagrad = dynamic_cast<const optim::AdagradParamState*>(state.get())) {
      step = adagrad->step();
    }
    if (step < 0) {
      refuse(fail, fmt::format("parameter state {}'s step is {}; a step count must be >= 0", index,
                               step));
    }
    ++index;
  }
}

OptimizerSnapshot::OptimizerSnapshot(torch::optim::Optimizer& optimizer) : optimizer_(optimizer) {
  for (const auto& group : optimizer.param_groups())
    options_.push_back(group.options().clone());
  for (const auto& [key, state] : optimizer.state())
    state_.emplace_back(key, state->clone());
}

void OptimizerSnapshot::restore() {
  auto& groups = optimizer_.param_groups();
  for (std::size_t i = 0; i < groups.size() && i < options_.size(); ++i)
    groups[i].set_options(options_[i]->clone());
  optimizer_.state().clear();
  for (auto& [key, state] : state_)
    optimizer_.state()[key] = state->clone();
}

}  // namespace ddp::detail
