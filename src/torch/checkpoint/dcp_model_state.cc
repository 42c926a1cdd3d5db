// dcp_model_state (ddp/torch/checkpoint/dcp_model_state.h): the model's state dict and the
// optimizer's, keyed by parameter name as PyTorch's get_state_dict keys them, through the
// optimizer state dict's value form (index-keyed, as Python's optimizer.state_dict()), flattened
// as dcp.save flattens it; then the split tensors become parts. The load is
// dcp_model_state_load.cc.
#include "ddp/torch/checkpoint/dcp_model_state.h"

#include <functional>
#include <map>
#include <numeric>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "ddp/torch/checkpoint/distributed_checkpoint.h"
#include "torch/checkpoint/dcp_model_layout.h"
#include "torch/formats/optimizer_state_value.h"

namespace ddp {
namespace {

using c10::IValue;
using GenericDict = c10::impl::GenericDict;
using GenericList = c10::impl::GenericList;

GenericDict string_dict() {
  return GenericDict(c10::StringType::get(), c10::AnyType::get());
}

// {"state": {index: s}, "param_groups": [{..., "params": [index]}]} with indices replaced by
// `rename(index)`.
template <class Rename>
GenericDict rekeyed(const GenericDict& optim, const Rename& rename, const std::string& source) {
  const auto state = optim.find("state");
  const auto groups = optim.find("param_groups");
  if (state == optim.end() || groups == optim.end() || !state->value().isGenericDict() ||
      !groups->value().isList()) {
    throw StateDictFormatError(fmt::format(
        "{}: the optimizer's entries are not a 'state' dict and a 'param_groups' list", source));
  }
  GenericDict new_state(c10::AnyType::get(), c10::AnyType::get());
  for (const auto& entry : state->value().toGenericDict())
    new_state.insert(rename(entry.key()), entry.value());
  GenericList new_groups(c10::AnyType::get());
  for (const IValue& group : groups->value().toListRef()) {
    if (!group.isGenericDict()) {
      throw StateDictFormatError(fmt::format("{}: a parameter group is not a dict", source));
    }
    GenericDict copy = string_dict();
    for (const auto& option : group.toGenericDict()) {
      if (option.key() == IValue("params")) {
        if (!option.value().isList()) {
          throw StateDictFormatError(
              fmt::format("{}: a parameter group's 'params' is not a list", source));
        }
        GenericList params(c10::AnyType::get());
        for (const IValue& p : option.value().toListRef())
          params.push_back(rename(p));
        copy.insert(option.key(), params);
      } else {
        copy.insert(option.key(), option.value());
      }
    }
    new_groups.push_back(copy);
  }
  GenericDict out = string_dict();
  out.insert("state", new_state);
  out.insert("param_groups", new_groups);
  return out;
}

// PyTorch's _flatten_optim_state_dict (flatten_optimizer_state_dict=True): "state.<name>.<key>"
// and "param_groups.<name>.<option>" for every parameter of every group.
GenericDict per_parameter(const GenericDict& optim, const std::vector<std::string>& names) {
  GenericDict out = string_dict();
  auto name_of = [&](const IValue& index) {
    return names.at(static_cast<std::size_t>(index.toInt()));
  };
  for (const auto& entry : optim.at("state").toGenericDict()) {
    for (const auto& key : entry.value().toGenericDict())
      out.insert(fmt::format("state.{}.{}", name_of(entry.key()), key.key().toStringRef()),
                 key.value());
  }
  for (const IValue& group : optim.at("param_groups").toListRef()) {
    const GenericDict options = group.toGenericDict();
    for (const IValue& index : options.at("params").toListRef()) {
      for (const auto& option : options) {
        if (option.key() == IValue("params")) continue;
        out.insert(fmt::format("param_groups.{}.{}", name_of(index), option.key().toStringRef()),
                   option.value());
      }
    }
  }
  return out;
}

// The spec of a flattened entry, if it is a part: "model.<name>" with a spec, or
// "optim.state.<name>.<key>" of a parameter with a spec and of the parameter's shape.
const DcpShardSpec* spec_of(const DcpStateDict::Entry& entry, const DcpModelLayout& layout,
                            const StateDict& target) {
  const std::string& name = entry.name;
  std::string parameter;
  if (name.starts_with("model.")) {
    parameter = name.substr(6);
  } else if (name.starts_with("optim.state.")) {
    const auto dot = name.rfind('.');
    parameter = name.substr(12, dot - 12);
  } else {
    return nullptr;
  }
  const auto spec = layout.shards.find(parameter);
  const torch::Tensor* held = target.find(parameter);
  if (spec == layout.shards.end() || held == nullptr) return nullptr;
  return entry.tensor.sizes() == held->sizes() ? &spec->second : nullptr;
}

}  // namespace

namespace detail {

std::vector<std::string> optimizer_parameter_names(const torch::nn::Module& model,
                                                   const torch::optim::Optimizer& optimizer,
                                                   const std::string& who) {
  std::unordered_map<const c10::TensorImpl*, std::string> names;
  for (const auto& item : state_dict(model))
    names.emplace(item.value().unsafeGetTensorImpl(), item.key());
  std::vector<std::string> out;
  for (const auto& group : optimizer.param_groups()) {
    for (const auto& p : group.params()) {
      const auto it = names.find(p.unsafeGetTensorImpl());
      if (it == names.end()) {
        throw ConfigError(fmt::format(
            "{}: the optimizer's parameter {} (of shape [{}]) is not one of the model's: build "
            "the optimizer over model->parameters() of the module passed here",
            who, out.size(), fmt::join(p.sizes(), ", ")));
      }
      out.push_back(it->second);
    }
  }
  return out;
}

std::vector<std::int64_t> shard_view(const DcpShardSpec& spec, const at::Tensor& tensor) {
  return spec.local_view.empty() ? tensor.sizes().vec() : spec.local_view;
}

void check_layout(const DcpModelLayout& layout, const StateDict& target, const std::string& who) {
  for (const auto& [name, spec] : layout.shards) {
    const torch::Tensor* tensor = target.find(name);
    if (tensor == nullptr) {
      throw ConfigError(fmt::format(
          "{}: the layout splits '{}', which the model has no parameter or buffer of", who, name));
    }
    const auto view = shard_view(spec, *tensor);
    const std::int64_t count =
        std::accumulate(view.begin(), view.end(), std::int64_t{1}, std::multiplies<>());
    bool fits = count == tensor->numel() && view.size() == spec.offsets.size() &&
                view.size() == spec.global_shape.size();
    for (std::size_t d = 0; fits && d < view.size(); ++d) {
      fits =
          spec.offsets[d] >= 0 && view[d] >= 0 && spec.offsets[d] + view[d] <= spec.global_shape[d];
    }
    if (!fits) {
      throw ConfigError(fmt::format(
          "{}: the layout's part of '{}' does not fit: the tensor [{}] viewed as [{}] at offsets "
          "[{}] of a tensor [{}] (the view must hold the tensor's elements, and the region lie "
          "inside the global shape)",
          who, name, fmt::join(tensor->sizes(), ", "), fmt::join(view, ", "),
          fmt::join(spec.offsets, ", "), fmt::join(spec.global_shape, ", ")));
    }
    if (!spec.saved_shape.empty()) {
      const auto& g = spec.global_shape;
      std::vector<std::int64_t> merged;
      if (g.size() >= 2) {
        merged.push_back(g[0] * g[1]);
        merged.insert(merged.end(), g.begin() + 2, g.end());
      }
      if (merged.empty() || spec.saved_shape != merged) {
        throw ConfigError(fmt::format(
            "{}: the layout saves '{}' as [{}], which is not its global shape [{}] with the first "
            "two dimensions merged (the one other shape a part may be saved as)",
            who, name, fmt::join(spec.saved_shape, ", "), fmt::join(g, ", ")));
      }
    }
  }
}

}  // namespace detail

DcpStateDict dcp_model_state(const torch::nn::Module& model,
                             const torch::optim::Optimizer* optimizer,
                             const DcpModelLayout& layout) {
  const StateDict target = state_dict(model);
  detail::check_layout(layout, target, "dcp_model_state");
  GenericDict top = string_dict();
  GenericDict model_entries = string_dict();
  for (const auto& item : target)
    model_entries.insert(item.key(), item.value());
  top.insert("model", model_entries);
  if (optimizer != nullptr) {
    const std::vector<std::string> names =
        detail::optimizer_parameter_names(model, *optimizer, "dcp_model_state");
    const IValue by_index = detail::optimizer_state_value(*optimizer);
    if (layout.per_parameter_groups) {
      top.insert("optim", per_parameter(by_index.toGenericDict(), names));
    } else {
      top.insert("optim", rekeyed(
                              by_index.toGenericDict(),
                              [&](const IValue& index) {
                                return IValue(names.at(static_cast<std::size_t>(index.toInt())));
                              },
                              "dcp_model_state"));
    }
  }
  DcpStateDict flat = DcpStateDict::flatten(top);
  if (layout.shards.empty()) return flat;
  DcpStateDict out;
  for (DcpStateDict::Entry entry : flat.entries()) {
    const DcpShardSpec* spec =
        entry.kind == DcpStateDict::Entry::Kind::kTensor ? spec_of(entry, layout, target) : nullptr;
    if (spec == nullptr) {
      out.add_entry(std::move(entry));
      continue;
    }
    // The part in the view, as the regions of the tensor the checkpoint records.
    const at::Tensor part = entry.tensor.reshape(detail::shard_view(*spec, entry.tensor));
    entry.kind = DcpStateDict::Entry::Kind::kShard;
    entry.global_shape = detail::saved_shape_of(*spec);
    for (const auto& region : detail::saved_regions(*spec, spec->offsets, part.sizes().vec())) {
      DcpStateDict::Entry chunk = entry;
      chunk.tensor = region.index < 0 ? part.reshape(region.sizes) : part.select(0, region.index);
      chunk.offsets = region.offsets;
      out.add_entry(std::move(chunk));
    }
  }
  return out;
}

}  // namespace ddp
