// int8 gradient quantisation as a DDP comm hook, with error feedback.
//
//   auto state = std::make_shared<ddp::Int8QuantizeState>();
//   ddp_model->register_comm_hook(ddp::int8_quantize_hook(state));
//
// Per bucket and rank: scale = max|g| / 127, q = round(g / scale) in [-127, 127]. The ranks
// allgather their int8 values with their float32 scale appended (n + 4 bytes per rank instead of
// 4n for float32), and every rank computes the average sum_r q_r * scale_r / world in the same
// rank order, so the result is bit-identical on every rank (DDP's parameters stay identical).
// Why an allgather and not an allreduce: int8 sums overflow, and an allreduce of int8 values
// needs one scale for all ranks plus headroom (log2(world) bits fewer); the allgather keeps every
// rank's own scale and 8 bits, at (world - 1) x n bytes sent per rank on a ring, which is less
// than float32's 2 (world - 1) / world x 4n up to 8 ranks. Beyond that use PowerSGD or bf16.
// Error per element and rank: at most scale / 2 = max|g| / 254. With error feedback (the
// default) each rank adds its last quantisation error to the next gradient, so the errors do not
// accumulate over steps: the sum of the averaged gradients stays within one step's error of the
// true sum. Non-floating buckets are averaged exactly.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>

#include <torch/torch.h>

#include "ddp/torch/ddp/hooks/comm_hooks.h"

// Exported by ddp's shared libraries, which hide the rest (src/CMakeLists.txt).
#pragma GCC visibility push(default)
namespace ddp {

struct Int8QuantizeOptions {
  bool use_error_feedback = true;
};

class Int8QuantizeState {
 public:
  explicit Int8QuantizeState(Int8QuantizeOptions options = {}) : options_(options) {}
  const Int8QuantizeOptions& options() const { return options_; }
  // Payload bytes handed to collectives since construction.
  std::uint64_t bytes_sent() const;
  // Checkpoint: the per-bucket errors (keys "int8/error/<bucket>"). load() replaces them; not
  // while a backward pass uses the state.
  void save(torch::serialize::OutputArchive& archive) const;
  void load(torch::serialize::InputArchive& archive);

 private:
  friend struct Int8Access;  // src/torch/ddp/hooks/quantized_hook.cc
  Int8QuantizeOptions options_;
  mutable std::mutex mutex_;
  std::uint64_t bytes_sent_ = 0;
  std::map<std::size_t, torch::Tensor> error_;  // per bucket index
};

CommHook int8_quantize_hook(
    std::shared_ptr<Int8QuantizeState> state = std::make_shared<Int8QuantizeState>());

}  // namespace ddp
#pragma GCC visibility pop
