// Optimizer state that crosses between Python and C++: libtorch's SGD, Adam and AdamW saved in
// the layout of Python's `optimizer.state_dict()` and loaded from it, so a run can start in
// Python and continue in C++ on the same trajectory, and back.
//
//   ddp::save_optimizer_state_dict(optimizer, "opt.pt");   // Python: opt.load_state_dict(
//                                                          //   torch.load("opt.pt"))
//   ddp::load_optimizer_state_dict(optimizer, "from_python.pt");
//
// Layout: {"state": {index: {...}}, "param_groups": [{hyper-parameters..., "params": [index,
// ...]}]}. Parameters are numbered in the order of the optimizer's groups and their parameters,
// as Python numbers them: build the C++ optimizer over the parameters in the order Python's was
// (module->parameters() and model.parameters() agree). Per parameter: SGD `momentum_buffer`;
// Adam and AdamW `step` (a 0-dim float tensor, which PyTorch 1.13 and 2.x both use; a number is
// accepted when reading), `exp_avg`, `exp_avg_sq`, and `max_exp_avg_sq` with amsgrad. Groups
// carry lr, momentum, dampening, weight_decay, nesterov (SGD) or betas, eps, weight_decay, amsgrad
// (Adam, AdamW) and Python's flags (maximize, foreach, differentiable, fused, capturable,
// decoupled_weight_decay) at the values libtorch's optimizers implement.
//
// Loading replaces the optimizer's options with the file's (as Python's load_state_dict does) and
// its state with the file's state, after validating all of it; a failed load changes nothing.
// PyTorch 1.13's `torch.load(weights_only=True)` cannot read any optimizer state (its restricted
// unpickler has no floats): load these files with weights_only=False there, or use 2.x.
//
// Errors: OptimizerMismatchError (optimizer_mismatch_error.h) when the file holds another
// optimizer (SGD vs Adam, Adam vs AdamW where the file says, SGD with maximize) or another number
// of groups or parameters; StateDictMismatchError when a state tensor's shape or dtype differs from
// its parameter's; ConfigError for an optimizer other than SGD, Adam or AdamW; the read errors of
// state_dict.h.
#pragma once

#include <filesystem>

#include <torch/torch.h>

#include "ddp/torch/formats/optimizer_mismatch_error.h"
#include "ddp/torch/formats/state_dict.h"

// Exported by ddp's shared libraries, which hide the rest (src/CMakeLists.txt).
#pragma GCC visibility push(default)
namespace ddp {

// Writes `optimizer`'s state and groups to `path` (through PATH.tmp, as save_state_dict). For a
// ZeroRedundancyOptimizer pass state_dict() on the rank that consolidated.
void save_optimizer_state_dict(const torch::optim::Optimizer& optimizer,
                               const std::filesystem::path& path);

// Loads a Python optimizer.state_dict() (or one save_optimizer_state_dict wrote) into `optimizer`.
// Everything is checked before anything changes: state tensors of another shape or dtype are a
// StateDictMismatchError, hyper-parameters and step counts the training loop cannot use (a NaN,
// infinite or negative learning rate, a step that is not a whole number >= 0) a
// StateDictFormatError naming the key (e.g. "param_groups[0]['lr'] is nan").
void load_optimizer_state_dict(torch::optim::Optimizer& optimizer,
                               const std::filesystem::path& path);

}  // namespace ddp
#pragma GCC visibility pop
