// save_dcp's plan (dcp_save_parts.h): each rank's entries encoded for the exchange, the global
// plan every rank computes alike from all of them (a plan that is wrong refused everywhere before
// anything is written: dtypes, shapes, paths and shards that must tile their tensor), and the
// metadata it becomes, parsed back by the archive layer before it is committed.
#include <algorithm>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "torch/checkpoint/dcp_info.h"
#include "torch/checkpoint/dcp_save_parts.h"

namespace ddp::dcp_save {

namespace {

json encode_path(const std::vector<DcpPathKey>& path) {
  json out = json::array();
  for (const DcpPathKey& key : path) {
    if (key.index >= 0) {
      out.push_back(key.index);
    } else {
      out.push_back(key.name);
    }
  }
  return out;
}

std::vector<DcpPathKey> decode_path(const json& path) {
  std::vector<DcpPathKey> out;
  for (const json& key : path) {
    if (key.is_number_integer()) {
      out.push_back({"", key.get<std::int64_t>()});
    } else {
      out.push_back({key.get<std::string>(), -1});
    }
  }
  return out;
}

}  // namespace

std::string local_plan(const DcpStateDict& state, const std::string& error,
                       std::uint64_t generation) {
  json plan;
  plan["gen"] = generation;
  if (!error.empty()) {
    plan["err"] = error;
    return plan.dump();
  }
  json entries = json::array();
  for (const DcpStateDict::Entry& e : state.entries()) {
    json entry;
    entry["n"] = e.name;
    entry["p"] = encode_path(e.path);
    if (e.kind == Kind::kValue) {
      entry["k"] = "v";
    } else {
      entry["k"] = "s";
      entry["d"] = detail::dcp_dtype_name(e.tensor.scalar_type());
      const auto sizes = e.tensor.sizes().vec();
      entry["z"] = sizes;
      entry["o"] = e.kind == Kind::kShard ? e.offsets : std::vector<std::int64_t>(sizes.size(), 0);
      entry["g"] = e.kind == Kind::kShard ? e.global_shape : sizes;
      entry["b"] = e.tensor.numel() * e.tensor.element_size();
    }
    entries.push_back(std::move(entry));
  }
  plan["e"] = std::move(entries);
  return plan.dump();
}

[[noreturn]] void refuse_plan(const std::filesystem::path& folder, const std::string& what) {
  throw ConfigError(fmt::format("save_dcp({}): {}; nothing was written", folder.string(), what));
}

// The same on every rank: it depends only on every rank's local plan.
GlobalPlan global_plan(const std::vector<std::string>& plans, const std::filesystem::path& folder) {
  GlobalPlan plan;
  std::vector<std::string> failures;
  std::vector<json> decoded;
  for (std::size_t r = 0; r < plans.size(); ++r) {
    decoded.push_back(json::parse(plans[r], nullptr, /*allow_exceptions=*/false));
    if (decoded.back().is_discarded() || !decoded.back().is_object()) {
      refuse_plan(folder, fmt::format("rank {}'s plan is not readable", r));
    }
    if (decoded.back().contains("err")) {
      failures.push_back(fmt::format("rank {}: {}", r, decoded.back()["err"].get<std::string>()));
    }
  }
  if (!failures.empty()) refuse_plan(folder, fmt::format("{}", fmt::join(failures, "; ")));
  plan.generation = decoded[0]["gen"].get<std::uint64_t>();

  std::map<std::pair<std::string, std::vector<std::int64_t>>, std::size_t> chunk_items;
  std::map<std::string, std::size_t> value_items;
  std::map<std::string, std::vector<std::size_t>> entry_items;
  for (std::size_t r = 0; r < decoded.size(); ++r) {
    const json& entries = decoded[r]["e"];
    for (std::size_t i = 0; i < entries.size(); ++i) {
      const json& e = entries[i];
      const std::string name = e["n"].get<std::string>();
      const Kind kind = e["k"] == "v" ? Kind::kValue : Kind::kShard;
      PlannedEntry candidate;
      candidate.kind = kind;
      candidate.path = decode_path(e["p"]);
      candidate.first_rank = static_cast<int>(r);
      if (kind == Kind::kShard) {
        candidate.dtype = e["d"].get<std::string>();
        candidate.shape = e["g"].get<std::vector<std::int64_t>>();
      }
      auto [it, fresh] = plan.entries.try_emplace(name, candidate);
      const PlannedEntry& known = it->second;
      if (fresh) {
        plan.order.push_back(name);
      } else if (known.kind != kind) {
        refuse_plan(folder, fmt::format("'{}' is a tensor on rank {} and a value on rank {}", name,
                                        kind == Kind::kValue ? known.first_rank : r,
                                        kind == Kind::kValue ? r : known.first_rank));
      } else if (known.dtype != candidate.dtype || known.shape != candidate.shape) {
        refuse_plan(folder,
                    fmt::format("the tensor '{}' is {} [{}] on rank {} and {} [{}] on rank {}",
                                name, known.dtype, fmt::join(known.shape, ", "), known.first_rank,
                                candidate.dtype, fmt::join(candidate.shape, ", "), r));
      } else if (e["p"] != encode_path(known.path)) {
        refuse_plan(folder, fmt::format("'{}' has the path '{}' on rank {} and '{}' on rank {}",
                                        name, path_text(known.path), known.first_rank,
                                        path_text(candidate.path), r));
      }
      const std::pair<int, std::size_t> holder{static_cast<int>(r), i};
      if (kind == Kind::kValue) {
        auto [v, new_value] = value_items.try_emplace(name, plan.items.size());
        if (new_value) {
          plan.items.push_back({name, {}, {}, true, 0, {}, -1});
          entry_items[name].push_back(v->second);
        }
        plan.items[v->second].holders.push_back(holder);
        continue;
      }
      auto offsets = e["o"].get<std::vector<std::int64_t>>();
      auto sizes = e["z"].get<std::vector<std::int64_t>>();
      std::vector<std::int64_t> key = offsets;
      key.insert(key.end(), sizes.begin(), sizes.end());
      auto [c, new_chunk] = chunk_items.try_emplace({name, key}, plan.items.size());
      if (new_chunk) {
        plan.items.push_back({name,
                              std::move(offsets),
                              std::move(sizes),
                              false,
                              e["b"].get<std::uint64_t>(),
                              {},
                              -1});
        entry_items[name].push_back(c->second);
      }
      plan.items[c->second].holders.push_back(holder);
    }
  }
  // Items in entry order, each entry's chunks in the order the ranks hold them.
  std::vector<Item> ordered;
  for (const std::string& name : plan.order) {
    for (const std::size_t i : entry_items[name])
      ordered.push_back(std::move(plan.items[i]));
  }
  plan.items = std::move(ordered);

  // Writers: items only one rank holds first (they have no choice), then each shared item to the
  // least loaded of its holders (the lowest rank on a tie).
  std::vector<std::uint64_t> load(plans.size(), 0);
  for (Item& item : plan.items) {
    if (item.holders.size() == 1) {
      item.writer = item.holders[0].first;
      load[static_cast<std::size_t>(item.writer)] += item.bytes;
    }
  }
  for (Item& item : plan.items) {
    if (item.writer >= 0) continue;
    item.writer = item.holders[0].first;
    for (const auto& [rank, index] : item.holders) {
      if (load[static_cast<std::size_t>(rank)] < load[static_cast<std::size_t>(item.writer)]) {
        item.writer = rank;
      }
    }
    load[static_cast<std::size_t>(item.writer)] += item.bytes;
  }
  return plan;
}

// The metadata `plan` describes, with each item's storage from `storage` (or placeholders).
archive::DcpMetadata metadata_of(const GlobalPlan& plan,
                                 const std::vector<archive::DcpStorage>& storage) {
  archive::DcpMetadata metadata;
  metadata.version = "1.0.0";
  metadata.order = plan.order;
  for (const std::string& name : plan.order) {
    const PlannedEntry& entry = plan.entries.at(name);
    std::vector<archive::DcpPathKey> path;
    for (const DcpPathKey& key : entry.path)
      path.push_back({key.name, key.index});
    metadata.paths.emplace(name, std::move(path));
    if (entry.kind == Kind::kShard) {
      metadata.tensors[name] = {entry.dtype, entry.shape, {}};
    }
  }
  for (std::size_t i = 0; i < plan.items.size(); ++i) {
    const Item& item = plan.items[i];
    archive::DcpStorage where =
        storage.empty() ? archive::DcpStorage{"__0_0.distcp", 0, 0} : storage[i];
    if (item.value) {
      metadata.values[item.name] = std::move(where);
    } else {
      metadata.tensors[item.name].chunks.push_back({item.offsets, item.sizes, std::move(where)});
    }
  }
  return metadata;
}

// The encoded metadata, parsed back: what the reader will accept, or a FormatError.
std::string checked_metadata(const archive::DcpMetadata& metadata) {
  std::string bytes = archive::encode_dcp_metadata(metadata);
  archive::parse_dcp_metadata(bytes);
  return bytes;
}

}  // namespace ddp::dcp_save
