// What differs between the libtorch versions ddp builds against, Debian's 1.13 and PyTorch's
// 2.x (2.1 and later; cmake/DdpFindTorch.cmake refuses others), in one place: the rest of
// ddp::torch calls these instead of libtorch's autograd internals.
//
// The reducer's "gradient ready" signal: libtorch's C++ API has no public hook that runs once a
// leaf's gradient has been accumulated into .grad. Python's
// Tensor.register_post_accumulate_grad_hook (2.1) has no C++ counterpart up to 2.15: it keeps
// Python callables in one slot per tensor, which a C++ library must not take over. So with either
// version the hook is a post hook on the parameter's AccumulateGrad node, as PyTorch's own c10d
// Reducer does. What changed between the versions is how graph nodes are owned (std::shared_ptr
// in 1.13, c10::intrusive_ptr in 2.x); NodePtr follows whichever this libtorch uses.
//
// Threads: hooks run on the autograd engine's threads; callers synchronise their own state.
#pragma once

#include <cstdint>
#include <functional>
#include <sstream>
#include <string>
#include <type_traits>
#include <unordered_set>
#include <utility>
#include <vector>

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/torch.h>

namespace ddp::libtorch_compat {

// An owning pointer to an autograd graph node, of the kind this libtorch uses.
using NodePtr = decltype(torch::autograd::impl::grad_accumulator(
    std::declval<const torch::autograd::Variable&>()));

// Runs `fn` each time autograd has accumulated `param`'s gradient (on the engine's thread).
// Attached on construction to the parameter's current gradient accumulator, which it keeps alive
// (a parameter holds its accumulator weakly), and detached on destruction.
// REQUIRES: param is a leaf that requires grad.
class GradReadyHook {
 public:
  GradReadyHook(const torch::Tensor& param, std::function<void()> fn);
  ~GradReadyHook();
  GradReadyHook(const GradReadyHook&) = delete;
  GradReadyHook& operator=(const GradReadyHook&) = delete;

  // Whether `param`'s gradient accumulator is still the one this hook is attached to: not after
  // the parameter was replaced by another tensor (Module::load, assigning a new tensor).
  bool attached_to(const torch::Tensor& param) const;
  // The accumulator node, to look for among reachable_nodes().
  const torch::autograd::Node* node() const { return accumulator_.get(); }

 private:
  NodePtr accumulator_;
  std::uintptr_t key_ = 0;
};

// Every autograd node that a backward pass from `outputs` can reach: their grad_fn (or a leaf's
// gradient accumulator) and all nodes behind them. Outputs that do not require grad add nothing.
std::unordered_set<const torch::autograd::Node*> reachable_nodes(
    const std::vector<torch::Tensor>& outputs);

// Runs `fn` once the current backward pass has finished (the engine's final callback).
// REQUIRES: called from within a backward pass, e.g. from a GradReadyHook.
void at_end_of_backward(std::function<void()> fn);

// CPU autocast state of this thread (at::autocast's CPU functions, renamed in 2.x).
bool cpu_autocast_enabled();
at::ScalarType cpu_autocast_dtype();
void set_cpu_autocast(bool enabled, at::ScalarType dtype);
// Whether CPU autocast runs in float16 (2.x does; 1.13 warns and disables itself).
bool cpu_autocast_supports_half();
// The key of `param` in torch::optim::Optimizer::state(): its TensorImpl's address as text in
// 1.13 (as libtorch's own serialisation writes it), the
// address itself in 2.x.
using OptimizerStateKey =
    std::decay_t<decltype(std::declval<torch::optim::Optimizer&>().state())>::key_type;
template <class Key = OptimizerStateKey>
Key optimizer_state_key(const torch::Tensor& param) {
  if constexpr (std::is_same_v<Key, std::string>) {
    std::ostringstream text;  // what c10::guts::to_string(TensorImpl*) writes
    text << static_cast<const void*>(param.unsafeGetTensorImpl());
    return text.str();
  } else {
    return static_cast<Key>(param.unsafeGetTensorImpl());
  }
}

}  // namespace ddp::libtorch_compat
