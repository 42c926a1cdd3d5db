// Context parallelism (PyTorch's context_parallel ring attention, Megatron-core's
// cp_comm_type="p2p"): a long sequence split over the ranks of a cp group, causal self-attention
// computed by passing key/value blocks around the ring.
//
//   auto cp = mesh.group("cp");
//   auto positions = ddp::context_parallel_positions(sequence, *cp);  // this rank's positions
//   auto x_local = ddp::context_parallel_shard(x, /*dim=*/1, *cp);    // [batch, 2 s/(2 cp), ...]
//   auto y = ddp::ring_attention(q, k, v, cp);  // q, k, v: [batch, heads, local, head_dim]
//
// Layout (load balanced, as Megatron's): the sequence is cut into 2 cp equal chunks and rank r
// holds chunks r and 2 cp - 1 - r, in that order, so every rank has as much of the causal
// triangle's work as any other. A sequence must divide into 2 cp chunks (ConfigError).
//
// ring_attention: softmax(q kᵀ / sqrt(head_dim), causal by global position) v for this rank's
// queries against every rank's keys. Forward: cp steps; at step j the rank holds the key/value
// block of rank r - j, sends it on to rank r + 1 and receives the next from rank r - 1 while it
// computes on it (isend/irecv, overlapped), and folds the block into each query chunk's result by
// the online softmax (running maximum and sum; a block entirely in the future is skipped). Saves
// q, k, v, the output and the log-sum-exp. Backward (the same ring, flash-attention's
// recomputation of the probabilities): the key/value block travels with its gradient
// accumulators; each rank adds its queries' contribution and passes them on, and after cp passes
// every block is back at its owner with its whole gradient. Memory: this rank's activations and
// two blocks in flight; no rank ever holds the whole sequence's keys or scores.
//
// Collective over `cp` in forward and backward (point to point, tags kRingAttentionTag..+3):
// every rank calls it with tensors of the same shape. Its tensors: CPU float32 or float64.
#pragma once

#include <cstdint>
#include <memory>

#include <torch/torch.h>

#include "ddp/comm/process_group.h"

// Exported by ddp's shared libraries, which hide the rest (src/CMakeLists.txt).
#pragma GCC visibility push(default)
namespace ddp {

inline constexpr int kRingAttentionTag = 32760;  // ..32763: keys, values, their gradients

// This rank's positions of a sequence of `sequence` tokens (int64, 2 sequence / (2 cp) of them).
torch::Tensor context_parallel_positions(std::int64_t sequence, const ProcessGroup& cp);
// This rank's part of `full` along `dim` (no communication).
torch::Tensor context_parallel_shard(const torch::Tensor& full, std::int64_t dim,
                                     const ProcessGroup& cp);
// Causal attention over the whole sequence for this rank's queries (above). null cp: one rank.
torch::Tensor ring_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                             const std::shared_ptr<ProcessGroup>& cp);

}  // namespace ddp
#pragma GCC visibility pop
