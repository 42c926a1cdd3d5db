// Where the parameters and tensors that ddp is given live: the checks that name a wrong device
// before anything is allocated or communicated there.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include <torch/torch.h>

namespace ddp::detail {

// An error text naming two parameters on different devices (and the fix: module->to(device)),
// or nullopt when every parameter is on one device.
std::optional<std::string> mixed_devices(const std::vector<torch::Tensor>& parameters,
                                         const std::vector<std::string>& names);

// Throws ConfigError when `device` is a CUDA device this process cannot use: no CUDA in this
// build or on this machine, or an index beyond the devices it sees (named, with their count).
// `what` names whoever asked for the device, e.g. "load_checkpoint's map_location".
void check_device_usable(const c10::Device& device, const std::string& what);

}  // namespace ddp::detail
