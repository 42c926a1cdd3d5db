// DeviceGuard: makes the group's CUDA device current on this thread for a scope and restores the
// caller's afterwards (internal). The queue may run a call on a caller's thread (Work::wait), whose
// current device is the caller's business; cudaSetDevice is a thread-local switch, cheap when the
// device is already current.
#pragma once

#include "comm/nccl/nccl_library.h"

namespace ddp::comm::nccl {

class DeviceGuard {
 public:
  DeviceGuard(const NcclLibrary& lib, int device) : lib_(lib) {
    int current = -1;
    const bool known = lib_.GetDevice(&current) == cudaSuccess;
    if (known && current == device) return;
    lib_.SetDevice(device);
    if (known) previous_ = current;
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;
  ~DeviceGuard() {
    if (previous_ >= 0) lib_.SetDevice(previous_);
  }

 private:
  const NcclLibrary& lib_;
  int previous_ = -1;
};

}  // namespace ddp::comm::nccl
