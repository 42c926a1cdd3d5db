// OpArgs: one call of the ring backend as its algorithms see it (internal to src/comm/ring).
//
// Made by RingProcessGroup from the caller's arguments; read by the TCP algorithms, the
// shared-memory dispatch and the hierarchical allreduce on the thread that runs the operation.
#pragma once

#include <chrono>
#include <cstddef>
#include <string>
#include <vector>

#include "comm/wire.h"
#include "ddp/process_group.h"
#include "ddp/types.h"

namespace ddp::comm {

struct OpArgs {
  Collective kind = Collective::kAllreduce;
  const std::byte* send = nullptr;
  std::byte* recv = nullptr;
  std::size_t count = 0;
  DType dtype = DType::kFloat32;
  ReduceOp op = ReduceOp::kSum;
  int root = 0;
  int avg_divisor = 0;  // avg: divide by this instead of the group size (hierarchical steps)
  std::chrono::milliseconds timeout{0};
  OpHeader header;    // sent, and expected from every peer
  std::string label;  // replaces the description (the steps of a hierarchical allreduce)
  std::vector<BufferSegment> segments;  // allreduce_segments over shared memory (send/recv null)

  // Formatted when needed (errors, TCP steps), not on every call: it allocates.
  std::string description() const {
    if (!label.empty()) return label;
    return describe(header);
  }
};

}  // namespace ddp::comm
