// Python's optimizer.state_dict() as a value (optimizer_state_dict.h writes it to a file, and
// distributed checkpoints key its state by parameter name): {"state": {index: {...}},
// "param_groups": [{..., "params": [index, ...]}]}. Internal to ddp_torch.
#pragma once

#include <string>

#include <torch/torch.h>

namespace ddp::detail {

// The optimizer's state and groups as save_optimizer_state_dict writes them. ConfigError for an
// optimizer other than SGD, Adam or AdamW.
c10::IValue optimizer_state_value(const torch::optim::Optimizer& optimizer);

// Loads `value` as load_optimizer_state_dict loads a file's (checked first, all or nothing);
// `source` names where it came from in errors.
void load_optimizer_state_value(torch::optim::Optimizer& optimizer, const c10::IValue& value,
                                const std::string& source);

}  // namespace ddp::detail
