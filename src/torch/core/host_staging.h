// Host staging of the tensor-level API (distributed.h) for CUDA tensors on a group that reads
// host memory (ring, mpi), as gloo stages CUDA tensors: the call runs on host copies, made after
// the work queued on the current stream (a synchronous device-to-host copy), and the tensors it
// writes get their results back before its wait() returns: the Work becomes a chain whose last
// step copies host to device (synchronously, so the caller's stream sees the values), and its
// result is the caller's tensors. A failed call copies nothing back: the tensors keep their
// values. CPU tensors pass through untouched.
//
// On a CUDA group (nccl) the calls that pack their tensors on the host (the list and coalesced
// forms: `packs_on_host`) are staged the same way, and their inner call runs on the group's
// HostValues relay (host_values.h), which takes the packed host buffers to the device for NCCL
// and back: four copies in all, correct but slow (the single-tensor forms hand NCCL device memory
// directly). Internal.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <vector>

#include <torch/torch.h>

#include "ddp/comm/process_group.h"

namespace ddp::detail {

// The inner call: `read` and `written` are the host copies, `group` the group to call (the
// caller's host group, or a CUDA group's relay).
using StagedCall = std::function<std::shared_ptr<Work>(const std::vector<torch::Tensor>& read,
                                                       const std::vector<torch::Tensor>& written,
                                                       ProcessGroup& group)>;

// Whether a call on `group` with `tensors` runs through run_on_host: some tensor is a CUDA
// tensor, the group reads host memory (or it is a CUDA group and the call `packs_on_host`), and
// the call is not already a staged one's inner call.
bool must_stage(ProcessGroup& group, const std::vector<torch::Tensor>& tensors,
                bool packs_on_host = false);

// Runs `call` on `group` (its relay for a CUDA group) with host copies of `read` (tensors the call
// only reads) and `written` (tensors it writes, in place or as outputs; their copies start with
// their values, for the parts a call leaves alone), and returns its Work chained with the copy back
// of `written`, whose result is `result` (the call's outputs as the caller passed them; `written`
// when null). With `blocking`, waits and returns Work::completed_blocking_call().
std::shared_ptr<Work> run_on_host(ProcessGroup& group, const std::vector<torch::Tensor>& read,
                                  const std::vector<torch::Tensor>& written, const StagedCall& call,
                                  bool blocking = false,
                                  const std::vector<torch::Tensor>* result = nullptr);

// Tests without a GPU: while one lives, must_stage is also true for CPU tensors on this thread,
// which are then staged through host clones the same way; copies() counts the tensors copied
// to the host and back by every thread since it was made.
class ScopedStagingOfCpuTensorsForTests {
 public:
  ScopedStagingOfCpuTensorsForTests();
  ~ScopedStagingOfCpuTensorsForTests();
  ScopedStagingOfCpuTensorsForTests(const ScopedStagingOfCpuTensorsForTests&) = delete;
  ScopedStagingOfCpuTensorsForTests& operator=(const ScopedStagingOfCpuTensorsForTests&) = delete;
  std::size_t copies_to_host() const;
  std::size_t copies_back() const;
};

}  // namespace ddp::detail
