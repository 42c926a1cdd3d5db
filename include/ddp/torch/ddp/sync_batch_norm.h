// SyncBatchNorm: batch normalisation whose statistics cover the batches of every rank of a group,
// as if one process held their concatenation (PyTorch's torch.nn.SyncBatchNorm, on any device).
//
//   auto net = std::make_shared<Net>();                  // BatchNorms inside Sequential/ModuleList
//   ddp::convert_sync_batchnorm(net);                    // every BatchNorm{1,2,3}d ->
//   SyncBatchNorm auto model = ddp::DistributedDataParallel(net, pg);  // convert first, then wrap
//   // or declare it directly: ddp::SyncBatchNorm bn{ddp::SyncBatchNormOptions(64)};
//
// Training forward (module in training mode, input of shape (N, C, *)): each rank computes its
// sample count, per-channel mean and biased variance; ONE allgather per layer (float64,
// 2 + 2C values per rank) brings every rank's triple; each rank combines them with the parallel
// variance formula (Chan et al.: deviations from the combined mean, never raw sums of squares) in
// float64, normalises its own batch, and updates running_mean and running_var (unbiased over the
// global count, as PyTorch) identically on every rank. Ranks may hold different batch sizes,
// including none at all (N = 0). Backward: ONE allreduce per layer of the per-channel sums of dy
// and dy*(x-mean) (only when the input needs a gradient, as PyTorch); grad_input is then exactly
// that of one BatchNorm over the concatenated batch; grad_weight and grad_bias are this rank's
// share (its batch's contribution), which DistributedDataParallel then averages like every other
// gradient. Outside DDP, sum them over ranks to get the gradient of the summed losses.
//
// No communication: in eval mode with running statistics (they are used, as BatchNorm does), in
// eval mode without running statistics (this rank's batch statistics, as PyTorch), and when the
// group has one rank (plain batch_norm). Anything that communicates must run on every rank of the
// group in the same order, like any collective: a training-mode forward on one rank only waits
// for the others and ends in a CommError or TimeoutError naming the layer, within the timeout.
//
// no_sync: inside DistributedDataParallel::no_sync() SyncBatchNorm still synchronises (forward
// statistics and backward sums). no_sync only defers the averaging of parameter gradients; the
// forward output of a SyncBatchNorm layer is defined by the statistics of the global batch, so
// skipping them would change the numbers. Every rank runs the same micro-steps under no_sync, so
// the collectives still match; accumulated grad_weight/grad_bias are averaged at the step that
// synchronises, which gives the same parameters as one process over the concatenated batches.
//
// Errors (on every rank of the group, never a hang): a training forward whose global count per
// channel is at most 1 throws ConfigError "expected more than 1 value per channel when training"
// (decided from the gathered counts, so all ranks agree); an input with fewer than 2 dimensions or
// with a channel count other than num_features throws ConfigError on that rank, which still takes
// part in the collective with an "invalid" mark so that every other rank throws an Error naming
// that rank; ranks whose num_features differ fail the allgather's fingerprint check and every rank
// throws CommError naming the layer and its num_features. Collective failures are rethrown as
// CommError with the layer named. The statistics move through CPU buffers (C values per layer);
// tensors may live on any device.
//
// Threads: like any module, one forward/backward at a time per instance.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include <torch/torch.h>

#include "ddp/comm/process_group.h"

// Exported by ddp's shared libraries, which hide the rest (src/CMakeLists.txt).
#pragma GCC visibility push(default)
namespace ddp {

struct SyncBatchNormOptions {
  /* implicit */ SyncBatchNormOptions(int64_t num_features) : num_features_(num_features) {}

  // The options of torch::nn::BatchNormOptions, with the same defaults.
  TORCH_ARG(int64_t, num_features);
  TORCH_ARG(double, eps) = 1e-5;
  // nullopt: cumulative moving average (factor 1 / num_batches_tracked), as torch.
  TORCH_ARG(c10::optional<double>, momentum) = 0.1;
  TORCH_ARG(bool, affine) = true;
  TORCH_ARG(bool, track_running_stats) = true;
  // The ranks whose batches are normalised together; null = default_process_group().
  TORCH_ARG(std::shared_ptr<ProcessGroup>, process_group) = nullptr;
  // The layer's name in error messages (convert_sync_batchnorm sets its path in the tree).
  TORCH_ARG(std::string, name) = "";
};

class SyncBatchNormImpl : public torch::nn::Cloneable<SyncBatchNormImpl> {
 public:
  // The state of a BatchNorm that this module adopts as its own tensors (the same objects, so an
  // optimizer created before the conversion keeps working). Used by convert_sync_batchnorm.
  struct AdoptedState {
    torch::Tensor weight, bias, running_mean, running_var, num_batches_tracked;
  };

  explicit SyncBatchNormImpl(SyncBatchNormOptions options);
  SyncBatchNormImpl(SyncBatchNormOptions options, AdoptedState state);

  // (Re)creates the parameters and buffers (ones, zeros, ones, zeros, 0), as BatchNorm does.
  void reset() override;
  void reset_running_stats();
  void reset_parameters();
  void pretty_print(std::ostream& stream) const override;

  // Input (N, C) or (N, C, *), C = num_features. See the file comment for what communicates.
  torch::Tensor forward(const torch::Tensor& input);

  SyncBatchNormOptions options;
  torch::Tensor weight, bias;                                    // when affine
  torch::Tensor running_mean, running_var, num_batches_tracked;  // when track_running_stats

 private:
  std::string layer_name() const;
  std::optional<AdoptedState> adopt_;
};

TORCH_MODULE(SyncBatchNorm);

// Replaces every torch::nn::BatchNorm1d/2d/3d in `module`'s tree by a SyncBatchNorm over `group`
// (null = default_process_group(), resolved at the first forward) with the same options, the very
// same weight, bias, running statistics and num_batches_tracked tensors, and the same train/eval
// mode. Returns the root: `module` itself, or its replacement when `module` is a BatchNorm.
//
// libtorch calls submodules through C++ members, which a replacement cannot reach: conversion
// works where the parent calls its children through the module tree (Sequential, ModuleList, or
// a registered child the parent looks up by name). It throws ConfigError, before changing
// anything, when a BatchNorm is also held elsewhere (a `torch::nn::BatchNorm2d bn` member of its
// parent, a ModuleDict, the same layer twice), because that holder would go on calling the local
// BatchNorm silently; declare such layers as ddp::SyncBatchNorm instead.
std::shared_ptr<torch::nn::Module> convert_sync_batchnorm(
    std::shared_ptr<torch::nn::Module> module, std::shared_ptr<ProcessGroup> group = nullptr);

}  // namespace ddp
#pragma GCC visibility pop
