// Group lookup, group information, new_group and new_subgroups of the tensor-level API.
#include <algorithm>
#include <cstdint>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "ddp/error.h"
#include "ddp/init.h"
#include "ddp/torch/distributed.h"

namespace ddp {

ProcessGroup& GroupRef::get() const {
  if (group_ != nullptr) return *group_;
  if (holder_given_) {
    throw ConfigError(
        "the group passed is null: this rank is not a member of it (new_group returns nullptr on "
        "the ranks it does not include); call collectives of a subgroup on its members only");
  }
  if (!holder_) holder_ = default_process_group();
  if (!holder_) {
    throw ConfigError(
        "no process group: call ddp::init_process_group() first, or pass the group to use");
  }
  return *holder_;
}

int get_rank(GroupRef group) {
  return group.get().rank();
}
int get_world_size(GroupRef group) {
  return group.get().size();
}
int get_local_rank(GroupRef group) {
  return group.get().local_rank();
}
int get_local_world_size(GroupRef group) {
  return group.get().local_size();
}
bool is_initialized() {
  return default_process_group() != nullptr;
}

std::shared_ptr<ProcessGroup> new_group(std::vector<int> ranks, GroupRef group) {
  ProcessGroup& parent = group.get();
  std::sort(ranks.begin(), ranks.end());
  if (auto dup = std::adjacent_find(ranks.begin(), ranks.end()); dup != ranks.end()) {
    throw ConfigError(fmt::format("new_group: rank {} is listed twice in [{}]; list each rank once",
                                  *dup, fmt::join(ranks, ", ")));
  }
  return parent.new_group(std::move(ranks));
}

Subgroups new_subgroups(int group_size, GroupRef group) {
  ProcessGroup& parent = group.get();
  const bool by_host = group_size == 0;
  if (group_size < 0) {
    throw ConfigError(fmt::format(
        "new_subgroups: group_size is {}; pass a positive size, or 0 for one subgroup per host",
        group_size));
  }
  if (by_host) {
    // local_size() throws the same ConfigError on every rank of a backend that does not know
    // hosts. Whether the ranks are laid out host by host is judged from every rank's view, so
    // that every rank reaches the same verdict before any subgroup is made.
    group_size = parent.local_size();
    std::int64_t mine[2] = {parent.local_size(), parent.local_rank()};
    std::vector<std::int64_t> all(2 * static_cast<std::size_t>(parent.size()));
    parent.allgather(mine, all.data(), 2, DType::kInt64)->wait();
    for (int r = 0; r < parent.size(); ++r) {
      const auto size_r = all[2 * static_cast<std::size_t>(r)];
      const auto local_r = all[2 * static_cast<std::size_t>(r) + 1];
      if (size_r != group_size || local_r != r % group_size) {
        throw ConfigError(fmt::format(
            "new_subgroups: the ranks are not laid out host by host in blocks of {} (rank {} has "
            "local rank {} of {}); pass group_size explicitly",
            group_size, r, local_r, size_r));
      }
    }
  }
  if (parent.size() % group_size != 0) {
    throw ConfigError(fmt::format(
        "new_subgroups: group_size {} does not divide the group's {} ranks; pick a divisor",
        group_size, parent.size()));
  }
  Subgroups result;
  for (int first = 0; first < parent.size(); first += group_size) {
    std::vector<int> ranks(static_cast<std::size_t>(group_size));
    for (int i = 0; i < group_size; ++i)
      ranks[static_cast<std::size_t>(i)] = first + i;
    // Every rank of the parent takes part in making each subgroup (new_group is collective).
    auto subgroup = parent.new_group(ranks);
    if (subgroup) result.mine = std::move(subgroup);
    result.ranks.push_back(std::move(ranks));
  }
  return result;
}

bool is_main_process(GroupRef group) {
  try {
    return group.get().rank() == 0;
  } catch (const ConfigError&) {
    if (!is_initialized()) return true;  // a single process without a group
    throw;
  }
}

}  // namespace ddp
