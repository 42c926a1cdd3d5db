#include "ddp/torch/recompute/activation_checkpoint.h"

#include <ATen/SequenceNumber.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <unordered_set>
#include <utility>

#include <fmt/format.h>

#include "ddp/error.h"
#include "torch/core/libtorch_compat.h"
#include "torch/core/recomputation.h"

namespace ddp {
namespace {

using torch::autograd::Edge;
using torch::autograd::Node;
using NodePtr = libtorch_compat::NodePtr;

// The random number generators a recomputation must replay: the CPU's, the default one of each
// CUDA device an input lives on, and those the function noted drawing from
// (detail::note_generator_draw).
struct RngStates {
  std::vector<std::pair<at::Generator, torch::Tensor>> saved;

  static RngStates capture(const std::vector<torch::Tensor>& inputs) {
    std::vector<c10::Device> devices{c10::Device(c10::kCPU)};
    for (const auto& x : inputs) {
      if (x.defined() && x.is_cuda() &&
          std::find(devices.begin(), devices.end(), x.device()) == devices.end()) {
        devices.push_back(x.device());
      }
    }
    RngStates states;
    for (const auto& device : devices) {
      at::Generator generator = at::globalContext().defaultGenerator(device);
      std::lock_guard lock(generator.mutex());
      states.saved.emplace_back(generator, generator.get_state());
    }
    return states;
  }
  void restore() const {
    for (const auto& [generator, state] : saved) {
      at::Generator g = generator;
      std::lock_guard lock(g.mutex());
      g.set_state(state);
    }
  }
  // The generators' states now, to put back after a recomputation.
  RngStates now() const {
    RngStates states;
    for (const auto& [generator, unused] : saved) {
      at::Generator g = generator;
      std::lock_guard lock(g.mutex());
      states.saved.emplace_back(g, g.get_state());
    }
    return states;
  }
};

struct OutputShape {
  std::vector<int64_t> sizes;
  at::ScalarType dtype;
  c10::Device device;
  bool requires_grad;

  bool operator==(const OutputShape&) const = default;
  std::string describe() const {
    return fmt::format("{} tensor of shape [{}] on {}{}", c10::toString(dtype),
                       fmt::join(sizes, ", "), device.str(),
                       requires_grad ? " that needs a gradient" : "");
  }
};

// One run of the function with gradient mode on: its outputs, and the gradient edges of the leaves
// it used besides its inputs (parameters, captured leaves).
struct TracedRun {
  std::vector<torch::Tensor> outputs;
  std::vector<OutputShape> shapes;
  std::vector<Edge>
      edges;  // to the leaves it used (not its inputs), each once, in the order reached
};

bool same_edge(const Edge& a, const Edge& b) {
  return a.function.get() == b.function.get() && a.input_nr == b.input_nr;
}

TracedRun traced_run(const CheckpointedFunction& function,
                     const std::vector<torch::Tensor>& detached_inputs) {
  torch::AutoGradMode grad_mode(true);
  const std::uint64_t first_node = at::sequence_number::peek();
  TracedRun run;
  run.outputs = function(detached_inputs);
  std::unordered_set<const torch::TensorImpl*> inputs;
  for (const auto& x : detached_inputs)
    inputs.insert(x.unsafeGetTensorImpl());
  std::vector<const Node*> stack;
  std::unordered_set<const Node*> seen;
  auto reach = [&](const Edge& edge) {
    const Node* node = edge.function.get();
    if (node == nullptr || !seen.insert(node).second) return;
    if (const auto* leaf = dynamic_cast<const torch::autograd::AccumulateGrad*>(node)) {
      if (!inputs.contains(leaf->variable.unsafeGetTensorImpl())) run.edges.push_back(edge);
      return;
    }
    if (node->sequence_nr() < first_node) {
      // Made before the function ran: a tensor of the outer graph that the function captured.
      // Its gradient would have to go on through the outer graph from inside this backward, and
      // the recomputation could run outer nodes a second time: refused.
      throw ConfigError(fmt::format(
          "ddp::checkpoint: the checkpointed function uses a tensor that needs a gradient, is not "
          "a leaf and is not one of its inputs (it comes from {} outside the function); pass it "
          "as an input",
          node->name()));
    }
    stack.push_back(node);
  };
  for (auto& out : run.outputs) {
    if (!out.defined()) {
      throw ConfigError(
          "ddp::checkpoint: the checkpointed function returned an undefined tensor; return "
          "defined tensors only");
    }
    // An output that is a leaf (an input or a parameter returned as it is) gets a node of its
    // own, so that every output that needs a gradient has one made inside the function.
    if (out.requires_grad() && !out.grad_fn()) out = out.view_as(out);
    run.shapes.push_back({out.sizes().vec(), out.scalar_type(), out.device(), out.requires_grad()});
    if (out.requires_grad()) reach(torch::autograd::impl::gradient_edge(out));
  }
  while (!stack.empty()) {
    const Node* node = stack.back();
    stack.pop_back();
    for (const auto& edge : node->next_edges())
      reach(edge);
  }
  return run;
}

template <class T>
NodePtr make_node() {
  if constexpr (std::is_same_v<NodePtr, std::shared_ptr<Node>>) {
    return std::make_shared<T>();
  } else {
    return c10::make_intrusive<T>();
  }
}

// The one autograd node a checkpointed call leaves in the graph. Its next edges: the inputs'
// gradient edges, then those of the leaves the traced run found. Its apply()
// recomputes the function and back-propagates through the recomputation to those edges.
class CheckpointNode : public Node {
 public:
  CheckpointedFunction function;
  std::vector<torch::Tensor>
      inputs;  // detached: their values, sharing the callers' version counters
  std::vector<std::uint32_t> input_versions;
  std::vector<bool> input_requires_grad;
  RngStates rng;
  bool autocast_enabled = false;
  at::ScalarType autocast_dtype = at::kBFloat16;
  std::vector<OutputShape> shapes;
  std::vector<Edge> traced_edges;
  std::vector<int> output_input_nr;  // per output, this node's input for it, or -1
  bool released = false;

  std::string name() const override { return "ddp::CheckpointBackward"; }

  void release_variables() override {
    inputs.clear();
    released = true;
  }

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    if (released) {
      throw ConfigError(
          "ddp::checkpoint: backward through a checkpointed function a second time, after its "
          "saved inputs were freed; pass retain_graph=true to the first backward");
    }
    for (std::size_t i = 0; i < inputs.size(); ++i) {
      if (inputs[i]._version() != input_versions[i]) {
        throw ConfigError(fmt::format(
            "ddp::checkpoint: input {} of a checkpointed function was modified in place after "
            "the forward pass (version {}, now {}); the recomputation would see other values: "
            "clone it before modifying it",
            i, input_versions[i], inputs[i]._version()));
      }
    }
    std::vector<torch::Tensor> detached;
    for (std::size_t i = 0; i < inputs.size(); ++i) {
      detached.push_back(inputs[i].detach().requires_grad_(input_requires_grad[i]));
    }
    const RngStates after_backward = rng.now();
    const bool autocast_now = libtorch_compat::cpu_autocast_enabled();
    const at::ScalarType autocast_dtype_now = libtorch_compat::cpu_autocast_dtype();
    rng.restore();
    libtorch_compat::set_cpu_autocast(autocast_enabled, autocast_dtype);
    TracedRun run;
    try {
      const detail::RecomputationScope recomputing;
      run = traced_run(function, detached);
    } catch (...) {
      after_backward.restore();
      libtorch_compat::set_cpu_autocast(autocast_now, autocast_dtype_now);
      throw;
    }
    after_backward.restore();
    libtorch_compat::set_cpu_autocast(autocast_now, autocast_dtype_now);
    check_same_as_forward(run);

    torch::autograd::edge_list roots;
    torch::autograd::variable_list root_grads;
    for (std::size_t i = 0; i < run.outputs.size(); ++i) {
      const int nr = output_input_nr[i];
      if (nr < 0 || !grads[static_cast<std::size_t>(nr)].defined()) continue;
      roots.push_back(torch::autograd::impl::gradient_edge(run.outputs[i]));
      root_grads.push_back(grads[static_cast<std::size_t>(nr)]);
    }
    torch::autograd::edge_list wanted;
    std::vector<int> input_slot(detached.size(), -1);
    for (std::size_t i = 0; i < detached.size(); ++i) {
      if (!input_requires_grad[i]) continue;
      input_slot[i] = static_cast<int>(wanted.size());
      wanted.emplace_back(torch::autograd::impl::grad_accumulator(detached[i]), 0);
    }
    const std::size_t first_traced = wanted.size();
    wanted.insert(wanted.end(), run.edges.begin(), run.edges.end());
    torch::autograd::variable_list found(wanted.size());
    if (!roots.empty()) {
      found = torch::autograd::Engine::get_default_engine().execute(
          roots, root_grads, /*keep_graph=*/false, /*create_graph=*/false,
          /*accumulate_grad=*/false, wanted);
    }
    torch::autograd::variable_list result;
    for (std::size_t i = 0; i < detached.size(); ++i) {
      result.push_back(input_slot[i] < 0 ? torch::Tensor()
                                         : found[static_cast<std::size_t>(input_slot[i])]);
    }
    for (std::size_t i = first_traced; i < wanted.size(); ++i)
      result.push_back(found[i]);
    return result;
  }

 private:
  void check_same_as_forward(const TracedRun& run) const {
    if (run.shapes.size() != shapes.size()) {
      throw ConfigError(fmt::format(
          "ddp::checkpoint: the recomputation of a checkpointed function returned {} tensors "
          "where its forward pass returned {}; a checkpointed function must do the same on the "
          "same inputs (no branch on a random draw, the time or a counter)",
          run.shapes.size(), shapes.size()));
    }
    for (std::size_t i = 0; i < shapes.size(); ++i) {
      if (!(run.shapes[i] == shapes[i])) {
        throw ConfigError(fmt::format(
            "ddp::checkpoint: output {} of the recomputation of a checkpointed function is a {} "
            "where its forward pass returned a {}; a checkpointed function must do the same on "
            "the same inputs",
            i, run.shapes[i].describe(), shapes[i].describe()));
      }
    }
    bool same = run.edges.size() == traced_edges.size();
    for (std::size_t i = 0; same && i < traced_edges.size(); ++i)
      same = same_edge(run.edges[i], traced_edges[i]);
    if (!same) {
      throw ConfigError(fmt::format(
          "ddp::checkpoint: the recomputation of a checkpointed function used other tensors "
          "that need gradients ({} leaves) than its forward pass did ({}); a "
          "checkpointed function must use the same parameters on the same inputs",
          run.edges.size(), traced_edges.size()));
    }
  }
};

}  // namespace

std::vector<torch::Tensor> checkpoint(const CheckpointedFunction& function,
                                      const std::vector<torch::Tensor>& inputs) {
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    if (!inputs[i].defined()) {
      throw ConfigError(fmt::format(
          "ddp::checkpoint: input {} is an undefined tensor; pass defined tensors only", i));
    }
  }
  if (!torch::GradMode::is_enabled()) return function(inputs);

  auto node = make_node<CheckpointNode>();
  auto& state = static_cast<CheckpointNode&>(*node);
  state.function = function;
  state.rng = RngStates::capture(inputs);
  state.autocast_enabled = libtorch_compat::cpu_autocast_enabled();
  state.autocast_dtype = libtorch_compat::cpu_autocast_dtype();
  std::vector<torch::Tensor> detached;
  for (const auto& x : inputs) {
    detached.push_back(x.detach().requires_grad_(x.requires_grad()));
    state.input_requires_grad.push_back(x.requires_grad());
    state.input_versions.push_back(x._version());
  }
  TracedRun run;
  {
    // Generators of its own that the function draws from (the tensor-parallel RNG tracker's):
    // their states before the first draw, replayed with the default ones.
    detail::GeneratorRecorder recorder;
    run = traced_run(function, detached);
    for (const auto& entry : recorder.recorded())
      state.rng.saved.push_back(entry);
  }
  detached.clear();
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    // The recomputation would start from the changed values (an in-place op, or a collective
    // that reduces its input in place, would apply twice): refused, whatever needs gradients.
    if (inputs[i]._version() != state.input_versions[i]) {
      throw ConfigError(fmt::format(
          "ddp::checkpoint: the checkpointed function modified its input {} in place; its "
          "recomputation in backward would start from the modified values: clone the input "
          "inside the function before modifying it",
          i));
    }
  }

  const bool any_gradient = std::any_of(inputs.begin(), inputs.end(),
                                        [](const torch::Tensor& x) { return x.requires_grad(); }) ||
                            !run.edges.empty();
  std::vector<torch::Tensor> results;
  if (!any_gradient) {
    for (auto& out : run.outputs)
      results.push_back(out.detach());
    return results;
  }
  for (const auto& x : inputs)
    state.inputs.push_back(x.detach());  // shares x's version counter: an edit is seen
  for (const auto& x : inputs) {
    node->add_next_edge(x.requires_grad() ? torch::autograd::impl::gradient_edge(x) : Edge());
  }
  for (const auto& edge : run.edges)
    node->add_next_edge(edge);
  state.traced_edges = std::move(run.edges);
  state.shapes = run.shapes;
  // The outputs keep their values but not the graph of the traced run (its activations are freed
  // here); those that need a gradient lead to this node instead.
  for (auto& out : run.outputs) {
    torch::Tensor result = out.variable_data();
    if (out.requires_grad()) {
      state.output_input_nr.push_back(static_cast<int>(node->add_input_metadata(result)));
      torch::autograd::impl::set_gradient_edge(
          result, Edge(node, static_cast<std::uint32_t>(state.output_input_nr.back())));
    } else {
      state.output_input_nr.push_back(-1);
    }
    results.push_back(std::move(result));
  }
  return results;
}

}  // namespace ddp
