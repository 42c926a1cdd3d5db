// Optimizer values checked as the training loop will use them, wherever they come from a file
// (Python's optimizer state dicts, ddp's checkpoints, ZeRO's consolidated state): a learning
// rate of NaN, -1e9 or inf, or a step count of -5, loads without complaint into libtorch and
// trains to `loss -nan`. Internal to ddp_torch.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "ddp/error.h"
#include "torch/core/libtorch_compat.h"

namespace ddp::detail {

// Throws the caller's error for `what` (a value and why it is refused); it must not return.
using ValueError = std::function<void(const std::string& what)>;

enum class ValueRange {
  kFinite,       // any finite number
  kNonNegative,  // finite, >= 0
  kUnitInterval  // finite, in [0, 1): Adam's betas
};

// Calls fail("<what> is <value>; it must be ...") unless `value` lies in `range`.
void check_value(double value, ValueRange range, const std::string& what, const ValueError& fail);

// An optimizer's step count as stored (a float in Python's files): a finite whole number in
// [0, 2^53]; returns it. Calls fail(...) naming `what` otherwise.
std::int64_t checked_step(double value, const std::string& what, const ValueError& fail);

// Every group's hyper-parameters (lr of any optimizer; momentum, dampening, weight decay, betas,
// eps of SGD, Adam, AdamW, Adagrad and RMSprop) and every parameter state's step count.
void check_optimizer_values(const torch::optim::Optimizer& optimizer, const ValueError& fail);

// A shallow copy of an optimizer's options and state (tensor handles, not their data): what
// libtorch's Optimizer::load replaces, so that a load whose values fail the checks is undone.
class OptimizerSnapshot {
 public:
  explicit OptimizerSnapshot(torch::optim::Optimizer& optimizer);
  void restore();

 private:
  torch::optim::Optimizer& optimizer_;
  std::vector<std::unique_ptr<torch::optim::OptimizerOptions>> options_;
  std::vector<std::pair<libtorch_compat::OptimizerStateKey,
                        std::unique_ptr<torch::optim::OptimizerParamState>>>
      state_;
};

}  // namespace ddp::detail
