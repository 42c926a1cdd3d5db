// save_dcp (ddp/torch/checkpoint/distributed_checkpoint_save.h): dcp.save's plan / write /
// finish, over ddp's object collectives. Every rank computes the global plan from every rank's
// local plan, so a wrong plan is refused alike everywhere without a further exchange; the
// metadata is encoded by the archive layer and parsed back before it is committed, so what is
// committed is what the reader accepts (chunks that tile, one record each).
#include "ddp/torch/checkpoint/distributed_checkpoint_save.h"

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <regex>
#include <set>
#include <thread>
#include <utility>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "archive/crc32.h"
#include "archive/dcp_metadata.h"
#include "ddp/runtime/init.h"
#include "ddp/torch/api/distributed_objects.h"
#include "torch/checkpoint/dcp_info.h"
#include "torch/formats/pytorch_archive.h"

namespace ddp {
namespace dcp_save {  // named: DcpAsyncSave::State holds its types

using json = nlohmann::json;
using Kind = DcpStateDict::Entry::Kind;

std::string system_error_text(int error) {
  return std::strerror(error);
}

// ---- Entries -------------------------------------------------------------------------------

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

// ---- The plan ------------------------------------------------------------------------------

// One item a rank may write: a chunk of a tensor, or a value.
struct Item {
  std::string name;
  std::vector<std::int64_t> offsets, sizes;  // a chunk's; empty for a value
  bool value = false;
  std::uint64_t bytes = 0;
  std::vector<std::pair<int, std::size_t>> holders;  // (rank, index in its entries)
  int writer = -1;
};

struct PlannedEntry {
  Kind kind = Kind::kValue;  // kShard for every tensor (a whole tensor is one chunk of itself)
  std::string dtype;
  std::vector<std::int64_t> shape;
  std::vector<DcpPathKey> path;
  int first_rank = 0;
};

struct GlobalPlan {
  std::uint64_t generation = 0;
  std::vector<std::string> order;
  std::map<std::string, PlannedEntry> entries;
  std::vector<Item> items;  // in order: every entry's chunks, or its value
};

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

// ---- Files ---------------------------------------------------------------------------------

const std::regex& data_file_pattern() {
  static const std::regex pattern(R"(__(\d+)_(\d+)\.distcp)");
  return pattern;
}

// The first n such that no `__<rank>_<n>.distcp` is in the folder (0 in a new folder).
std::uint64_t next_generation(const std::filesystem::path& folder) {
  std::uint64_t next = 0;
  for (const auto& file : std::filesystem::directory_iterator(folder)) {
    std::smatch match;
    const std::string name = file.path().filename().string();
    if (std::regex_match(name, match, data_file_pattern())) {
      next = std::max<std::uint64_t>(next, std::stoull(match[2].str()) + 1);
    }
  }
  return next;
}

void sync_path(const std::filesystem::path& path, int flags) {
  const int fd = ::open(path.c_str(), flags | O_CLOEXEC);
  if (fd < 0) {
    throw ConfigError(
        fmt::format("cannot open {} to sync it: {}", path.string(), system_error_text(errno)));
  }
  const int result = ::fsync(fd);
  const int error = errno;
  ::close(fd);
  if (result != 0) {
    throw ConfigError(
        fmt::format("fsync of {} failed: {}", path.string(), system_error_text(error)));
  }
}

// A chunk as its own compact tensor on the CPU: torch.save writes a tensor's whole storage.
at::Tensor compact_cpu(const at::Tensor& tensor) {
  at::Tensor t = tensor.detach();
  if (!t.is_cpu()) t = t.cpu();
  const bool compact = t.is_contiguous() && t.storage_offset() == 0 &&
                       t.storage().nbytes() == static_cast<std::size_t>(t.numel()) *
                                                   static_cast<std::size_t>(t.element_size());
  return compact ? t : t.clone(at::MemoryFormat::Contiguous);
}

// The CRC-32 of what an entry holds: a tensor's bytes in row-major order (dtype and shape are
// already equal across the ranks: the plan checked them), a value's pickle (as torch.save writes
// it, so equal values pickle alike).
std::uint32_t content_crc(const DcpStateDict::Entry& entry) {
  if (entry.kind == Kind::kValue) {
    std::uint32_t crc = 0;
    const std::string pickle = detail::pickle_value(
        entry.value, /*ordered_dict_at_top=*/false,
        [&crc](const std::string&, const at::Storage& storage) {
          crc = archive::crc32(storage.data(), storage.nbytes(), crc);
        },
        fmt::format("save_dcp: the entry '{}'", entry.name));
    return archive::crc32(pickle.data(), pickle.size(), crc);
  }
  at::Tensor t = entry.tensor.detach();
  if (!t.is_cpu()) t = t.cpu();
  t = t.contiguous();
  return archive::crc32(t.data_ptr(), static_cast<std::size_t>(t.numel()) *
                                          static_cast<std::size_t>(t.element_size()));
}

// The CRC-32 of every item this rank holds together with another rank, by item index: the
// replicas finish_save compares before it commits.
std::vector<std::pair<std::size_t, std::uint32_t>> replica_crcs(const DcpStateDict& state,
                                                                const GlobalPlan& plan, int rank) {
  std::vector<std::pair<std::size_t, std::uint32_t>> crcs;
  for (std::size_t i = 0; i < plan.items.size(); ++i) {
    const Item& item = plan.items[i];
    if (item.holders.size() < 2) continue;
    for (const auto& [holder, index] : item.holders) {
      if (holder == rank) crcs.emplace_back(i, content_crc(state.entries()[index]));
    }
  }
  return crcs;
}

// The items whose replicas differ, from every rank's CRC-32s (rank, item, crc): one line each
// naming which ranks hold which bytes, at most `shown` of them.
std::string differing_replicas(const GlobalPlan& plan,
                               const std::vector<std::map<std::size_t, std::uint32_t>>& crcs,
                               std::size_t shown = 3) {
  std::vector<std::string> lines;
  std::size_t differing = 0;
  for (std::size_t i = 0; i < plan.items.size(); ++i) {
    const Item& item = plan.items[i];
    std::map<std::uint32_t, std::vector<int>> ranks_by_crc;
    for (const auto& [holder, index] : item.holders) {
      const auto& reported = crcs[static_cast<std::size_t>(holder)];
      const auto it = reported.find(i);
      if (it != reported.end()) ranks_by_crc[it->second].push_back(holder);
    }
    if (ranks_by_crc.size() < 2) continue;
    if (++differing > shown) continue;
    std::vector<std::pair<std::vector<int>, std::uint32_t>> groups;
    for (const auto& [crc, ranks] : ranks_by_crc)
      groups.emplace_back(ranks, crc);
    std::sort(groups.begin(), groups.end());
    std::vector<std::string> parts;
    for (const auto& [ranks, crc] : groups) {
      parts.push_back(fmt::format("rank{} {} (CRC-32 {:08x})", ranks.size() > 1 ? "s" : "",
                                  fmt::join(ranks, ", "), crc));
    }
    const std::string what =
        item.value ? fmt::format("the value '{}'", item.name)
        : item.sizes == plan.entries.at(item.name).shape
            ? fmt::format("the tensor '{}'", item.name)
            : fmt::format("the chunk [{}] at [{}] of '{}'", fmt::join(item.sizes, ", "),
                          fmt::join(item.offsets, ", "), item.name);
    lines.push_back(fmt::format("{} differs across the ranks that hold it: {}", what,
                                fmt::join(parts, " against ")));
  }
  if (differing == 0) return "";
  if (differing > shown) lines.push_back(fmt::format("and {} more", differing - shown));
  return fmt::format(
      "{}; a tensor or value added on several ranks is written once and must be equal on each "
      "(save per-rank state under per-rank names; DcpSaveOptions::check_replicas = false writes "
      "one rank's copy unchecked)",
      fmt::join(lines, "; "));
}

// This rank's items into its data file; the storage of each, by item index.
std::map<std::size_t, archive::DcpStorage> write_items(const DcpStateDict& state,
                                                       const GlobalPlan& plan, int rank,
                                                       const std::filesystem::path& file) {
  std::map<std::size_t, archive::DcpStorage> written;
  std::vector<std::size_t> mine;
  for (std::size_t i = 0; i < plan.items.size(); ++i) {
    if (plan.items[i].writer == rank) mine.push_back(i);
  }
  if (mine.empty()) return written;
  std::unique_ptr<FILE, int (*)(FILE*)> out(std::fopen(file.c_str(), "wb"), &std::fclose);
  if (!out) {
    throw ConfigError(fmt::format("cannot create {}: {} (is the folder writable?)", file.string(),
                                  system_error_text(errno)));
  }
  std::setvbuf(out.get(), nullptr, _IOFBF, 1 << 20);
  const std::string name = file.filename().string();
  std::uint64_t offset = 0;
  for (const std::size_t i : mine) {
    const Item& item = plan.items[i];
    std::size_t index = 0;
    for (const auto& [holder, at] : item.holders) {
      if (holder == rank) index = at;
    }
    const DcpStateDict::Entry& entry = state.entries()[index];
    const c10::IValue value = item.value ? entry.value : c10::IValue(compact_cpu(entry.tensor));
    const std::uint64_t length = detail::append_pytorch_archive(
        out.get(), file.string(), value, /*ordered_dict_at_top=*/false,
        fmt::format("save_dcp: the entry '{}'", item.name));
    written[i] = {name, offset, length};
    offset += length;
  }
  if (std::fflush(out.get()) != 0 || ::fsync(::fileno(out.get())) != 0) {
    throw ConfigError(
        fmt::format("writing {} failed: {}", file.string(), system_error_text(errno)));
  }
  FILE* raw = out.release();
  if (std::fclose(raw) != 0) {
    throw ConfigError(
        fmt::format("closing {} failed: {}", file.string(), system_error_text(errno)));
  }
  return written;
}

void write_metadata(const std::filesystem::path& folder, const std::string& bytes) {
  const std::filesystem::path file = folder / ".metadata";
  const std::filesystem::path temporary = folder / ".metadata.tmp";
  {
    std::unique_ptr<FILE, int (*)(FILE*)> out(std::fopen(temporary.c_str(), "wb"), &std::fclose);
    if (!out) {
      throw ConfigError(
          fmt::format("cannot create {}: {}", temporary.string(), system_error_text(errno)));
    }
    if (std::fwrite(bytes.data(), 1, bytes.size(), out.get()) != bytes.size() ||
        std::fflush(out.get()) != 0 || ::fsync(::fileno(out.get())) != 0) {
      const int error = errno;
      out.reset();
      std::filesystem::remove(temporary);
      throw ConfigError(
          fmt::format("writing {} failed: {}", temporary.string(), system_error_text(error)));
    }
  }
  if (::rename(temporary.c_str(), file.c_str()) != 0) {
    const int error = errno;
    std::filesystem::remove(temporary);
    throw ConfigError(fmt::format("renaming {} to {} failed: {}", temporary.string(), file.string(),
                                  system_error_text(error)));
  }
}

// After the commit, on every rank at once: this rank's data files of earlier saves (another
// generation), and on rank 0 also those of ranks the job no longer has. Each rank unlinks its own,
// in parallel (an earlier save's 768 MiB file took 0.13 s to unlink on this machine's ext4 with
// discard, which rank 0 alone did for every rank before). By their pattern only: nothing else in
// the folder is touched.
void remove_earlier_data_files(const std::filesystem::path& folder, int rank, int world,
                               std::uint64_t generation) {
  std::error_code ignored;
  for (const auto& file : std::filesystem::directory_iterator(folder, ignored)) {
    std::smatch match;
    const std::string name = file.path().filename().string();
    if (!std::regex_match(name, match, data_file_pattern())) continue;
    const auto owner = std::stoull(match[1].str());
    const bool mine = owner == static_cast<std::uint64_t>(rank) ||
                      (rank == 0 && owner >= static_cast<std::uint64_t>(world));
    if (mine && std::stoull(match[2].str()) != generation) {
      std::filesystem::remove(file.path(), ignored);
    }
  }
}

// Rank 0's claim on the folder for one save: `.dcp-save.lock`, made with O_EXCL, removed when the
// save ends. Two jobs saving into one folder would pick the same data file names and overwrite
// each other's; the second is refused instead, naming the first. A lock left by a process of this
// host that no longer runs (killed mid-save) is taken over; one from another host is named.
class FolderLock {
 public:
  explicit FolderLock(const std::filesystem::path& folder) : path_(folder / ".dcp-save.lock") {
    for (int attempt = 0; attempt < 2; ++attempt) {
      const int fd = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
      if (fd >= 0) {
        const std::string owner = fmt::format("pid={} host={}\n", ::getpid(), host_name());
        const bool written =
            ::write(fd, owner.data(), owner.size()) == static_cast<ssize_t>(owner.size());
        ::close(fd);
        if (!written) {
          ::unlink(path_.c_str());
          throw ConfigError(fmt::format("cannot write {}", path_.string()));
        }
        return;
      }
      if (errno != EEXIST) {
        throw ConfigError(
            fmt::format("cannot create {}: {}", path_.string(), system_error_text(errno)));
      }
      const std::string owner = read_owner();
      if (attempt == 0 && owner_is_gone(owner)) {
        ::unlink(path_.c_str());  // its process died mid-save on this host
        continue;
      }
      throw ConfigError(fmt::format(
          "another save is writing this folder ({}: {}); two jobs saving into one folder would "
          "overwrite each other's files. Save into another folder, or remove {} if that save is "
          "gone",
          path_.string(), owner.empty() ? "owner unknown" : owner, path_.string()));
    }
  }
  FolderLock(const FolderLock&) = delete;
  FolderLock& operator=(const FolderLock&) = delete;
  ~FolderLock() { ::unlink(path_.c_str()); }

 private:
  static std::string host_name() {
    char name[256] = {};
    ::gethostname(name, sizeof(name) - 1);
    return name;
  }
  std::string read_owner() const {
    std::ifstream in(path_);
    std::string line;
    std::getline(in, line);
    return line.substr(0, 200);
  }
  static bool owner_is_gone(const std::string& owner) {
    std::smatch match;
    static const std::regex pattern(R"(pid=(\d+) host=(\S+))");
    if (!std::regex_match(owner, match, pattern) || match[2].str() != host_name()) return false;
    const long pid = std::stol(match[1].str());
    return pid > 0 && ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH;
  }

  std::filesystem::path path_;
};

// ---- The exchange --------------------------------------------------------------------------

// The group the save runs over, or this process alone.
class Participants {
 public:
  Participants() = default;  // this process alone
  explicit Participants(const DcpSaveOptions& options) {
    if (!options.no_dist) {
      group_ = options.group ? options.group : default_process_group();
    }
  }
  int rank() const { return group_ ? group_->rank() : 0; }
  int size() const { return group_ ? group_->size() : 1; }
  std::vector<std::string> all_gather(const std::string& mine) const {
    if (!group_) return {mine};
    std::vector<std::string> all;
    all_gather_object(all, mine, group_);
    return all;
  }
  std::string from_rank0(const std::string& mine) const {
    if (!group_) return mine;
    std::vector<std::string> list{mine};
    broadcast_object_list(list, 0, group_);
    return list.at(0);
  }

 private:
  std::shared_ptr<ProcessGroup> group_;
};

std::string what_of(const std::exception& e) {
  if (const auto* c = dynamic_cast<const c10::Error*>(&e)) return c->what_without_backtrace();
  return e.what();
}

}  // namespace dcp_save

// ---- DcpStateDict --------------------------------------------------------------------------

void DcpStateDict::add(Entry entry) {
  if (entry.name.empty()) throw ConfigError("DcpStateDict: an entry needs a non-empty name");
  if (!names_.insert(entry.name).second) {
    throw ConfigError(fmt::format("DcpStateDict: the entry '{}' is added twice", entry.name));
  }
  if (entry.path.empty()) entry.path.push_back({entry.name, -1});
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

// ---- save_dcp ------------------------------------------------------------------------------

namespace dcp_save {

// A save the ranks have planned: what each writes, and where this rank's part goes.
struct PlannedSave {
  Participants participants;
  std::filesystem::path folder;
  GlobalPlan plan;
  std::filesystem::path data_file;
  std::shared_ptr<FolderLock> lock;  // rank 0's, for the save's whole life
  bool check_replicas = true;
};

// 1. Plan (collective). Rank 0 picks the data files' generation; every rank reports what it
// holds, or why it cannot take part (the folder cannot be made, a dtype the format cannot hold).
PlannedSave plan_save(const DcpStateDict& state, const std::filesystem::path& folder,
                      const DcpSaveOptions& options) {
  PlannedSave save{Participants(options), folder, {}, {}, {}, options.check_replicas};
  const int rank = save.participants.rank();
  std::string plan_error;
  std::uint64_t generation = 0;
  try {
    std::filesystem::create_directories(folder);
    if (rank == 0) {
      save.lock = std::make_shared<FolderLock>(folder);
      generation = next_generation(folder);
    }
  } catch (const std::exception& e) {
    plan_error = fmt::format("cannot use the folder {}: {}", folder.string(), what_of(e));
  }
  std::string mine;
  try {
    mine = local_plan(state, plan_error, generation);
  } catch (const std::exception& e) {
    mine = local_plan(state, what_of(e), generation);
  }
  const std::vector<std::string> plans = save.participants.all_gather(mine);
  try {
    save.plan = global_plan(plans, folder);
  } catch (const json::exception& e) {  // a rank's plan not as this code writes it
    refuse_plan(folder, fmt::format("a rank's plan is not readable: {}", e.what()));
  }
  try {
    checked_metadata(metadata_of(save.plan, {}));
  } catch (const archive::FormatError& e) {
    refuse_plan(folder, fmt::format("the ranks' entries do not make a checkpoint: {}", e.what()));
  }
  save.data_file = folder / fmt::format("__{}_{}.distcp", rank, save.plan.generation);
  return save;
}

// 2. Write this rank's items (local: no collective, so it may run on another thread). The report
// for finish_save: where each item went, or why the part could not be written. Never throws.
std::string write_part(const DcpStateDict& state, const PlannedSave& save) {
  json result;
  try {
    json items = json::array();
    for (const auto& [index, where] :
         write_items(state, save.plan, save.participants.rank(), save.data_file)) {
      items.push_back({index, where.file, where.offset, where.length});
    }
    result["items"] = std::move(items);
    if (save.check_replicas) {
      result["crc"] = replica_crcs(state, save.plan, save.participants.rank());
    }
  } catch (const std::exception& e) {
    result["err"] = what_of(e);
  } catch (...) {
    result["err"] = "an exception that is not a std::exception";
  }
  return result.dump();
}

// 3. Finish (collective): rank 0 commits the metadata if every rank wrote its part; every rank
// learns the outcome from it.
DcpCheckpointInfo finish_save(const PlannedSave& save, const std::string& report) {
  const std::filesystem::path& folder = save.folder;
  const std::vector<std::string> results = save.participants.all_gather(report);
  std::vector<std::string> failures;
  std::vector<archive::DcpStorage> storage(save.plan.items.size());
  std::vector<std::map<std::size_t, std::uint32_t>> crcs(results.size());
  for (std::size_t r = 0; r < results.size(); ++r) {
    const json written = json::parse(results[r], nullptr, /*allow_exceptions=*/false);
    if (!written.is_object() || (!written.contains("err") && !written.contains("items"))) {
      failures.push_back(fmt::format("rank {}: its report is not readable", r));
      continue;
    }
    if (written.contains("err")) {
      failures.push_back(fmt::format("rank {}: {}", r, written["err"].get<std::string>()));
      continue;
    }
    for (const json& item : written["items"]) {
      storage.at(item[0].get<std::size_t>()) = {
          item[1].get<std::string>(), item[2].get<std::uint64_t>(), item[3].get<std::uint64_t>()};
    }
    if (written.contains("crc")) {
      for (const json& item : written["crc"])
        crcs[r][item[0].get<std::size_t>()] = item[1].get<std::uint32_t>();
    }
  }
  if (const std::string differing = differing_replicas(save.plan, crcs); !differing.empty()) {
    failures.insert(failures.begin(), differing);
  }
  std::string outcome;
  if (save.participants.rank() == 0 && failures.empty()) {
    try {
      const archive::DcpMetadata metadata = metadata_of(save.plan, storage);
      const std::string bytes = checked_metadata(metadata);
      write_metadata(folder, bytes);
      outcome = "ok" + bytes;  // committed: from here on no rank removes its part
      // The rename lives in the folder's entries: until they are on disk a crash may forget it.
      sync_path(folder, O_RDONLY | O_DIRECTORY);
    } catch (const std::exception& e) {
      outcome = (outcome.empty() ? "no" : "cx") + ("rank 0: " + what_of(e));
    }
  }
  // Outcomes: "ok" and the metadata committed; "cx" committed, then a failure (the folder's
  // sync); "no" not committed.
  if (!failures.empty()) outcome = fmt::format("no{}", fmt::join(failures, "; "));
  outcome = save.participants.from_rank0(outcome);
  if (outcome.starts_with("cx")) {
    throw ConfigError(fmt::format(
        "save_dcp({}): the checkpoint's metadata was written and renamed into place, but then "
        "{}: it is readable now, and a crash of this machine before the folder reaches the disk "
        "may lose it",
        folder.string(), outcome.substr(2)));
  }
  if (!outcome.starts_with("ok")) {
    std::error_code ignored;
    std::filesystem::remove(save.data_file, ignored);  // this save's part, which nothing names
    throw ConfigError(fmt::format(
        "save_dcp({}): the checkpoint was not committed: {}; the folder's previous checkpoint, "
        "if it had one, is as it was",
        folder.string(), outcome.substr(2)));
  }
  remove_earlier_data_files(folder, save.participants.rank(), save.participants.size(),
                            save.plan.generation);
  return detail::dcp_checkpoint_info(archive::parse_dcp_metadata(outcome.substr(2)),
                                     (folder / ".metadata").string());
}

// This rank's entries copied for a background writer: tensors into compact host copies (pinned
// where they live on a GPU, so the copy runs at the link's speed), values deep-copied, so that
// training may change the originals as soon as save_dcp_async returns.
// The host copies of the last finished asynchronous save, kept for the next one: a training
// loop saves the same tensors again and again, and memory the process has already touched is
// copied into at the speed of memory, where fresh pages cost a page fault each (measured at world
// 4, 768 MiB a rank: a stall of 1.7 s with fresh memory against a copy of 0.16 s into touched
// memory). Buffers the next save cannot use are dropped then.
std::mutex recycled_mutex;
std::vector<at::Tensor> recycled_buffers;

void recycle(DcpStateDict& copy) {
  std::vector<at::Tensor> buffers;
  for (const DcpStateDict::Entry& e : copy.entries()) {
    if (e.tensor.defined()) buffers.push_back(e.tensor);
  }
  copy = DcpStateDict();
  std::lock_guard lock(recycled_mutex);
  recycled_buffers = std::move(buffers);
}

DcpStateDict host_copy(const DcpStateDict& state) {
  std::vector<at::Tensor> pool;
  {
    std::lock_guard lock(recycled_mutex);
    pool = std::move(recycled_buffers);
    recycled_buffers.clear();
  }
  // Recycled buffers by shape and dtype (and pinned-ness), taken in order.
  auto take = [&](const at::Tensor& source) -> at::Tensor {
    for (auto it = pool.begin(); it != pool.end(); ++it) {
      if (it->sizes() == source.sizes() && it->scalar_type() == source.scalar_type() &&
          it->is_pinned() == source.is_cuda()) {
        at::Tensor buffer = std::move(*it);
        pool.erase(it);
        return buffer;
      }
    }
    return at::empty(source.sizes(), source.options()
                                         .device(at::kCPU)
                                         .pinned_memory(source.is_cuda())
                                         .memory_format(at::MemoryFormat::Contiguous));
  };
  DcpStateDict copy;
  for (const DcpStateDict::Entry& e : state.entries()) {
    DcpStateDict::Entry entry = e;
    if (e.kind == Kind::kValue) {
      entry.value = e.value.deepcopy();
    } else {
      const at::Tensor source = e.tensor.detach();
      at::Tensor host = take(source);
      host.copy_(source);
      entry.tensor = host;
    }
    copy.add_entry(std::move(entry));
  }
  return copy;  // what the pool held and this save did not use is freed here
}

}  // namespace dcp_save

// One save whose part this rank writes in the background.
struct DcpAsyncSave::State {
  dcp_save::PlannedSave save;
  DcpStateDict copy;
  std::thread writer;
  std::string report;  // set by the writer before it ends
  std::mutex mutex;    // serialises wait()
  bool finished = false;
  std::optional<DcpCheckpointInfo> info;
  std::string failure;  // the save's failure, thrown by every wait()

  pid_t owner = ::getpid();  // a process forked while this save is pending does not own it

  ~State() {
    if (::getpid() != owner) {
      // In a forked child: the writer thread is the parent's (it does not run here) and so are
      // the files. Nothing is joined or removed; the thread object is left, not destroyed.
      if (writer.joinable()) (void)new std::thread(std::move(writer));
      (void)new std::shared_ptr<dcp_save::FolderLock>(std::move(save.lock));
      return;
    }
    if (writer.joinable()) writer.join();
    if (!finished) {
      std::error_code ignored;
      std::filesystem::remove(save.data_file, ignored);
      std::fprintf(stderr,
                   "ddp: save_dcp_async(%s) was never finished (wait() or a later save was not "
                   "called): its metadata was not written and the folder's previous checkpoint "
                   "is as it was\n",
                   save.folder.c_str());
    }
  }
};

namespace {

// The save started by save_dcp_async and not yet finished, in this process: the next save (or
// the process's exit) finishes it first. Held here, not only by the handle, so that a handle
// dropped without wait() cannot leave the ranks' collectives out of step.
std::mutex pending_mutex;
std::shared_ptr<DcpAsyncSave::State> pending_save;

void finish_pending_save() {
  std::shared_ptr<DcpAsyncSave::State> previous;
  {
    std::lock_guard lock(pending_mutex);
    previous = std::move(pending_save);
  }
  // A save pending in the process this one was forked from is that process's to finish.
  if (previous && previous->owner == ::getpid()) DcpAsyncSave(previous).wait();
}

}  // namespace

DcpAsyncSave::DcpAsyncSave(std::shared_ptr<State> state) : state_(std::move(state)) {}
DcpAsyncSave::DcpAsyncSave(DcpAsyncSave&&) noexcept = default;
DcpAsyncSave& DcpAsyncSave::operator=(DcpAsyncSave&&) noexcept = default;
DcpAsyncSave::~DcpAsyncSave() = default;

const std::filesystem::path& DcpAsyncSave::folder() const {
  return state_->save.folder;
}

DcpCheckpointInfo DcpAsyncSave::wait() {
  State& s = *state_;
  if (::getpid() != s.owner) {
    throw ConfigError(fmt::format(
        "save_dcp_async({}): this save belongs to process {}, from which this one was forked; "
        "only that process can finish it",
        s.save.folder.string(), s.owner));
  }
  std::lock_guard lock(s.mutex);
  if (!s.finished) {
    if (s.writer.joinable()) s.writer.join();
    s.finished = true;
    {
      std::lock_guard pending(pending_mutex);
      if (pending_save == state_) pending_save.reset();
    }
    dcp_save::recycle(s.copy);  // written: its buffers serve the next save's copy
    try {
      s.info = dcp_save::finish_save(s.save, s.report);
    } catch (const std::exception& e) {
      s.failure = e.what();
    }
    s.save.lock.reset();  // the folder is free for the next save, whoever holds this handle
  }
  if (!s.info) throw ConfigError(s.failure);
  return *s.info;
}

DcpCheckpointInfo save_dcp(const DcpStateDict& state, const std::filesystem::path& folder,
                           const DcpSaveOptions& options) {
  finish_pending_save();
  const dcp_save::PlannedSave save = dcp_save::plan_save(state, folder, options);
  return dcp_save::finish_save(save, dcp_save::write_part(state, save));
}

DcpAsyncSave save_dcp_async(const DcpStateDict& state, const std::filesystem::path& folder,
                            const DcpSaveOptions& options) {
  finish_pending_save();
  auto s = std::make_shared<DcpAsyncSave::State>();
  s->save = dcp_save::plan_save(state, folder, options);
  s->copy = dcp_save::host_copy(state);
  s->writer =
      std::thread([raw = s.get()] { raw->report = dcp_save::write_part(raw->copy, raw->save); });
  {
    std::lock_guard lock(pending_mutex);
    pending_save = s;
  }
  return DcpAsyncSave(std::move(s));
}

DcpCheckpointInfo torch_save_to_dcp(const std::filesystem::path& file,
                                    const std::filesystem::path& folder) {
  const c10::IValue state = detail::read_pytorch_archive(file);
  if (!state.isGenericDict()) {
    throw ConfigError(fmt::format("torch_save_to_dcp: {} holds a {}, not a dict (a state dict)",
                                  file.string(), state.tagKind()));
  }
  return save_dcp(DcpStateDict::flatten(state), folder, {.no_dist = true});
}

}  // namespace ddp
