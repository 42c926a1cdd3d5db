// What FullyShardedDataParallel holds outside its shards, counted where it allocates it: the bytes
// of its unsharded flat buffers, i.e. each unit's gathered (full) parameters and its full flat
// gradient, over every FSDP wrapper of this process, on the host or on a device (CUDA). Live now,
// and the most that was live at once since the process started or since
// reset_fsdp_buffer_peak().
//
// What that measures: with FsdpCpuOffload on a CUDA wrapper, kDevice is the device memory FSDP
// keeps for parameters and gradients apart from the shard-sized transients (the shards, their
// gradients and the optimizer's state are host memory); without offload it is what FSDP adds to
// the shards. Not counted: the shards and their gradients (a reduce-scatter's output, which
// becomes the shard's gradient, is shard-sized), except where SHARD_GRAD_OP or NO_SHARD in fp32
// keeps the shard as a range of the full buffer, which counts; a gather's shard-sized copy to the
// device; activations. docs/sharding.md ("CPU offload") gives the formula the peak follows.
#pragma once

#include <cstdint>

#pragma GCC visibility push(default)

namespace ddp {

enum class FsdpMemoryPlace { kHost, kDevice };

struct FsdpBufferBytes {
  std::int64_t live = 0;
  std::int64_t peak = 0;
};

FsdpBufferBytes fsdp_buffer_bytes(FsdpMemoryPlace place);

// Sets each place's peak to what is live now (to measure one step: reset, step, read).
void reset_fsdp_buffer_peak();

}  // namespace ddp

#pragma GCC visibility pop
