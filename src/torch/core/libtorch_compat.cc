#include "torch/core/libtorch_compat.h"

#include <ATen/autocast_mode.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/version.h>

namespace ddp::libtorch_compat {

GradReadyHook::GradReadyHook(const torch::Tensor& param, std::function<void()> fn)
    : accumulator_(torch::autograd::impl::grad_accumulator(param)) {
  key_ = accumulator_->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
      [fn = std::move(fn)](const torch::autograd::variable_list& outputs,
                           const torch::autograd::variable_list& /*inputs*/) {
        fn();
        return outputs;
      }));
}

GradReadyHook::~GradReadyHook() {
  accumulator_->del_post_hook(key_);
}

bool GradReadyHook::attached_to(const torch::Tensor& param) const {
  return torch::autograd::impl::try_get_grad_accumulator(param).get() == accumulator_.get();
}

std::unordered_set<const torch::autograd::Node*> reachable_nodes(
    const std::vector<torch::Tensor>& outputs) {
  std::unordered_set<const torch::autograd::Node*> seen;
  std::vector<const torch::autograd::Node*> stack;
  for (const auto& output : outputs) {
    if (!output.defined() || !output.requires_grad()) continue;
    const auto& fn = output.grad_fn();
    const torch::autograd::Node* node =
        fn ? fn.get() : torch::autograd::impl::try_get_grad_accumulator(output).get();
    if (node != nullptr && seen.insert(node).second) stack.push_back(node);
  }
  while (!stack.empty()) {
    const auto* node = stack.back();
    stack.pop_back();
    for (const auto& edge : node->next_edges()) {
      const auto* next = edge.function.get();
      if (next != nullptr && seen.insert(next).second) stack.push_back(next);
    }
  }
  return seen;
}

void at_end_of_backward(std::function<void()> fn) {
  torch::autograd::Engine::get_default_engine().queue_callback(std::move(fn));
}

// 1.13 has CPU-specific functions; 2.x takes the device type (the old names were removed).
bool cpu_autocast_enabled() {
#if TORCH_VERSION_MAJOR >= 2
  return at::autocast::is_autocast_enabled(at::kCPU);
#else
  return at::autocast::is_cpu_enabled();
#endif
}

at::ScalarType cpu_autocast_dtype() {
#if TORCH_VERSION_MAJOR >= 2
  return at::autocast::get_autocast_dtype(at::kCPU);
#else
  return at::autocast::get_autocast_cpu_dtype();
#endif
}

bool cpu_autocast_supports_half() {
  return TORCH_VERSION_MAJOR >= 2;
}

void set_cpu_autocast(bool enabled, at::ScalarType dtype) {
#if TORCH_VERSION_MAJOR >= 2
  at::autocast::set_autocast_dtype(at::kCPU, dtype);
  at::autocast::set_autocast_enabled(at::kCPU, enabled);
#else
  at::autocast::set_autocast_cpu_dtype(dtype);
  at::autocast::set_cpu_enabled(enabled);
#endif
}

}  // namespace ddp::libtorch_compat
