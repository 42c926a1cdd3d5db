// Call: one collective as every backend sees it (internal), and CallWork, its entry in the queue.
//
// The front (group_front.h) checks the caller's arguments and builds the Call; the OpQueue gives
// it its sequence number (into header.sequence); the backend runs it. The header is the call's
// fingerprint: what every rank must agree on (kind, dtype, count, root, reduce op, algorithm,
// sequence), sent with the ring's messages and compared by the mpi backend's checks.
#pragma once

#include <chrono>
#include <cstddef>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "comm/op_queue.h"
#include "comm/wire.h"
#include "ddp/comm/process_group.h"
#include "ddp/comm/types.h"

namespace ddp::comm {

struct Call {
  Collective kind = Collective::kAllreduce;
  const std::byte* send = nullptr;
  std::byte* recv = nullptr;
  std::size_t count = 0;  // elements (per rank for the block collectives)
  DType dtype = DType::kFloat32;
  ReduceOp op = ReduceOp::kSum;
  int root = -1;
  int avg_divisor = 0;  // avg: divide by this instead of the group size (hierarchical steps)
  std::chrono::milliseconds timeout{0};
  OpHeader header;    // sent, and expected from every peer
  std::string label;  // replaces the description (the steps of a hierarchical allreduce)
  std::vector<BufferSegment> segments;  // allreduce_segments in place (send/recv null)
  // The backend's per-call state made on the caller's thread (GroupFront::prepare_call), e.g. the
  // nccl backend's event recorded on CallOptions::cuda_stream; opaque to the front and the queue.
  std::shared_ptr<void> backend_state;
  // CallOptions::cuda_done_event, kept by a device group's prepare_call for its run_call.
  void* cuda_done_event = nullptr;

  // Formatted when needed (errors, TCP steps), not on every call: it allocates.
  std::string description() const {
    if (!label.empty()) return label;
    return describe(header);
  }
};

// Told each call's header once it has its sequence number (under the queue's lock: must not
// block or call into the queue). The mpi backend keeps the last one for its "left" notices.
class SequenceObserver {
 public:
  virtual void on_sequenced(const OpHeader& header) noexcept = 0;

 protected:
  ~SequenceObserver() = default;
};

class CallWork final : public QueuedWork {
 public:
  CallWork(Call call, SequenceObserver* observer)
      : QueuedWork(call.timeout, call.count * dtype_size(call.dtype)),
        call_(std::move(call)),
        observer_(observer) {}
  Call& call() { return call_; }
  // OpQueue::submit: a blocking call that could not run at once is rebuilt on the heap from this.
  Call take_arguments() { return std::move(call_); }
  std::string description() const override { return call_.description(); }
  const OpHeader* fingerprint() const override { return &call_.header; }

 protected:
  void on_sequenced(std::uint64_t sequence) override {
    call_.header.sequence = sequence;
    if (observer_ != nullptr) observer_->on_sequenced(call_.header);
  }

 private:
  Call call_;
  SequenceObserver* observer_;  // the group's; outlives every call
};

}  // namespace ddp::comm
