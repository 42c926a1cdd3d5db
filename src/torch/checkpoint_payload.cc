#include "torch/checkpoint_payload.h"

#include <string>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "ddp/error.h"
#include "torch/parameter_loads.h"

namespace ddp::internal {
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

}  // namespace

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
}

void load_model_and_optimizer(torch::serialize::InputArchive& archive, torch::nn::Module& model,
                              torch::optim::Optimizer& optimizer,
                              const std::filesystem::path& path) {
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
  torch::serialize::InputArchive optimizer_archive;
  if (!archive.try_read("optimizer", optimizer_archive)) throw fail("it holds no optimizer");
  optimizer.load(optimizer_archive);
  torch::NoGradGuard no_grad;
  for (auto& t : tensors)
    t.target.copy_(t.stored);
  // In place, so DistributedDataParallel cannot see it in the tensors: tell its divergence guard.
  detail::note_parameters_loaded();
}

}  // namespace ddp::internal
