// What save_dcp's phases share (distributed_checkpoint_save.cc runs them): the entries' checks
// (dcp_state_dict.cc), the global plan every rank computes alike and the metadata it becomes
// (dcp_save_plan.cc), and the files: data files, CRCs of replicas, the metadata's atomic commit,
// the folder's lock (dcp_save_files.cc). Internal to ddp_torch.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "archive/dcp_metadata.h"
#include "ddp/torch/checkpoint/distributed_checkpoint_save.h"

namespace ddp::dcp_save {  // named: DcpAsyncSave::State holds its types

using json = nlohmann::json;
using Kind = DcpStateDict::Entry::Kind;

// ---- Entries (dcp_state_dict.cc) -------------------------------------------------------------

// A path in the nested state dict as flatten names it ("optim.state.0").
std::string path_text(const std::vector<DcpPathKey>& path);
// ConfigError for a tensor a distributed checkpoint cannot hold, naming `name`.
void check_tensor(const at::Tensor& tensor, const std::string& name);
// check_tensor, and ConfigError where the shard is not inside its global shape.
void check_shard(const std::string& name, const at::Tensor& local,
                 const std::vector<std::int64_t>& offsets,
                 const std::vector<std::int64_t>& global_shape);

// ---- The plan (dcp_save_plan.cc) -------------------------------------------------------------

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

// This rank's entries (or the error that keeps it out of the save) as the ranks exchange them.
std::string local_plan(const DcpStateDict& state, const std::string& error,
                       std::uint64_t generation);
// The same on every rank: it depends only on every rank's local plan. ConfigError, naming
// `folder`, for a plan that is wrong (nothing is written then).
GlobalPlan global_plan(const std::vector<std::string>& plans, const std::filesystem::path& folder);
// ConfigError: "save_dcp(<folder>): <what>; nothing was written".
[[noreturn]] void refuse_plan(const std::filesystem::path& folder, const std::string& what);
// The metadata of `plan` with each item's storage, and its encoding checked by the reader.
archive::DcpMetadata metadata_of(const GlobalPlan& plan,
                                 const std::vector<archive::DcpStorage>& storage);
std::string checked_metadata(const archive::DcpMetadata& metadata);

// ---- Files (dcp_save_files.cc) ---------------------------------------------------------------

std::string system_error_text(int error);
// The first n such that no `__<rank>_<n>.distcp` is in the folder (0 in a new folder).
std::uint64_t next_generation(const std::filesystem::path& folder);
// fsync of a file or folder opened with `flags`; ConfigError naming it on failure.
void sync_path(const std::filesystem::path& path, int flags);
// The CRC-32 of every item this rank holds together with another rank, by item index.
std::vector<std::pair<std::size_t, std::uint32_t>> replica_crcs(const DcpStateDict& state,
                                                                const GlobalPlan& plan, int rank);
// The items whose holders reported different CRCs, named ("" where none), at most `shown`.
std::string differing_replicas(const GlobalPlan& plan,
                               const std::vector<std::map<std::size_t, std::uint32_t>>& crcs,
                               std::size_t shown = 3);
// Writes this rank's items into `file` (synced); returns where each item's bytes lie.
std::map<std::size_t, archive::DcpStorage> write_items(const DcpStateDict& state,
                                                       const GlobalPlan& plan, int rank,
                                                       const std::filesystem::path& file);
// `.metadata` through `.metadata.tmp`, synced and renamed, the folder synced.
void write_metadata(const std::filesystem::path& folder, const std::string& bytes);
// After the commit: this rank's data files of other generations than `generation` (and on rank
// 0 those of ranks beyond `world`), by their pattern only.
void remove_earlier_data_files(const std::filesystem::path& folder, int rank, int world,
                               std::uint64_t generation);

// Rank 0's claim on the folder for one save: `.dcp-save.lock`, made with O_EXCL, removed when the
// save ends. Two jobs saving into one folder would pick the same data file names and overwrite
// each other's; the second is refused instead, naming the first. A lock left by a process of this
// host that no longer runs (killed mid-save) is taken over; one from another host is named.
class FolderLock {
 public:
  explicit FolderLock(const std::filesystem::path& folder);
  FolderLock(const FolderLock&) = delete;
  FolderLock& operator=(const FolderLock&) = delete;
  ~FolderLock();

 private:
  static std::string host_name();
  std::string read_owner() const;
  static bool owner_is_gone(const std::string& owner);

  std::filesystem::path path_;
};

}  // namespace ddp::dcp_save
