#include "torch/checkpoint/checkpoint_payload.h"

#include <string>
#include <typeinfo>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "ddp/error.h"
#include "ddp/torch/checkpoint/checkpoint.h"
#include "ddp/torch/formats/optimizer_wrapper.h"
#include "torch/core/parameter_loads.h"
#include "torch/formats/optimizer_values.h"

namespace ddp::detail {
namespace {

// One tensor of the model and the value stored for it.
struct StoredTensor {
  std::string name;
  torch::Tensor target;
  torch::Tensor stored;
};

// Reads the stored value of every parameter and buffer of `module` (and, recursively, of its
// children) from `archive`, laid out as Module::save writes it, without changing the module.
void read_module_state(const torch::nn::Module& module, torch::serialize::InputArchive& archive,
                       const std::string& prefix, std::vector<StoredTensor>& out) {
  const auto read = [&](const std::string& key, const torch::Tensor& target, bool is_buffer) {
    torch::Tensor stored;
    if (!archive.try_read(key, stored, is_buffer)) {
      throw Error(
          fmt::format("it holds no {} '{}{}'", is_buffer ? "buffer" : "parameter", prefix, key));
    }
    out.push_back({prefix + key, target, stored});
  };
  for (const auto& item : module.named_parameters(/*recurse=*/false))
    read(item.key(), item.value(), false);
  for (const auto& item : module.named_buffers(/*recurse=*/false))
    read(item.key(), item.value(), true);
  for (const auto& child : module.named_children()) {
    torch::serialize::InputArchive child_archive;
    if (!archive.try_read(child.key(), child_archive)) {
      throw Error(fmt::format("it holds no submodule '{}{}'", prefix, child.key()));
    }
    read_module_state(*child.value(), child_archive, prefix + child.key() + ".", out);
  }
}

std::string shapes_text(const torch::Tensor& tensor) {
  return tensor.defined() ? fmt::format("[{}]", fmt::join(tensor.sizes(), ", ")) : "undefined";
}

// True when some parameter group's options (of type OptionsT) satisfy `test`; the defaults stand
// for a group without options of its own (and for an optimizer without groups).
template <class OptionsT, class Test>
bool any_group(const torch::optim::Optimizer& optimizer, Test test) {
  const auto& defaults = static_cast<const OptionsT&>(optimizer.defaults());
  if (optimizer.param_groups().empty()) return test(defaults);
  for (const auto& group : optimizer.param_groups()) {
    if (test(group.has_options() ? static_cast<const OptionsT&>(group.options()) : defaults)) {
      return true;
    }
  }
  return false;
}

constexpr const char* kOptimizerKindEntry = "optimizer_kind";

}  // namespace

std::string describe_optimizer(const torch::optim::Optimizer& optimizer) {
  namespace optim = torch::optim;
  if (const auto* wrapper = dynamic_cast<const OptimizerWrapper*>(&optimizer)) {
    return describe_optimizer(wrapper->wrapped_optimizer());
  }
  if (dynamic_cast<const optim::SGD*>(&optimizer) != nullptr) {
    return any_group<optim::SGDOptions>(optimizer,
                                        [](const auto& o) { return o.momentum() != 0.0; })
               ? "SGD with momentum"
               : "SGD without momentum";
  }
  if (dynamic_cast<const optim::Adam*>(&optimizer) != nullptr) {
    return any_group<optim::AdamOptions>(optimizer, [](const auto& o) { return o.amsgrad(); })
               ? "Adam with amsgrad"
               : "Adam";
  }
  if (dynamic_cast<const optim::AdamW*>(&optimizer) != nullptr) {
    return any_group<optim::AdamWOptions>(optimizer, [](const auto& o) { return o.amsgrad(); })
               ? "AdamW with amsgrad"
               : "AdamW";
  }
  if (dynamic_cast<const optim::Adagrad*>(&optimizer) != nullptr) return "Adagrad";
  if (dynamic_cast<const optim::RMSprop*>(&optimizer) != nullptr) {
    const bool momentum = any_group<optim::RMSpropOptions>(
        optimizer, [](const auto& o) { return o.momentum() != 0.0; });
    const bool centered =
        any_group<optim::RMSpropOptions>(optimizer, [](const auto& o) { return o.centered(); });
    if (momentum && centered) return "RMSprop with momentum, centered";
    if (momentum) return "RMSprop with momentum";
    if (centered) return "RMSprop centered";
    return "RMSprop";
  }
  if (dynamic_cast<const optim::LBFGS*>(&optimizer) != nullptr) return "LBFGS";
  return c10::demangle(typeid(optimizer).name());
}

void write_model_and_optimizer(torch::serialize::OutputArchive& archive,
                               const torch::nn::Module& model,
                               const torch::optim::Optimizer& optimizer) {
  // Nested archives share the outer one's compilation unit, as Module::save does for children.
  torch::serialize::OutputArchive model_archive(archive.compilation_unit());
  model.save(model_archive);
  archive.write("model", model_archive);
  torch::serialize::OutputArchive optimizer_archive(archive.compilation_unit());
  optimizer.save(optimizer_archive);
  archive.write("optimizer", optimizer_archive);
  archive.write(kOptimizerKindEntry, c10::IValue(describe_optimizer(optimizer)));
}

void load_model_and_optimizer(torch::serialize::InputArchive& archive, torch::nn::Module& model,
                              torch::optim::Optimizer& optimizer, const std::filesystem::path& path,
                              const std::string& what) {
  const auto fail = [&](const std::string& what) {
    return Error(fmt::format("checkpoint: {}: {}", path.string(), what));
  };
  // Values are copied into the model's existing tensors (Module::load would give them new
  // storage and, for parameters, possibly new gradient accumulators, which a wrapping
  // DistributedDataParallel would have to re-attach to). Everything is read and checked before
  // anything changes, so a checkpoint that does not fit leaves the model as it was.
  torch::serialize::InputArchive model_archive;
  if (!archive.try_read("model", model_archive)) throw fail("it holds no model");
  std::vector<StoredTensor> tensors;
  try {
    read_module_state(model, model_archive, "", tensors);
  } catch (const Error& e) {
    throw fail(e.what());
  }
  for (const auto& t : tensors) {
    if (t.stored.sizes() != t.target.sizes() || t.stored.scalar_type() != t.target.scalar_type()) {
      throw fail(fmt::format("tensor '{}' is {} {} in the checkpoint but [{}] {} in the model",
                             t.name, shapes_text(t.stored), c10::toString(t.stored.scalar_type()),
                             fmt::join(t.target.sizes(), ", "),
                             c10::toString(t.target.scalar_type())));
    }
  }
  // Before libtorch reads the optimizer's state: read as another kind's, it fails with an internal
  // assertion ("is_tensor_type INTERNAL ASSERT FAILED") that says nothing of the cause.
  const std::string current = describe_optimizer(optimizer);
  c10::IValue stored_kind;
  if (archive.try_read(kOptimizerKindEntry, stored_kind) && stored_kind.isString() &&
      stored_kind.toStringRef() != current) {
    const std::string& stored = stored_kind.toStringRef();
    // "Adam" -> "an Adam optimizer's state", "SGD with momentum" -> "an SGD optimizer's state
    // (with momentum)".
    const auto space = stored.find(' ');
    const std::string kind = stored.substr(0, space);
    const std::string detail =
        space == std::string::npos ? std::string() : " (" + stored.substr(space + 1) + ")";
    throw OptimizerMismatchError(
        fmt::format("{} {} holds an {} optimizer's state{}; this run uses {}. Resume with the "
                    "optimizer it was saved with ({}) or start without resuming",
                    what, path.string(), kind, detail, current, stored),
        stored, current);
  }
  torch::serialize::InputArchive optimizer_archive;
  if (!archive.try_read("optimizer", optimizer_archive)) throw fail("it holds no optimizer");
  // libtorch loads any number into the options and the state; a NaN learning rate or a negative
  // step count trains to `loss -nan`. Checked here, and the optimizer put back as it was.
  detail::OptimizerSnapshot before(optimizer);
  optimizer.load(optimizer_archive);
  try {
    detail::check_optimizer_values(optimizer, [&](const std::string& why) {
      throw fail(
          fmt::format("the optimizer's {} (damaged or hand-edited?); nothing was loaded", why));
    });
  } catch (...) {
    before.restore();
    throw;
  }
  torch::NoGradGuard no_grad;
  for (auto& t : tensors)
    t.target.copy_(t.stored);
  // In place, so DistributedDataParallel cannot see it in the tensors: tell its divergence guard.
  detail::note_parameters_loaded();
}

}  // namespace ddp::detail
