// Model state dicts under Python's names (state_dict.h): collecting a module's tensors in
// Python's order, and the checked, all-or-nothing copy of a loaded dict into them.
#include "ddp/torch/formats/state_dict.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "torch/formats/pytorch_archive.h"
#include "torch/formats/state_dict_check.h"

namespace ddp {
namespace {

std::string describe(const torch::Tensor& t) {
  return fmt::format("[{}] {}", fmt::join(t.sizes(), ", "), c10::toString(t.scalar_type()));
}

std::string quoted_list(const std::vector<std::string>& names) {
  std::vector<std::string> quoted;
  quoted.reserve(names.size());
  for (const auto& n : names)
    quoted.push_back(fmt::format("\"{}\"", n));
  return fmt::format("{}", fmt::join(quoted, ", "));
}

std::string dotted(const std::string& prefix, const std::string& name) {
  return prefix.empty() ? name : prefix + "." + name;
}

}  // namespace

// Python's Module.state_dict() walks the modules depth first, each module's parameters, then its
// buffers, then its children; named_modules() visits them in that order. The module itself is
// taken apart (named_modules' include_self needs it held by a shared_ptr, which a module built
// on the stack is not).
StateDict state_dict(const torch::nn::Module& module) {
  StateDict all;
  auto add = [&all](const torch::nn::Module& m, const std::string& prefix) {
    for (const auto& p : m.named_parameters(/*recurse=*/false))
      all.insert(dotted(prefix, p.key()), p.value());
    for (const auto& b : m.named_buffers(/*recurse=*/false))
      all.insert(dotted(prefix, b.key()), b.value());
  };
  add(module, "");
  for (const auto& item : module.named_modules("", /*include_self=*/false))
    add(*item.value(), item.key());
  return all;
}

StateDict state_dict(const torch::jit::Module& module) {
  StateDict all;
  for (const auto& item : module.named_modules()) {
    for (const auto& p : item.value.named_parameters(/*recurse=*/false)) {
      all.insert(dotted(item.name, p.name), p.value);
    }
    for (const auto& b : item.value.named_buffers(/*recurse=*/false)) {
      all.insert(dotted(item.name, b.name), b.value);
    }
  }
  return all;
}

void save_state_dict(const StateDict& tensors, const std::filesystem::path& path) {
  c10::impl::GenericDict dict(c10::StringType::get(), c10::TensorType::get());
  dict.reserve(tensors.size());
  for (const auto& item : tensors)
    dict.insert(item.key(), item.value().detach());
  detail::write_pytorch_archive(path, dict, /*ordered_dict_at_top=*/true);
}

void save_state_dict(const torch::nn::Module& module, const std::filesystem::path& path) {
  save_state_dict(state_dict(module), path);
}

void save_state_dict(const torch::jit::Module& module, const std::filesystem::path& path) {
  save_state_dict(state_dict(module), path);
}

StateDict read_state_dict(const std::filesystem::path& path) {
  const c10::IValue value = detail::read_pytorch_archive(path);
  if (!value.isGenericDict()) {
    throw StateDictFormatError(fmt::format(
        "{}: not a state dict: the file holds a {}, expected a dict of names to tensors",
        path.string(), value.tagKind()));
  }
  StateDict tensors;
  for (const auto& entry : value.toGenericDict()) {
    if (!entry.key().isString()) {
      throw StateDictFormatError(
          fmt::format("{}: not a state dict: a key is a {}, expected parameter names (strings)",
                      path.string(), entry.key().tagKind()));
    }
    const auto& name = entry.key().toStringRef();
    if (!entry.value().isTensor()) {
      throw StateDictFormatError(fmt::format(
          "{}: not a state dict: '{}' holds a {}, expected a tensor{}", path.string(), name,
          entry.value().tagKind(),
          entry.value().isGenericDict() ? " (a checkpoint of several dicts? save the model's "
                                          "state_dict() on its own)"
                                        : ""));
    }
    tensors.insert(name, entry.value().toTensor());
  }
  return tensors;
}

namespace detail {

StateDictLoadReport check_state_dict(const StateDict& target, const StateDict& source,
                                     StateDictLoadOptions options, const std::string& source_name,
                                     std::vector<std::pair<torch::Tensor, torch::Tensor>>* copies) {
  StateDictLoadReport report;
  for (const auto& item : target) {
    const torch::Tensor* found = source.find(item.key());
    if (found == nullptr) {
      report.missing.push_back(item.key());
    } else if (found->sizes() != item.value().sizes() ||
               found->scalar_type() != item.value().scalar_type()) {
      report.mismatched.push_back(fmt::format("{}: {} in {}, {} in the module", item.key(),
                                              describe(*found), source_name,
                                              describe(item.value())));
    } else {
      report.loaded.push_back(item.key());
      if (copies != nullptr) copies->emplace_back(item.value(), *found);
    }
  }
  for (const auto& item : source) {
    if (target.find(item.key()) == nullptr) report.unexpected.push_back(item.key());
  }
  if (options.strict && !report.complete()) {
    std::string message = fmt::format("load_state_dict: {} does not fit the module:", source_name);
    if (!report.missing.empty()) {
      message += fmt::format(" missing key(s): {}.", quoted_list(report.missing));
    }
    if (!report.unexpected.empty()) {
      message += fmt::format(" unexpected key(s): {}.", quoted_list(report.unexpected));
    }
    if (!report.mismatched.empty()) {
      message += fmt::format(" mismatched: {}.", fmt::join(report.mismatched, "; "));
    }
    message += " Nothing was loaded.";
    throw StateDictMismatchError(message, std::move(report));
  }
  return report;
}

}  // namespace detail

StateDictLoadReport load_state_dict(const StateDict& target, const StateDict& source,
                                    StateDictLoadOptions options, const std::string& source_name) {
  std::vector<std::pair<torch::Tensor, torch::Tensor>> copies;
  StateDictLoadReport report =
      detail::check_state_dict(target, source, options, source_name, &copies);
  // Every check passed: from here on nothing can fail half-way (same shapes and dtypes).
  torch::NoGradGuard no_grad;
  for (auto& [to, from] : copies)
    to.copy_(from);
  return report;
}

StateDictLoadReport load_state_dict(torch::nn::Module& module, const std::filesystem::path& path,
                                    StateDictLoadOptions options) {
  return load_state_dict(state_dict(module), read_state_dict(path), options, path.string());
}

StateDictLoadReport load_state_dict(torch::jit::Module& module, const std::filesystem::path& path,
                                    StateDictLoadOptions options) {
  return load_state_dict(state_dict(module), read_state_dict(path), options, path.string());
}

}  // namespace ddp
