// load_dcp_model_state (ddp/torch/checkpoint/dcp_model_state.h): the checkpoint's entries are
// found by name in its metadata, so a rank reads only what its model holds: whole tensors, or
// the regions its parts cover (DcpReader::read of a region reads only the overlapping chunks).
// The optimizer's state is rebuilt in its index-keyed value form and loaded by the optimizer
// state dict's loader, which checks it; the model is checked first and copied last.
#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "ddp/torch/checkpoint/dcp_model_state.h"
#include "ddp/torch/checkpoint/distributed_checkpoint.h"
#include "torch/checkpoint/dcp_model_layout.h"
#include "torch/formats/optimizer_state_value.h"
#include "torch/formats/state_dict_check.h"

namespace ddp {
namespace {

using c10::IValue;
using GenericDict = c10::impl::GenericDict;
using GenericList = c10::impl::GenericList;

// "<prefix><name>.<key>" split into name and key (the key has no dot): nullopt for another
// prefix, or no dot after it.
std::optional<std::pair<std::string, std::string>> name_and_key(const std::string& entry,
                                                                const std::string& prefix) {
  if (!entry.starts_with(prefix)) return std::nullopt;
  const auto dot = entry.rfind('.');
  if (dot == std::string::npos || dot < prefix.size() + 1) return std::nullopt;
  return std::pair{entry.substr(prefix.size(), dot - prefix.size()), entry.substr(dot + 1)};
}

class Loader {
 public:
  // `state_of`: the parameters whose optimizer state is read (null: every parameter's).
  Loader(const std::filesystem::path& folder, const DcpModelLayout& layout,
         const std::set<std::string>* state_of)
      : reader_(folder),
        info_(reader_.info()),
        layout_(layout),
        state_of_(state_of),
        source_(folder.string()) {}

  // The model's entries as the checkpoint holds them, for check_state_dict: this rank's parts
  // read as regions; an entry the model lacks as an empty placeholder (unexpected, unless the
  // model is a part); a part whose global shape differs is left out and listed in `mismatched`.
  StateDict model_entries(const StateDict& target, const StateDictLoadOptions& options) {
    StateDict saved;
    bool any = false;
    for (const char* part : {"model", "optim"}) {
      if (info_.values.contains(part) || info_.tensors.contains(part)) {
        throw StateDictFormatError(fmt::format(
            "{}: '{}' is a {}, not a dict of entries", source_, part,
            info_.values.contains(part) ? reader_.read_value(part).tagKind() : "Tensor"));
      }
    }
    for (const std::string& name : info_.order) {
      if (!name.starts_with("model.")) continue;
      any = true;
      const std::string key = name.substr(6);
      if (info_.values.contains(name)) {
        throw StateDictFormatError(fmt::format("{}: '{}' is a {}, not a tensor", source_, name,
                                               reader_.read_value(name).tagKind()));
      }
      const torch::Tensor* held = target.find(key);
      if (held == nullptr) {
        if (!layout_.part_of_model) saved.insert(key, at::empty({0}));
        continue;
      }
      std::optional<at::Tensor> value = read_tensor(name, key, *held, options);
      if (value) saved.insert(key, *value);
    }
    if (!any) {
      throw StateDictFormatError(fmt::format(
          "{}: the checkpoint has no 'model' entries (saved from get_state_dict's model dict as "
          "{{\"model\": ..., \"optim\": ...}}, or by dcp_model_state)",
          source_));
    }
    return saved;
  }

  // StateDictFormatError where the checkpoint holds no optimizer.
  void check_optimizer_entries() const {
    for (const std::string& name : info_.order) {
      if (name.starts_with("optim.")) return;
    }
    throw StateDictFormatError(fmt::format(
        "{}: the checkpoint has no 'optim' entries (it was saved without the optimizer)", source_));
  }

  // The optimizer's state and groups in the index-keyed value form load_optimizer_state_value
  // takes, read from either layout of the groups (per group, or per parameter).
  IValue optimizer_value(const std::vector<std::string>& names,
                         const torch::optim::Optimizer& optimizer, const StateDict& target) {
    std::map<std::string, std::int64_t> index_of;
    for (std::size_t i = 0; i < names.size(); ++i)
      index_of.emplace(names[i], static_cast<std::int64_t>(i));
    GenericDict state(c10::AnyType::get(), c10::AnyType::get());
    std::map<std::int64_t, GenericDict> per_parameter;
    for (const std::string& name : info_.order) {
      const auto entry = name_and_key(name, "optim.state.");
      if (!entry) continue;
      const auto it = index_of.find(entry->first);
      if (it == index_of.end()) {
        if (layout_.part_of_model) continue;
        throw StateDictFormatError(fmt::format(
            "{}: the optimizer's state names the parameter '{}', which the optimizer does not hold",
            source_, entry->first));
      }
      if (state_of_ != nullptr && !state_of_->contains(entry->first)) continue;
      auto [slot, fresh] = per_parameter.try_emplace(
          it->second, GenericDict(c10::StringType::get(), c10::AnyType::get()));
      IValue value;
      if (info_.values.contains(name)) {
        value = reader_.read_value(name);
      } else {
        const torch::Tensor& parameter = *target.find(entry->first);
        std::optional<at::Tensor> tensor = read_tensor(name, entry->first, parameter, {}, true);
        value = *tensor;
      }
      slot->second.insert(entry->second, value);
    }
    for (auto& [index, s] : per_parameter)
      state.insert(index, s);
    GenericList groups(c10::AnyType::get());
    std::size_t first = 0;
    for (std::size_t g = 0; g < optimizer.param_groups().size(); ++g) {
      const std::size_t count = optimizer.param_groups()[g].params().size();
      groups.push_back(group_value(g, names, first, count));
      first += count;
    }
    GenericDict out(c10::StringType::get(), c10::AnyType::get());
    out.insert("state", state);
    out.insert("param_groups", groups);
    return out;
  }

 private:
  // The tensor `name` for the model's `held` of state_dict name `key`: the region its spec
  // names, or whole. A state tensor of another shape than its parameter (Adam's step) is whole.
  // A part whose saved global shape differs: StateDictMismatchError when strict, else nullopt
  // and listed in mismatched.
  std::optional<at::Tensor> read_tensor(const std::string& name, const std::string& key,
                                        const at::Tensor& held, const StateDictLoadOptions& options,
                                        bool optimizer_state = false) {
    const auto spec = layout_.shards.find(key);
    const DcpTensorInfo& saved = info_.tensors.at(name);
    if (spec == layout_.shards.end()) return reader_.read(name);
    if (optimizer_state && saved.shape.size() != spec->second.global_shape.size() &&
        saved.shape.size() != detail::saved_shape_of(spec->second).size()) {
      return reader_.read(name);  // a scalar (step) saved whole beside a split parameter
    }
    if (!detail::records_spec(spec->second, saved.shape)) {
      const std::string message = fmt::format(
          "{}: '{}' is [{}] in the checkpoint, but this rank's part of it belongs to a tensor "
          "[{}] (saved from another model, or with another split of it)",
          source_, name, fmt::join(saved.shape, ", "),
          fmt::join(detail::saved_shape_of(spec->second), ", "));
      if (options.strict || optimizer_state) {
        StateDictLoadReport report;
        report.mismatched.push_back(key);
        throw StateDictMismatchError(message, report);
      }
      mismatched.push_back(key);
      return std::nullopt;
    }
    return detail::read_spec_region(reader_, name, spec->second, spec->second.offsets,
                                    detail::shard_view(spec->second, held))
        .reshape(held.sizes());
  }

  // Group g's options from the checkpoint, with "params" this optimizer's indices
  // [first, first + count).
  GenericDict group_value(std::size_t g, const std::vector<std::string>& names, std::size_t first,
                          std::size_t count) {
    GenericDict group(c10::StringType::get(), c10::AnyType::get());
    const std::string per_group = fmt::format("optim.param_groups.{}.", g);
    if (info_.values.contains(per_group + "params")) {
      const IValue saved_params = reader_.read_value(per_group + "params");
      std::set<std::string> listed;
      if (saved_params.isList()) {
        for (const IValue& p : saved_params.toListRef())
          if (p.isString()) listed.insert(p.toStringRef());
      }
      for (std::size_t i = first; i < first + count; ++i) {
        if (!listed.contains(names[i])) {
          throw StateDictFormatError(fmt::format(
              "{}: the optimizer's parameter group {} holds '{}', which the checkpoint's group {} "
              "does not list",
              source_, g, names[i], g));
        }
      }
      if (!layout_.part_of_model && listed.size() != count) {
        throw StateDictFormatError(fmt::format(
            "{}: the checkpoint's parameter group {} lists {} parameters, the optimizer's {}",
            source_, g, listed.size(), count));
      }
      read_options(per_group, group);
    } else if (count > 0) {
      // Per parameter: the group's options are its first parameter's; every other parameter of
      // the group must have them too.
      read_options(fmt::format("optim.param_groups.{}.", names[first]), group);
      for (std::size_t i = first + 1; i < first + count; ++i) {
        if (!info_.values.contains(fmt::format("optim.param_groups.{}.lr", names[i]))) {
          throw StateDictFormatError(fmt::format(
              "{}: the checkpoint has no options for the parameter '{}' (optim.param_groups.{}.*)",
              source_, names[i], names[i]));
        }
      }
    }
    GenericList params(c10::AnyType::get());
    for (std::size_t i = first; i < first + count; ++i)
      params.push_back(static_cast<std::int64_t>(i));
    group.insert("params", params);
    return group;
  }

  // Every value "<prefix><option>" (no dot in option, "params" aside) into `group`.
  void read_options(const std::string& prefix, GenericDict& group) {
    for (const auto& entry : info_.values) {
      const std::string& name = entry.first;
      if (!name.starts_with(prefix)) continue;
      const std::string option = name.substr(prefix.size());
      if (option.find('.') != std::string::npos || option == "params") continue;
      group.insert(option, reader_.read_value(name));
    }
    if (group.find("lr") == group.end()) {
      throw StateDictFormatError(
          fmt::format("{}: the checkpoint has no optimizer options under '{}*'", source_, prefix));
    }
  }

 public:
  std::vector<std::string> mismatched;

 private:
  DcpReader reader_;
  const DcpCheckpointInfo& info_;
  const DcpModelLayout& layout_;
  const std::set<std::string>* state_of_;
  std::string source_;
};

}  // namespace

StateDictLoadReport load_dcp_model_state(const std::filesystem::path& folder,
                                         torch::nn::Module& model,
                                         torch::optim::Optimizer* optimizer,
                                         StateDictLoadOptions options,
                                         const DcpModelLayout& layout) {
  return detail::load_dcp_model_state_of(folder, model, optimizer, options, layout, nullptr);
}

StateDictLoadReport detail::load_dcp_model_state_of(const std::filesystem::path& folder,
                                                    torch::nn::Module& model,
                                                    torch::optim::Optimizer* optimizer,
                                                    StateDictLoadOptions options,
                                                    const DcpModelLayout& layout,
                                                    const std::set<std::string>* state_of) {
  const StateDict target = state_dict(model);
  detail::check_layout(layout, target, "load_dcp_model_state");
  Loader loader(folder, layout, state_of);
  const StateDict saved = loader.model_entries(target, options);
  // Everything checked before anything changes: the model's names, shapes and dtypes here, the
  // optimizer's state in its load (itself all or nothing), then the model's copy, which cannot
  // fail once checked. A part left out for its global shape is reported as mismatched, not
  // missing.
  const std::string source = folder.string();
  detail::check_state_dict(target, saved, options, source);
  if (optimizer != nullptr) {
    loader.check_optimizer_entries();
    const std::vector<std::string> names =
        detail::optimizer_parameter_names(model, *optimizer, "load_dcp_model_state");
    detail::load_optimizer_state_value(*optimizer,
                                       loader.optimizer_value(names, *optimizer, target), source);
  }
  StateDictLoadReport report = load_state_dict(target, saved, options, source);
  for (const std::string& name : loader.mismatched) {
    std::erase(report.missing, name);
    report.mismatched.push_back(name);
  }
  return report;
}

}  // namespace ddp
