#include "torch/core/parameter_devices.h"

#include <fmt/format.h>

#include "ddp/error.h"

namespace ddp::detail {

std::optional<std::string> mixed_devices(const std::vector<torch::Tensor>& parameters,
                                         const std::vector<std::string>& names) {
  for (std::size_t i = 1; i < parameters.size(); ++i) {
    if (parameters[i].device() == parameters[0].device()) continue;
    return fmt::format(
        "DistributedDataParallel: parameter '{}' is on {} but parameter '{}' is on {}; every "
        "parameter of the wrapped module must be on one device. Move the module there with "
        "module->to(device) before wrapping it",
        names[0], parameters[0].device().str(), names[i], parameters[i].device().str());
  }
  return std::nullopt;
}

void check_device_usable(const c10::Device& device, const std::string& what) {
  if (!device.is_cuda()) return;
  // Asked before the device is touched: libtorch's own error for a bad index is an assertion
  // from deep inside the allocator.
  const auto count = static_cast<int>(torch::cuda::device_count());
  const int index = device.has_index() ? device.index() : 0;
  if (index < count) return;
  throw ConfigError(fmt::format(
      "{} is {}, but this process sees {} CUDA device{}{}", what, device.str(), count,
      count == 1 ? "" : "s",
      count == 0 ? " (no GPU, or a libtorch without CUDA): use the CPU (torch::kCPU)"
                 : fmt::format(": use an index below {} (CUDA_VISIBLE_DEVICES renumbers the "
                               "visible devices from 0)",
                               count)));
}

}  // namespace ddp::detail
