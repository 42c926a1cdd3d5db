// Activation checkpointing (the role of torch.utils.checkpoint, non-reentrant semantics): trade
// compute for memory by keeping a function's inputs instead of the activations inside it, and
// running it again in the backward pass.
//
//   auto y = ddp::checkpoint([&](const torch::Tensor& x) { return block->forward(x); }, x);
//   auto model = ddp::apply_activation_checkpointing(sequential, ddp::checkpoint_every_child());
//
// checkpoint(function, inputs) runs `function` once in the forward pass and returns its outputs;
// the autograd graph of the result holds one node whose saved tensors are the inputs. The
// backward pass of that node runs `function` again on the same inputs, with the random number
// generators (the CPU's, that of every CUDA device an input lives on, and the tensor-parallel RNG
// tracker's that GptBlock's dropout draws from) and CPU autocast as they were in the forward pass,
// so that dropout draws the same masks, and back-propagates through the recomputation. Gradients
// reach the tensors the function used (inputs, the parameters of the modules it calls, any leaf it
// captured) through the outer backward pass as they would without checkpointing: parameters'
// gradients are accumulated by the outer pass, once, so the hooks of DistributedDataParallel, ZeRO
// and FSDP see them as they would without it, in buckets, with unused parameters found (a parameter
// the function does not use gets no gradient) and with static_graph. Parameters after a step are
// bit for bit those of the run without checkpointing.
//
// Which leaves the function uses is learned in the forward pass, which records the function's
// graph for a moment (its activations live until the function returns, as they would without
// checkpointing: the peak is one function's activations, not the whole model's).
//
// Errors, each a ddp::ConfigError naming what to do:
//   - the function captures a tensor that needs a gradient and is not a leaf (an activation made
//     outside it): pass it as an input instead;
//   - the function modifies an input in place (an in-place op, or a collective that reduces its
//     input in place): the recomputation would start from the modified values; clone it first;
//   - DistributedDataParallel's or FullyShardedDataParallel's forward inside the function: their
//     broadcasts, gathers and bookkeeping belong to one forward pass; checkpoint the modules they
//     wrap instead (raised from the backward pass, on every rank);
//   - the recomputation differs from the forward pass: a different number of outputs, another
//     shape, dtype or device of one, or other leaves used (say, a branch on a random draw or on
//     the time); raised from the backward pass.
// The function is kept (a copy of it) until the backward pass has run: what it refers to (the
// modules it calls) must live until then. Without gradient mode, or when no input nor leaf the
// function uses needs a gradient, the function just runs. The result of a checkpointed function
// cannot be differentiated twice (create_graph).
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <torch/torch.h>

// Exported by ddp's shared libraries, which hide the rest (src/CMakeLists.txt).
#pragma GCC visibility push(default)
namespace ddp {

using CheckpointedFunction =
    std::function<std::vector<torch::Tensor>(const std::vector<torch::Tensor>&)>;

std::vector<torch::Tensor> checkpoint(const CheckpointedFunction& function,
                                      const std::vector<torch::Tensor>& inputs);

// One or more tensors in, one tensor out: checkpoint(function, x), checkpoint(function, x, mask).
template <class Function, class... Inputs>
requires(std::is_convertible_v<const Inputs&, const torch::Tensor&>&&...) &&
    std::is_invocable_r_v<torch::Tensor, Function&, const Inputs&...> torch::Tensor
    checkpoint(Function&& function, const Inputs&... inputs) {
  auto outputs = checkpoint(
      [function = std::decay_t<Function>(std::forward<Function>(function))](
          const std::vector<torch::Tensor>& in) mutable -> std::vector<torch::Tensor> {
        return [&]<std::size_t... I>(std::index_sequence<I...>)->std::vector<torch::Tensor> {
          return {function(in[I]...)};
        }
        (std::index_sequence_for<Inputs...>{});
      },
      std::vector<torch::Tensor>{inputs...});
  return outputs.front();
}

// Which children of a Sequential to checkpoint: by index (0, 1, ...) and the child itself.
using CheckpointPredicate = std::function<bool(std::size_t index, const torch::nn::Module& child)>;

// Every child.
CheckpointPredicate checkpoint_every_child();
// The children whose module type is one of `type_names` (e.g. "torch::nn::LinearImpl", as
// Module::name() writes it).
CheckpointPredicate checkpoint_children_named(std::vector<std::string> type_names);

// A Sequential whose chosen children run under checkpoint() (the role of PyTorch's
// apply_activation_checkpointing): the children are the same modules, shared with `model`, under
// the same names (the Sequential's own and those inside each child), so parameters(),
// named_parameters() and state dicts are those of `model`.
// A child checkpointed must take one tensor and return one (Sequential's usual forward); the
// others are kept as they are. Throws ConfigError when the predicate chooses none.
torch::nn::Sequential apply_activation_checkpointing(const torch::nn::Sequential& model,
                                                     const CheckpointPredicate& predicate);

// The module that a child of apply_activation_checkpointing's result runs: the original child
// where it was checkpointed, else `child` itself (e.g. to find a block by its type).
std::shared_ptr<torch::nn::Module> checkpointed_module(
    const std::shared_ptr<torch::nn::Module>& child);

}  // namespace ddp
#pragma GCC visibility pop
