#include "ddp/torch/parallel/mesh/mesh_train_state.h"

#include <algorithm>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "ddp/error.h"
#include "ddp/torch/checkpoint/checkpoint.h"
#include "torch/api/rank_agreement.h"

namespace ddp {

namespace {

constexpr const char* kManifest = "mesh.pt";

}  // namespace

MeshTrainState::MeshTrainState(const DeviceMesh& mesh, torch::nn::Module& part,
                               torch::optim::Optimizer& optimizer, MeshTrainStateOptions options,
                               GroupRef group)
    : mesh_(mesh),
      part_(part),
      optimizer_(optimizer),
      options_(std::move(options)),
      group_(std::move(group)) {
  for (const auto& name : options_.replicated_dims) {
    if (!mesh_.has_dim(name)) {
      throw ConfigError(fmt::format(
          "MeshTrainState: the replicated dimension '{}' is not one of {}'s; name the mesh's "
          "data-parallel dimensions (or none)",
          name, mesh_.describe()));
    }
  }
  if (group_.get().size() != mesh_.size()) {
    throw ConfigError(fmt::format(
        "MeshTrainState: the group has {} ranks but {} has {}; give the group the mesh was built "
        "over",
        group_.get().size(), mesh_.describe(), mesh_.size()));
  }
}

std::string MeshTrainState::split_description() const {
  std::vector<std::string> parts;
  for (std::size_t d = 0; d < mesh_.dim_names().size(); ++d) {
    const auto& name = mesh_.dim_names()[d];
    if (std::find(options_.replicated_dims.begin(), options_.replicated_dims.end(), name) !=
        options_.replicated_dims.end()) {
      continue;
    }
    parts.push_back(fmt::format("{}={}", name, mesh_.shape()[d]));
  }
  return parts.empty() ? std::string("(none)") : fmt::format("{}", fmt::join(parts, ", "));
}

std::filesystem::path MeshTrainState::part_path(const std::filesystem::path& dir) const {
  std::string name = "part";
  for (std::size_t d = 0; d < mesh_.dim_names().size(); ++d) {
    const auto& dim = mesh_.dim_names()[d];
    if (std::find(options_.replicated_dims.begin(), options_.replicated_dims.end(), dim) !=
        options_.replicated_dims.end()) {
      continue;
    }
    name += fmt::format("-{}{}", dim, mesh_.coordinate()[d]);
  }
  return dir / (name + ".pt");
}

bool MeshTrainState::writes_part() const {
  return std::all_of(options_.replicated_dims.begin(), options_.replicated_dims.end(),
                     [&](const std::string& dim) { return mesh_.coordinate(dim) == 0; });
}

void MeshTrainState::save(const std::filesystem::path& dir, const TrainProgress& progress) const {
  ProcessGroup& group = group_.get();
  const bool leader = group.rank() == 0;
  std::string failure;
  if (leader) {
    try {
      std::filesystem::create_directories(dir);
      std::filesystem::remove(dir / kManifest);  // no complete checkpoint until the parts are
    } catch (const std::exception& e) {
      failure = e.what();
    }
  }
  detail::raise_if_any_rank_failed(group, failure, "MeshTrainState: preparing " + dir.string());
  if (writes_part()) {
    try {
      TrainState(part_, optimizer_, {.tag = options_.tag})
          .save(part_path(dir), progress, group.size());
    } catch (const std::exception& e) {
      failure = e.what();
    }
  }
  detail::raise_if_any_rank_failed(group, failure,
                                   "MeshTrainState: writing the parts of " + dir.string());
  if (leader) {
    try {
      torch::serialize::OutputArchive manifest;
      manifest.write("split", c10::IValue(split_description()));
      manifest.write("tag", c10::IValue(options_.tag));
      save_archive_atomically(manifest, dir / kManifest);
    } catch (const std::exception& e) {
      failure = e.what();
    }
  }
  detail::raise_if_any_rank_failed(group, failure,
                                   "MeshTrainState: writing " + (dir / kManifest).string());
}

TrainProgress MeshTrainState::load(const std::filesystem::path& dir) {
  const auto manifest_path = dir / kManifest;
  if (!std::filesystem::exists(manifest_path)) {
    throw Error(fmt::format(
        "MeshTrainState: {} has no {}: not a split-model checkpoint, or its save did not complete",
        dir.string(), kManifest));
  }
  auto manifest = load_archive(manifest_path);
  c10::IValue split, tag;
  manifest.read("split", split);
  manifest.read("tag", tag);
  if (tag.toStringRef() != options_.tag) {
    throw Error(fmt::format("MeshTrainState: {} was saved for '{}', not '{}'",
                            manifest_path.string(), tag.toStringRef(), options_.tag));
  }
  if (split.toStringRef() != split_description()) {
    throw Error(fmt::format(
        "MeshTrainState: {} was saved with the model split {} but this mesh splits it {}; resume "
        "on the same split (the data-parallel size may differ; resharding a split model is not "
        "built)",
        dir.string(), split.toStringRef(), split_description()));
  }
  return TrainState(part_, optimizer_, {.tag = options_.tag}).load(part_path(dir));
}

}  // namespace ddp
