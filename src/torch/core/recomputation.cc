#include "torch/core/recomputation.h"

namespace ddp::detail {
namespace {

// The autograd engine runs a checkpointed node's recomputation on the thread of that backward
// pass: the flag is that thread's.
thread_local int t_recomputing = 0;

}  // namespace

bool in_recomputation() {
  return t_recomputing > 0;
}

RecomputationScope::RecomputationScope() {
  ++t_recomputing;
}

RecomputationScope::~RecomputationScope() {
  --t_recomputing;
}

}  // namespace ddp::detail
