// PowerSGD gradient compression (Vogels et al. 2019) as a DDP comm hook, with the semantics of
// PyTorch's torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook (same options, defaults,
// random initial Q, orthogonalisation, error feedback and iteration counter), so that the same
// gradients and options give the same averages as PyTorch (tested against PyTorch 2.x to 1e-5).
//
//   auto state = std::make_shared<ddp::PowerSGDState>(
//       ddp::PowerSGDOptions{.matrix_approximation_rank = 4, .start_powersgd_iter = 10});
//   ddp_model->register_comm_hook(ddp::powersgd_hook(state));
//
// Per bucket, once state->iteration() >= start_powersgd_iter (plain averaging before): each
// gradient is viewed as an n x m matrix (its first dimension by the rest); those where
// (n + m) * r * min_compression_rate < n * m are compressed to P = M Q (n x r) and Q = M^T P
// (m x r), the others (biases, small layers) are averaged uncompressed. One allreduce carries the
// uncompressed tensors and every P (PyTorch makes these two allreduces in sequence: the sums are
// the same); in the bucket's finish step (on the autograd thread, in bucket order, so that every
// rank issues the same collectives in the same order) P is orthogonalised, Q = M^T P computed
// and allreduced, and M ~ P Q^T / world_size.
// Error feedback adds last step's local compression error to the gradient first; warm start
// keeps Q between steps. batched_powersgd_hook compresses the whole bucket as one square matrix
// (faster, usually much less accurate unless rank 1; PyTorch's own batched hook fails an
// assertion in its orthogonalisation, so it is compared with a direct computation only).
//
// The state is shared by every bucket of one model (one state per DDP model; not across models).
// Checkpoint it with the model: save()/load() write the iteration, the random generator, the
// error and Q memories. Bytes: bytes_sent() counts the payload handed to collectives.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <random>

#include <torch/torch.h>

#include "ddp/torch/ddp/hooks/comm_hooks.h"

// Exported by ddp's shared libraries, which hide the rest (src/CMakeLists.txt).
#pragma GCC visibility push(default)
namespace ddp {

struct PowerSGDOptions {
  int matrix_approximation_rank = 1;        // r: columns of P and Q; >= 1
  std::int64_t start_powersgd_iter = 1000;  // plain allreduce for the iterations before
  double min_compression_rate = 2;          // compress only where it divides the size by more
  bool use_error_feedback = true;           // add last step's compression error
  bool warm_start = true;                   // reuse Q from the last step instead of a random one
  double orthogonalization_epsilon = 0;     // added to column norms (Gram-Schmidt) against 0/0
  std::uint32_t random_seed = 0;            // seeds the random initial Q (as numpy's RandomState)
  bool batch_tensors_with_same_shape = false;  // one batched matmul per shape instead of per tensor
};

class PowerSGDState {
 public:
  // ConfigError for matrix_approximation_rank < 1, a negative start or compression rate, and
  // start_powersgd_iter <= 1 with error feedback or warm start (as PyTorch: DDP rebuilds its
  // buckets after the first iteration, so per-bucket memories only make sense from iteration 2).
  explicit PowerSGDState(PowerSGDOptions options = {});

  const PowerSGDOptions& options() const { return options_; }
  // Backward passes seen (counted at the last bucket, as PyTorch's state.iter).
  std::int64_t iteration() const;
  // Elements of the gradients that went through compression, before and after (PyTorch's
  // compression_stats), and the payload bytes handed to collectives, since construction.
  std::int64_t numel_before_compression() const;
  std::int64_t numel_after_compression() const;
  std::uint64_t bytes_sent() const;

  // Writes/reads the iteration, statistics, random generator and the per-bucket error, P and Q
  // memories (not the options: construct the loading state with the same ones). load() replaces
  // this state; it must not run while a backward pass uses the state.
  void save(torch::serialize::OutputArchive& archive) const;
  void load(torch::serialize::InputArchive& archive);

 private:
  friend struct PowerSGDAccess;  // src/torch/ddp/hooks/powersgd_internal.h
  PowerSGDOptions options_;
  mutable std::mutex mutex_;  // buckets run on the autograd thread and the group's worker
  std::int64_t iter_ = 0;
  std::int64_t numel_before_ = 0;
  std::int64_t numel_after_ = 0;
  std::uint64_t bytes_sent_ = 0;
  std::mt19937 rng_;                            // numpy.random.RandomState(random_seed)'s generator
  std::map<std::size_t, torch::Tensor> error_;  // per bucket index
  std::map<std::size_t, torch::Tensor> p_memory_;  // per bucket index
  std::map<std::size_t, torch::Tensor> q_memory_;  // per bucket index
};

CommHook powersgd_hook(std::shared_ptr<PowerSGDState> state);
CommHook batched_powersgd_hook(std::shared_ptr<PowerSGDState> state);

namespace powersgd_detail {
// Exposed for tests: PyTorch's _orthogonalize of a batch of matrices [batch, n, r] in place
// (Gram-Schmidt for r <= 2 or 16-bit types, else QR), and numpy's RandomState.randint(0, high)
// on `rng`.
void orthogonalize(torch::Tensor matrices, double epsilon);
std::int64_t numpy_randint(std::mt19937& rng, std::uint32_t high);
}  // namespace powersgd_detail

}  // namespace ddp
#pragma GCC visibility pop
