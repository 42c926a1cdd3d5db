// dcp_model_state / load_dcp_model_state (ddp/torch/checkpoint/dcp_model_state.h): the model's
// state dict and the optimizer's, keyed by parameter name as PyTorch's get_state_dict keys them,
// through the optimizer state dict's value form (index-keyed, as Python's optimizer.state_dict()).
#include "ddp/torch/checkpoint/dcp_model_state.h"

#include <map>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "ddp/torch/checkpoint/distributed_checkpoint.h"
#include "torch/formats/optimizer_state_value.h"
#include "torch/formats/state_dict_check.h"

namespace ddp {
namespace {

using c10::IValue;
using GenericDict = c10::impl::GenericDict;
using GenericList = c10::impl::GenericList;

GenericDict string_dict() {
  return GenericDict(c10::StringType::get(), c10::AnyType::get());
}

// Each optimizer parameter's name in the model, in the optimizer's order (its index in Python's
// optimizer.state_dict()). ConfigError for a parameter the model does not hold.
std::vector<std::string> parameter_names(const torch::nn::Module& model,
                                         const torch::optim::Optimizer& optimizer) {
  std::unordered_map<const c10::TensorImpl*, std::string> names;
  for (const auto& item : state_dict(model))
    names.emplace(item.value().unsafeGetTensorImpl(), item.key());
  std::vector<std::string> out;
  for (const auto& group : optimizer.param_groups()) {
    for (const auto& p : group.params()) {
      const auto it = names.find(p.unsafeGetTensorImpl());
      if (it == names.end()) {
        throw ConfigError(fmt::format(
            "dcp_model_state: the optimizer's parameter {} (of shape [{}]) is not one of the "
            "model's: build the optimizer over model->parameters() of the module passed here",
            out.size(), fmt::join(p.sizes(), ", ")));
      }
      out.push_back(it->second);
    }
  }
  return out;
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

}  // namespace

DcpStateDict dcp_model_state(const torch::nn::Module& model,
                             const torch::optim::Optimizer* optimizer) {
  GenericDict top = string_dict();
  GenericDict model_entries = string_dict();
  for (const auto& item : state_dict(model))
    model_entries.insert(item.key(), item.value());
  top.insert("model", model_entries);
  if (optimizer != nullptr) {
    const std::vector<std::string> names = parameter_names(model, *optimizer);
    const IValue by_index = detail::optimizer_state_value(*optimizer);
    top.insert("optim", rekeyed(
                            by_index.toGenericDict(),
                            [&](const IValue& index) {
                              return IValue(names.at(static_cast<std::size_t>(index.toInt())));
                            },
                            "dcp_model_state"));
  }
  return DcpStateDict::flatten(top);
}

StateDictLoadReport load_dcp_model_state(const std::filesystem::path& folder,
                                         torch::nn::Module& model,
                                         torch::optim::Optimizer* optimizer,
                                         StateDictLoadOptions options) {
  const std::string source = folder.string();
  const IValue nested = DcpReader(folder).read_state_dict();
  const GenericDict top = nested.toGenericDict();
  auto part = [&](const char* key) -> std::optional<GenericDict> {
    const auto it = top.find(key);
    if (it == top.end()) return std::nullopt;
    if (!it->value().isGenericDict()) {
      throw StateDictFormatError(fmt::format("{}: '{}' is a {}, not a dict of entries", source, key,
                                             it->value().tagKind()));
    }
    return it->value().toGenericDict();
  };
  const auto model_part = part("model");
  if (!model_part) {
    throw StateDictFormatError(fmt::format(
        "{}: the checkpoint has no 'model' entries (saved from get_state_dict's model dict as "
        "{{\"model\": ..., \"optim\": ...}}, or by dcp_model_state)",
        source));
  }
  StateDict saved;
  for (const auto& entry : *model_part) {
    if (!entry.key().isString()) continue;
    if (!entry.value().isTensor()) {
      throw StateDictFormatError(fmt::format("{}: 'model.{}' is a {}, not a tensor", source,
                                             entry.key().toStringRef(), entry.value().tagKind()));
    }
    saved.insert(entry.key().toStringRef(), entry.value().toTensor());
  }
  const StateDict target = state_dict(model);
  // Everything checked before anything changes: the model's names, shapes and dtypes here, the
  // optimizer's state in its load (itself all or nothing), then the model's copy, which cannot
  // fail once checked.
  detail::check_state_dict(target, saved, options, source);
  if (optimizer != nullptr) {
    const auto optim_part = part("optim");
    if (!optim_part) {
      throw StateDictFormatError(fmt::format(
          "{}: the checkpoint has no 'optim' entries (it was saved without the optimizer)",
          source));
    }
    const std::vector<std::string> names = parameter_names(model, *optimizer);
    std::map<std::string, std::int64_t> index_of;
    for (std::size_t i = 0; i < names.size(); ++i)
      index_of.emplace(names[i], static_cast<std::int64_t>(i));
    const GenericDict by_index = rekeyed(
        *optim_part,
        [&](const IValue& name) {
          const auto it = name.isString() ? index_of.find(name.toStringRef()) : index_of.end();
          if (it == index_of.end()) {
            throw StateDictFormatError(fmt::format(
                "{}: the optimizer's state names the parameter {}, which the optimizer does not "
                "hold",
                source, name.isString() ? "'" + name.toStringRef() + "'" : name.tagKind()));
          }
          return IValue(it->second);
        },
        source);
    detail::load_optimizer_state_value(*optimizer, by_index, source);
  }
  return load_state_dict(target, saved, options, source);
}

}  // namespace ddp
