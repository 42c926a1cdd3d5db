// The torch layer's own exchanges of host values (flags, counts, hashes, orders, encoded objects):
// the checks and plans of DistributedDataParallel, Join and GradScaler, the rank agreement and
// the object collectives. A host group (ring, mpi) reads them where they lie. A CUDA group (nccl)
// reads device memory only, so there HostValues relays them through device copies on the group's
// CUDA device (ProcessGroup::cuda_device(); the current one when it does not say): each call's
// inputs are copied there on the current stream, the call follows that stream, and its outputs are
// copied back (synchronously) as the Work's last step, so that they are in place when wait()
// returns; a failed call copies nothing back.
//
//   detail::HostValues values(group);
//   values->allreduce(flags.data(), flags.size(), DType::kInt32, ReduceOp::kMax)->wait();
//
// The relay takes every collective and send/recv with the ProcessGroup contract (new_group is a
// ConfigError: make subgroups on the group itself). Internal.
#pragma once

#include <cstddef>
#include <memory>

#include <c10/core/Device.h>

#include "ddp/comm/process_group.h"

namespace ddp::detail {

class HostValues {
 public:
  // `group` must outlive this.
  explicit HostValues(ProcessGroup& group);
  ~HostValues();
  HostValues(const HostValues&) = delete;
  HostValues& operator=(const HostValues&) = delete;
  // The group itself for a host group, else the relay over it.
  ProcessGroup* operator->() const { return group_; }
  ProcessGroup& operator*() const { return *group_; }

 private:
  std::unique_ptr<ProcessGroup> relay_;
  ProcessGroup* group_;
};

// Tests without a GPU. While one lives (any thread): a CUDA group's device copies are host
// clones, counted by relayed_calls(), and the torch layer takes CPU tensors as that group's
// device memory (takes_as_is below), so that DistributedDataParallel and Join run over a group
// that declares CUDA memory (tests/torch/api/cuda_group_test.cc).
class ScopedCpuAsCudaGroupMemoryForTests {
 public:
  ScopedCpuAsCudaGroupMemoryForTests();
  ~ScopedCpuAsCudaGroupMemoryForTests();
  ScopedCpuAsCudaGroupMemoryForTests(const ScopedCpuAsCudaGroupMemoryForTests&) = delete;
  ScopedCpuAsCudaGroupMemoryForTests& operator=(const ScopedCpuAsCudaGroupMemoryForTests&) = delete;
  // Calls whose host values went through the group's memory, by every thread since this was made.
  std::size_t relayed_calls() const;
};

// Whether `group`'s calls take memory on `device` as it is: the CPU for a host group, a CUDA
// device for a CUDA group (and the CPU there too while the switch above lives).
bool takes_as_is(const ProcessGroup& group, const c10::Device& device);

}  // namespace ddp::detail
