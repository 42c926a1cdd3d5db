// CudaEventPool: idle CUDA events (cudaEventDisableTiming) of one device, handed out again
// (internal). Every call of a nccl group used to create and destroy an event for the caller's
// stream, and a stream-ordered call takes a second one for the watcher; at world 1 the host is
// what bounds a small DDP step on a GPU (docs/gpu.md), so the events are made once per group and
// reused. Reuse is safe as soon as an event's last use was issued: a stream that waits on an event
// (cudaStreamWaitEvent) waits for the record made before the wait, whatever is recorded after.
//
// Thread-safe. Events are created on the current device (the caller's DeviceGuard). A handle from
// hold() returns its event when its last copy is dropped and keeps the pool alive until
// then, so a call that outlives its group still gives its event back (and the pool, last, destroys
// it). Destroying the pool destroys the idle events; one still handed out is the holder's.
#pragma once

#include <cstddef>
#include <memory>
#include <mutex>
#include <vector>

#include "comm/nccl/nccl_library.h"

namespace ddp::comm::nccl {

class CudaEventPool : public std::enable_shared_from_this<CudaEventPool> {
 public:
  explicit CudaEventPool(const NcclLibrary& lib) : lib_(lib) {}
  ~CudaEventPool();
  CudaEventPool(const CudaEventPool&) = delete;
  CudaEventPool& operator=(const CudaEventPool&) = delete;

  // An idle event, or a new one; a failed cudaEventCreateWithFlags's error (*event untouched).
  cudaError_t acquire(cudaEvent_t* event);
  // Gives `event` back for reuse.
  void release(cudaEvent_t event);
  // Destroys `event` instead (one whose record failed: it is not handed out again).
  void discard(cudaEvent_t event);
  // A handle on an acquired `event` that releases it to this pool (owned by a shared_ptr) when
  // its last copy is dropped.
  std::shared_ptr<void> hold(cudaEvent_t event);

  std::size_t created() const;  // events created so far
  std::size_t idle() const;     // events waiting to be handed out

 private:
  const NcclLibrary& lib_;
  mutable std::mutex mutex_;
  std::vector<cudaEvent_t> idle_;  // under mutex_
  std::size_t created_ = 0;        // under mutex_
};

}  // namespace ddp::comm::nccl
