// What the save and the load of a model's distributed checkpoint (dcp_model_state.h) share: the
// optimizer's parameters by name and the checks of a DcpModelLayout; and the load of a part of
// the optimizer's state. Internal to ddp_torch.
#pragma once

#include <cstdint>
#include <filesystem>
#include <set>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "ddp/torch/checkpoint/dcp_model_state.h"

namespace ddp::detail {

// Each optimizer parameter's name in the model, in the optimizer's order (its index in Python's
// optimizer.state_dict()). ConfigError, naming `who`, for a parameter the model does not hold.
std::vector<std::string> optimizer_parameter_names(const torch::nn::Module& model,
                                                   const torch::optim::Optimizer& optimizer,
                                                   const std::string& who);

// ConfigError, naming `who` and the entry, for a spec of a name `target` lacks or that does not
// fit its tensor: a view of another element count, or of another rank than its offsets and
// global shape, or a region outside the global shape.
void check_layout(const DcpModelLayout& layout, const StateDict& target, const std::string& who);

// The shape `tensor` is viewed as in its checkpoint's tensor (the spec's local_view, or its own).
std::vector<std::int64_t> shard_view(const DcpShardSpec& spec, const at::Tensor& tensor);

// load_dcp_model_state, reading the optimizer state of the parameters named in `state_of` only
// (null: of every parameter; the others are left without state): an optimizer whose state is
// split across ranks (ZeRO) loads the full groups and its own parameters' state.
StateDictLoadReport load_dcp_model_state_of(const std::filesystem::path& folder,
                                            torch::nn::Module& model,
                                            torch::optim::Optimizer* optimizer,
                                            StateDictLoadOptions options,
                                            const DcpModelLayout& layout,
                                            const std::set<std::string>* state_of);

}  // namespace ddp::detail
