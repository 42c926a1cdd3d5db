// The checks of load_state_dict (state_dict.h) without the copy: what a load of `source` into
// `target` would find, for a caller that must check several things before it changes any of
// them (a model and its optimizer from one checkpoint). Internal to ddp_torch.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "ddp/torch/formats/state_dict.h"

namespace ddp::detail {

// The report load_state_dict would return; throws its StateDictMismatchError where it would
// (strict, and not complete). With `copies`, the (target, source) pairs it would copy.
StateDictLoadReport check_state_dict(
    const StateDict& target, const StateDict& source, StateDictLoadOptions options,
    const std::string& source_name,
    std::vector<std::pair<torch::Tensor, torch::Tensor>>* copies = nullptr);

}  // namespace ddp::detail
