// What a checkpointed function's recomputation (recompute/, ddp::checkpoint) needs from the code
// it runs. Internal.
//
// Whether this thread is running a checkpointed function again in a backward pass: what must not
// run twice for one forward pass asks. The forward of DistributedDataParallel and
// FullyShardedDataParallel (their broadcasts, gathers and bookkeeping for the backward pass that
// is already running) refuse, naming the fix: checkpoint the modules they wrap, not the wrapper.
//
// Generators other than the default ones (the CPU's and each CUDA device's, which the checkpoint
// saves itself), such as the tensor-parallel RNG tracker's, say before each draw that they draw
// (note_generator_draw): a checkpoint's forward records their states then, and its recomputation
// replays them, so that dropout on them draws the same masks.
#pragma once

#include <utility>
#include <vector>

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>

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

// Before drawing from `generator` (not a default one). Cheap when no recorder is active.
void note_generator_draw(const at::Generator& generator);

// While it lives, records on this thread each generator noted, once, with its state before its
// first draw (every recorder alive on the thread: checkpoints nest).
class GeneratorRecorder {
 public:
  GeneratorRecorder();
  ~GeneratorRecorder();
  GeneratorRecorder(const GeneratorRecorder&) = delete;
  GeneratorRecorder& operator=(const GeneratorRecorder&) = delete;
  // The generators noted so far and their states before their first draw.
  const std::vector<std::pair<at::Generator, at::Tensor>>& recorded() const { return recorded_; }

 private:
  friend void note_generator_draw(const at::Generator& generator);
  std::vector<std::pair<at::Generator, at::Tensor>> recorded_;
};

}  // namespace ddp::detail
