// Checkpoints that survive a crash: a training run's model, optimizer and progress in one file
// that is either the old complete version or the new complete version, never a torn mixture.
//
//   if (pg->rank() == 0) {
//     ddp::save_checkpoint(path, *model->module(), optimizer, {.epoch = epoch});
//   }
//   ...
//   ddp::CheckpointInfo info = ddp::load_checkpoint(path, *net, optimizer);   // every rank
//   start_epoch = info.epoch + 1;
//
// Writing: the archive goes to PATH.tmp, the file is fsync'ed, renamed over PATH, and the folder
// is fsync'ed so the rename itself is durable (the usual write-rename protocol). A crash leaves
// PATH as it was, plus at worst a stale PATH.tmp that the next save overwrites.
//
// Integrity: every archive written here carries a CRC-32 of each tensor (dtype, shape and bytes)
// and of each other value, and load_archive/load_checkpoint verify them before anything is used:
// a file damaged after it was written (64 flipped bytes inside a weight, which libtorch's zip
// reader does not notice) throws Error naming the file and the tensor, e.g. "checkpoint: run.pt
// is damaged: tensor 'model.fc1.weight' has checksum ...". Checksums catch accidents (disk,
// copies), not tampering. Checkpoints without checksums (written before ddp stored them, or by
// torch::save) still load, unverified, with a warning (TORCH_WARN) saying to save them again.
//
// Save the unwrapped module (DistributedDataParallel's module()) so the names carry no "module."
// prefix and the file loads without ddp. The optimizer's state is matched to parameters by
// position, so load into a model and optimizer built the same way as the saved ones.
//
// The optimizer: files record its kind and the options that shape its state ("Adam", "Adam with
// amsgrad", "SGD with momentum", "SGD without momentum", ...), and loading into an optimizer that
// differs throws OptimizerMismatchError naming both (files written before the kind was recorded
// load as before).
//
// A failed write (a full disk: ENOSPC; a file-size limit: EFBIG) throws Error naming the
// temporary file and the OS reason; the partial PATH.tmp is removed and PATH is left as it was.
//
// Threads: each call is independent; callers must not write the same path from two threads or
// processes at once (in a job, let one rank save). Throws ddp::Error naming the path and the
// cause: the file is missing or unreadable (ConfigError), not a checkpoint or corrupt, or does
// not fit the model or optimizer; and for I/O failures while writing. A path that is a folder is
// a ConfigError on save (before anything is written) and on load, saying so.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <utility>

#include <torch/torch.h>

#include "ddp/error.h"
#include "ddp/torch/formats/optimizer_mismatch_error.h"

// Exported by ddp's shared libraries, which hide the rest (src/CMakeLists.txt).
#pragma GCC visibility push(default)
namespace ddp {

struct CheckpointInfo {
  std::int64_t epoch = 0;  // the last completed epoch
  std::string tag;         // free text, e.g. the model's name; checked on load when non-empty
};

// Adds the checksum entry ("ddp_checksums") to `archive` and writes it to `path` atomically
// (see above).
void save_archive_atomically(torch::serialize::OutputArchive& archive,
                             const std::filesystem::path& path);

// Reads an archive written by save_archive_atomically (or torch::save), verifying its checksums
// when it has them (Error naming the path and the entry that differs). `map_location`: the device
// its tensors are read onto (as torch.load's), e.g. torch::kCPU for a checkpoint saved from CUDA
// on a machine without a GPU; unset = the devices they were saved from. A CUDA device this
// process does not see is a ConfigError naming how many it sees, before the file is read.
torch::serialize::InputArchive load_archive(const std::filesystem::path& path,
                                            std::optional<torch::Device> map_location = {});

void save_checkpoint(const std::filesystem::path& path, const torch::nn::Module& model,
                     const torch::optim::Optimizer& optimizer, const CheckpointInfo& info);

// Loads model parameters and buffers and optimizer state in place and returns the stored info.
// When `expected_tag` is non-empty it must equal the stored tag (else Error naming both).
// In place means copied into the model's existing tensors, after every stored tensor was read and
// its shape and dtype checked (a checkpoint that does not fit changes nothing). So it is safe in
// either order with DistributedDataParallel: load into the unwrapped module before wrapping, or
// into model->module() afterwards; load on every rank (a rank that skips the load keeps its own
// values, which the DDP divergence check reports).
// `map_location` as for load_archive: the stored tensors are read there, then copied into the
// model's tensors on whatever device those are.
CheckpointInfo load_checkpoint(const std::filesystem::path& path, torch::nn::Module& model,
                               torch::optim::Optimizer& optimizer,
                               const std::string& expected_tag = {},
                               std::optional<torch::Device> map_location = {});

}  // namespace ddp
#pragma GCC visibility pop
