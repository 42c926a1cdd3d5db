// The tensors inside a torch::optim optimizer's per-parameter state, for the optimizers whose
// state types ddp knows (SGD, Adam, AdamW, Adagrad, RMSprop): libtorch's OptimizerParamState is
// opaque, so checking a loaded state's shapes or counting state bytes needs the concrete type.
#pragma once

#include <optional>
#include <vector>

#include <torch/torch.h>

namespace ddp::detail {

// The defined tensors of `state` (e.g. Adam's exp_avg and exp_avg_sq), or nullopt when its type
// is none of the known ones.
std::optional<std::vector<torch::Tensor>> optimizer_state_tensors(
    const torch::optim::OptimizerParamState& state);

}  // namespace ddp::detail
