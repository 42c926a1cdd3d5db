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
#include "ddp/torch/checkpoint/distributed_checkpoint.h"

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

// A region of a spec's global tensor in the checkpoint's tensor: the same region where that
// records global_shape; where it records saved_shape (the first two dimensions merged), one region
// of whole blocks (`index` -1: the region itself, reshaped), or one per index of the region's
// first dimension (`index` that position in the region) where its second is not whole.
struct DcpSavedRegion {
  std::int64_t index = -1;
  std::vector<std::int64_t> offsets, sizes;
};
std::vector<DcpSavedRegion> saved_regions(const DcpShardSpec& spec,
                                          const std::vector<std::int64_t>& offsets,
                                          const std::vector<std::int64_t>& sizes);

// The shape the checkpoint records for the spec's tensor: saved_shape, or global_shape.
const std::vector<std::int64_t>& saved_shape_of(const DcpShardSpec& spec);

// Reads the region (offsets, sizes) of the spec's global tensor from the checkpoint's tensor
// `name`, which records either global_shape (a checkpoint saved before saved_shape existed) or
// saved_shape; the caller has checked that it is one of them.
at::Tensor read_spec_region(const DcpReader& reader, const std::string& name,
                            const DcpShardSpec& spec, const std::vector<std::int64_t>& offsets,
                            const std::vector<std::int64_t>& sizes);

// Whether the checkpoint's shape `recorded` is the spec's tensor (saved_shape or global_shape).
bool records_spec(const DcpShardSpec& spec, const std::vector<std::int64_t>& recorded);

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
