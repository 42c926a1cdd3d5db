// The parts of a training state that TrainState and ShardedTrainState store alike: the progress,
// the tag, torch's generator state and the caller's std::mt19937. Internal to ddp_torch
// (train_state.cc defines them, sharded_train_state.cc uses them too).
#pragma once

#include <functional>
#include <optional>
#include <random>
#include <string>

#include <torch/torch.h>

#include "ddp/error.h"
#include "ddp/torch/checkpoint/train_state.h"

namespace ddp::detail {

// Writes the format entry (`format_entry` = `format`), the tag, the progress (world_size stored
// from `world_size` when > 0) and the generators.
void write_train_progress(torch::serialize::OutputArchive& archive, const char* format_entry,
                          std::int64_t format, const TrainStateOptions& options,
                          const TrainProgress& progress, int world_size);

// What read_train_progress parsed; nothing is applied until apply_generators.
struct StoredTrainProgress {
  TrainProgress progress;
  torch::Tensor torch_rng;
  std::optional<std::mt19937> user_rng;  // when options.rng is set
};

// Parses and checks what write_train_progress wrote; throws fail(what) naming what is missing
// or wrong (another format, another tag, a generator state that cannot be read).
StoredTrainProgress read_train_progress(torch::serialize::InputArchive& archive,
                                        const char* format_entry, std::int64_t format,
                                        const TrainStateOptions& options,
                                        const std::function<Error(const std::string&)>& fail);

// Sets torch's default CPU generator and options.rng from `stored`.
void apply_generators(const StoredTrainProgress& stored, const TrainStateOptions& options);

}  // namespace ddp::detail
