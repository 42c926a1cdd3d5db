// ScriptDistributedDataParallel: DistributedDataParallel for a TorchScript module
// (torch::jit::Module, from torch::jit::load of a file that Python's torch.jit.script or
// torch.jit.trace exported), so a model written in Python trains in C++ across processes.
//
//   auto pg = ddp::init_process_group();
//   auto model = ddp::ScriptDistributedDataParallel(torch::jit::load("model.pt"), pg);
//   torch::optim::SGD opt(model->parameters(), 0.1);   // or ddp::ZeroRedundancyOptimizer
//   for (...) {
//     opt.zero_grad();
//     torch::nn::functional::cross_entropy(model->forward(x), y).backward();
//     opt.step();
//   }
//
// Everything DistributedDataParallel does (ddp/torch/ddp/distributed_data_parallel.h) happens the
// same way, by the same code: the construction check and rank 0's broadcast, buckets and gradient
// hooks, buffer broadcasts, no_sync(), Join, comm hooks, the divergence guard. The module's
// parameters and buffers are its attributes (named_parameters/named_buffers, recursive, as Python
// names them: "conv1.weight", "bn.running_mean"), read from the module at every forward, so an
// attribute replaced after wrapping (module.setattr) is followed as a replaced nn::Module parameter
// is.
//
// This wrapper is a torch::nn::Module: parameters() and buffers() are the TorchScript module's
// own tensors (the same TensorImpls, under "module."), for optimizers and checkpoints; a
// parameter attribute replaced after wrapping shows there from the next forward, a replaced
// buffer does not (DDP itself follows both). train() and eval() set the TorchScript module's mode
// too (its `training` attributes, which a scripted BatchNorm or Dropout reads; a traced module
// keeps the mode it was traced in, see docs/torchscript.md); the wrapper starts in the mode the
// module was saved in.
//
// forward(inputs) runs the module's `forward` method on IValues and returns its IValue; the
// tensors inside it (a tensor, or tensors nested in tuples, lists and dicts) are the outputs DDP
// watches (find_unused_parameters). forward(tensor) is the common case of one tensor in, one out.
// The forward runs with the TorchScript graph executor's optimisation off (for that call and
// thread only), so autograd records one node per operation as for an nn::Module and each
// gradient is ready as backward reaches it: the optimised plan puts the whole forward in one
// differentiable graph whose backward hands every gradient over at its end, which leaves no
// bucket to overlap backward (+8 % step time and +46 % peak memory for the cnn at world 2,
// docs/torchscript.md). set_jit_graph_optimization(true) runs the optimised plan.
//
// Errors (before any collective, on the rank that has them): ConfigError for a module without a
// `forward` method or without a parameter that requires grad (nothing to synchronise: a module
// frozen with torch.jit.freeze, or exported after requires_grad_(False)); the errors of
// DistributedDataParallel otherwise (a module whose parameters differ across ranks is an Error
// naming the first differing parameter and the ranks).
//
// Threads and lifetime: as DistributedDataParallel. The TorchScript module is a handle: this keeps
// the module object alive, and the caller's handle sees the same tensors and mode.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <torch/script.h>
#include <torch/torch.h>

#include "ddp/comm/process_group.h"
#include "ddp/torch/ddp/distributed_data_parallel.h"

// Exported by ddp's shared libraries, which hide the rest (src/CMakeLists.txt).
#pragma GCC visibility push(default)
namespace ddp {
namespace detail {
class ScriptModuleView;
}  // namespace detail

class ScriptDistributedDataParallelImpl : public DistributedDataParallelBase {
 public:
  // `group` null = default_process_group(). Collective (as DistributedDataParallel).
  explicit ScriptDistributedDataParallelImpl(torch::jit::Module module,
                                             std::shared_ptr<ProcessGroup> group = nullptr,
                                             DdpOptions options = {});

  // Runs the module's forward method on `inputs`.
  torch::jit::IValue forward(std::vector<torch::jit::IValue> inputs);
  // One tensor in, one tensor out; Error if the module's forward returns something else.
  torch::Tensor forward(torch::Tensor input);

  // Sets this wrapper's and the TorchScript module's mode (recursively).
  void train(bool on = true) override;

  // Whether forward runs TorchScript's optimised plan (default false: see the header comment).
  void set_jit_graph_optimization(bool on) { jit_graph_optimization_ = on; }
  bool jit_graph_optimization() const { return jit_graph_optimization_; }

  // The wrapped TorchScript module (a handle to the same object).
  const torch::jit::Module& module() const { return module_; }

 private:
  ScriptDistributedDataParallelImpl(torch::jit::Module module,
                                    std::shared_ptr<detail::ScriptModuleView> view,
                                    std::shared_ptr<ProcessGroup> group, DdpOptions options);

  torch::jit::Module module_;
  // The nn::Module view of module_'s tensors registered as "module" (parameters()).
  std::shared_ptr<detail::ScriptModuleView> view_;
  bool jit_graph_optimization_ = false;
};

// The module holder, as TORCH_MODULE's: `ddp::ScriptDistributedDataParallel model{nullptr}` is
// empty until assigned.
class ScriptDistributedDataParallel
    : public torch::nn::ModuleHolder<ScriptDistributedDataParallelImpl> {
 public:
  ScriptDistributedDataParallel(std::nullptr_t) : ModuleHolder(nullptr) {}
  explicit ScriptDistributedDataParallel(torch::jit::Module module,
                                         std::shared_ptr<ProcessGroup> group = nullptr,
                                         DdpOptions options = {})
      : ModuleHolder(std::make_shared<ScriptDistributedDataParallelImpl>(
            std::move(module), std::move(group), options)) {}
};

}  // namespace ddp
#pragma GCC visibility pop
