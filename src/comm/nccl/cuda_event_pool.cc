#include "comm/nccl/cuda_event_pool.h"

namespace ddp::comm::nccl {

CudaEventPool::~CudaEventPool() {
  for (cudaEvent_t event : idle_)
    lib_.EventDestroy(event);
}

cudaError_t CudaEventPool::acquire(cudaEvent_t* event) {
  {
    std::lock_guard lock(mutex_);
    if (!idle_.empty()) {
      *event = idle_.back();
      idle_.pop_back();
      return cudaSuccess;
    }
  }
  // Outside the lock: creating an event may take the driver's time.
  cudaEvent_t created = nullptr;
  const cudaError_t rc = lib_.EventCreateWithFlags(&created, cudaEventDisableTiming);
  if (rc != cudaSuccess) return rc;
  *event = created;
  std::lock_guard lock(mutex_);
  ++created_;
  return cudaSuccess;
}

void CudaEventPool::release(cudaEvent_t event) {
  std::lock_guard lock(mutex_);
  idle_.push_back(event);
}

void CudaEventPool::discard(cudaEvent_t event) {
  lib_.EventDestroy(event);
}

std::shared_ptr<void> CudaEventPool::hold(cudaEvent_t event) {
  return std::shared_ptr<void>(event,
                               [pool = shared_from_this()](CUevent_st* e) { pool->release(e); });
}

std::size_t CudaEventPool::created() const {
  std::lock_guard lock(mutex_);
  return created_;
}

std::size_t CudaEventPool::idle() const {
  std::lock_guard lock(mutex_);
  return idle_.size();
}

}  // namespace ddp::comm::nccl
