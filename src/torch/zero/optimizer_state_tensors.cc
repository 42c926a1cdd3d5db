#include "torch/zero/optimizer_state_tensors.h"

namespace ddp::detail {

std::optional<std::vector<torch::Tensor>> optimizer_state_tensors(
    const torch::optim::OptimizerParamState& state) {
  std::vector<torch::Tensor> all;
  if (const auto* s = dynamic_cast<const torch::optim::SGDParamState*>(&state)) {
    all = {s->momentum_buffer()};
  } else if (const auto* s = dynamic_cast<const torch::optim::AdamParamState*>(&state)) {
    all = {s->exp_avg(), s->exp_avg_sq(), s->max_exp_avg_sq()};
  } else if (const auto* s = dynamic_cast<const torch::optim::AdamWParamState*>(&state)) {
    all = {s->exp_avg(), s->exp_avg_sq(), s->max_exp_avg_sq()};
  } else if (const auto* s = dynamic_cast<const torch::optim::AdagradParamState*>(&state)) {
    all = {s->sum()};
  } else if (const auto* s = dynamic_cast<const torch::optim::RMSpropParamState*>(&state)) {
    all = {s->square_avg(), s->momentum_buffer(), s->grad_avg()};
  } else {
    return std::nullopt;
  }
  std::vector<torch::Tensor> defined;
  for (auto& t : all) {
    if (t.defined()) defined.push_back(std::move(t));
  }
  return defined;
}

}  // namespace ddp::detail
