// libtorch's Adam and AdamW with a step that makes no parameter-sized temporaries.
//
// torch::optim::Adam's step allocates two tensors the size of each parameter (the square root of
// the second moment and its quotient, the denominator), and three with weight decay; on a large
// weight that is what sets a training step's peak memory. ChunkedAdam and ChunkedAdamW run the
// same tensor operations in the same order over chunks of at most kChunkedAdamElements elements
// of each parameter, so the temporaries are chunk-sized (and the chunk's five streams stay in the
// cache). Everything else is libtorch's class: options, state (AdamParamState/AdamWParamState),
// save/load, and ZeroRedundancyOptimizer's, FSDP's and the checkpoints' handling of them, so a
// state saved by one loads into the other.
//
// Results: equal to libtorch's step bit for bit with one intra-op thread (chunks start at
// multiples of the kernels' vector width, so every element takes the same code path); with more
// threads within rounding, as libtorch's own step is across thread counts. Sparse gradients: as
// libtorch (refused). A parameter that is not contiguous, or whose gradient or state is not,
// steps whole, as libtorch does.
//
// ZeroRedundancyOptimizer's AdamOptions/AdamWOptions constructors use these classes.
//   ddp::ChunkedAdam optimizer(fsdp->parameters(), torch::optim::AdamOptions(1e-3));
#pragma once

#include <cstdint>
#include <vector>

#include <torch/torch.h>

#pragma GCC visibility push(default)

namespace ddp {

// Elements per chunk: 256 KiB of each float32 stream, so that the five a chunk touches stay in a
// core's L2 cache; a multiple of every vector width.
inline constexpr std::int64_t kChunkedAdamElements = 1 << 16;

class ChunkedAdam : public torch::optim::Adam {
 public:
  using torch::optim::Adam::Adam;
  torch::Tensor step(LossClosure closure = nullptr) override;
};

class ChunkedAdamW : public torch::optim::AdamW {
 public:
  using torch::optim::AdamW::AdamW;
  torch::Tensor step(LossClosure closure = nullptr) override;
};

}  // namespace ddp

#pragma GCC visibility pop
