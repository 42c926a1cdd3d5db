// DcpStateDict (ddp/torch/checkpoint/distributed_checkpoint_save.h): a rank's entries, checked as
// they are added (a dtype the format holds, a shard inside its global shape, one entry per name
// but for several shards of one tensor),
// and flatten's naming of a nested state dict as PyTorch's flatten_state_dict names it.
#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "ddp/torch/checkpoint/distributed_checkpoint_save.h"
#include "torch/checkpoint/dcp_info.h"
#include "torch/checkpoint/dcp_save_parts.h"

namespace ddp {
namespace dcp_save {

std::string path_text(const std::vector<DcpPathKey>& path) {
  std::string out;
  for (const DcpPathKey& key : path) {
    if (!out.empty()) out += '.';
    out += key.index >= 0 ? std::to_string(key.index) : key.name;
  }
  return out;
}

void check_tensor(const at::Tensor& tensor, const std::string& name) {
  if (!tensor.defined()) {
    throw ConfigError(fmt::format("DcpStateDict: the tensor '{}' is undefined", name));
  }
  if (tensor.layout() != at::kStrided || tensor.is_quantized()) {
    throw ConfigError(fmt::format(
        "DcpStateDict: the tensor '{}' is not a dense strided tensor (sparse and quantized "
        "tensors cannot be saved in a distributed checkpoint)",
        name));
  }
  detail::dcp_dtype_name(tensor.scalar_type());  // throws, naming the dtype
}

// A shard's tensor, and its place inside its global shape.
void check_shard(const std::string& name, const at::Tensor& local,
                 const std::vector<std::int64_t>& offsets,
                 const std::vector<std::int64_t>& global_shape) {
  check_tensor(local, name);
  const auto dims = static_cast<std::size_t>(local.dim());
  bool inside = offsets.size() == dims && global_shape.size() == dims;
  for (std::size_t d = 0; inside && d < dims; ++d) {
    inside = offsets[d] >= 0 && global_shape[d] >= 0 && offsets[d] <= global_shape[d] &&
             local.size(static_cast<std::int64_t>(d)) <= global_shape[d] - offsets[d];
  }
  if (!inside) {
    throw ConfigError(fmt::format(
        "DcpStateDict: the shard of '{}' at [{}] of [{}] is not inside its global shape [{}]", name,
        fmt::join(offsets, ", "), fmt::join(local.sizes(), ", "), fmt::join(global_shape, ", ")));
  }
}

}  // namespace dcp_save

namespace {

bool same_path(const std::vector<DcpPathKey>& a, const std::vector<DcpPathKey>& b) {
  return std::equal(a.begin(), a.end(), b.begin(), b.end(),
                    [](const DcpPathKey& x, const DcpPathKey& y) {
                      return x.name == y.name && x.index == y.index;
                    });
}

}  // namespace

void DcpStateDict::add(Entry entry) {
  if (entry.name.empty()) throw ConfigError("DcpStateDict: an entry needs a non-empty name");
  if (entry.path.empty()) entry.path.push_back({entry.name, -1});
  auto [it, fresh] = names_.try_emplace(entry.name);
  if (!fresh) {
    // Several chunks of one tensor on one rank (an FSDP flat shard that starts and ends inside
    // rows): shards of the same tensor, at different offsets. Anything else is a mistake.
    const Entry& first = entries_[it->second.front()];
    if (entry.kind != Entry::Kind::kShard || first.kind != Entry::Kind::kShard) {
      throw ConfigError(
          fmt::format("DcpStateDict: the entry '{}' is added twice (only shards "
                      "of one tensor may share a name)",
                      entry.name));
    }
    if (entry.global_shape != first.global_shape ||
        entry.tensor.scalar_type() != first.tensor.scalar_type() ||
        !same_path(entry.path, first.path)) {
      throw ConfigError(fmt::format(
          "DcpStateDict: the shards of '{}' disagree: {} of [{}] at '{}', and {} of [{}] at '{}'",
          entry.name, c10::toString(first.tensor.scalar_type()),
          fmt::join(first.global_shape, ", "), dcp_save::path_text(first.path),
          c10::toString(entry.tensor.scalar_type()), fmt::join(entry.global_shape, ", "),
          dcp_save::path_text(entry.path)));
    }
    for (const std::size_t i : it->second) {
      if (entries_[i].offsets == entry.offsets) {
        throw ConfigError(fmt::format("DcpStateDict: the shard of '{}' at [{}] is added twice",
                                      entry.name, fmt::join(entry.offsets, ", ")));
      }
    }
  }
  it->second.push_back(entries_.size());
  entries_.push_back(std::move(entry));
}

void DcpStateDict::add_entry(Entry entry) {
  switch (entry.kind) {
    case Entry::Kind::kTensor:
    case Entry::Kind::kShard:
      if (entry.kind == Entry::Kind::kShard) {
        dcp_save::check_shard(entry.name, entry.tensor, entry.offsets, entry.global_shape);
      } else {
        dcp_save::check_tensor(entry.tensor, entry.name);
      }
      break;
    case Entry::Kind::kValue:
      if (entry.value.isTensor()) {
        throw ConfigError(fmt::format(
            "DcpStateDict: '{}' is a tensor: add it with add_tensor or add_shard", entry.name));
      }
      break;
  }
  add(std::move(entry));
}

void DcpStateDict::add_tensor(const std::string& name, const at::Tensor& tensor) {
  dcp_save::check_tensor(tensor, name);
  Entry entry;
  entry.kind = Entry::Kind::kTensor;
  entry.name = name;
  entry.tensor = tensor;
  add(std::move(entry));
}

void DcpStateDict::add_shard(const std::string& name, const at::Tensor& local,
                             std::vector<std::int64_t> offsets,
                             std::vector<std::int64_t> global_shape) {
  dcp_save::check_shard(name, local, offsets, global_shape);
  Entry entry;
  entry.kind = Entry::Kind::kShard;
  entry.name = name;
  entry.tensor = local;
  entry.offsets = std::move(offsets);
  entry.global_shape = std::move(global_shape);
  add(std::move(entry));
}

void DcpStateDict::add_value(const std::string& name, const c10::IValue& value) {
  if (value.isTensor()) {
    throw ConfigError(
        fmt::format("DcpStateDict: '{}' is a tensor: add it with add_tensor or add_shard", name));
  }
  Entry entry;
  entry.kind = Entry::Kind::kValue;
  entry.name = name;
  entry.value = value;
  add(std::move(entry));
}

namespace {

// PyTorch's _traverse.traverse_state_dict: a list is a leaf unless it holds a tensor, a dict, or
// a list that is not a leaf.
bool is_leaf(const c10::IValue& value) {
  if (value.isGenericDict()) return false;
  if (!value.isList()) return true;
  for (const c10::IValue& e : value.toListRef()) {
    if ((e.isGenericDict() || e.isList()) && !is_leaf(e)) return false;
    if (e.isTensor()) return false;
  }
  return true;
}

std::string key_text(const c10::IValue& key, const std::vector<DcpPathKey>& path) {
  if (key.isString()) return key.toStringRef();
  if (key.isInt()) return std::to_string(key.toInt());
  throw ConfigError(fmt::format(
      "DcpStateDict::flatten: a dict under '{}' has a key of kind {}: only strings and integers "
      "name entries",
      dcp_save::path_text(path), key.tagKind()));
}

}  // namespace

DcpStateDict DcpStateDict::flatten(const c10::IValue& nested) {
  if (!nested.isGenericDict()) {
    throw ConfigError(
        fmt::format("DcpStateDict::flatten: the state dict is a {}, not a dict", nested.tagKind()));
  }
  DcpStateDict out;
  std::set<std::string> seen;
  std::vector<DcpPathKey> path;
  std::function<void(const c10::IValue&)> visit = [&](const c10::IValue& value) {
    if (value.isGenericDict()) {
      for (const auto& item : value.toGenericDict()) {
        path.push_back({key_text(item.key(), path), -1});
        visit(item.value());
        path.pop_back();
      }
      return;
    }
    if (!is_leaf(value)) {
      const auto list = value.toListRef();
      for (std::size_t i = 0; i < list.size(); ++i) {
        path.push_back({"", static_cast<std::int64_t>(i)});
        visit(list[i]);
        path.pop_back();
      }
      return;
    }
    Entry entry;
    entry.name = dcp_save::path_text(path);
    entry.path = path;
    if (!seen.insert(entry.name).second) {
      throw ConfigError(fmt::format(
          "DcpStateDict::flatten: two entries flatten to '{}' (a key with a '.' beside a nested "
          "path: PyTorch's flatten_state_dict refuses it too)",
          entry.name));
    }
    if (value.isTensor()) {
      dcp_save::check_tensor(value.toTensor(), entry.name);
      entry.kind = Entry::Kind::kTensor;
      entry.tensor = value.toTensor();
    } else {
      entry.kind = Entry::Kind::kValue;
      entry.value = value;
    }
    out.add(std::move(entry));
  };
  visit(nested);
  return out;
}

}  // namespace ddp
