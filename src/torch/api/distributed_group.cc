// Group lookup, group information, new_group and new_subgroups of the tensor-level API.
#include <algorithm>
#include <cstdint>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "ddp/error.h"
#include "ddp/runtime/init.h"
#include "ddp/torch/api/distributed.h"
#include "torch/api/rank_agreement.h"

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

std::shared_ptr<ProcessGroup> default_process_group_for(const c10::Device& device) {
  if (device.is_cuda()) {
    if (auto cuda = default_cuda_process_group()) return cuda;
  }
  return default_process_group();
}

ProcessGroup& GroupRef::get_for(const torch::Tensor& tensor) const {
  if (group_ != nullptr || holder_given_ || !tensor.defined() || !tensor.is_cuda()) return get();
  if (!holder_) holder_ = default_process_group_for(tensor.device());
  return get();
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

namespace {

// What is wrong with `split_ranks` for a group of `size` ranks, or "" when nothing is.
std::string split_problem(const std::vector<std::vector<int>>& split_ranks, int size) {
  std::vector<int> owner(static_cast<std::size_t>(size), -1);
  for (std::size_t k = 0; k < split_ranks.size(); ++k) {
    if (split_ranks[k].empty()) {
      return fmt::format("split_group: split {} is empty; every split needs at least one rank", k);
    }
    for (int r : split_ranks[k]) {
      if (r < 0 || r >= size) {
        return fmt::format(
            "split_group: split {} names rank {}, which is not a rank of the "
            "group (ranks 0..{})",
            k, r, size - 1);
      }
      auto& first = owner[static_cast<std::size_t>(r)];
      if (first >= 0) {
        return first == static_cast<int>(k)
                   ? fmt::format("split_group: split {} names rank {} twice", k, r)
                   : fmt::format(
                         "split_group: rank {} is in split {} and in split {}; splits "
                         "must not overlap",
                         r, first, k);
      }
      first = static_cast<int>(k);
    }
  }
  return "";
}

std::string describe_splits(const std::vector<std::vector<int>>& split_ranks) {
  std::string text;
  for (std::size_t k = 0; k < split_ranks.size(); ++k) {
    text += fmt::format("split {}: [{}]\n", k, fmt::join(split_ranks[k], ", "));
  }
  return text.empty() ? "no splits\n" : text;
}

}  // namespace

std::shared_ptr<ProcessGroup> split_group(const std::vector<std::vector<int>>& split_ranks,
                                          GroupRef group) {
  ProcessGroup& parent = group.get();
  detail::require_agreement(parent, describe_splits(split_ranks),
                            split_problem(split_ranks, parent.size()), "the split", "split_group",
                            "splits");
  std::shared_ptr<ProcessGroup> mine;
  for (const auto& split : split_ranks) {
    std::vector<int> ranks = split;
    std::sort(ranks.begin(), ranks.end());
    // Every rank of the parent takes part in making each subgroup (new_group is collective).
    auto subgroup = parent.new_group(std::move(ranks));
    if (subgroup) mine = std::move(subgroup);
  }
  return mine;
}

std::vector<int> get_process_group_ranks(GroupRef group) {
  return group.get().world_ranks();
}

int get_global_rank(GroupRef group, int group_rank) {
  const ProcessGroup& g = group.get();
  if (group_rank < 0 || group_rank >= g.size()) {
    throw ConfigError(
        fmt::format("get_global_rank: {} is not a rank of the group, whose ranks are 0..{}",
                    group_rank, g.size() - 1));
  }
  return g.world_ranks()[static_cast<std::size_t>(group_rank)];
}

int get_group_rank(GroupRef group, int global_rank) {
  const auto& world = group.get().world_ranks();
  const auto it = std::find(world.begin(), world.end(), global_rank);
  if (it == world.end()) {
    throw ConfigError(fmt::format(
        "get_group_rank: world rank {} is not in the group, whose ranks are world ranks [{}]",
        global_rank, fmt::join(world, ", ")));
  }
  return static_cast<int>(it - world.begin());
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
