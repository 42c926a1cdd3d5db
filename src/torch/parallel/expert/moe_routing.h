// The routing decision of MoeLayer (mixture_of_experts.h), made alike on every layout: one
// all-gather over the token group carries each rank's input check, token count, capacity factor,
// per-(choice, expert) counts and per-expert probability sums; from it every rank computes the
// batch's capacity, the global order of its own assignments and which of them are kept.
#pragma once

#include <cstdint>
#include <string>

#include <torch/torch.h>

#include "ddp/comm/process_group.h"
#include "ddp/torch/parallel/expert/mixture_of_experts.h"

namespace ddp::detail {

// What this rank found wrong with its input (kind None: nothing), sent with the counts so that
// every rank names it at the same collective.
struct MoeInputCheck {
  enum class Kind : std::int64_t { kNone = 0, kLastDimension = 1, kDtype = 2, kDevice = 3 };
  Kind kind = Kind::kNone;
  std::int64_t value = 0;  // the last dimension, or the dtype (c10::ScalarType)
};

struct MoeAssignment {
  torch::Tensor kept;              // [T, k] bool: this rank's slots within their capacity
  MoeRouting routing;              // the batch's, the same on every rank
  torch::Tensor probability_sums;  // [E] float64: the batch's sum of each expert's probability
};

// experts: [T, k] int64, this rank's choices (T may be 0); probability_sums: [E] float64 of this
// rank's tokens. Collective over `tokens` (null: this rank alone). ConfigError on every rank for
// a failed check on any rank, or capacity factors that differ.
MoeAssignment assign_tokens(const torch::Tensor& experts, const torch::Tensor& probability_sums,
                            std::int64_t num_experts, std::int64_t hidden, double capacity_factor,
                            const MoeInputCheck& check, ProcessGroup* tokens);

}  // namespace ddp::detail
