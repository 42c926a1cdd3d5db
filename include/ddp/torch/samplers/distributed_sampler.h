// DistributedSampler: which samples of a dataset this rank trains on in each epoch.
//
//   ddp::DistributedSampler sampler(dataset_size, *pg, {.shuffle = true, .seed = 42});
//   for (int epoch = 0; epoch < epochs; ++epoch) {
//     sampler.set_epoch(epoch);
//     for (std::int64_t index : sampler.indices()) { ... }
//   }
//
// Same semantics as PyTorch's torch.utils.data.distributed.DistributedSampler, index for index:
// - The epoch's order is 0..N-1, or with `shuffle` a permutation drawn by torch::randperm from a
//   CPU generator seeded with seed + epoch, so every rank draws the same permutation.
// - Without drop_last every rank gets ceil(N / world_size) indices; the list is padded to
//   world_size times that by repeating it from its start (as often as needed when N < world_size).
//   With drop_last every rank gets floor(N / world_size) indices and the tail is dropped.
// - Rank r takes positions r, r + world_size, r + 2 * world_size, ... of that list.
// Every rank therefore gets the same number of indices, so ranks run the same number of steps.
// With `pad` = false (and no drop_last) nothing is repeated: rank r takes the positions r,
// r + world_size, ... below N, so ranks get ceil or floor of N / world_size indices: uneven
// inputs, for training under ddp::Join.
//
//
// Resuming mid-epoch (ddp::TrainState; PyTorch's sampler has no such thing):
// set_epoch(epoch, start_offset) starts the epoch after its first `start_offset` global samples,
// i.e. after positions [0, start_offset) of the epoch's order (the permutation above, which is the
// same for every world size). The remaining N - start_offset indices are dealt exactly as a whole
// epoch is dealt above, as if they were the dataset: padded by repeating them from their start
// (pad), cut to a multiple of world_size (drop_last), or left uneven (pad = false). A job that ran
// k steps of B samples per rank at world size W consumed positions [0, k * B * W) (rank r's step
// j reads positions r + W * (j * B + i)), so start_offset = k * B * W resumes it with no sample
// repeated or skipped, at this or at any other world size; offsets add up over several resumes
// (see consumed_after()). start_offset >= N leaves nothing to do in the epoch (size() == 0).
// With drop_last, 0 < N - start_offset < world_size (start_offset > 0) would drop every remaining
// sample: that is a ConfigError naming both numbers (resume at a smaller world size or without
// drop_last).
//
// Threads: a sampler is a small value; use each object from one thread at a time. Throws
// ConfigError for world_size < 1 or a rank outside [0, world_size), naming the value.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

// Exported by ddp's shared libraries, which hide the rest (src/CMakeLists.txt).
#pragma GCC visibility push(default)
namespace ddp {

class ProcessGroup;

struct SamplerOptions {
  bool shuffle = true;
  std::uint64_t seed = 0;  // must be the same on every rank
  bool drop_last = false;
  // false: no padding, ranks may get one index less than others (see above).
  bool pad = true;
};

class DistributedSampler {
 public:
  DistributedSampler(std::size_t dataset_size, int rank, int world_size,
                     SamplerOptions options = {});
  // Rank and world size from the group.
  DistributedSampler(std::size_t dataset_size, const ProcessGroup& group,
                     SamplerOptions options = {});

  // Selects the epoch's order; call it at the start of every epoch (with shuffle, forgetting it
  // repeats the first epoch's order every time).
  void set_epoch(std::uint64_t epoch) { set_epoch(epoch, 0); }
  // The same, starting after the first `start_offset` global samples of the epoch (see above).
  // Throws ConfigError with drop_last when the rest cannot be split across the world size.
  void set_epoch(std::uint64_t epoch, std::uint64_t start_offset);
  std::uint64_t epoch() const { return epoch_; }
  std::uint64_t start_offset() const { return start_offset_; }

  // The global offset into the epoch after this rank's first `local_samples` indices were
  // consumed by every rank (e.g. steps * batch_size): start_offset() + local_samples *
  // world_size, at most dataset_size(). What TrainState stores to resume.
  std::uint64_t consumed_after(std::uint64_t local_samples) const;

  // This rank's indices for the current epoch, in training order; size() of them.
  std::vector<std::int64_t> indices() const;

  // Indices of this rank per epoch (PyTorch's num_samples; with pad = false, this rank's own);
  // after set_epoch(e, offset), of the rest of the epoch.
  std::size_t size() const { return num_samples_; }
  // Indices of all ranks together: size() * world_size (PyTorch's total_size); with pad = false
  // and without drop_last it is meaningless (use dataset_size()).
  std::size_t total_size() const { return num_samples_ * static_cast<std::size_t>(world_size_); }
  std::size_t dataset_size() const { return dataset_size_; }
  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  const SamplerOptions& options() const { return options_; }

 private:
  std::size_t dataset_size_;
  int rank_;
  int world_size_;
  SamplerOptions options_;
  std::size_t num_samples_;
  std::uint64_t epoch_ = 0;
  std::uint64_t start_offset_ = 0;
};

}  // namespace ddp
#pragma GCC visibility pop
