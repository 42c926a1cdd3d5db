// BenchRunner: times one collective at one message size on a ProcessGroup, as nccl-tests does.
//
//   BenchRunner runner(*pg, options);          // allocates and touches every buffer once
//   BenchRow row = runner.run(Collective::kAllreduce, 1 << 20);
//
// Timing: every iteration starts with a barrier (not timed); each rank then times its own call
// from issue to Work::wait() returning. After the loop the per-iteration times are reduced with
// max over ranks (one extra allreduce, outside the timed region), so an iteration counts as long
// as its slowest rank took, and the row reports the median of those iterations (also min and
// max). The first --warmup iterations are run the same way and discarded.
//
// Buffers are allocated once, for the largest size of the run, and reused for every size and
// collective: nothing is allocated or first-touched inside the timed region. With `check`, inputs
// are rewritten, receive buffers poisoned before, and results compared after every iteration
// (outside the timed region); wrong elements are summed over iterations and ranks.
//
// Every rank of the group calls run() with the same arguments in the same order, from one thread.
// Throws what the collectives throw (CommError, TimeoutError) and std::bad_alloc when the largest
// size does not fit in memory.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "ddp-bench/bench_options.h"
#include "ddp-bench/reference.h"
#include "ddp/comm/process_group.h"

namespace ddp::bench {

struct BenchRow {
  Collective collective = Collective::kAllreduce;
  Layout layout;
  DType dtype = DType::kFloat32;
  ReduceOp reduce_op = ReduceOp::kSum;
  int root = 0;
  int world_size = 1;
  std::string backend;
  int iters = 0;
  int warmup = 0;
  bool blocking = true;    // timed blocking calls, else collective(...)->wait() (--async)
  double time_us = 0;      // median over iterations of the slowest rank's time
  double time_min_us = 0;  // fastest iteration (slowest rank)
  double time_max_us = 0;  // slowest iteration (slowest rank)
  double algbw_gbps = 0;   // layout.bytes / time_us, in 1e9 bytes per second
  double busbw_gbps = 0;   // algbw * bus_bandwidth_factor
  std::optional<std::uint64_t>
      wrong;  // wrong elements over ranks and iterations; unset without --check
};

class BenchRunner {
 public:
  BenchRunner(ProcessGroup& group, const BenchOptions& options);
  ~BenchRunner();
  BenchRunner(const BenchRunner&) = delete;
  BenchRunner& operator=(const BenchRunner&) = delete;

  // Measures `collective` at `requested_bytes` (see layout_for for the size actually used). The
  // result is complete on rank 0; other ranks get their own (unreduced) wrong count.
  BenchRow run(Collective collective, std::size_t requested_bytes);

 private:
  struct AlignedFree {
    void operator()(std::byte* p) const;
  };
  using Buffer = std::unique_ptr<std::byte[], AlignedFree>;
  static Buffer allocate(std::size_t bytes);

  ProcessGroup& group_;
  const BenchOptions& options_;
  std::size_t capacity_bytes_ = 0;
  Buffer send_;
  Buffer recv_;
  std::shared_ptr<void> shared_recv_;  // --shared-buffer: replaces recv_
  std::shared_ptr<void> shared_send_;  // --shared-buffer: replaces send_ for reduce_scatter
};

}  // namespace ddp::bench
