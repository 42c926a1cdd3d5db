// SplitBackward (split_backward.h): the input and weight halves of a stage's backward.
#include "torch/parallel/pipeline/split_backward.h"

#include <algorithm>
#include <cstdint>
#include <deque>
#include <map>
#include <set>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>

namespace ddp::detail {

namespace {

using torch::autograd::Edge;
using torch::autograd::Node;
using torch::autograd::variable_list;
// NodePtr in libtorch 1.13, c10::intrusive_ptr<Node> in later releases.
using NodePtr = decltype(Edge::function);

// The node a tensor's gradient enters the graph at: its grad_fn, or a leaf's accumulator.
NodePtr node_of(const torch::Tensor& t) {
  if (t.grad_fn()) return t.grad_fn();
  if (t.requires_grad()) return torch::autograd::impl::grad_accumulator(t);
  return nullptr;
}

// Keeps the gradients arriving at a node (one per output of its forward).
struct KeepArrivingGradients : torch::autograd::FunctionPreHook {
  explicit KeepArrivingGradients(std::shared_ptr<variable_list> kept) : kept(std::move(kept)) {}
  variable_list operator()(const variable_list& grads) override {
    *kept = grads;
    return grads;
  }
  std::shared_ptr<variable_list> kept;
};

}  // namespace

// Parameters whose branches leave the input path at the same nodes.
struct SplitBackward::Group {
  std::vector<NodePtr> nodes;                            // on the input path
  std::vector<std::shared_ptr<variable_list>> arriving;  // at each of them, in the input half
  std::vector<Edge> parameters;                          // their accumulators
};

torch::Tensor SplitBackward::backward_input(const torch::Tensor& output, const torch::Tensor& grad,
                                            const torch::Tensor& input,
                                            const std::vector<torch::Tensor>& parameters) {
  output_ = output;
  grad_ = grad.defined() ? grad : torch::ones_like(output);
  const auto root = node_of(output);
  const auto input_node = input.requires_grad() ? node_of(input) : nullptr;
  if (!root || !input_node) {
    whole_ = true;
    return {};
  }
  // Each node's parents (the nodes with an edge to it), from the output down.
  std::unordered_map<const Node*, std::vector<NodePtr>> parents;
  std::deque<NodePtr> queue{root};
  std::unordered_set<const Node*> seen{root.get()};
  while (!queue.empty()) {
    const auto node = queue.front();
    queue.pop_front();
    for (const auto& edge : node->next_edges()) {
      if (!edge.function) continue;
      parents[edge.function.get()].push_back(node);
      if (seen.insert(edge.function.get()).second) queue.push_back(edge.function);
    }
  }
  // The input path: every node from which the input is reached.
  std::unordered_set<const Node*> on_path{input_node.get()};
  queue = {input_node};
  while (!queue.empty()) {
    const auto node = queue.front();
    queue.pop_front();
    for (const auto& parent : parents[node.get()])
      if (on_path.insert(parent.get()).second) queue.push_back(parent);
  }
  // Each parameter's branch, up to where it meets the input path; groups that share a node merge.
  std::map<const Node*, std::shared_ptr<Group>> group_at;
  for (const auto& parameter : parameters) {
    if (!parameter.requires_grad()) continue;
    const auto accumulator = torch::autograd::impl::grad_accumulator(parameter);
    if (!accumulator || !seen.contains(accumulator.get())) continue;  // not used: no gradient
    std::vector<NodePtr> meets;
    std::unordered_set<const Node*> branch{accumulator.get()};
    queue = {accumulator};
    while (!queue.empty()) {
      const auto node = queue.front();
      queue.pop_front();
      for (const auto& parent : parents[node.get()]) {
        if (on_path.contains(parent.get())) {
          if (std::find(meets.begin(), meets.end(), parent) == meets.end()) meets.push_back(parent);
        } else if (branch.insert(parent.get()).second) {
          queue.push_back(parent);
        }
      }
    }
    auto group = std::make_shared<Group>();
    group->parameters.emplace_back(accumulator, 0);
    for (std::size_t k = 0; k < meets.size(); ++k) {  // grows as groups merge
      const auto node = meets[k];
      const auto found = group_at.find(node.get());
      if (found == group_at.end() || found->second == group) continue;
      // Merge the other group into this one.
      const auto other = found->second;
      for (const auto& p : other->parameters)
        group->parameters.push_back(p);
      for (const auto& n : other->nodes)
        if (std::find(meets.begin(), meets.end(), n) == meets.end()) meets.push_back(n);
      for (auto& [key, value] : group_at)
        if (value == other) value = group;
    }
    for (const auto& node : meets) {
      if (std::find(group->nodes.begin(), group->nodes.end(), node) == group->nodes.end())
        group->nodes.push_back(node);
      group_at[node.get()] = group;
    }
  }
  // A parameter whose branch meets the path twice (used at two places of it, e.g. a tied weight):
  // started at both nodes, the engine would also carry the later one's gradient down the path
  // into the earlier one, which already holds it, and count it twice. Such a stage's weight half
  // runs the whole backward into the parameters instead (correct, and as slow as no split).
  for (const auto& [node, group] : group_at) {
    if (group->nodes.size() > 1) tied_ = true;
  }
  if (tied_) {
    parameters_ = parameters;
    return torch::autograd::grad({output}, {input}, {grad_}, /*retain_graph=*/true,
                                 /*create_graph=*/false, /*allow_unused=*/true)[0];
  }
  std::set<Group*> done;
  for (const auto& [node, group] : group_at) {
    if (!done.insert(group.get()).second) continue;
    for (const auto& n : group->nodes) {
      auto kept = std::make_shared<variable_list>();
      n->add_pre_hook(std::make_unique<KeepArrivingGradients>(kept));
      group->arriving.push_back(kept);
    }
    groups_.push_back(group);
  }
  const auto grads = torch::autograd::grad({output}, {input}, {grad_}, /*retain_graph=*/true,
                                           /*create_graph=*/false, /*allow_unused=*/true);
  return grads[0];
}

void SplitBackward::backward_weight() {
  if (whole_) {
    if (output_.defined() && output_.requires_grad()) output_.backward(grad_);
  } else if (tied_) {
    std::vector<torch::Tensor> trainable;
    for (const auto& p : parameters_)
      if (p.requires_grad()) trainable.push_back(p);
    if (!trainable.empty()) {
      torch::autograd::backward({output_}, {grad_}, /*retain_graph=*/false,
                                /*create_graph=*/false, trainable);
    }
  } else {
    for (const auto& group : groups_) {
      torch::autograd::edge_list roots;
      variable_list arriving;
      for (std::size_t k = 0; k < group->nodes.size(); ++k) {
        const auto& kept = *group->arriving[k];
        for (std::size_t i = 0; i < kept.size(); ++i) {
          if (!kept[i].defined()) continue;
          roots.emplace_back(group->nodes[k], static_cast<std::uint32_t>(i));
          arriving.push_back(kept[i]);
        }
      }
      // No gradient reached the branch (as in a whole backward, none accumulates).
      if (roots.empty()) continue;
      torch::autograd::Engine::get_default_engine().execute(
          roots, arriving, /*keep_graph=*/true, /*create_graph=*/false, /*accumulate_grad=*/true,
          group->parameters);
    }
  }
  groups_.clear();
  parameters_.clear();
  output_ = torch::Tensor();
  grad_ = torch::Tensor();
}

}  // namespace ddp::detail
