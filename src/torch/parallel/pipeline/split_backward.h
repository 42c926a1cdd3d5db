// A stage's backward in two halves, for the zero-bubble schedule (pipeline.h): the input half
// computes only the gradient of the stage's input (what the previous stage waits for), the weight
// half, later, the parameters' gradients, without running the input half's path again (the idea
// of PyTorch's pipelining/_backward.py: stage_backward_input / stage_backward_weight).
//
// How. In the autograd graph of the stage's output, the nodes on a path to the input are the
// "input path"; each parameter's branch leaves it at some of them (a Linear's addmm: its input
// gradient is on the path, its weight's is not). The input half registers a pre-hook on those
// nodes that keeps the gradient arriving there, then differentiates the output with respect to
// the input alone (the engine skips the parameters' branches), keeping the graph. The weight
// half starts the engine at those nodes with the kept gradients and runs only the branches to
// their parameters, accumulating into .grad, then lets the graph go. Together they accumulate
// what one output.backward(grad) would.
//
// When the input needs no gradient (the first stage), the input half does nothing and the weight
// half runs the whole backward. When a parameter is used at two places of the input path (a tied
// weight), the weight half runs the whole backward into the parameters alone (the split would
// count the later use's gradient twice).
#pragma once

#include <memory>
#include <vector>

#include <torch/torch.h>

namespace ddp::detail {

class SplitBackward {
 public:
  // The input half: returns d(output)/d(input) . grad (undefined when the input needs none).
  // `output` is the stage's output (grad: the next stage's gradient) or its scalar loss (grad:
  // undefined, meaning 1).
  torch::Tensor backward_input(const torch::Tensor& output, const torch::Tensor& grad,
                               const torch::Tensor& input,
                               const std::vector<torch::Tensor>& parameters);
  // The weight half: the parameters' gradients accumulated into their .grad. Once.
  void backward_weight();

 private:
  struct Group;
  torch::Tensor output_, grad_;
  bool whole_ = false;  // the input needs no gradient: backward_weight runs the whole backward
  bool tied_ = false;   // a parameter meets the input path twice: the same, into the parameters
  std::vector<torch::Tensor> parameters_;
  std::vector<std::shared_ptr<Group>> groups_;
};

}  // namespace ddp::detail
