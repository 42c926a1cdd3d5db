// MeshTrainState: TrainState (train_state.h) for a model split over a DeviceMesh (tensor and
// pipeline parallelism, replicated over data-parallel dimensions), whose parts no rank holds all
// of. A checkpoint is a folder:
//
//   ddp::MeshTrainState state(mesh, pipe.stage_module(), optimizer, {.tag = "gpt"});
//   if (resume) progress = state.load(dir);     // every rank
//   ...; state.save(dir, progress);             // every rank (collective over the mesh)
//
// save: rank 0 removes DIR/mesh.pt; the ranks at coordinate 0 of every replicated dimension
// (default {"dp"}) each write their part, DIR/part-<dim><coordinate>-....pt over the other
// dimensions (e.g. part-pp1-tp0.pt), with TrainState (parameters, buffers, optimizer state,
// progress, torch's generator; atomic, checksummed); once every part is complete rank 0 writes
// DIR/mesh.pt (the split dimensions, the replicated ones, the tag). A save that fails part-way
// leaves no mesh.pt; an error on any rank is thrown on every rank.
//
// load: reads DIR/mesh.pt; the split dimensions (names and sizes) must be this mesh's, otherwise
// Error naming both ("resharding a split model is not built"); the replicated dimensions may
// differ (every replica holds the same part), so a run may resume with another dp size. Then
// each rank loads its part (TrainState::load: checksums, tag, shapes checked before anything
// changes). Not collective.
//
// `group` is the group the mesh was built over (default: the default group).
#pragma once

#include <filesystem>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "ddp/torch/api/distributed.h"
#include "ddp/torch/checkpoint/train_state.h"
#include "ddp/torch/parallel/mesh/device_mesh.h"

// Exported by ddp's shared libraries, which hide the rest (src/CMakeLists.txt).
#pragma GCC visibility push(default)
namespace ddp {

struct MeshTrainStateOptions {
  std::string tag;  // as TrainStateOptions::tag
  // Dimensions over which the parts are replicas (data parallelism).
  std::vector<std::string> replicated_dims = {"dp"};
};

class MeshTrainState {
 public:
  // ConfigError: a replicated dimension the mesh does not have, or a group whose size is not the
  // mesh's.
  MeshTrainState(const DeviceMesh& mesh, torch::nn::Module& part,
                 torch::optim::Optimizer& optimizer, MeshTrainStateOptions options = {},
                 GroupRef group = {});

  void save(const std::filesystem::path& dir, const TrainProgress& progress) const;
  TrainProgress load(const std::filesystem::path& dir);

  // This rank's part file in `dir`, and the split dimensions as "pp=2, tp=2".
  std::filesystem::path part_path(const std::filesystem::path& dir) const;
  std::string split_description() const;

 private:
  bool writes_part() const;

  const DeviceMesh& mesh_;
  torch::nn::Module& part_;
  torch::optim::Optimizer& optimizer_;
  MeshTrainStateOptions options_;
  GroupRef group_;
};

}  // namespace ddp
#pragma GCC visibility pop
