// DeviceStaging over CUDA streams and events (see device_staging.h). Compiled only when the
// libtorch has CUDA (DDP_TORCH_CUDA). Everything goes through c10's streams and events and
// ATen's copies, never the CUDA runtime API directly: ddp links no libcudart of its own
// (cmake/DdpFindTorch.cmake, --as-needed). Hence the device-generic guards (c10::DeviceGuard,
// c10::StreamGuard, c10::Event reach CUDA through libc10_cuda's registered implementation):
// c10::cuda::CUDAGuard would instantiate CUDAGuardImpl's inline methods, which call the runtime.
#include <algorithm>
#include <memory>
#include <thread>
#include <vector>

#include <c10/core/DeviceGuard.h>
#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <fmt/format.h>

#include "ddp/error.h"
#include "torch/core/device_staging.h"

namespace ddp::detail {
namespace {

using Clock = std::chrono::steady_clock;

class CudaStaging final : public DeviceStaging {
 public:
  explicit CudaStaging(c10::Device device)
      : device_(device),
        copy_out_stream_(c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device.index())),
        copy_in_stream_(c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device.index())) {}

  std::vector<torch::Tensor> make_twins(const std::vector<torch::Tensor>& buckets) override {
    std::vector<torch::Tensor> twins;
    for (std::size_t b = 0; b < buckets.size(); ++b) {
      const auto& bucket = buckets[b];
      try {
        // Page-locked, so that the copies are DMA transfers that overlap compute (pageable
        // memory would make them synchronous).
        twins.push_back(
            torch::empty({bucket.numel()},
                         torch::TensorOptions().dtype(bucket.scalar_type()).pinned_memory(true)));
      } catch (const c10::Error& e) {
        throw Error(fmt::format(
            "DistributedDataParallel: could not allocate the pinned host twin of gradient bucket "
            "{} ({} bytes, for a bucket on {}): {}. Pinned memory is limited by the host's RAM "
            "and its locked-memory limit (ulimit -l); use a smaller bucket_cap_mb or fewer "
            "processes per host",
            b + 1, bucket.nbytes(), device_.str(), e.what_without_backtrace()));
      }
    }
    const auto events = [&] {
      std::vector<std::unique_ptr<c10::Event>> list;
      for (std::size_t b = 0; b < buckets.size(); ++b)
        list.push_back(std::make_unique<c10::Event>(c10::DeviceType::CUDA));
      return list;
    };
    ready_ = events();
    copied_out_ = events();
    copied_in_ = events();
    return twins;
  }

  void copy_out(std::size_t b, const torch::Tensor& bucket, torch::Tensor& twin) override {
    torch::NoGradGuard no_grad;
    const c10::DeviceGuard guard(device_);
    // The gradients were written into the bucket on the current stream (the one autograd runs
    // this part of backward on): the copy must follow that work, not the default stream.
    ready_[b]->record(c10::cuda::getCurrentCUDAStream(device_.index()));
    ready_[b]->block(copy_out_stream_);
    {
      const c10::StreamGuard on_copy_stream(copy_out_stream_);
      twin.copy_(bucket, /*non_blocking=*/true);
    }
    // The caching allocator must not hand the bucket's memory to others while this stream reads it.
    bucket.record_stream(copy_out_stream_);
    copied_out_[b]->record(copy_out_stream_);
  }

  bool wait_copied_out(std::size_t b, Clock::time_point deadline) override {
    // Polled rather than synchronised: a device that never finishes the copy must not hold this
    // thread past the deadline.
    auto pause = std::chrono::microseconds(20);
    while (!copied_out_[b]->query()) {
      if (Clock::now() >= deadline) return false;
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::microseconds(1000));
    }
    return true;
  }

  void copy_in(std::size_t b, const torch::Tensor& twin, torch::Tensor& bucket) override {
    torch::NoGradGuard no_grad;
    const c10::DeviceGuard guard(device_);
    {
      const c10::StreamGuard on_copy_stream(copy_in_stream_);
      bucket.copy_(twin, /*non_blocking=*/true);
    }
    bucket.record_stream(copy_in_stream_);
    copied_in_[b]->record(copy_in_stream_);
  }

  void join() override {
    const c10::DeviceGuard guard(device_);
    const c10::Stream current = c10::cuda::getCurrentCUDAStream(device_.index());
    // An event never recorded blocks nothing; one recorded in an earlier pass is long complete.
    for (const auto& event : copied_in_)
      event->block(current);
  }

 private:
  c10::Device device_;
  c10::cuda::CUDAStream copy_out_stream_;
  c10::cuda::CUDAStream copy_in_stream_;
  // Per bucket: the current stream reached the bucket's readiness; its twin holds it; the bucket
  // holds the twin's reduction.
  std::vector<std::unique_ptr<c10::Event>> ready_;
  std::vector<std::unique_ptr<c10::Event>> copied_out_;
  std::vector<std::unique_ptr<c10::Event>> copied_in_;
};

class CudaDoneEvent final : public DoneEvent {
 public:
  explicit CudaDoneEvent(c10::Device device) : device_(device), event_(c10::DeviceType::CUDA) {
    // c10::Event makes its cudaEvent_t when first recorded: once now, so that the group has one
    // to record (and block() one to wait on: it waits only for an event recorded once).
    c10::DeviceGuard guard(device_);
    event_.record(c10::cuda::getCurrentCUDAStream(device_.index()));
  }
  void* handle() const override { return event_.eventId(); }
  void wait_on_current_stream() override {
    event_.block(c10::cuda::getCurrentCUDAStream(device_.index()));
  }

 private:
  c10::Device device_;
  c10::Event event_;
};

}  // namespace

std::unique_ptr<DoneEvent> make_cuda_done_event(c10::Device device) {
  if (!device.is_cuda() || !device.has_index()) {
    throw ConfigError(
        fmt::format("a CUDA event needs a CUDA device with an index, not {}", device.str()));
  }
  return std::make_unique<CudaDoneEvent>(device);
}

std::unique_ptr<DeviceStaging> make_cuda_staging(c10::Device device) {
  if (!device.is_cuda() || !device.has_index()) {
    throw ConfigError(
        fmt::format("CUDA staging needs a CUDA device with an index, not {}", device.str()));
  }
  return std::make_unique<CudaStaging>(device);
}

void* current_cuda_stream(c10::Device device) {
  return c10::cuda::getCurrentCUDAStream(device.index()).stream();
}

}  // namespace ddp::detail
