// fsdp_auto_wrap: PyTorch's size_based_auto_wrap_policy over Sequential and ModuleList trees; and
// fsdp_build_sharded, the same policy applied while the model is built, child by child.
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <unordered_set>
#include <vector>

#include <fmt/format.h>

#include "ddp/error.h"
#include "ddp/torch/fsdp/fully_sharded_data_parallel.h"

namespace ddp {

namespace {

// Parameters of `module` that no FullyShardedDataParallel inside it (or it itself) shards yet.
std::int64_t unwrapped_parameter_count(const torch::nn::Module& module) {
  std::unordered_set<const void*> wrapped;
  for (const auto& sub : module.modules(/*include_self=*/true)) {
    if (auto* wrapper = dynamic_cast<FullyShardedDataParallelImpl*>(sub.get())) {
      for (const auto& shard : wrapper->parameters())
        wrapped.insert(shard.unsafeGetTensorImpl());
    }
  }
  std::int64_t count = 0;
  for (const auto& p : module.parameters())
    if (!wrapped.contains(p.unsafeGetTensorImpl())) count += p.numel();
  return count;
}

class AutoWrapper {
 public:
  AutoWrapper(GroupRef group, FsdpOptions options)
      : group_(std::move(group)), options_(std::move(options)) {
    if (options_.min_num_params <= 0) {
      throw ConfigError(fmt::format("ddp::fsdp_auto_wrap: min_num_params must be positive, got {}",
                                    options_.min_num_params));
    }
    // Each wrapper is one unit or (a Sequential) grouped by min_num_params: explicit child
    // ranges name no particular Sequential here.
    if (!options_.units.empty()) {
      throw ConfigError(
          "ddp::fsdp_auto_wrap: FsdpOptions::units name the children of one Sequential; the "
          "auto-wrap policy decides the units (leave units empty)");
    }
  }

  // A Sequential with its large children wrapped (the children are the same modules).
  torch::nn::Sequential sequential(const torch::nn::SequentialImpl& from) {
    torch::nn::Sequential to;
    const auto names = from.named_children();
    std::size_t i = 0;
    for (const auto& child : from) {
      const std::string& name = names[i++].key();
      if (unwrapped_parameter_count(*child.ptr()) >= options_.min_num_params) {
        to->push_back(name, torch::nn::AnyModule(wrap(child)));
      } else {
        to->push_back(name, torch::nn::AnyModule(child));
      }
    }
    return to;
  }

  // A ModuleList with its large elements wrapped, descending into lists and Sequentials.
  torch::nn::ModuleList list(const torch::nn::ModuleListImpl& from) {
    torch::nn::ModuleList to;
    for (const auto& element : from) {
      std::shared_ptr<torch::nn::Module> replacement = element;
      if (auto sublist = std::dynamic_pointer_cast<torch::nn::ModuleListImpl>(element)) {
        replacement = list(*sublist).ptr();  // a list has no forward: never wrapped itself
      } else if (auto seq = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(element)) {
        auto rebuilt = sequential(*seq);
        replacement = rebuilt.ptr();
        if (unwrapped_parameter_count(*rebuilt) >= options_.min_num_params) {
          replacement = wrap(rebuilt.ptr());
        }
      } else if (unwrapped_parameter_count(*element) >= options_.min_num_params) {
        replacement = wrap(element);
      }
      to->push_back(replacement);
    }
    return to;
  }

  std::int64_t min_num_params() const { return options_.min_num_params; }

  template <typename Module>
  std::shared_ptr<FullyShardedDataParallelImpl> wrap(Module module) {
    auto wrapper =
        std::make_shared<FullyShardedDataParallelImpl>(std::move(module), group_, options_);
    // kHybridShard made its groups collectively once: the next wrappers reuse them.
    options_ = wrapper->options();
    return wrapper;
  }

 private:
  GroupRef group_;
  FsdpOptions options_;
};

}  // namespace

FullyShardedDataParallel fsdp_auto_wrap(torch::nn::Sequential module, GroupRef group,
                                        FsdpOptions options) {
  if (module.is_empty()) throw ConfigError("ddp::fsdp_auto_wrap: the Sequential is null");
  AutoWrapper wrapper(std::move(group), std::move(options));
  return FullyShardedDataParallel(wrapper.wrap(wrapper.sequential(*module)));
}

FullyShardedDataParallel fsdp_build_sharded(
    std::size_t children, const std::function<torch::nn::AnyModule(std::size_t)>& make_child,
    GroupRef group, FsdpOptions options, const std::vector<std::string>& names) {
  if (!names.empty() && names.size() != children) {
    throw ConfigError(fmt::format(
        "ddp::fsdp_build_sharded: {} names for {} children; give one name per child, or none",
        names.size(), children));
  }
  AutoWrapper wrapper(std::move(group), std::move(options));
  torch::nn::Sequential built;
  for (std::size_t i = 0; i < children; ++i) {
    torch::nn::AnyModule child = make_child(i);
    if (child.is_empty()) {
      throw ConfigError(
          fmt::format("ddp::fsdp_build_sharded: make_child({}) returned no module", i));
    }
    const std::string name = names.empty() ? std::to_string(i) : names[i];
    // Wrapped before the next child exists: its full parameters go (kFullShard) before more come.
    if (unwrapped_parameter_count(*child.ptr()) >= wrapper.min_num_params()) {
      built->push_back(name, torch::nn::AnyModule(wrapper.wrap(child)));
    } else {
      built->push_back(name, std::move(child));
    }
  }
  return FullyShardedDataParallel(wrapper.wrap(built.ptr()));
}

torch::nn::ModuleList fsdp_auto_wrap(torch::nn::ModuleList module, GroupRef group,
                                     FsdpOptions options) {
  if (module.is_empty()) throw ConfigError("ddp::fsdp_auto_wrap: the ModuleList is null");
  AutoWrapper wrapper(std::move(group), std::move(options));
  return wrapper.list(*module);
}

}  // namespace ddp
