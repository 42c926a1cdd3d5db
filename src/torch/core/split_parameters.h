// Parameters that are one part of a larger tensor split over a group (the tensor-parallel layers'
// shards, a MoeLayer's experts split over ep), recorded where they are made so that code below
// those layers can tell. Internal.
//
// FullyShardedDataParallel and DistributedDataParallel describe each parameter they take with its
// part: wrapped over the tp (or ep) dimension of a mesh instead of the dp one, the ranks of their
// group hold different parts of the same split weights, which their construction-time agreement
// then names (averaging them as if they were replicas would train a silently wrong model).
//
// Keyed by the tensor's TensorImpl and held weakly: a recorded parameter that is freed is
// forgotten, and a new tensor at its address is not mistaken for it.
#pragma once

#include <optional>

#include <ATen/core/Tensor.h>

namespace ddp::detail {

struct SplitPart {
  int part = 0;                          // this rank's part: the rank in the group it is split over
  int parts = 1;                         // the group's size
  const char* kind = "tensor-parallel";  // what splits it ("expert-parallel": a MoeLayer's experts)
};

// Over how many ranks a parameter's gradient must be averaged to be one process's, where the layer
// that made it knows (a MoeLayer's router: its tokens group, whose ranks split the batch's rows;
// its experts: their replicas in that group). A wrapper averaging it over another number of ranks
// would train a silently wrong model, and names it instead.
struct GradientRanks {
  int ranks = 1;
  const char* what = "";  // e.g. "a MoeLayer's router, trained on the rows of its tokens group"
};

// Records `parameter` as part `part` of `parts` (thread-safe).
void note_split_parameter(const at::Tensor& parameter, SplitPart part);
// Records the ranks `parameter`'s gradient must be averaged over (thread-safe).
void note_gradient_ranks(const at::Tensor& parameter, GradientRanks ranks);

// What note_split_parameter / note_gradient_ranks recorded of `parameter` (the same TensorImpl,
// still alive), if anything.
std::optional<SplitPart> split_part_of(const at::Tensor& parameter);
std::optional<GradientRanks> gradient_ranks_of(const at::Tensor& parameter);

}  // namespace ddp::detail
