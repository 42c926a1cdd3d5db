// DeviceMesh: the ranks of a group laid out as an N-dimensional grid with named dimensions, and a
// process group per slice along each dimension (PyTorch's init_device_mesh / DeviceMesh).
//
//   auto pg = ddp::init_process_group();                       // 4 ranks
//   ddp::DeviceMesh mesh({{"dp", 2}, {"tp", 2}});              // collective over the default group
//   auto tp = mesh.group("tp");       // this rank's tp slice: ranks {0,1} or {2,3}
//   auto dp = mesh.group("dp");       // this rank's dp slice: ranks {0,2} or {1,3}
//   mesh.coordinate();                // rank 3 -> {1, 1};  mesh.rank_of({1, 0}) == 2
//   ddp::DeviceMesh tp_mesh = mesh["tp"];  // the 1-D sub-mesh of this rank's tp slice
//
// Layout: row-major, the last dimension fastest, as PyTorch's: rank = sum_d coordinate[d] *
// stride[d]. A slice along dimension d is the ranks whose coordinates differ only in d; its group
// numbers them by their coordinate along d (group(d)->rank() == coordinate(d)).
//
// Construction is collective over `group`: every rank calls it with the same shape, in the same
// order relative to the group's other calls. It checks the shape on every rank together (one small
// allgather), then makes every slice's group through ddp::new_group, each dimension in order and
// each slice of it in row-major order, on every rank (new_group is collective over the parent and
// numbers its subgroups by call order). Bad input is a ConfigError on every rank, naming what was
// wrong and what to do: an empty shape, an empty or repeated name, a size below 1, a product of
// sizes other than the group's size, ranks that pass different shapes. A sub-mesh shares its
// parent's groups and makes none (no communication). Accessors throw ConfigError for an unknown
// dimension name, naming the mesh's dimensions. Not thread-safe while being built; the accessors
// are const and may be called from any thread.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "ddp/comm/process_group.h"
#include "ddp/torch/api/distributed.h"

// Exported by ddp's shared libraries, which hide the rest (src/CMakeLists.txt).
#pragma GCC visibility push(default)
namespace ddp {

// One dimension of a mesh: its name ("dp", "tp", "pp", ...) and how many ranks lie along it.
struct MeshDimension {
  std::string name;
  int size = 0;
};

class DeviceMesh {
 public:
  // Lays the ranks of `group` (default: the default group) out as `shape`. Collective (above).
  explicit DeviceMesh(std::vector<MeshDimension> shape, GroupRef group = {});

  int ndim() const { return static_cast<int>(names_.size()); }
  const std::vector<std::string>& dim_names() const { return names_; }
  const std::vector<int>& shape() const { return sizes_; }
  // The number of ranks in the mesh, and along one dimension.
  int size() const;
  int size(const std::string& name) const;
  // Whether the mesh has a dimension called `name`.
  bool has_dim(const std::string& name) const;

  // This rank's coordinate (one entry per dimension), and along one dimension.
  const std::vector<int>& coordinate() const { return coordinate_; }
  int coordinate(const std::string& name) const;
  // This rank, and the rank at `coordinate`, as ranks of the group the mesh was built over (for a
  // sub-mesh: of its root mesh's group). ConfigError for a coordinate of the wrong length or
  // outside the shape.
  int rank() const { return rank_; }
  int rank_of(const std::vector<int>& coordinate) const;
  // The ranks (of the root group) of this rank's slice along `name`, in coordinate order.
  std::vector<int> slice_ranks(const std::string& name) const;

  // The group of this rank's slice along `name` (never null; size(name) ranks).
  const std::shared_ptr<ProcessGroup>& group(const std::string& name) const;

  // The sub-mesh of the dimensions `names` (in the parent's order) through this rank: the ranks
  // whose coordinates along the other dimensions equal this rank's. PyTorch's mesh["tp"] and
  // mesh["dp", "tp"]. Shares the parent's groups.
  DeviceMesh sub_mesh(const std::vector<std::string>& names) const;
  DeviceMesh operator[](const std::string& name) const { return sub_mesh({name}); }

  // "DeviceMesh(dp=2, tp=2)", for messages.
  std::string describe() const;

 private:
  DeviceMesh() = default;
  std::size_t index_of(const std::string& name) const;

  std::vector<std::string> names_;
  std::vector<int> sizes_;
  std::vector<int> ranks_;       // the root group's rank at each grid position, row-major
  std::vector<int> coordinate_;  // this rank's
  int rank_ = 0;                 // this rank in the root group
  std::vector<std::shared_ptr<ProcessGroup>> groups_;  // this rank's slice group, per dimension
};

}  // namespace ddp
#pragma GCC visibility pop
