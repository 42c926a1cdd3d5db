#include "ddp/torch/samplers/distributed_sampler.h"

#include <algorithm>

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <fmt/format.h>

#include "ddp/comm/process_group.h"
#include "ddp/error.h"

namespace ddp {
namespace {

std::size_t samples_per_rank(std::size_t dataset_size, int rank, int world_size,
                             const SamplerOptions& options) {
  if (world_size < 1) {
    throw ConfigError(
        fmt::format("DistributedSampler: world_size is {}; it must be at least 1", world_size));
  }
  if (rank < 0 || rank >= world_size) {
    throw ConfigError(
        fmt::format("DistributedSampler: rank is {}; it must lie in [0, {}) for world_size {}",
                    rank, world_size, world_size));
  }
  const auto world = static_cast<std::size_t>(world_size);
  if (!options.pad && !options.drop_last) {
    // Positions rank, rank + world, ... below N: ceil((N - rank) / world).
    const auto r = static_cast<std::size_t>(rank);
    return dataset_size > r ? (dataset_size - r + world - 1) / world : 0;
  }
  const bool drop_last = options.drop_last;
  // PyTorch: with drop_last, ceil((N - world) / world) when N is not a multiple, which is
  // floor(N / world); without it, ceil(N / world).
  return drop_last ? dataset_size / world : (dataset_size + world - 1) / world;
}

}  // namespace

DistributedSampler::DistributedSampler(std::size_t dataset_size, int rank, int world_size,
                                       SamplerOptions options)
    : dataset_size_(dataset_size),
      rank_(rank),
      world_size_(world_size),
      options_(options),
      num_samples_(samples_per_rank(dataset_size, rank, world_size, options)) {}

void DistributedSampler::set_epoch(std::uint64_t epoch, std::uint64_t start_offset) {
  const std::size_t remaining =
      start_offset >= dataset_size_ ? 0 : dataset_size_ - static_cast<std::size_t>(start_offset);
  // Only on a resume: a whole epoch with fewer samples than ranks keeps PyTorch's behaviour (no
  // indices), but a resume that silently drops the rest of an epoch would skip samples.
  if (options_.drop_last && start_offset > 0 && remaining > 0 &&
      remaining < static_cast<std::size_t>(world_size_)) {
    throw ConfigError(fmt::format(
        "DistributedSampler: resuming epoch {} at global offset {} leaves {} of {} samples, fewer "
        "than the world size {}, and drop_last would drop them all; resume with at most {} "
        "ranks or without drop_last",
        epoch, start_offset, remaining, dataset_size_, world_size_, remaining));
  }
  epoch_ = epoch;
  start_offset_ = start_offset;
  num_samples_ = samples_per_rank(remaining, rank_, world_size_, options_);
}

std::uint64_t DistributedSampler::consumed_after(std::uint64_t local_samples) const {
  const std::uint64_t consumed =
      start_offset_ + local_samples * static_cast<std::uint64_t>(world_size_);
  return std::min<std::uint64_t>(consumed, dataset_size_);
}

DistributedSampler::DistributedSampler(std::size_t dataset_size, const ProcessGroup& group,
                                       SamplerOptions options)
    : DistributedSampler(dataset_size, group.rank(), group.size(), options) {}

std::vector<std::int64_t> DistributedSampler::indices() const {
  const auto n = static_cast<std::int64_t>(dataset_size_);
  std::vector<std::int64_t> order(dataset_size_);
  if (options_.shuffle && n > 0) {
    // The same generator and call as PyTorch's sampler (torch.Generator().manual_seed(seed +
    // epoch); torch.randperm(n, generator=g)), so the order is the one Python would draw.
    auto generator = at::make_generator<at::CPUGeneratorImpl>(options_.seed + epoch_);
    const auto permutation =
        torch::randperm(n, generator, torch::TensorOptions().dtype(torch::kInt64)).contiguous();
    const auto* values = permutation.data_ptr<std::int64_t>();
    order.assign(values, values + n);
  } else {
    for (std::int64_t i = 0; i < n; ++i)
      order[static_cast<std::size_t>(i)] = i;
  }

  // Resumed mid-epoch: the first start_offset_ positions are done; the rest is dealt as a whole
  // epoch would be.
  const std::size_t skip = std::min<std::size_t>(start_offset_, dataset_size_);
  const std::size_t remaining = dataset_size_ - skip;
  // Rank r reads positions r, r + world, ... of the order, padded by repeating it from the start
  // (drop_last instead cuts total_size() short of N, so no padding is needed then).
  const std::size_t total = options_.pad || options_.drop_last ? total_size() : remaining;
  const auto world = static_cast<std::size_t>(world_size_);
  std::vector<std::int64_t> mine;
  mine.reserve(num_samples_);
  for (std::size_t position = static_cast<std::size_t>(rank_); position < total;
       position += world) {
    mine.push_back(order[skip + position % remaining]);
  }
  return mine;
}

}  // namespace ddp
