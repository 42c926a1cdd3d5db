// DataLoaderSampler: ddp::DistributedSampler as a sampler of libtorch's DataLoader.
//
//   auto pg = ddp::init_process_group();
//   auto dataset = MyDataset(...).map(torch::data::transforms::Stack<>());
//   ddp::DataLoaderSampler sampler(dataset.size().value(), *pg, {.shuffle = true, .seed = 42});
//   auto loader = torch::data::make_data_loader(dataset, sampler,
//                                               torch::data::DataLoaderOptions(64));
//   for (std::uint64_t epoch = 0; epoch < epochs; ++epoch) {
//     sampler.set_epoch(epoch);               // or set_epoch(epoch, offset) to resume mid-epoch
//     for (auto& batch : *loader) { ... }     // this rank's share, batch_size samples at a time
//   }
//
// make_data_loader takes its sampler by value: copies of a DataLoaderSampler share one state, so
// set_epoch on the caller's copy chooses the order the loader's copy deals (the same indices, in
// the same order, as DistributedSampler::indices(), i.e. as PyTorch's DistributedSampler). Each
// pass over the loader (its begin(), which calls reset()) deals the current epoch from its start.
//
// Built with an explicit rank and world size while a default process group exists of another
// size, reset() throws ConfigError naming both (the sampler would deal each rank a share of the
// wrong size); build it from the group instead. A reset() with a new dataset size (a stateful
// loader's) other than the sampler's is a ConfigError too.
//
// Threads: as libtorch's samplers, used from the loader's thread; set_epoch between epochs only.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include <torch/data/samplers/base.h>
#include <torch/types.h>

#include "ddp/torch/samplers/distributed_sampler.h"

// Exported by ddp's shared libraries, which hide the rest (src/CMakeLists.txt).
#pragma GCC visibility push(default)
namespace ddp {

class DataLoaderSampler : public torch::data::samplers::Sampler<std::vector<std::size_t>> {
 public:
  DataLoaderSampler(std::size_t dataset_size, const ProcessGroup& group,
                    SamplerOptions options = {});
  DataLoaderSampler(std::size_t dataset_size, int rank, int world_size,
                    SamplerOptions options = {});

  // As DistributedSampler::set_epoch; takes effect at the loader's next pass.
  void set_epoch(std::uint64_t epoch, std::uint64_t start_offset = 0);
  // The shared DistributedSampler (epoch, size(), consumed_after() for TrainState).
  const DistributedSampler& sampler() const;
  // Indices dealt since the last reset() (e.g. batches * batch_size, the last one maybe short).
  std::size_t dealt() const;

  // torch::data::samplers::Sampler.
  void reset(torch::optional<std::size_t> new_size = torch::nullopt) override;
  torch::optional<std::vector<std::size_t>> next(std::size_t batch_size) override;
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;

 private:
  struct State;
  std::shared_ptr<State> state_;
};

}  // namespace ddp
#pragma GCC visibility pop
