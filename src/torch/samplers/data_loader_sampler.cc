#include "ddp/torch/samplers/data_loader_sampler.h"

#include <algorithm>

#include <fmt/format.h>
#include <torch/serialize/archive.h>

#include "ddp/comm/process_group.h"
#include "ddp/error.h"
#include "ddp/runtime/init.h"

namespace ddp {

struct DataLoaderSampler::State {
  DistributedSampler sampler;
  // Built from a group: that group's size is the world; no check against the default group.
  bool from_group = false;
  std::vector<std::int64_t> epoch_indices;
  std::size_t position = 0;
};

DataLoaderSampler::DataLoaderSampler(std::size_t dataset_size, const ProcessGroup& group,
                                     SamplerOptions options)
    : state_(std::make_shared<State>(State{
          .sampler = DistributedSampler(dataset_size, group, options), .from_group = true})) {}

DataLoaderSampler::DataLoaderSampler(std::size_t dataset_size, int rank, int world_size,
                                     SamplerOptions options)
    : state_(std::make_shared<State>(
          State{.sampler = DistributedSampler(dataset_size, rank, world_size, options)})) {}

void DataLoaderSampler::set_epoch(std::uint64_t epoch, std::uint64_t start_offset) {
  state_->sampler.set_epoch(epoch, start_offset);
}

const DistributedSampler& DataLoaderSampler::sampler() const {
  return state_->sampler;
}

std::size_t DataLoaderSampler::dealt() const {
  return state_->position;
}

void DataLoaderSampler::reset(torch::optional<std::size_t> new_size) {
  auto& state = *state_;
  if (new_size && *new_size != state.sampler.dataset_size()) {
    throw ConfigError(fmt::format(
        "DataLoaderSampler: the data loader reset it for a dataset of {} samples, but it was "
        "built for {}; build the sampler from the dataset's size (dataset.size().value())",
        *new_size, state.sampler.dataset_size()));
  }
  if (!state.from_group) {
    if (const auto group = default_process_group();
        group && group->size() != state.sampler.world_size()) {
      throw ConfigError(fmt::format(
          "DataLoaderSampler: built for rank {} of a world of {}, but the default process group "
          "has {} ranks, so each rank would train on a share of the wrong size; build it from "
          "the group: ddp::DataLoaderSampler(dataset_size, *group, options)",
          state.sampler.rank(), state.sampler.world_size(), group->size()));
    }
  }
  state.epoch_indices = state.sampler.indices();
  state.position = 0;
}

torch::optional<std::vector<std::size_t>> DataLoaderSampler::next(std::size_t batch_size) {
  auto& state = *state_;
  if (batch_size == 0) {
    throw ConfigError("DataLoaderSampler: a batch size of 0 was asked for; use at least 1");
  }
  if (state.position >= state.epoch_indices.size()) return torch::nullopt;
  const std::size_t count = std::min(batch_size, state.epoch_indices.size() - state.position);
  std::vector<std::size_t> batch(count);
  for (std::size_t i = 0; i < count; ++i) {
    batch[i] = static_cast<std::size_t>(state.epoch_indices[state.position + i]);
  }
  state.position += count;
  return batch;
}

void DataLoaderSampler::save(torch::serialize::OutputArchive& archive) const {
  const auto& s = state_->sampler;
  archive.write(
      "ddp_sampler_state",
      torch::tensor(
          {static_cast<std::int64_t>(s.dataset_size()), static_cast<std::int64_t>(s.world_size()),
           static_cast<std::int64_t>(s.epoch()), static_cast<std::int64_t>(s.start_offset()),
           static_cast<std::int64_t>(state_->position)},
          torch::kInt64),
      /*is_buffer=*/true);
}

void DataLoaderSampler::load(torch::serialize::InputArchive& archive) {
  torch::Tensor saved;
  archive.read("ddp_sampler_state", saved, /*is_buffer=*/true);
  auto& state = *state_;
  if (!saved.defined() || saved.numel() != 5 || saved.scalar_type() != torch::kInt64) {
    throw ConfigError("DataLoaderSampler::load: the archive holds no DataLoaderSampler state");
  }
  const auto* v = saved.data_ptr<std::int64_t>();
  if (static_cast<std::size_t>(v[0]) != state.sampler.dataset_size() ||
      v[1] != state.sampler.world_size()) {
    throw ConfigError(fmt::format(
        "DataLoaderSampler::load: the saved sampler dealt {} samples over {} ranks; this one "
        "deals {} over {}. Resume at the saved world size with the same dataset, or resume by "
        "global offset with set_epoch(epoch, offset)",
        v[0], v[1], state.sampler.dataset_size(), state.sampler.world_size()));
  }
  state.sampler.set_epoch(static_cast<std::uint64_t>(v[2]), static_cast<std::uint64_t>(v[3]));
  state.epoch_indices = state.sampler.indices();
  state.position = std::min(static_cast<std::size_t>(v[4]), state.epoch_indices.size());
}

}  // namespace ddp
