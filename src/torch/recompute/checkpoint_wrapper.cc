// apply_activation_checkpointing: a Sequential whose chosen children run under checkpoint().
#include <algorithm>
#include <memory>
#include <string>
#include <utility>

#include <fmt/format.h>

#include "ddp/error.h"
#include "ddp/torch/recompute/activation_checkpoint.h"

namespace ddp {
namespace {

// A child of a Sequential run under checkpoint(). It owns what the child owns under the same
// names (its parameters, buffers and children are registered here as they are there), so that the
// wrapped Sequential's names and state dict are the original's; train()/eval() reach the child.
// Not Cloneable: a clone would share the child.
class CheckpointedChildImpl : public torch::nn::Module {
 public:
  explicit CheckpointedChildImpl(torch::nn::AnyModule child) : child_(std::move(child)) {
    const auto& module = *child_.ptr();
    for (const auto& item : module.named_parameters(/*recurse=*/false)) {
      register_parameter(item.key(), item.value(), item.value().requires_grad());
    }
    for (const auto& item : module.named_buffers(/*recurse=*/false))
      register_buffer(item.key(), item.value());
    for (const auto& item : module.named_children())
      register_module(item.key(), item.value());
  }

  torch::Tensor forward(const torch::Tensor& x) {
    // The child by value (an AnyModule shares its module): the recomputation needs it, not this.
    return checkpoint(
        [child = child_](const torch::Tensor& in) mutable {
          return child.forward<torch::Tensor>(in);
        },
        x);
  }

  void train(bool on) override {
    child_.ptr()->train(on);
    torch::nn::Module::train(on);
  }

  std::shared_ptr<torch::nn::Module> module() const { return child_.ptr(); }

  void pretty_print(std::ostream& stream) const override {
    stream << "ddp::Checkpointed(";
    child_.ptr()->pretty_print(stream);
    stream << ")";
  }

 private:
  torch::nn::AnyModule child_;
};
TORCH_MODULE(CheckpointedChild);

}  // namespace

CheckpointPredicate checkpoint_every_child() {
  return [](std::size_t, const torch::nn::Module&) { return true; };
}

CheckpointPredicate checkpoint_children_named(std::vector<std::string> type_names) {
  return [names = std::move(type_names)](std::size_t, const torch::nn::Module& child) {
    return std::find(names.begin(), names.end(), child.name()) != names.end();
  };
}

torch::nn::Sequential apply_activation_checkpointing(const torch::nn::Sequential& model,
                                                     const CheckpointPredicate& predicate) {
  torch::nn::Sequential wrapped;
  const auto names = model->named_children().keys();
  std::size_t index = 0;
  std::size_t chosen = 0;
  for (const auto& child : *model) {
    if (predicate(index, *child.ptr())) {
      wrapped->push_back(std::string(names[index]), CheckpointedChild(child));
      ++chosen;
    } else {
      wrapped->push_back(std::string(names[index]), torch::nn::AnyModule(child));
    }
    ++index;
  }
  if (chosen == 0) {
    throw ConfigError(fmt::format(
        "apply_activation_checkpointing: the predicate chose none of the Sequential's {} "
        "children; nothing would be checkpointed (checkpoint_children_named matches "
        "Module::name(), e.g. \"torch::nn::LinearImpl\")",
        model->size()));
  }
  wrapped->train(model->is_training());
  return wrapped;
}

std::shared_ptr<torch::nn::Module> checkpointed_module(
    const std::shared_ptr<torch::nn::Module>& child) {
  if (const auto* wrapper = child->as<CheckpointedChildImpl>()) return wrapper->module();
  return child;
}

}  // namespace ddp
