// The sum over a group's ranks of a sparse COO tensor, as gloo computes it for PyTorch's
// all_reduce of a sparse tensor: every rank's (coalesced) indices and values are gathered, and
// their concatenation, coalesced, is the sum. What DDP does with the gradients of an Embedding
// with sparse = true: the bytes each rank sends grow with the rows it touched, not with the table.
#pragma once

#include <cstddef>

#include <torch/torch.h>

#include "ddp/comm/process_group.h"

namespace ddp::detail {

// Collective: every rank passes a sparse tensor of the same sizes, sparse_dim and dtype (a dtype
// the engine reduces), possibly with no entries. Blocks until the sum is there (three collectives:
// the entry counts, then the indices and the values, each sized by the counts). `bytes_sent` grows
// by what this rank contributed (its count, indices and values).
torch::Tensor sparse_all_reduce_sum(const torch::Tensor& sparse, ProcessGroup& group,
                                    std::size_t& bytes_sent);

}  // namespace ddp::detail
