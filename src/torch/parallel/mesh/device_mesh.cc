#include "ddp/torch/parallel/mesh/device_mesh.h"

#include <algorithm>
#include <cstdint>
#include <set>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "ddp/error.h"
#include "torch/api/rank_agreement.h"

namespace ddp {

namespace {

// The first thing wrong with `shape` for a group of `group_size` ranks; empty when it is fine.
std::string shape_problem(const std::vector<MeshDimension>& shape, int group_size) {
  if (shape.empty()) {
    return "DeviceMesh: the shape has no dimensions; pass at least one, e.g. {{\"dp\", 2}}";
  }
  std::set<std::string> seen;
  std::int64_t product = 1;
  for (std::size_t d = 0; d < shape.size(); ++d) {
    const auto& dim = shape[d];
    if (dim.name.empty()) {
      return fmt::format("DeviceMesh: dimension {} has an empty name; name every dimension", d);
    }
    if (!seen.insert(dim.name).second) {
      return fmt::format(
          "DeviceMesh: the dimension name \"{}\" is used twice; give each "
          "dimension its own name",
          dim.name);
    }
    if (dim.size < 1) {
      return fmt::format("DeviceMesh: dimension \"{}\" has size {}; sizes must be at least 1",
                         dim.name, dim.size);
    }
    product *= dim.size;
  }
  if (product != group_size) {
    std::vector<std::string> parts;
    for (const auto& dim : shape)
      parts.push_back(fmt::format("{}={}", dim.name, dim.size));
    return fmt::format(
        "DeviceMesh: the shape ({}) holds {} ranks but the group has {}; make the product of the "
        "sizes equal the number of ranks (launch {} processes, or change the shape)",
        fmt::join(parts, ", "), product, group_size, product);
  }
  return {};
}

std::string describe_shape(const std::vector<MeshDimension>& shape) {
  std::vector<std::string> parts;
  for (const auto& dim : shape)
    parts.push_back(fmt::format("{}={}", dim.name, dim.size));
  return fmt::format("mesh shape ({})", fmt::join(parts, ", "));
}

}  // namespace

DeviceMesh::DeviceMesh(std::vector<MeshDimension> shape, GroupRef group) {
  ProcessGroup& parent = group.get();
  // Every rank judges its shape, then all compare: a rank with a bad or different shape makes every
  // rank throw here instead of leaving the others waiting in new_group.
  detail::require_agreement(parent, describe_shape(shape), shape_problem(shape, parent.size()),
                            "the mesh", "DeviceMesh", "shapes");

  for (auto& dim : shape) {
    names_.push_back(std::move(dim.name));
    sizes_.push_back(dim.size);
  }
  rank_ = parent.rank();
  ranks_.resize(static_cast<std::size_t>(parent.size()));
  for (std::size_t r = 0; r < ranks_.size(); ++r)
    ranks_[r] = static_cast<int>(r);
  coordinate_.assign(sizes_.size(), 0);
  for (int d = ndim() - 1, rest = rank_; d >= 0; --d) {
    coordinate_[static_cast<std::size_t>(d)] = rest % sizes_[static_cast<std::size_t>(d)];
    rest /= sizes_[static_cast<std::size_t>(d)];
  }

  // Every slice of every dimension, in the same order on every rank: new_group is collective over
  // the parent (all its members take part in making each subgroup) and names subgroups by order.
  groups_.resize(sizes_.size());
  for (std::size_t d = 0; d < sizes_.size(); ++d) {
    // The slices along d are indexed by the coordinates along the other dimensions: enumerate every
    // grid position with coordinate 0 along d, in row-major order.
    for (std::size_t start = 0; start < ranks_.size(); ++start) {
      std::vector<int> position(sizes_.size());
      for (int e = ndim() - 1, rest = static_cast<int>(start); e >= 0; --e) {
        position[static_cast<std::size_t>(e)] = rest % sizes_[static_cast<std::size_t>(e)];
        rest /= sizes_[static_cast<std::size_t>(e)];
      }
      if (position[d] != 0) continue;
      std::vector<int> slice;
      for (int i = 0; i < sizes_[d]; ++i) {
        position[d] = i;
        slice.push_back(rank_of(position));
      }
      auto made = new_group(slice, parent);
      if (made) groups_[d] = std::move(made);
    }
  }
}

std::size_t DeviceMesh::index_of(const std::string& name) const {
  const auto it = std::find(names_.begin(), names_.end(), name);
  if (it == names_.end()) {
    throw ConfigError(fmt::format("{} has no dimension \"{}\"; its dimensions are {}", describe(),
                                  name, fmt::join(names_, ", ")));
  }
  return static_cast<std::size_t>(it - names_.begin());
}

int DeviceMesh::size() const {
  return static_cast<int>(ranks_.size());
}

int DeviceMesh::size(const std::string& name) const {
  return sizes_[index_of(name)];
}

bool DeviceMesh::has_dim(const std::string& name) const {
  return std::find(names_.begin(), names_.end(), name) != names_.end();
}

int DeviceMesh::coordinate(const std::string& name) const {
  return coordinate_[index_of(name)];
}

int DeviceMesh::rank_of(const std::vector<int>& coordinate) const {
  if (coordinate.size() != sizes_.size()) {
    throw ConfigError(fmt::format("{}: rank_of needs {} coordinates, got {} ([{}])", describe(),
                                  sizes_.size(), coordinate.size(), fmt::join(coordinate, ", ")));
  }
  std::size_t flat = 0;
  for (std::size_t d = 0; d < sizes_.size(); ++d) {
    if (coordinate[d] < 0 || coordinate[d] >= sizes_[d]) {
      throw ConfigError(fmt::format("{}: coordinate {} along \"{}\" is outside 0..{}", describe(),
                                    coordinate[d], names_[d], sizes_[d] - 1));
    }
    flat = flat * static_cast<std::size_t>(sizes_[d]) + static_cast<std::size_t>(coordinate[d]);
  }
  return ranks_[flat];
}

std::vector<int> DeviceMesh::slice_ranks(const std::string& name) const {
  const auto d = index_of(name);
  auto position = coordinate_;
  std::vector<int> ranks;
  for (int i = 0; i < sizes_[d]; ++i) {
    position[d] = i;
    ranks.push_back(rank_of(position));
  }
  return ranks;
}

const std::shared_ptr<ProcessGroup>& DeviceMesh::group(const std::string& name) const {
  return groups_[index_of(name)];
}

DeviceMesh DeviceMesh::sub_mesh(const std::vector<std::string>& names) const {
  if (names.empty()) {
    throw ConfigError(fmt::format("{}: sub_mesh needs at least one dimension name", describe()));
  }
  std::vector<std::size_t> kept;
  for (const auto& name : names) {
    const auto d = index_of(name);
    if (!kept.empty() && d <= kept.back()) {
      throw ConfigError(fmt::format(
          "{}: sub_mesh({}) names a dimension twice or out of order; name them in the mesh's "
          "order ({})",
          describe(), fmt::join(names, ", "), fmt::join(names_, ", ")));
    }
    kept.push_back(d);
  }
  DeviceMesh sub;
  sub.rank_ = rank_;
  std::size_t sub_size = 1;
  for (const auto d : kept) {
    sub.names_.push_back(names_[d]);
    sub.sizes_.push_back(sizes_[d]);
    sub.coordinate_.push_back(coordinate_[d]);
    sub.groups_.push_back(groups_[d]);
    sub_size *= static_cast<std::size_t>(sizes_[d]);
  }
  // The sub-grid through this rank, row-major over the kept dimensions.
  for (std::size_t flat = 0; flat < sub_size; ++flat) {
    auto position = coordinate_;
    for (std::size_t k = kept.size(), rest = flat; k-- > 0;) {
      position[kept[k]] = static_cast<int>(rest % static_cast<std::size_t>(sizes_[kept[k]]));
      rest /= static_cast<std::size_t>(sizes_[kept[k]]);
    }
    sub.ranks_.push_back(rank_of(position));
  }
  return sub;
}

std::string DeviceMesh::describe() const {
  std::vector<std::string> parts;
  for (std::size_t d = 0; d < names_.size(); ++d)
    parts.push_back(fmt::format("{}={}", names_[d], sizes_[d]));
  return fmt::format("DeviceMesh({})", fmt::join(parts, ", "));
}

}  // namespace ddp
