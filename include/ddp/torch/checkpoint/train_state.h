// TrainState: everything a training run needs to continue exactly where it stopped, mid-epoch
// included, in one file that is either the old complete version or the new one.
//
//   std::mt19937 augment_rng(seed);                       // optional: a generator of your own
//   ddp::TrainState state(*net, optimizer, {.tag = "cnn", .rng = &augment_rng});
//   ddp::TrainProgress progress;
//   if (resume) progress = state.load(path);               // every rank, before wrapping in DDP
//   for (auto epoch = progress.epoch; epoch < epochs; ++epoch, progress.epoch_offset = 0) {
//     sampler.set_epoch(epoch, progress.epoch_offset);     // the rest of a half-done epoch
//     for (b...) {
//       ...; optimizer.step(); ++progress.global_step; ++progress.scheduler_step;
//       if (rank == 0 && progress.global_step % 100 == 0) {
//         state.save(path, {.epoch = epoch,
//                           .epoch_offset = sampler.consumed_after((b + 1) * batch_size), ...});
//       }
//     }
//   }
//
// What is stored: the model's parameters and buffers and the optimizer's state (as
// save_checkpoint, checkpoint.h), the progress below (epoch, global samples consumed in it, global
// step, the LR scheduler's step count, world size at save time), the state of torch's default CPU
// generator, and, when options.rng is set, that std::mt19937's state. The optimizer's kind is
// recorded and checked on load (OptimizerMismatchError, checkpoint.h).
//
// Resuming at a different world size works because the position is stored in global samples, not
// steps: DistributedSampler::set_epoch(epoch, epoch_offset) skips the samples every rank together
// consumed and deals the rest across the new world size (distributed_sampler.h gives the rule).
// Steps per epoch change with the world size; a schedule that must follow the data rather than the
// step count derives its position from (epoch, epoch_offset).
//
// Writing: by one rank (rank 0), atomically (PATH.tmp, fsync, rename, folder fsync), with a CRC-32
// of every entry (checkpoint.h's save_archive_atomically). Loading: every rank reads the file;
// load verifies the checksums, the format, the tag, and that every tensor fits the model before it
// changes anything, so a corrupt, truncated or foreign file throws and leaves the model, optimizer,
// generators and the file itself as they were. torch's generator state is rank 0's at save time:
// every rank gets that state back (ranks that need different streams seed them from their rank).
//
// Threads: a TrainState refers to the model, optimizer and generator it was given (they must
// outlive it) and is used from one thread at a time. Errors: ddp::ConfigError when the file is
// missing; ddp::Error naming the file and what is wrong: damaged or truncated ("is damaged",
// "is not a readable torch archive"), not a training state ("not a ddp training state"), saved for
// another model ("was saved for 'mlp'" or the tensor that differs), for another optimizer
// (OptimizerMismatchError), a generator state that cannot be read; and for I/O failures while
// writing (the previous file stays intact, the partial PATH.tmp is removed).
#pragma once

#include <cstdint>
#include <filesystem>
#include <random>
#include <string>

#include <torch/torch.h>

// Exported by ddp's shared libraries, which hide the rest (src/CMakeLists.txt).
#pragma GCC visibility push(default)
namespace ddp {

// Where a run is. Every field is the caller's to keep current; TrainState stores and returns it.
struct TrainProgress {
  std::uint64_t epoch = 0;          // the epoch in progress, as given to set_epoch (0-based)
  std::uint64_t epoch_offset = 0;   // global samples of it consumed (sampler.consumed_after)
  std::int64_t global_step = 0;     // optimizer steps taken since the start of the run
  std::int64_t scheduler_step = 0;  // the LR scheduler's step count
  int world_size = 0;               // set by save from its argument; informational on load
  // Samples of the dataset the sampler deals (its length), for the caller to compare on resume:
  // epoch_offset counts positions in that dataset's shuffled order, which another size changes.
  // 0: not recorded (also in files written before it was stored).
  std::uint64_t dataset_size = 0;
};

struct TrainStateOptions {
  // Free text naming the model (e.g. "cnn"); load refuses a file saved under another tag.
  std::string tag;
  // A generator of the caller's (data augmentation, dropout masks of its own) saved and restored
  // along; nullptr for none.
  std::mt19937* rng = nullptr;
};

class TrainState {
 public:
  TrainState(torch::nn::Module& model, torch::optim::Optimizer& optimizer,
             TrainStateOptions options = {});

  // Writes everything to `path` atomically; call it on one rank (rank 0). `world_size` is stored
  // with the progress (0 keeps progress.world_size).
  void save(const std::filesystem::path& path, const TrainProgress& progress,
            int world_size = 0) const;

  // Restores model, optimizer and generators from `path` and returns the stored progress; call it
  // on every rank, before DistributedDataParallel's construction or into its module().
  TrainProgress load(const std::filesystem::path& path);

 private:
  torch::nn::Module& model_;
  torch::optim::Optimizer& optimizer_;
  TrainStateOptions options_;
};

class FullyShardedDataParallelImpl;

// ShardedTrainState: TrainState for a FullyShardedDataParallel model (any strategy), whose
// parameters and optimizer state no single rank holds. A checkpoint is a folder:
//
//   ddp::ShardedTrainState state(*fsdp, optimizer, {.tag = "cnn"});   // fsdp: the wrapper's impl
//   if (resume) progress = state.load(dir);          // every rank; any world size
//   ...; state.save(dir, progress, world_size);      // every rank (collective)
//
// save writes DIR/ckpt-<n>/ (PyTorch's distributed checkpoint of the model and its optimizer,
// FullyShardedDataParallel::dcp_state: each rank's elements of each parameter and their optimizer
// state, under the model's own names), then rank 0 adds DIR/ckpt-<n>/train_state.pt
// (the progress, the generators as TrainState stores them, and rank 0's buffers), then points
// DIR/latest.pt at ckpt-<n> (atomically) and removes the older ckpt-* folders. A save that fails
// or is killed part-way therefore leaves the previous checkpoint as the one load finds; `n` counts
// up from the previous save's. Errors while writing on any rank are thrown on every rank.
//
// load reads DIR/latest.pt, checks train_state.pt (format, tag, generators, each buffer's name
// and shape) and the checkpoint (every parameter's name, shape and dtype, the optimizer's kind and
// state; a folder saved in ddp's earlier sharded format by units) before it changes anything, then
// sets the shards, the optimizer state, the buffers and the generators. Not collective: each rank
// reads what it needs. Errors: ConfigError when DIR holds no latest.pt; Error naming the file and
// what is wrong otherwise (damaged, another model or optimizer, a latest.pt naming anything but a
// ckpt-<n> folder of DIR), with nothing changed.
class ShardedTrainState {
 public:
  ShardedTrainState(FullyShardedDataParallelImpl& model, torch::optim::Optimizer& optimizer,
                    TrainStateOptions options = {});

  void save(const std::filesystem::path& dir, const TrainProgress& progress,
            int world_size = 0) const;
  TrainProgress load(const std::filesystem::path& dir);

 private:
  FullyShardedDataParallelImpl& model_;
  torch::optim::Optimizer& optimizer_;
  TrainStateOptions options_;
};

}  // namespace ddp
#pragma GCC visibility pop
