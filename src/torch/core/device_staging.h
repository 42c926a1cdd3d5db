// DeviceStaging: the stream order of gradient buckets that live where the group cannot read them
// (a CUDA bucket on a host group: ring, mpi), reduced through host twins.
//
//   buckets built or rebuilt     make_twins()     one host twin per bucket (pinned for CUDA)
//   bucket ready (autograd)      copy_out(b)      an event on the current stream; the copy-out
//                                                 stream waits on it and copies bucket -> twin
//                                                 asynchronously; returns at once
//   staging thread               wait_copied_out  the twin holds the bucket (or the deadline
//                                                 passed): only now may the engine read it
//   reduction done (any thread)  copy_in(b)       twin -> bucket on the copy-in stream
//   end of backward (autograd)   join()           the current stream waits on every copy_in
//
// The caller keeps that order (src/torch/ddp/reducer_launch.cc); the autograd thread never blocks
// on a copy. Calls for different buckets may come from different threads at once; calls for one
// bucket come in the order above. Two implementations: CUDA streams and events (cuda_staging.cc,
// compiled with DDP_TORCH_CUDA), and a host one for tests that stages CPU buckets the same way,
// copying at once and reporting every step to an observer (ReducerOptions::staging_for_tests).
#pragma once

#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <string_view>
#include <vector>

#include <torch/torch.h>

namespace ddp::detail {

// Steps reported by the host implementation: "twin" (make_twins, once per bucket), "copy_out",
// "copied_out" (wait_copied_out returned), "copy_in", "join" (bucket is then 0); `twin` is the
// bucket's host twin's address (null for "join").
using StagingObserver =
    std::function<void(std::string_view step, std::size_t bucket, const void* twin)>;

class DeviceStaging {
 public:
  virtual ~DeviceStaging() = default;
  // Host twins of `buckets` (same dtype and size); drops the state of earlier buckets. Throws
  // ddp::Error naming the bucket and its size when the memory cannot be allocated.
  virtual std::vector<torch::Tensor> make_twins(const std::vector<torch::Tensor>& buckets) = 0;
  virtual void copy_out(std::size_t b, const torch::Tensor& bucket, torch::Tensor& twin) = 0;
  // Returns once the copy_out of bucket b has completed (true) or at `deadline` (false).
  virtual bool wait_copied_out(std::size_t b, std::chrono::steady_clock::time_point deadline) = 0;
  virtual void copy_in(std::size_t b, const torch::Tensor& twin, torch::Tensor& bucket) = 0;
  virtual void join() = 0;
};

// CPU buckets staged through host twins (tests of the order; see above).
std::unique_ptr<DeviceStaging> make_host_staging(StagingObserver observer);

// CUDA buckets on `device` (a CUDA device). Throws ConfigError in builds without CUDA
// (DDP_TORCH_CUDA unset: the libtorch had none).
std::unique_ptr<DeviceStaging> make_cuda_staging(c10::Device device);

// An event for a stream-ordered collective on a device group (CallOptions::cuda_done_event): the
// group records it on its stream after the call; wait_on_current_stream() then makes the
// device's current stream wait for the call's results, without blocking the host.
class DoneEvent {
 public:
  virtual ~DoneEvent() = default;
  virtual void* handle() const = 0;  // the cudaEvent_t, for CallOptions::cuda_done_event
  virtual void wait_on_current_stream() = 0;
};

// One on `device` (a CUDA device with an index). ConfigError in builds without CUDA.
std::unique_ptr<DoneEvent> make_cuda_done_event(c10::Device device);

// The current CUDA stream of `device` as a cudaStream_t (CallOptions::cuda_stream), for a group
// whose buffers are device memory. ConfigError in builds without CUDA.
void* current_cuda_stream(c10::Device device);

}  // namespace ddp::detail
