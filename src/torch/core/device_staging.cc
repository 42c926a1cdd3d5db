#include "torch/core/device_staging.h"

#include <fmt/format.h>

#include "ddp/error.h"
#include "ddp/torch/core/version.h"

namespace ddp::detail {
namespace {

// The same steps as the CUDA implementation, on the host: each copy happens at once (so
// wait_copied_out has nothing to wait for), and each step is reported in the order it happens.
class HostStaging final : public DeviceStaging {
 public:
  explicit HostStaging(StagingObserver observer) : observer_(std::move(observer)) {}

  std::vector<torch::Tensor> make_twins(const std::vector<torch::Tensor>& buckets) override {
    std::vector<torch::Tensor> twins;
    for (std::size_t b = 0; b < buckets.size(); ++b) {
      // Memory of its own (never the bucket's): a test can tell which one the engine was given.
      twins.push_back(torch::empty_like(buckets[b], torch::MemoryFormat::Contiguous));
      report("twin", b, twins.back());
    }
    return twins;
  }
  void copy_out(std::size_t b, const torch::Tensor& bucket, torch::Tensor& twin) override {
    torch::NoGradGuard no_grad;
    twin.copy_(bucket);
    report("copy_out", b, twin);
  }
  bool wait_copied_out(std::size_t b, std::chrono::steady_clock::time_point) override {
    report("copied_out", b, {});
    return true;
  }
  void copy_in(std::size_t b, const torch::Tensor& twin, torch::Tensor& bucket) override {
    torch::NoGradGuard no_grad;
    bucket.copy_(twin);
    report("copy_in", b, twin);
  }
  void join() override { report("join", 0, {}); }

 private:
  void report(std::string_view step, std::size_t b, const torch::Tensor& twin) const {
    if (observer_) observer_(step, b, twin.defined() ? twin.data_ptr() : nullptr);
  }
  StagingObserver observer_;
};

}  // namespace

std::unique_ptr<DeviceStaging> make_host_staging(StagingObserver observer) {
  return std::make_unique<HostStaging>(std::move(observer));
}

#ifndef DDP_TORCH_CUDA
std::unique_ptr<DeviceStaging> make_cuda_staging(c10::Device device) {
  throw ConfigError(fmt::format(
      "the gradients are on {}, but this ddp was built against libtorch {}, which has no CUDA "
      "(see the 'ddp: torch layer without CUDA' line of its configuration). Build ddp against a "
      "CUDA-enabled libtorch (-DDDP_LIBTORCH=pytorch), or keep the model on the CPU",
      device.str(), libtorch_version()));
}

void* current_cuda_stream(c10::Device device) {
  make_cuda_staging(device);  // throws the same named error
  return nullptr;
}

std::unique_ptr<DoneEvent> make_cuda_done_event(c10::Device device) {
  make_cuda_staging(device);  // throws the same named error
  return nullptr;
}
#endif

}  // namespace ddp::detail
