#include "ddp/torch/ddp/script_distributed_data_parallel.h"

#include <utility>

#include <fmt/format.h>
#include <torch/csrc/jit/runtime/graph_executor.h>

#include "ddp/error.h"

namespace ddp {
namespace {

std::string type_name(const torch::jit::Module& module) {
  return module.type()->name() ? module.type()->name()->qualifiedName() : module.type()->str();
}

}  // namespace

namespace detail {

// A torch::nn::Module tree shaped like the TorchScript module, holding the same parameter and
// buffer tensors (not copies) under the same names: what the wrapper registers as "module", so
// that its parameters() and named_parameters() are the TorchScript module's. DDP itself reads the
// TorchScript module directly (WrappedModuleTensors); refresh() makes this view's parameters
// follow attributes replaced after wrapping. Its buffers are those of wrapping time: libtorch keeps
// nn::Module's buffer dictionary private, with no way to replace an entry.
class ScriptModuleView : public torch::nn::Module {
 public:
  explicit ScriptModuleView(torch::jit::Module module) : module_(std::move(module)) {
    for (const auto& item : module_.named_parameters(/*recurse=*/false)) {
      register_parameter(item.name, item.value, item.value.requires_grad());
    }
    for (const auto& item : module_.named_buffers(/*recurse=*/false))
      register_buffer(item.name, item.value);
    for (const auto& item : module_.named_children()) {
      children_views_.push_back(
          register_module(item.name, std::make_shared<ScriptModuleView>(item.value)));
    }
  }

  // Takes the module's current parameter tensors where an attribute now holds another tensor: a
  // lookup per parameter, no names built, so it runs before every forward.
  void refresh() {
    for (auto& item : parameters_) {
      const auto live = module_.attr(item.key());
      if (live.isTensor() &&
          live.toTensor().unsafeGetTensorImpl() != item.value().unsafeGetTensorImpl()) {
        item.value() = live.toTensor();
      }
    }
    for (const auto& child : children_views_)
      child->refresh();
  }

 private:
  torch::jit::Module module_;
  std::vector<std::shared_ptr<ScriptModuleView>> children_views_;
};

}  // namespace detail

namespace {

using detail::ScriptModuleView;

// The checks that need no other rank, so that every rank with a bad module fails before the
// first collective. Returns the module's view.
std::shared_ptr<ScriptModuleView> checked_view(const torch::jit::Module& module) {
  if (!module.find_method("forward")) {
    throw ConfigError(fmt::format(
        "ScriptDistributedDataParallel: the TorchScript module ({}) has no forward method. Export "
        "a module whose forward is scripted or traced (torch.jit.script(model) or "
        "torch.jit.trace(model, example)); methods other than forward cannot be wrapped",
        type_name(module)));
  }
  bool any_trainable = false;
  std::size_t count = 0;
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    ++count;
    any_trainable = any_trainable || item.value.requires_grad();
  }
  if (!any_trainable) {
    throw ConfigError(fmt::format(
        "ScriptDistributedDataParallel: the TorchScript module ({}) has {} parameters and none "
        "requires grad, so there is nothing to train or synchronise. A module frozen with "
        "torch.jit.freeze keeps its weights as constants, and one exported after "
        "requires_grad_(False) keeps that flag: export the trainable module, or set "
        "requires_grad on its parameters in C++ before wrapping",
        type_name(module), count));
  }
  return std::make_shared<ScriptModuleView>(module);
}

WrappedModuleTensors tensors_of(const torch::jit::Module& module) {
  return {.named_parameters =
              [module] {
                torch::OrderedDict<std::string, torch::Tensor> named;
                for (const auto& item : module.named_parameters(/*recurse=*/true))
                  named.insert(item.name, item.value);
                return named;
              },
          .named_buffers =
              [module] {
                torch::OrderedDict<std::string, torch::Tensor> named;
                for (const auto& item : module.named_buffers(/*recurse=*/true))
                  named.insert(item.name, item.value);
                return named;
              }};
}

// The tensors in a forward's result: what DDP watches for unused parameters.
void collect_tensors(const torch::jit::IValue& value, std::vector<torch::Tensor>& out) {
  if (value.isTensor()) {
    out.push_back(value.toTensor());
  } else if (value.isTensorList()) {
    for (const auto& t : value.toTensorVector())
      out.push_back(t);
  } else if (value.isTuple()) {
    for (const auto& element : value.toTupleRef().elements())
      collect_tensors(element, out);
  } else if (value.isList()) {
    for (const auto& element : value.toListRef())
      collect_tensors(element, out);
  } else if (value.isGenericDict()) {
    for (const auto& entry : value.toGenericDict())
      collect_tensors(entry.value(), out);
  }
}

}  // namespace

ScriptDistributedDataParallelImpl::ScriptDistributedDataParallelImpl(
    torch::jit::Module module, std::shared_ptr<ProcessGroup> group, DdpOptions options)
    : ScriptDistributedDataParallelImpl(module, checked_view(module), std::move(group), options) {}

ScriptDistributedDataParallelImpl::ScriptDistributedDataParallelImpl(
    torch::jit::Module module, std::shared_ptr<detail::ScriptModuleView> view,
    std::shared_ptr<ProcessGroup> group, DdpOptions options)
    : DistributedDataParallelBase(view, tensors_of(module), std::move(group), options),
      module_(std::move(module)),
      view_(std::move(view)) {
  // The mode the module was saved in (Python saves it as it was when exported).
  torch::nn::Module::train(module_.is_training());
}

torch::jit::IValue ScriptDistributedDataParallelImpl::forward(
    std::vector<torch::jit::IValue> inputs) {
  view_->refresh();
  pre_forward();
  for (auto& input : inputs) {  // DdpOptions::param_dtype: tensor arguments as the parameters
    if (input.isTensor()) input = mixed_precision_input(input.toTensor());
  }
  // Thread-local and restored on exit, so other TorchScript calls of the program keep theirs.
  const torch::jit::GraphOptimizerEnabledGuard optimisation(jit_graph_optimization_);
  auto output = module_.forward(std::move(inputs));
  std::vector<torch::Tensor> tensors;
  collect_tensors(output, tensors);
  post_forward(tensors);
  return output;
}

torch::Tensor ScriptDistributedDataParallelImpl::forward(torch::Tensor input) {
  auto output = forward(std::vector<torch::jit::IValue>{std::move(input)});
  if (!output.isTensor()) {
    throw Error(fmt::format(
        "ScriptDistributedDataParallel::forward(tensor): the forward of {} returned {}, not a "
        "tensor; call forward(std::vector<torch::jit::IValue>) to get the IValue",
        type_name(module_), output.tagKind()));
  }
  return output.toTensor();
}

void ScriptDistributedDataParallelImpl::train(bool on) {
  torch::nn::Module::train(on);
  module_.train(on);
}

}  // namespace ddp
