// FullyShardedDataParallel in PyTorch's distributed checkpoint format
// (fully_sharded_data_parallel.h: dcp_state, load_dcp_state): each parameter under the wrapped
// model's name, of its own shape, so that the checkpoint does not know how the model was wrapped or
// sharded. A rank's flat shard holds a flat range of each parameter it overlaps; the save cuts that
// range into boxes (chunks), the load reads the rows that hold it. The optimizer's state goes
// through its index-keyed value form (formats/optimizer_state_value.h), one entry per shard, split
// and joined per parameter here.
#include <algorithm>
#include <map>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "ddp/error.h"
#include "ddp/torch/checkpoint/distributed_checkpoint.h"
#include "ddp/torch/fsdp/fully_sharded_data_parallel.h"
#include "torch/checkpoint/dcp_flat_range.h"
#include "torch/checkpoint/dcp_model_layout.h"
#include "torch/formats/optimizer_state_value.h"
#include "torch/formats/state_dict_check.h"
#include "torch/fsdp/fsdp_unit.h"

namespace ddp {

struct FullyShardedDataParallelImpl::DcpSlots {
  struct Parameter {
    std::string name;  // in the wrapped model
    Unit* unit = nullptr;
    std::vector<std::int64_t> shape;
    std::int64_t offset = 0;       // in the unit's flat buffer
    std::int64_t shard_begin = 0;  // the unit's flat element this rank's shard starts at
    // The parameter's flat elements this rank owns: [begin, end) of the parameter.
    std::int64_t begin = 0, end = 0;
    // Where the parameter lies in the checkpoint's tensor: viewed as place.local_view, the region
    // at place.offsets of a tensor of place.global_shape (the parameter's own shape and zeros
    // unless a layout splits it across tensor-parallel ranks), saved as place.saved_shape if set.
    DcpShardSpec place;
  };
  std::vector<Parameter> parameters;
  // Buffers, in the dtype full_state_dict returns them in.
  std::vector<std::pair<std::string, torch::Tensor>> buffers;
  std::vector<torch::ScalarType> buffer_dtypes;
  // The units, in the order of their first parameter, and each one's parameters (index_units).
  std::vector<Unit*> units;
  std::map<const Unit*, std::vector<const Parameter*>> parameters_of;

  void index_units() {
    for (const auto& p : parameters) {
      auto& list = parameters_of[p.unit];
      if (list.empty()) units.push_back(p.unit);
      list.push_back(&p);
    }
  }
};

void FullyShardedDataParallelImpl::collect_dcp_slots(const std::string& prefix,
                                                     DcpSlots& out) const {
  std::unordered_map<const void*, std::pair<Unit*, std::size_t>> where;
  for (const auto& unit : units_)
    for (std::size_t i = 0; i < unit->params.size(); ++i)
      where.emplace(unit->params[i].unsafeGetTensorImpl(), std::make_pair(unit.get(), i));
  const bool no_shard = options_.sharding_strategy == ShardingStrategy::kNoShard;
  std::vector<bool> nested_done(nested_.size(), false);
  auto nested = [&](std::size_t n) {
    nested_done[n] = true;
    nested_[n].second->collect_dcp_slots(prefix + nested_[n].first + ".", out);
  };
  // In named_parameters() order, as full_state_dict: a nested wrapper's parameters where its
  // first shard is.
  for (const auto& item : wrapped_->named_parameters()) {
    const auto it = where.find(item.value().unsafeGetTensorImpl());
    if (it == where.end()) {
      for (std::size_t n = 0; n < nested_.size(); ++n) {
        if (!nested_done[n] && item.key().rfind(nested_[n].first + ".", 0) == 0) nested(n);
      }
      continue;
    }
    const auto [unit, i] = it->second;
    DcpSlots::Parameter p;
    p.name = prefix + item.key();
    p.unit = unit;
    p.shape = unit->params[i].sizes().vec();
    p.offset = unit->offsets[i];
    p.shard_begin = no_shard ? 0 : shard_group_->rank() * unit->shard_numel;
    const std::int64_t numel = unit->params[i].numel();
    p.begin = std::clamp<std::int64_t>(p.shard_begin - p.offset, 0, numel);
    p.end = std::clamp<std::int64_t>(p.shard_begin + unit->shard_numel - p.offset, 0, numel);
    p.place.local_view = p.shape;
    p.place.offsets.assign(p.shape.size(), 0);
    p.place.global_shape = p.shape;
    out.parameters.push_back(std::move(p));
  }
  for (std::size_t n = 0; n < nested_.size(); ++n)
    if (!nested_done[n]) nested(n);  // a nested wrapper of buffers only
  std::unordered_map<const void*, torch::ScalarType> original_dtype;
  for (const auto& [buffer, dtype] : cast_buffers_)
    original_dtype.emplace(buffer.unsafeGetTensorImpl(), dtype);
  for (const auto& item : wrapped_->named_buffers()) {
    const auto it = original_dtype.find(item.value().unsafeGetTensorImpl());
    out.buffers.emplace_back(prefix + item.key(), item.value());
    out.buffer_dtypes.push_back(it == original_dtype.end() ? item.value().scalar_type()
                                                           : it->second);
  }
}

void FullyShardedDataParallelImpl::collect_dcp_slots(const DcpModelLayout& layout,
                                                     const std::string& who, DcpSlots& out) const {
  collect_dcp_slots("", out);
  if (layout.shards.empty()) return;
  // Checked as dcp_model_state checks a layout, against meta tensors of the parameters' shapes.
  StateDict parameters;
  for (const auto& p : out.parameters) {
    parameters.insert(
        p.name,
        torch::empty(p.shape,
                     torch::TensorOptions(p.unit->shard.scalar_type()).device(torch::kMeta)));
  }
  detail::check_layout(layout, parameters, who);
  for (auto& p : out.parameters) {
    const auto spec = layout.shards.find(p.name);
    if (spec == layout.shards.end()) continue;
    p.place = spec->second;
    p.place.local_view = detail::shard_view(spec->second, *parameters.find(p.name));
  }
}

namespace {

using c10::IValue;
using GenericDict = c10::impl::GenericDict;
using GenericList = c10::impl::GenericList;

// The shard each optimizer parameter is (its index in the value form) mapped to its unit;
// ConfigError for a parameter that is no shard of the tree.
template <class Unit>
std::vector<Unit*> optimizer_units(const torch::optim::Optimizer& optimizer,
                                   const std::vector<Unit*>& units, const std::string& who) {
  std::unordered_map<const void*, Unit*> by_shard;
  for (Unit* unit : units)
    by_shard.emplace(unit->shard.unsafeGetTensorImpl(), unit);
  std::vector<Unit*> out;
  for (const auto& group : optimizer.param_groups()) {
    for (const auto& p : group.params()) {
      const auto it = by_shard.find(p.unsafeGetTensorImpl());
      if (it == by_shard.end()) {
        throw ConfigError(fmt::format(
            "{}: the optimizer's parameter {} (of shape [{}]) is not one of this "
            "FullyShardedDataParallel's shards: build the optimizer over its parameters()",
            who, out.size(), fmt::join(p.sizes(), ", ")));
      }
      out.push_back(it->second);
    }
  }
  return out;
}

// A state tensor that holds one value per element of the shard (exp_avg, momentum_buffer), not
// one per shard (Adam's step).
bool per_element(const std::string& key, const IValue& value, std::int64_t shard_numel) {
  return key != "step" && value.isTensor() && value.toTensor().dim() == 1 &&
         value.toTensor().numel() == shard_numel;
}

// The same per-unit optimizer value: tensors of one shape, dtype and contents, or equal values.
bool same_entry(const IValue& a, const IValue& b) {
  if (a.isTensor() != b.isTensor()) return false;
  if (!a.isTensor()) return a.tagKind() == b.tagKind() && a == b;
  const torch::Tensor& x = a.toTensor();
  const torch::Tensor& y = b.toTensor();
  return x.sizes() == y.sizes() && x.scalar_type() == y.scalar_type() && torch::equal(x, y);
}

}  // namespace

DcpStateDict FullyShardedDataParallelImpl::dcp_state(const torch::optim::Optimizer* optimizer,
                                                     const DcpModelLayout& layout) const {
  torch::NoGradGuard no_grad;
  DcpSlots slots;
  collect_dcp_slots(layout, "FullyShardedDataParallel::dcp_state", slots);
  DcpStateDict out;
  // The parameter's elements this rank owns, as chunks of the tensor `name` (of the parameter's
  // shape, or the layout's global one), from `flat` (the unit's shard, or a state tensor of its
  // shape): cut in the parameter's view, placed at its origin.
  auto add_parts = [&](const std::string& name, const DcpSlots::Parameter& p,
                       const torch::Tensor& flat) {
    if (c10::multiply_integers(p.shape) == 0) {
      // Nothing to own: every rank holds it whole (a split part of no elements adds nothing).
      if (c10::multiply_integers(p.place.global_shape) == 0)
        out.add_tensor(name, torch::empty(detail::saved_shape_of(p.place), flat.options()));
      return;
    }
    for (const auto& box : detail::dcp_flat_boxes(p.place.local_view, p.begin, p.end)) {
      std::vector<std::int64_t> offsets = box.offsets;
      for (std::size_t d = 0; d < offsets.size(); ++d)
        offsets[d] += p.place.offsets[d];
      const torch::Tensor part =
          flat.narrow(0, p.offset + box.flat_begin - p.shard_begin, box.numel).view(box.sizes);
      for (const auto& region : detail::saved_regions(p.place, offsets, box.sizes)) {
        out.add_shard(name,
                      region.index < 0 ? part.reshape(region.sizes) : part.select(0, region.index),
                      region.offsets, detail::saved_shape_of(p.place));
      }
    }
  };
  for (const auto& p : slots.parameters)
    add_parts("model." + p.name, p, p.unit->shard.detach());
  // Buffers from rank 0 only: they may differ across ranks (a BatchNorm's running statistics
  // drift on each rank's batches after construction's broadcast), and rank 0's are the model's
  // as full_state_dict(0) returns it; a copy from every rank would be refused as replicas that
  // differ.
  for (std::size_t b = 0; group_->rank() == 0 && b < slots.buffers.size(); ++b) {
    const auto& [name, buffer] = slots.buffers[b];
    out.add_tensor("model." + name, buffer.detach().to(slots.buffer_dtypes[b]));
  }
  if (optimizer == nullptr) return out;

  slots.index_units();
  const auto& units = slots.units;
  const auto& parameters_of = slots.parameters_of;
  const std::vector<Unit*> shard_of =
      optimizer_units(*optimizer, units, "FullyShardedDataParallel::dcp_state");
  const IValue value = detail::optimizer_state_value(*optimizer);
  const GenericDict all = value.toGenericDict();
  // State, per parameter in the model's order (as get_state_dict lists it).
  std::map<const Unit*, GenericDict> state_of;
  for (const auto& entry : all.at("state").toGenericDict())
    state_of.emplace(shard_of.at(static_cast<std::size_t>(entry.key().toInt())),
                     entry.value().toGenericDict());
  for (const auto& p : slots.parameters) {
    const auto s = state_of.find(p.unit);
    if (s == state_of.end()) continue;
    for (const auto& item : s->second) {
      const std::string name = fmt::format("optim.state.{}.{}", p.name, item.key().toStringRef());
      if (per_element(item.key().toStringRef(), item.value(), p.unit->shard_numel)) {
        add_parts(name, p, item.value().toTensor());
      } else if (item.value().isTensor()) {
        out.add_tensor(name, item.value().toTensor());
      } else {
        out.add_value(name, item.value());
      }
    }
  }
  // Options per parameter (PyTorch's flatten_optimizer_state_dict): the groups hold shards,
  // which no other layout has.
  for (const IValue& group : all.at("param_groups").toListRef()) {
    const GenericDict options = group.toGenericDict();
    for (const IValue& index : options.at("params").toListRef()) {
      for (const auto* p : parameters_of.at(shard_of.at(static_cast<std::size_t>(index.toInt())))) {
        for (const auto& option : options) {
          if (option.key() == IValue("params")) continue;
          out.add_value(
              fmt::format("optim.param_groups.{}.{}", p->name, option.key().toStringRef()),
              option.value());
        }
      }
    }
  }
  return out;
}

StateDictLoadReport FullyShardedDataParallelImpl::load_dcp_state(
    const std::filesystem::path& folder, torch::optim::Optimizer* optimizer,
    StateDictLoadOptions options, const DcpModelLayout& layout) {
  torch::NoGradGuard no_grad;
  const std::string who = "FullyShardedDataParallel::load_dcp_state";
  DcpSlots slots;
  collect_dcp_slots(layout, who, slots);
  slots.index_units();
  const auto& units = slots.units;
  const auto& parameters_of = slots.parameters_of;
  std::vector<Unit*> shard_of;
  if (optimizer != nullptr) shard_of = optimizer_units(*optimizer, units, who);

  const DcpReader reader(folder);
  const DcpCheckpointInfo& info = reader.info();
  const std::string source = folder.string();
  // Names, shapes and dtypes checked as load_state_dict checks them, with meta tensors standing
  // for the model's parameters and the checkpoint's entries.
  const auto meta = [](const std::vector<std::int64_t>& shape, torch::ScalarType dtype) {
    return torch::empty(shape, torch::TensorOptions(dtype).device(torch::kMeta));
  };
  StateDict target;
  for (const auto& p : slots.parameters) {
    // The shape the checkpoint records for a split part's tensor, where it is one of the two.
    const auto it = info.tensors.find("model." + p.name);
    const bool recorded =
        it != info.tensors.end() && detail::records_spec(p.place, it->second.shape);
    target.insert(p.name, meta(recorded ? it->second.shape : detail::saved_shape_of(p.place),
                               p.unit->shard.scalar_type()));
  }
  for (std::size_t b = 0; b < slots.buffers.size(); ++b)
    target.insert(slots.buffers[b].first,
                  meta(slots.buffers[b].second.sizes().vec(), slots.buffer_dtypes[b]));
  StateDict saved;
  for (const std::string& name : info.order) {
    if (!name.starts_with("model.")) continue;
    if (info.values.contains(name)) {
      throw StateDictFormatError(fmt::format("{}: '{}' is a {}, not a tensor", source, name,
                                             reader.read_value(name).tagKind()));
    }
    const DcpTensorInfo& tensor = info.tensors.at(name);
    saved.insert(name.substr(6), meta(tensor.shape, tensor.dtype));
  }
  if (saved.is_empty()) {
    throw StateDictFormatError(fmt::format(
        "{}: the checkpoint has no 'model' entries (saved by dcp_state or dcp_model_state, or "
        "from get_state_dict's model dict as {{\"model\": ..., \"optim\": ...}})",
        source));
  }
  StateDictLoadReport report = detail::check_state_dict(target, saved, options, source);
  const std::set<std::string> loading(report.loaded.begin(), report.loaded.end());

  // The new shards: this rank's elements read over a copy of each unit's shard (its padding, and
  // a parameter a non-strict load leaves out, keep their values).
  std::map<const Unit*, torch::Tensor> shards;
  for (Unit* unit : units)
    shards.emplace(unit, unit->shard.detach().clone());
  auto read_into = [&](const std::string& name, const DcpSlots::Parameter& p,
                       const torch::Tensor& flat) {
    if (p.begin >= p.end) return;
    flat.narrow(0, p.offset + p.begin - p.shard_begin, p.end - p.begin)
        .copy_(detail::read_dcp_flat_range(reader, name, p.place.local_view, p.begin, p.end,
                                           &p.place));
  };
  for (const auto& p : slots.parameters)
    if (loading.contains(p.name)) read_into("model." + p.name, p, shards.at(p.unit));
  std::vector<torch::Tensor> buffers(slots.buffers.size());
  for (std::size_t b = 0; b < slots.buffers.size(); ++b)
    if (loading.contains(slots.buffers[b].first))
      buffers[b] = reader.read("model." + slots.buffers[b].first);

  if (optimizer != nullptr) {
    // The checkpoint's optimizer state keys of each parameter ("optim.state.<name>.<key>": the
    // key has no dot).
    std::map<std::string, std::set<std::string>> keys_of;
    bool any = false;
    for (const std::string& name : info.order) {
      if (!name.starts_with("optim.")) continue;
      any = true;
      const auto dot = name.rfind('.');
      if (!name.starts_with("optim.state.") || dot <= 12) continue;
      keys_of[name.substr(12, dot - 12)].insert(name.substr(dot + 1));
    }
    if (!any) {
      throw StateDictFormatError(fmt::format(
          "{}: the checkpoint has no 'optim' entries (it was saved without the optimizer)",
          source));
    }
    // The value form with one entry per shard: each per-element state tensor joined from its
    // parameters' ranges; a per-shard value (Adam's step), which all of them must hold alike.
    GenericDict state(c10::AnyType::get(), c10::AnyType::get());
    GenericList groups(c10::AnyType::get());
    for (std::size_t i = 0; i < shard_of.size(); ++i) {
      const Unit* unit = shard_of[i];
      const auto& parameters = parameters_of.at(unit);
      GenericDict keys(c10::StringType::get(), c10::AnyType::get());
      std::set<std::string> found;
      for (const auto* p : parameters) {
        const auto it = keys_of.find(p->name);
        if (it != keys_of.end()) found.insert(it->second.begin(), it->second.end());
      }
      for (const std::string& key : found) {
        // Every parameter of the unit has the key: the unit has one state for all of them.
        for (const auto* p : parameters) {
          const auto it = keys_of.find(p->name);
          if (it == keys_of.end() || !it->second.contains(key)) {
            throw StateDictFormatError(fmt::format(
                "{}: the checkpoint holds the optimizer state '{}' of some of the parameters "
                "'{}' to '{}' but not of '{}': FullyShardedDataParallel keeps one optimizer "
                "state for the parameters of a unit, so all of them have it or none",
                source, key, parameters.front()->name, parameters.back()->name, p->name));
          }
        }
        const std::string first = fmt::format("optim.state.{}.{}", parameters.front()->name, key);
        // Per element when any parameter's entry has the parameter's shape (then all must).
        const auto per_element_entry = [&](const DcpSlots::Parameter* p) {
          const std::string name = fmt::format("optim.state.{}.{}", p->name, key);
          return !info.values.contains(name) &&
                 detail::records_spec(p->place, info.tensors.at(name).shape);
        };
        const bool scalar =
            key == "step" || std::none_of(parameters.begin(), parameters.end(), per_element_entry);
        if (scalar) {
          // One value for the unit (Adam's step): every parameter must hold the same, or the
          // checkpoint's parameters of this unit were not trained as one, and any pick is wrong.
          const auto read_entry = [&](const std::string& name) {
            return info.values.contains(name) ? reader.read_value(name) : IValue(reader.read(name));
          };
          const IValue value = read_entry(first);
          for (std::size_t k = 1; k < parameters.size(); ++k) {
            const std::string other = fmt::format("optim.state.{}.{}", parameters[k]->name, key);
            if (!same_entry(value, read_entry(other))) {
              throw StateDictFormatError(fmt::format(
                  "{}: '{}' and '{}' differ, but FullyShardedDataParallel keeps one optimizer "
                  "state '{}' for the parameters of a unit: save them from one optimizer state "
                  "(they differ when the parameters were stepped apart)",
                  source, first, other, key));
            }
          }
          keys.insert(key, value);
          continue;
        }
        torch::Tensor flat =
            torch::zeros({unit->shard_numel}, torch::TensorOptions(info.tensors.at(first).dtype));
        for (const auto* p : parameters) {
          const std::string name = fmt::format("optim.state.{}.{}", p->name, key);
          if (info.values.contains(name) ||
              !detail::records_spec(p->place, info.tensors.at(name).shape)) {
            StateDictLoadReport mismatch;
            mismatch.mismatched.push_back(p->name);
            throw StateDictMismatchError(
                fmt::format("{}: '{}' is not a tensor of the parameter's shape [{}] in the "
                            "checkpoint",
                            source, name, fmt::join(detail::saved_shape_of(p->place), ", ")),
                mismatch);
          }
          read_into(name, *p, flat);
        }
        keys.insert(key, flat.to(unit->shard.device()));
      }
      if (!found.empty()) state.insert(static_cast<std::int64_t>(i), keys);
    }
    // Options: each group's from its first parameter's, per parameter
    // ("optim.param_groups.<name>.<option>") or per group ("optim.param_groups.<g>.<option>" whose
    // "params" lists the name).
    std::map<std::string, std::string> group_prefix_of;
    for (const auto& [name, value] : info.values) {
      if (!name.starts_with("optim.param_groups.") || !name.ends_with(".params")) continue;
      const IValue listed = reader.read_value(name);
      if (!listed.isList()) continue;
      for (const IValue& p : listed.toListRef())
        if (p.isString()) group_prefix_of.emplace(p.toStringRef(), name.substr(0, name.size() - 6));
    }
    std::size_t first = 0;
    for (const auto& group : optimizer->param_groups()) {
      const std::size_t count = group.params().size();
      GenericDict options_value(c10::StringType::get(), c10::AnyType::get());
      if (count > 0) {
        const std::string& name = parameters_of.at(shard_of[first]).front()->name;
        const auto listed = group_prefix_of.find(name);
        const std::string prefix = listed != group_prefix_of.end()
                                       ? listed->second
                                       : fmt::format("optim.param_groups.{}.", name);
        for (const auto& [entry, value] : info.values) {
          if (!entry.starts_with(prefix)) continue;
          const std::string option = entry.substr(prefix.size());
          if (option.find('.') != std::string::npos || option == "params") continue;
          options_value.insert(option, reader.read_value(entry));
        }
        if (options_value.find("lr") == options_value.end()) {
          throw StateDictFormatError(fmt::format(
              "{}: the checkpoint has no optimizer options for the parameter '{}' (under '{}*')",
              source, name, prefix));
        }
      }
      GenericList params(c10::AnyType::get());
      for (std::size_t i = first; i < first + count; ++i)
        params.push_back(static_cast<std::int64_t>(i));
      options_value.insert("params", params);
      groups.push_back(options_value);
      first += count;
    }
    GenericDict value(c10::StringType::get(), c10::AnyType::get());
    value.insert("state", state);
    value.insert("param_groups", groups);
    detail::load_optimizer_state_value(*optimizer, value, source);
  }

  // Everything read and checked: the copies cannot fail.
  for (Unit* unit : units)
    unit->shard.detach().copy_(shards.at(unit));
  for (std::size_t b = 0; b < slots.buffers.size(); ++b)
    if (buffers[b].defined()) slots.buffers[b].second.detach().copy_(buffers[b]);
  return report;
}

}  // namespace ddp
