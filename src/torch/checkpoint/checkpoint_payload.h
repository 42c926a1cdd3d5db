// The model and optimizer part of a checkpoint archive, shared by save_checkpoint
// (checkpoint.h) and TrainState (train_state.h) so that both lay it out and check it the same way.
//
//   detail::write_model_and_optimizer(archive, model, optimizer);        // entries "model",
//   ...                                                                   // "optimizer"
//   detail::load_model_and_optimizer(archive, model, optimizer, path);   // in place, all or none
//
// Internal to ddp_torch. Functions are thread-compatible (no shared state).
#pragma once

#include <filesystem>
#include <string>

#include <torch/torch.h>

namespace ddp::detail {

// The optimizer's kind and the options that shape its state, e.g. "Adam", "Adam with amsgrad",
// "SGD with momentum", "SGD without momentum", "RMSprop with momentum, centered"; a
// An OptimizerWrapper (ZeroRedundancyOptimizer) is described by the optimizer it wraps (its files
// are that one's).
std::string describe_optimizer(const torch::optim::Optimizer& optimizer);

// Writes the entries "model" (Module::save's layout), "optimizer" and "optimizer_kind"
// (describe_optimizer) into `archive`.
void write_model_and_optimizer(torch::serialize::OutputArchive& archive,
                               const torch::nn::Module& model,
                               const torch::optim::Optimizer& optimizer);

// Reads them back into the model's existing tensors and the optimizer. Every stored tensor is read
// and its shape and dtype checked before anything changes, so an archive that does not fit (from
// another model) leaves the model as it was. Throws ddp::Error naming `path` and the tensor or
// entry that is missing or differs, and OptimizerMismatchError (checkpoint.h) when the archive's
// "optimizer_kind" differs from the optimizer's (`what` starts its message: "the checkpoint",
// "the training state in"); c10::Error from the optimizer's own load passes through.
void load_model_and_optimizer(torch::serialize::InputArchive& archive, torch::nn::Module& model,
                              torch::optim::Optimizer& optimizer, const std::filesystem::path& path,
                              const std::string& what);

}  // namespace ddp::detail
