// Distributed autograd, as PyTorch's torch.distributed.autograd in its FAST mode (docs/rpc.md):
// one backward across every worker a step's RPCs touched, its gradients kept in the step's
// context instead of .grad.
//
//   {
//     ddp::rpc::dist_autograd::Context context;            // current on this thread
//     auto y = ddp::rpc::rpc_sync("ps", "f", {x});         // x requires grad: a send is recorded
//     auto loss = model->forward(y.toTensor()).sum();
//     ddp::rpc::dist_autograd::backward(context.id(), {loss});
//     auto grads = ddp::rpc::dist_autograd::get_gradients(context.id());  // (tensor, gradient)
//     optimizer.step(context.id());
//   }                                                      // ends it on every worker it touched
//
// Under a current context, every RPC whose arguments (or result) hold tensors that require grad
// records a send on the sender and a receive on the receiver (the received tensors require grad
// there); the callee runs the function, and what it sends back, in the same context. backward()
// runs the local graph from the roots; each received tensor's gradient goes back by RPC to its
// sender, which runs its graph from the tensors it sent, and so on; it returns when every worker
// is done. Gradients of the leaves reached (parameters, and tensors created with requires_grad)
// are summed into the context of the worker that holds them; .grad is left as it was (hooks on
// gradient accumulation, such as DistributedDataParallel's, run, and their results are what the
// context keeps).
//
// Errors: backward() or get_gradients() of a context this worker does not have (ended, or never
// created) is RpcError kRefused naming it; a worker that no longer has it fails the backward with
// RpcError naming the context; a root that is not a scalar is ConfigError.
// Threads: a Context is current on the thread that made it (and in the functions RPCs run for it).
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

// Exported by ddp's shared libraries, which hide the rest (src/CMakeLists.txt).
#pragma GCC visibility push(default)
namespace ddp::rpc::dist_autograd {

class Context {
 public:
  Context();
  ~Context();
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;
  std::int64_t id() const { return id_; }

 private:
  std::int64_t id_;
  std::int64_t previous_;
};

void backward(std::int64_t context_id, const std::vector<at::Tensor>& roots);
// (leaf, its gradient) for every leaf this worker holds that the context's backward reached.
std::vector<std::pair<at::Tensor, at::Tensor>> get_gradients(std::int64_t context_id);
// Contexts this worker holds (for tests and leak checks).
std::size_t context_count();

}  // namespace ddp::rpc::dist_autograd
#pragma GCC visibility pop
