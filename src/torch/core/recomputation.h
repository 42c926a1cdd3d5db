// Whether this thread is running a checkpointed function again in a backward pass (recompute/,
// ddp::checkpoint). What must not run twice for one forward pass asks: the forward of
// DistributedDataParallel and FullyShardedDataParallel (their broadcasts, gathers and bookkeeping
// for the backward pass that is already running) refuse, naming the fix: checkpoint the modules
// they wrap, not the wrapper. Internal.
#pragma once

namespace ddp::detail {

bool in_recomputation();

// Marks this thread as recomputing while it lives (nests).
class RecomputationScope {
 public:
  RecomputationScope();
  ~RecomputationScope();
  RecomputationScope(const RecomputationScope&) = delete;
  RecomputationScope& operator=(const RecomputationScope&) = delete;
};

}  // namespace ddp::detail
