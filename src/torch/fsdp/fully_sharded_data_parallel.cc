#include "ddp/torch/fsdp/fully_sharded_data_parallel.h"

#include <malloc.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <sstream>
#include <unordered_map>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "ddp/error.h"
#include "ddp/torch/core/tensor_collectives.h"
#include "torch/api/rank_agreement.h"
#include "torch/core/host_values.h"
#include "torch/core/libtorch_compat.h"
#include "torch/core/parameter_devices.h"
#include "torch/core/wrapper_phase.h"
#include "torch/fsdp/fsdp_flat_memory.h"
#include "torch/fsdp/fsdp_unit.h"

namespace ddp {

namespace {

using detail::shape_text;

// PyTorch FSDP's gradient_predivide_factor (DefaultState._get_gradient_predivide_factor): doubled
// while it divides the world and is below world/factor. A low-precision sum is divided by it
// before it is reduced (exact: a power of two) and by world/factor after, in fp32, so that the
// sum does not leave fp16's range.
std::int64_t gradient_predivide_factor(std::int64_t world) {
  std::int64_t factor = 1;
  while (world % factor == 0 && world / factor > factor)
    factor *= 2;
  return factor;
}

bool is_16_bit(torch::ScalarType dtype) {
  return dtype == torch::kBFloat16 || dtype == torch::kHalf;
}

std::string dtype_text(const std::optional<torch::ScalarType>& dtype) {
  return dtype ? std::string(c10::toString(*dtype)) : std::string("unset");
}

}  // namespace

const char* to_string(ShardingStrategy strategy) {
  switch (strategy) {
    case ShardingStrategy::kFullShard:
      return "FULL_SHARD";
    case ShardingStrategy::kShardGradOp:
      return "SHARD_GRAD_OP";
    case ShardingStrategy::kNoShard:
      return "NO_SHARD";
    case ShardingStrategy::kHybridShard:
      return "HYBRID_SHARD";
  }
  return "?";
}

FullyShardedDataParallelImpl::FullyShardedDataParallelImpl(torch::nn::Sequential module,
                                                           GroupRef group, FsdpOptions options)
    : FullyShardedDataParallelImpl(module.ptr(), {}, std::move(group), std::move(options)) {}

FullyShardedDataParallelImpl::FullyShardedDataParallelImpl(torch::nn::AnyModule module,
                                                           GroupRef group, FsdpOptions options)
    : FullyShardedDataParallelImpl(
          module.is_empty() ? nullptr : module.ptr(),
          module.is_empty() ? std::function<torch::Tensor(torch::Tensor)>()
                            : [any = module](torch::Tensor x) mutable { return any.forward(x); },
          std::move(group), std::move(options)) {}

FullyShardedDataParallelImpl::FullyShardedDataParallelImpl(
    std::shared_ptr<torch::nn::Module> module, GroupRef group, FsdpOptions options)
    : FullyShardedDataParallelImpl(std::move(module), {}, std::move(group), std::move(options)) {}

FullyShardedDataParallelImpl::FullyShardedDataParallelImpl(
    std::shared_ptr<torch::nn::Module> module,
    std::function<torch::Tensor(torch::Tensor)> tensor_forward, GroupRef group, FsdpOptions options)
    : module_(nullptr),
      wrapped_(std::move(module)),
      tensor_forward_(std::move(tensor_forward)),
      group_ref_(std::move(group)),
      options_(std::move(options)) {
  group_ = &group_ref_.get();
  if (auto sequential = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(wrapped_)) {
    module_ = torch::nn::Sequential(sequential);
    tensor_forward_ = nullptr;
  }
  make_hybrid_groups();
  build();
}

FullyShardedDataParallelImpl::~FullyShardedDataParallelImpl() = default;

torch::Tensor FullyShardedDataParallelImpl::flat_zeros(std::int64_t numel,
                                                       torch::ScalarType dtype) const {
  return detail::fsdp_flat_zeros(numel, dtype, device_);
}

void FullyShardedDataParallelImpl::check_device() const {
  if (device_.is_cuda()) {
    detail::check_device_usable(device_, "FullyShardedDataParallel's parameters' device");
  }
  for (const ProcessGroup* group : {group_, shard_group_, replicate_group_.get()}) {
    if (group == nullptr || group->memory_space() != MemorySpace::kCuda ||
        detail::takes_as_is(*group, device_)) {
      continue;
    }
    throw ConfigError(fmt::format(
        "FullyShardedDataParallel: the parameters are on {}, but the process group ({}) takes "
        "this process's CUDA memory only (cuda:{}); move the model to that GPU before wrapping "
        "it, or use a host group (ring, mpi)",
        device_.str(), group->backend(), group->cuda_device()));
  }
}

torch::ScalarType FullyShardedDataParallelImpl::compute_dtype() const {
  return options_.mixed_precision.param_dtype.value_or(torch::kFloat);
}

torch::ScalarType FullyShardedDataParallelImpl::reduce_dtype() const {
  return options_.mixed_precision.reduce_dtype.value_or(compute_dtype());
}

void FullyShardedDataParallelImpl::check_mixed_precision() const {
  const auto& mp = options_.mixed_precision;
  const auto check = [](const char* field, const std::optional<torch::ScalarType>& dtype) {
    if (!dtype || is_16_bit(*dtype) || *dtype == torch::kFloat) return;
    throw ConfigError(
        fmt::format("FsdpMixedPrecision::{} is {}; FSDP computes and reduces in torch::kBFloat16, "
                    "torch::kHalf or torch::kFloat (the shards stay fp32); leave it unset for fp32",
                    field, c10::toString(*dtype)));
  };
  check("param_dtype", mp.param_dtype);
  check("reduce_dtype", mp.reduce_dtype);
  if (mp.buffer_dtype && !c10::isFloatingType(*mp.buffer_dtype)) {
    throw ConfigError(fmt::format(
        "FsdpMixedPrecision::buffer_dtype is {}; buffers are cast to a floating-point dtype "
        "(e.g. torch::kBFloat16), or leave it unset to keep theirs",
        c10::toString(*mp.buffer_dtype)));
  }
}

bool FullyShardedDataParallelImpl::frees_full_parameters() const {
  return options_.sharding_strategy == ShardingStrategy::kFullShard ||
         options_.sharding_strategy == ShardingStrategy::kHybridShard;
}

void FullyShardedDataParallelImpl::make_hybrid_groups() {
  shard_group_ = group_;
  const bool given = options_.shard_group || options_.replicate_group;
  if (options_.sharding_strategy != ShardingStrategy::kHybridShard) {
    if (given) {
      throw ConfigError(fmt::format(
          "FsdpOptions::shard_group and replicate_group are for kHybridShard; the strategy is {}",
          to_string(options_.sharding_strategy)));
    }
    return;
  }
  if (given) {
    if (!options_.shard_group || !options_.replicate_group) {
      throw ConfigError(
          "FsdpOptions: kHybridShard takes both shard_group and replicate_group, or neither (then "
          "this host's ranks shard and the hosts replicate)");
    }
    if (options_.shard_group->size() * options_.replicate_group->size() != group_->size()) {
      throw ConfigError(fmt::format(
          "FsdpOptions: shard_group ({} ranks) x replicate_group ({} ranks) is not the group's {} "
          "ranks",
          options_.shard_group->size(), options_.replicate_group->size(), group_->size()));
    }
    shard_group_ = options_.shard_group.get();
    replicate_group_ = options_.replicate_group;
    return;
  }
  // This host's ranks shard; rank j of every host's subgroup replicates the same shards.
  const Subgroups hosts = new_subgroups(0, *group_);
  std::vector<std::vector<int>> replicas(hosts.ranks.front().size());
  for (const auto& host : hosts.ranks) {
    for (std::size_t j = 0; j < host.size() && j < replicas.size(); ++j)
      replicas[j].push_back(host[j]);
  }
  options_.shard_group = hosts.mine;
  options_.replicate_group = split_group(replicas, *group_);
  shard_group_ = options_.shard_group.get();
  replicate_group_ = options_.replicate_group;
}

void FullyShardedDataParallelImpl::find_nested_wrappers() {
  for (const auto& item : wrapped_->named_modules("", /*include_self=*/false)) {
    auto wrapper = std::dynamic_pointer_cast<FullyShardedDataParallelImpl>(item.value());
    if (!wrapper) continue;
    const bool inside_another = std::any_of(nested_.begin(), nested_.end(), [&](const auto& n) {
      return item.key().rfind(n.first + ".", 0) == 0;
    });
    if (inside_another) continue;  // its outermost wrapper takes care of it
    nested_.emplace_back(item.key(), wrapper);
    for (const auto& shard : wrapper->parameters())
      nested_shards_.push_back(shard);
  }
}

bool FullyShardedDataParallelImpl::shards_parameter(const torch::Tensor& p) const {
  for (const auto& unit : units_)
    for (const auto& mine : unit->params)
      if (mine.unsafeGetTensorImpl() == p.unsafeGetTensorImpl()) return true;
  return std::any_of(nested_.begin(), nested_.end(),
                     [&](const auto& n) { return n.second->shards_parameter(p); });
}

std::vector<torch::Tensor> FullyShardedDataParallelImpl::own_parameters(
    const torch::nn::Module& module) const {
  std::vector<torch::Tensor> own;
  for (const auto& p : module.parameters()) {
    const bool nested = std::any_of(
        nested_shards_.begin(), nested_shards_.end(),
        [&](const auto& s) { return s.unsafeGetTensorImpl() == p.unsafeGetTensorImpl(); });
    if (!nested) own.push_back(p);
  }
  return own;
}

void FullyShardedDataParallelImpl::build() {
  const int world = shard_group_->size();
  std::string local_error;
  std::ostringstream description;
  // A local problem must not leave the other ranks waiting: it travels in the agreement check and
  // every rank throws it.
  try {
    check_mixed_precision();
    if (!wrapped_) throw ConfigError("FullyShardedDataParallel: the module to wrap is null");
    if (dynamic_cast<FullyShardedDataParallelImpl*>(wrapped_.get()) != nullptr) {
      throw ConfigError(
          "FullyShardedDataParallel: the module is already a FullyShardedDataParallel; wrap the "
          "module inside it once");
    }
    find_nested_wrappers();
    for (const auto& [path, wrapper] : nested_) {
      description << "nested " << path << ": " << to_string(wrapper->options().sharding_strategy)
                  << ", " << wrapper->unit_count() << " units\n";
    }
    const bool sequential = !module_.is_empty();
    if (!sequential && !options_.units.empty()) {
      throw ConfigError(fmt::format(
          "FullyShardedDataParallel: FsdpOptions::units are child ranges of a Sequential; the "
          "module is a {}, which is one unit (wrap its submodules to shard them separately)",
          wrapped_->name()));
    }
    const std::size_t children = sequential ? module_->size() : 1;
    std::vector<std::vector<torch::Tensor>> child_params(children);
    std::vector<std::int64_t> child_numel(children);
    for (std::size_t c = 0; c < children; ++c) {
      child_params[c] = own_parameters(sequential ? *module_->ptr(c) : *wrapped_);
      for (const auto& p : child_params[c])
        child_numel[c] += p.numel();
    }
    for (const auto& params : child_params) {
      for (const auto& p : params) {
        // Sharded already: a parameter shared with a nested wrapper's module (tied weights), or
        // one another wrapper holds (its storage is FSDP's, or gone while freed).
        const auto& storage = p.storage();
        const bool sharded_elsewhere =
            detail::is_fsdp_memory(storage.data_ptr()) || (p.numel() > 0 && storage.nbytes() == 0);
        const auto owner = std::find_if(nested_.begin(), nested_.end(), [&](const auto& n) {
          return n.second->shards_parameter(p);
        });
        if (owner != nested_.end()) {
          throw ConfigError(fmt::format(
              "FullyShardedDataParallel: parameter {} is shared with the nested wrapper at '{}', "
              "which shards it; a parameter can be sharded by one wrapper only (wrap the modules "
              "that share it together)",
              shape_text(p), owner->first));
        }
        if (sharded_elsewhere) {
          throw ConfigError(fmt::format(
              "FullyShardedDataParallel: parameter {} is already sharded by another "
              "FullyShardedDataParallel (shared between two wrapped modules?); wrap the modules "
              "that share it together",
              shape_text(p)));
        }
      }
    }

    std::vector<std::pair<std::size_t, std::size_t>> ranges = options_.units;
    if (!sequential) {
      if (child_numel[0] > 0) ranges.emplace_back(0, 1);
    } else if (ranges.empty()) {
      if (options_.min_num_params <= 0) {
        throw ConfigError(
            fmt::format("FullyShardedDataParallel: min_num_params must be positive, got {}",
                        options_.min_num_params));
      }
      std::size_t begin = 0;
      std::int64_t numel = 0;
      for (std::size_t c = 0; c < children; ++c) {
        numel += child_numel[c];
        if (numel >= options_.min_num_params) {
          ranges.emplace_back(begin, c + 1);
          begin = c + 1;
          numel = 0;
        }
      }
      // Trailing children: their own unit if they hold parameters, else they join the last one.
      if (begin < children) {
        if (numel > 0 || ranges.empty()) {
          ranges.emplace_back(begin, children);
        } else {
          ranges.back().second = children;
        }
      }
    } else {
      std::size_t previous_end = 0;
      for (std::size_t u = 0; u < ranges.size(); ++u) {
        const auto [begin, end] = ranges[u];
        if (begin >= end || end > children) {
          throw ConfigError(fmt::format(
              "FullyShardedDataParallel: unit {} is children [{}, {}), which is empty or out of "
              "range (the Sequential has {} children); give [begin, end) ranges with begin < end "
              "<= {}",
              u, begin, end, children, children));
        }
        if (begin < previous_end) {
          throw ConfigError(fmt::format(
              "FullyShardedDataParallel: unit {} [{}, {}) starts before the previous unit ends "
              "({}); units must be sorted and must not overlap",
              u, begin, end, previous_end));
        }
        previous_end = end;
      }
      std::vector<bool> covered(children, false);
      for (const auto& [begin, end] : ranges)
        for (std::size_t c = begin; c < end; ++c)
          covered[c] = true;
      for (std::size_t c = 0; c < children; ++c) {
        if (!covered[c] && child_numel[c] > 0) {
          throw ConfigError(fmt::format(
              "FullyShardedDataParallel: child {} has {} parameters but is in no unit; every "
              "child with parameters must be inside a unit's [begin, end) range",
              c, child_numel[c]));
        }
      }
    }

    if (options_.cpu_offload.offload_params &&
        options_.sharding_strategy == ShardingStrategy::kNoShard) {
      throw ConfigError(
          "FullyShardedDataParallel: cpu_offload.offload_params with NO_SHARD is not built (every "
          "rank holds the whole model there, as DistributedDataParallel); offload with "
          "FULL_SHARD, SHARD_GRAD_OP or HYBRID_SHARD");
    }
    const auto& mp = options_.mixed_precision;
    description << "strategy " << to_string(options_.sharding_strategy) << "\n"
                << "cpu offload of parameters: " << options_.cpu_offload.offload_params << "\n"
                << "mixed precision: param " << dtype_text(mp.param_dtype) << ", reduce "
                << dtype_text(mp.reduce_dtype) << ", buffer " << dtype_text(mp.buffer_dtype) << "\n"
                << "children " << children << "\n";
    std::unordered_map<const void*, std::size_t> unit_of;
    unit_starting_at_.assign(children, -1);
    for (std::size_t u = 0; u < ranges.size(); ++u) {
      auto unit = std::make_unique<Unit>();
      unit->begin = ranges[u].first;
      unit->end = ranges[u].second;
      unit_starting_at_[unit->begin] = static_cast<std::ptrdiff_t>(u);
      description << "unit " << u << ": children [" << unit->begin << ", " << unit->end << ")\n";
      for (std::size_t c = unit->begin; c < unit->end; ++c) {
        for (const auto& p : child_params[c]) {
          const auto [it, fresh] = unit_of.emplace(p.unsafeGetTensorImpl(), u);
          if (!fresh) {
            if (it->second == u) continue;  // shared within the unit: flattened once
            throw ConfigError(fmt::format(
                "FullyShardedDataParallel: a parameter {} of child {} is shared with unit {}; "
                "put the children that share it in one unit",
                shape_text(p), c, it->second));
          }
          if (p.scalar_type() != torch::kFloat || !(p.is_cpu() || p.is_cuda()) || p.is_sparse()) {
            throw ConfigError(fmt::format(
                "FullyShardedDataParallel: parameter {} of child {} is {} on {}; it must be a "
                "dense fp32 tensor on the CPU or a CUDA device (the flat buffers are fp32)",
                shape_text(p), c, c10::toString(p.scalar_type()), p.device().str()));
          }
          if (unit_of.size() == 1) device_ = p.device();
          if (p.device() != device_) {
            throw ConfigError(fmt::format(
                "FullyShardedDataParallel: parameter {} of child {} is on {}, but the first "
                "parameter is on {}; every parameter of a wrapper must be on one device (move "
                "the model with ->to(device) before wrapping it)",
                shape_text(p), c, p.device().str(), device_.str()));
          }
          unit->offsets.push_back(unit->numel);
          unit->params.push_back(p);
          unit->numel += p.numel();
          description << "  parameter " << shape_text(p) << "\n";
        }
      }
      if (unit->params.empty()) {
        throw ConfigError(fmt::format(
            "FullyShardedDataParallel: unit {} (children [{}, {})) has no parameters; let "
            "parameter-free children join a neighbouring unit",
            u, unit->begin, unit->end));
      }
      if (options_.sharding_strategy == ShardingStrategy::kNoShard) {
        unit->padded = unit->numel;
        unit->shard_numel = unit->numel;
      } else {
        unit->padded = (unit->numel + world - 1) / world * world;
        unit->shard_numel = unit->padded / world;
      }
      units_.push_back(std::move(unit));
    }
    if (units_.empty() && nested_.empty()) {
      throw ConfigError("FullyShardedDataParallel: the module has no parameters to shard");
    }
    // A wrapper whose parameters are all in nested wrappers works where they do.
    if (units_.empty()) device_ = nested_.front().second->device_;
    for (const auto& [path, wrapper] : nested_) {
      if (wrapper->device_ == device_) continue;
      throw ConfigError(fmt::format(
          "FullyShardedDataParallel: the nested wrapper at '{}' holds parameters on {}, but this "
          "wrapper's are on {}; move the whole model to one device before wrapping it",
          path, wrapper->device_.str(), device_.str()));
    }
    check_device();
    // The device's type, not its index: ranks on one host each use their own GPU.
    description << "parameters on " << c10::DeviceTypeName(device_.type(), /*lower_case=*/true)
                << "\n";
    for (const auto& b : wrapped_->buffers())
      description << "buffer " << shape_text(b) << "\n";
  } catch (const std::exception& e) {
    local_error = e.what();
  }

  detail::agree_or_throw(*group_, description.str(), local_error,
                         {.wrapper = "FullyShardedDataParallel",
                          .requirement = "Every rank must wrap the same model (children, "
                                         "parameter shapes and dtypes, buffers) with the same "
                                         "strategy and units"});

  torch::NoGradGuard no_grad;
  const int rank = shard_group_->rank();
  const bool separate_copy = low_precision_parameters();
  for (std::size_t u = 0; u < units_.size(); ++u) {
    auto& unit = *units_[u];
    // The fp32 values: the gathered parameters themselves, or (param_dtype) their master copy.
    torch::Tensor master = flat_zeros(unit.padded, torch::kFloat);
    for (std::size_t i = 0; i < unit.params.size(); ++i) {
      master.narrow(0, unit.offsets[i], unit.params[i].numel())
          .copy_(unit.params[i].detach().reshape(-1));
    }
    broadcast(master, 0, *group_);  // every rank starts from rank 0's values, as DDP
    if (separate_copy) {
      unit.full = flat_zeros(unit.padded, compute_dtype());
      unit.full.copy_(master);
    } else {
      unit.full = master;
    }
    if (options_.sharding_strategy == ShardingStrategy::kNoShard) {
      unit.shard = master;
    } else if (options_.sharding_strategy == ShardingStrategy::kShardGradOp && !separate_copy &&
               !offloads_shards()) {
      // The full buffer stays allocated, so the shard is the rank's own range of it (the
      // all-gather then runs in place): 4 bytes per parameter / W less than a separate copy,
      // which is what ZeRO stage 2's 4Ψ + 12Ψ/W counts.
      unit.shard = unit.full.detach().narrow(0, rank * unit.shard_numel, unit.shard_numel);
    } else {
      unit.shard = master.narrow(0, rank * unit.shard_numel, unit.shard_numel).clone();
    }
    // cpu_offload: the shard lives in pinned host memory, so that each gather's copy to the device
    // is asynchronous; the optimizer then steps on the CPU.
    if (offloads_shards()) unit.shard = unit.shard.to(torch::kCPU).pin_memory();
    unit.shard.set_requires_grad(true);
    for (std::size_t i = 0; i < unit.params.size(); ++i) {
      auto& p = unit.params[i];
      p.set_data(unit.full.detach().narrow(0, unit.offsets[i], p.numel()).view(p.sizes()));
    }
    for (auto& p : unit.params) {
      unit.hooks.push_back(
          std::make_unique<libtorch_compat::GradReadyHook>(p, [this, u] { on_grad_ready(u); }));
    }
    register_parameter(fmt::format("unit_{}", u), unit.shard);
    if (frees_full_parameters()) free_full(u);
  }
  // parameters() then returns the whole tree's shards.
  for (const auto& [path, wrapper] : nested_) {
    std::string name = path;
    std::replace(name.begin(), name.end(), '.', '_');
    register_module(name, wrapper);
  }
  auto buffers = wrapped_->buffers();
  if (!buffers.empty()) broadcast_coalesced(*group_, buffers, 0);
  release_free_heap();  // the unwrapped parameters' memory (4 bytes per parameter)
  if (const auto dtype = options_.mixed_precision.buffer_dtype) {
    for (auto& buffer : buffers) {
      if (!buffer.is_floating_point() || buffer.scalar_type() == *dtype) continue;
      cast_buffers_.emplace_back(buffer, buffer.scalar_type());
      buffer.set_data(buffer.detach().to(*dtype));
    }
  }
}

FullyShardedDataParallelImpl::UnitInfo FullyShardedDataParallelImpl::unit_info(
    std::size_t unit) const {
  const auto& u = *units_.at(unit);
  return {.begin = u.begin,
          .end = u.end,
          .numel = u.numel,
          .padded_numel = u.padded,
          .shard_numel = u.shard_numel};
}

std::int64_t FullyShardedDataParallelImpl::gathered_parameter_bytes() const {
  if (options_.sharding_strategy == ShardingStrategy::kNoShard && !low_precision_parameters()) {
    return 0;  // the gathered parameters are the shards
  }
  std::int64_t bytes = 0;
  for (const auto& u : units_)
    bytes += static_cast<std::int64_t>(u->full.storage().nbytes());
  return bytes;
}

void FullyShardedDataParallelImpl::train(bool on) {
  torch::nn::Module::train(on);
  wrapped_->train(on);
}

void FullyShardedDataParallelImpl::start_gather(std::size_t unit) {
  if (options_.sharding_strategy == ShardingStrategy::kNoShard) return;
  auto& u = *units_[unit];
  if (u.state != Unit::State::kFree) return;
  if (!detail::fsdp_storage_allocated(u.full)) detail::allocate_fsdp_storage(u.full);
  // param_dtype: the shard is cast before it travels (half the bytes), and kept until gathered.
  // cpu_offload: copied to the device first (from pinned memory, ordered on the current stream,
  // which the collective follows).
  u.gather_source = u.shard.detach();
  if (offloads_shards()) u.gather_source = u.gather_source.to(device_, /*non_blocking=*/true);
  if (low_precision_parameters()) u.gather_source = u.gather_source.to(compute_dtype());
  u.gather = all_gather_into_tensor_async(u.full, u.gather_source, *shard_group_);
  u.state = Unit::State::kGathering;
  ++all_gather_count_;
}

void FullyShardedDataParallelImpl::wait_gather(std::size_t unit) {
  auto& u = *units_[unit];
  if (u.state != Unit::State::kGathering) return;
  detail::in_phase(
      detail::kFsdpCauses,
      [&] { return fmt::format("parameter all-gather of unit {} of {}", unit + 1, units_.size()); },
      [&] { u.gather->wait(); });
  u.gather.reset();
  u.gather_source = torch::Tensor();
  u.state = Unit::State::kGathered;
}

void FullyShardedDataParallelImpl::free_full(std::size_t unit) {
  wait_gather(unit);
  auto& u = *units_[unit];
  detail::release_fsdp_storage(u.full);
  u.state = Unit::State::kFree;
}

torch::Tensor FullyShardedDataParallelImpl::cast_tensor_input(const torch::Tensor& input) const {
  if (low_precision_parameters() && input.defined() && input.is_floating_point()) {
    return input.to(compute_dtype());
  }
  return input;
}

void FullyShardedDataParallelImpl::throw_not_a(const char* type_name) const {
  throw ConfigError(fmt::format(
      "FullyShardedDataParallel::forward_as<{}>: the wrapped module is a {}; name its own type",
      c10::demangle(type_name), wrapped_->name()));
}

// A backward that threw inside autograd (out of memory, a hook that failed) never ran
// finish_backward: the units' ready counts and reductions are stale, so the next backward would
// reduce none of those units and leave their gradients undefined. That pass is dropped here, before
// anything is gathered: its in-flight reductions are waited for (on every rank that failed alike
// they complete; a rank that did not fail is left waiting, which the group's timeout names), and
// its partial gradients freed. What it may already have added to a shard's .grad() is marked: a
// reduction that would add to it unchanged is refused by name (harvest_reduction), so the partial
// pass is never silently part of a step; zero the gradients and it is gone. Gradients accumulated
// under no_sync() are lost with it: that is an error here, once, naming what to redo.
void FullyShardedDataParallelImpl::drop_unfinished_backward() {
  if (!finish_queued_) return;
  finish_queued_ = false;
  torch::NoGradGuard no_grad;
  bool lost_accumulation = false;
  for (std::size_t unit = 0; unit < units_.size(); ++unit) {
    auto& u = *units_[unit];
    if (u.reduction) {
      detail::in_phase(
          detail::kFsdpCauses,
          [&] {
            return fmt::format(
                "gradient reduce-scatter of unit {} of {} (of a backward that failed)", unit + 1,
                units_.size());
          },
          [&] { u.reduction->wait(); });
    }
    lost_accumulation = lost_accumulation || u.holds_accumulation;
    u.holds_accumulation = false;
    u.reduction.reset();
    u.reduction_input = torch::Tensor();
    u.reduction_output = torch::Tensor();
    u.ready = 0;
    u.reduced = false;
    for (auto& p : u.params)
      p.mutable_grad().reset();
    const auto& grad = u.shard.grad();
    u.grad_at_failure = grad.defined() ? grad.unsafeGetTensorImpl() : nullptr;
    u.grad_version_at_failure = grad.defined() ? grad._version() : 0;
    if (frees_full_parameters()) free_full(unit);
  }
  outstanding_.clear();
  if (lost_accumulation) {
    throw Error(
        "FullyShardedDataParallel: the last backward failed before it finished, and the gradients "
        "accumulated under no_sync() went with it; start this step's accumulation again (zero the "
        "gradients first)");
  }
}

void FullyShardedDataParallelImpl::begin_forward(bool tensor_forward) {
  drop_unfinished_backward();
  if (!shadowing_ && join_state()) {
    if (!tensor_forward) {
      throw ConfigError(
          "FullyShardedDataParallel under ddp::Join runs forward(Tensor) only (a joined rank "
          "replays it with an empty batch); forward_as cannot be replayed");
    }
    check_join_setup();
    Join::notify_join_context(*this);  // this rank trains in this step (a no-op unless first)
  }
  release_free_heap();  // the optimizer step's temporaries, before the units are gathered
  const bool sharded = options_.sharding_strategy != ShardingStrategy::kNoShard;
  // The optimizer may have changed the shards since the last gather: gather at every forward.
  if (sharded) {
    for (std::size_t u = 0; u < units_.size(); ++u) {
      wait_gather(u);
      units_[u]->state = Unit::State::kFree;
    }
  } else if (low_precision_parameters()) {
    torch::NoGradGuard no_grad;
    for (auto& unit : units_)
      unit->full.copy_(unit->shard.detach());  // kNoShard's "gather": the cast master
  }
  if (module_.is_empty() && !units_.empty()) {
    start_gather(0);
    wait_gather(0);
  }
}

void FullyShardedDataParallelImpl::end_forward(const std::vector<torch::Tensor>& outputs) {
  if (units_.empty()) return;
  if (torch::GradMode::is_enabled()) {
    for (const auto& output : outputs) {
      if (output.defined() && output.requires_grad()) {
        auto hooked = output;  // register_hook is not const in libtorch 1.13
        hooked.register_hook([this](const torch::Tensor&) { before_unit_backward(0); });
      }
    }
  }
  if (frees_full_parameters()) free_full(0);
}

torch::Tensor FullyShardedDataParallelImpl::forward(torch::Tensor input) {
  if (input.defined()) {
    last_input_sizes_ = input.sizes().vec();
    last_input_dtype_ = input.scalar_type();
    last_input_device_ = input.device();
  }
  if (module_.is_empty() && !tensor_forward_) {
    throw ConfigError(
        fmt::format("FullyShardedDataParallel::forward(Tensor): the wrapped {} was given as a "
                    "std::shared_ptr<torch::nn::Module>, so its forward is unknown; call "
                    "forward_as<ItsImplType>(args...), or wrap the module's holder",
                    wrapped_->name()));
  }
  begin_forward(/*tensor_forward=*/true);
  input = cast_tensor_input(input);
  if (module_.is_empty()) {
    auto output = tensor_forward_(input);
    end_forward({output});
    return output;
  }
  const bool build_graph = torch::GradMode::is_enabled();
  torch::Tensor x = std::move(input);
  std::ptrdiff_t current = -1;
  for (std::size_t c = 0; c < module_->size(); ++c) {
    if (unit_starting_at_[c] >= 0) {
      current = unit_starting_at_[c];
      const auto u = static_cast<std::size_t>(current);
      start_gather(u);
      wait_gather(u);
      if (u + 1 < units_.size()) start_gather(u + 1);  // overlaps this unit's compute
    }
    x = (module_->begin() + static_cast<std::ptrdiff_t>(c))->forward(x);
    if (current >= 0 && units_[static_cast<std::size_t>(current)]->end == c + 1) {
      const auto u = static_cast<std::size_t>(current);
      if (build_graph && x.requires_grad()) {
        x.register_hook([this, u](const torch::Tensor&) { before_unit_backward(u); });
      }
      if (frees_full_parameters()) free_full(u);
      current = -1;
    }
  }
  return x;
}

void FullyShardedDataParallelImpl::queue_finish_backward() {
  if (finish_queued_) return;
  finish_queued_ = true;
  libtorch_compat::at_end_of_backward([this] { finish_backward(); });
}

void FullyShardedDataParallelImpl::attach_flat_gradient(Unit& u) const {
  torch::NoGradGuard no_grad;
  u.reduction_input = flat_zeros(u.padded, compute_dtype());
  for (std::size_t i = 0; i < u.params.size(); ++i) {
    auto& p = u.params[i];
    auto view = u.reduction_input.narrow(0, u.offsets[i], p.numel()).view(p.sizes());
    if (p.grad().defined()) view.copy_(p.grad());
    p.mutable_grad() = view;
  }
}

void FullyShardedDataParallelImpl::before_unit_backward(std::size_t unit) {
  queue_finish_backward();
  auto& u = *units_[unit];
  if (!u.reduced && !u.reduction_input.defined()) {
    // The unit's gradients accumulate in place into views of one flat buffer (autograd adds into
    // a defined .grad), which is then reduced as it is: no copy, and no full-size gradient
    // allocated per parameter.
    attach_flat_gradient(u);
  }
  if (!frees_full_parameters()) return;
  start_gather(unit);
  wait_gather(unit);
  if (unit > 0) start_gather(unit - 1);  // overlaps this unit's backward
}

void FullyShardedDataParallelImpl::on_grad_ready(std::size_t unit) {
  queue_finish_backward();
  auto& u = *units_[unit];
  if (++u.ready == u.params.size()) reduce_gradients(unit);
}

void FullyShardedDataParallelImpl::reduce_gradients(std::size_t unit) {
  torch::NoGradGuard no_grad;
  auto& u = *units_[unit];
  if (u.reduced) return;
  u.reduced = true;
  if (!sync_gradients_) {
    // no_sync: the gradients stay in the unit's flat buffer, whose views are the parameters'
    // .grad(), so the next passes accumulate into it and the first synced one reduces the sum.
    if (!u.reduction_input.defined()) attach_flat_gradient(u);
    if (frees_full_parameters()) free_full(unit);
    return;
  }
  const bool in_place = u.reduction_input.defined();
  // No hook ran before the unit.
  if (!in_place) u.reduction_input = flat_zeros(u.padded, compute_dtype());
  for (std::size_t i = 0; i < u.params.size(); ++i) {
    auto& p = u.params[i];
    const auto& grad = p.grad();
    if (!grad.defined()) continue;  // unused in this pass: zero
    auto slot = u.reduction_input.narrow(0, u.offsets[i], p.numel());
    // Autograd may have replaced the view (e.g. a gradient of another layout): copy it then.
    if (!in_place || grad.data_ptr() != slot.data_ptr()) slot.copy_(grad.reshape(-1));
    p.mutable_grad().reset();  // the full gradient is not kept
  }
  if (reduce_dtype() != compute_dtype()) {
    auto converted = flat_zeros(u.padded, reduce_dtype());
    converted.copy_(u.reduction_input);
    u.reduction_input = converted;
  }
  if (is_16_bit(reduce_dtype())) {
    u.reduction_input.div_(static_cast<double>(gradient_predivide_factor(group_->size())));
  }
  if (options_.sharding_strategy == ShardingStrategy::kNoShard) {
    u.reduction_output = u.reduction_input;
    u.reduction = all_reduce_async(u.reduction_input, ReduceOp::kSum, *group_);
  } else {
    // Mapped, as the flat buffers: freed at once when harvested (after the first backward).
    u.reduction_output = detail::fsdp_flat_zeros(u.shard_numel, reduce_dtype(), device_,
                                                 detail::FlatBufferKind::kShardSized);
    u.reduction = reduce_scatter_tensor_async(u.reduction_output, u.reduction_input, ReduceOp::kSum,
                                              *shard_group_);
  }
  if (frees_full_parameters()) free_full(unit);
  // Bound the memory of gradients in flight: every reduction that has completed hands its result
  // to its shard now (freeing its full flat gradient), and only the newest kReductionsInFlight
  // stay outstanding, so backward holds one unit's full gradient in flight while the next unit
  // computes (waiting only at the end would keep every unit's until then).
  outstanding_.push_back(unit);
  for (auto it = outstanding_.begin(); it != outstanding_.end();) {
    const bool done = units_[*it]->reduction->is_completed();
    if (done || outstanding_.size() > kReductionsInFlight) {
      harvest_reduction(*it);
      it = outstanding_.erase(it);
    } else {
      ++it;
    }
  }
}

void FullyShardedDataParallelImpl::harvest_reduction(std::size_t unit) {
  torch::NoGradGuard no_grad;
  auto& u = *units_[unit];
  detail::in_phase(
      detail::kFsdpCauses,
      [&] {
        return fmt::format("gradient reduce-scatter of unit {} of {}", unit + 1, units_.size());
      },
      [&] {
        u.reduction->wait();
        // kHybridShard: the shard group's sum, summed over the replicas of this shard.
        if (replicate_group_) all_reduce(u.reduction_output, ReduceOp::kSum, *replicate_group_);
      });
  // The shard's gradient is fp32 whatever the reduction's dtype: the upcast, then the rest of
  // the average (a 16-bit sum was pre-divided).
  torch::Tensor average = u.reduction_output;
  auto divisor = static_cast<double>(group_->size());
  if (is_16_bit(average.scalar_type())) {
    divisor /= static_cast<double>(gradient_predivide_factor(group_->size()));
    average = average.to(torch::kFloat);
  }
  if (divisor != 1.0) average.div_(divisor);
  // cpu_offload: only the shard's averaged gradient leaves the device, to the host shard's .grad().
  if (offloads_shards()) average = average.to(torch::kCPU);
  auto& grad = u.shard.mutable_grad();
  if (u.grad_at_failure != nullptr) {
    const bool unchanged = grad.defined() && grad.unsafeGetTensorImpl() == u.grad_at_failure &&
                           grad._version() == u.grad_version_at_failure;
    u.grad_at_failure = nullptr;
    if (unchanged) {
      throw Error(fmt::format(
          "FullyShardedDataParallel: unit {} of {}: its shard's gradient has not changed since a "
          "backward failed before it finished, so it may hold part of that backward; zero the "
          "gradients (optimizer.zero_grad()) after a failed step, then run the step again",
          unit + 1, units_.size()));
    }
  }
  if (grad.defined()) {
    grad.add_(average);
  } else {
    grad = average;
  }
  u.reduction.reset();
  u.reduction_input = torch::Tensor();
  u.reduction_output = torch::Tensor();
  u.holds_accumulation = false;
}

void FullyShardedDataParallelImpl::finish_backward() {
  if (!finish_queued_) return;
  // A unit some of whose parameters got no gradient in this pass is reduced now (the missing
  // gradients count as zero), in unit order on every rank. Units no gradient reached are left.
  for (std::size_t u = 0; u < units_.size(); ++u) {
    if (units_[u]->ready > 0) reduce_gradients(u);
  }
  for (const auto unit : outstanding_)
    harvest_reduction(unit);
  outstanding_.clear();
  for (auto& unit : units_) {
    unit->ready = 0;
    unit->reduced = false;
    unit->holds_accumulation = unit->reduction_input.defined();  // no_sync's, for the next pass
  }
  if (frees_full_parameters()) {
    for (std::size_t u = 0; u < units_.size(); ++u)
      free_full(u);
  }
  finish_queued_ = false;
  release_free_heap();
}

std::vector<FullyShardedDataParallelImpl*> FullyShardedDataParallelImpl::tree() {
  std::vector<FullyShardedDataParallelImpl*> all{this};
  for (const auto& [path, wrapper] : nested_) {
    const auto below = wrapper->tree();
    all.insert(all.end(), below.begin(), below.end());
  }
  return all;
}

FsdpNoSyncGuard FullyShardedDataParallelImpl::no_sync() {
  std::vector<std::pair<FullyShardedDataParallelImpl*, bool>> previous;
  for (auto* wrapper : tree()) {
    previous.emplace_back(wrapper, wrapper->sync_gradients_);
    wrapper->sync_gradients_ = false;
  }
  return FsdpNoSyncGuard([previous = std::move(previous)] {
    for (const auto& [wrapper, sync] : previous)
      wrapper->sync_gradients_ = sync;
  });
}

void FullyShardedDataParallelImpl::summon_full_params(const std::function<void()>& body,
                                                      bool writeback) {
  const auto wrappers = tree();
  for (auto* wrapper : wrappers) {
    if (writeback && wrapper->low_precision_parameters()) {
      throw ConfigError(
          "FullyShardedDataParallel::summon_full_params: writeback with a 16-bit param_dtype would "
          "round the fp32 shards; summon without writeback, or change the shards (parameters())");
    }
    if (wrapper->finish_queued_) {
      throw ConfigError(
          "FullyShardedDataParallel::summon_full_params inside a backward pass, or after one that "
          "failed before it finished; call it between steps (after a failed backward, once a "
          "forward has dropped what it left)");
    }
  }
  // Everything gathered, as forward's first gather would (the shards may have changed).
  for (auto* wrapper : wrappers) {
    for (std::size_t u = 0; u < wrapper->units_.size(); ++u) {
      if (wrapper->options_.sharding_strategy == ShardingStrategy::kNoShard) {
        if (wrapper->low_precision_parameters()) {
          torch::NoGradGuard no_grad;
          wrapper->units_[u]->full.copy_(wrapper->units_[u]->shard.detach());
        }
        continue;
      }
      wrapper->wait_gather(u);
      wrapper->units_[u]->state = Unit::State::kFree;
      wrapper->start_gather(u);
      wrapper->wait_gather(u);
    }
  }
  const auto release = [&] {
    for (auto* wrapper : wrappers) {
      if (!wrapper->frees_full_parameters()) continue;
      for (std::size_t u = 0; u < wrapper->units_.size(); ++u)
        wrapper->free_full(u);
    }
  };
  try {
    body();
  } catch (...) {
    release();
    throw;
  }
  if (writeback) {
    torch::NoGradGuard no_grad;
    for (auto* wrapper : wrappers) {
      if (wrapper->options_.sharding_strategy == ShardingStrategy::kNoShard) continue;
      const int rank = wrapper->shard_group_->rank();
      for (auto& unit : wrapper->units_) {
        // kShardGradOp's fp32 shard is a view of `full`: written already.
        auto mine = unit->full.narrow(0, rank * unit->shard_numel, unit->shard_numel);
        if (mine.data_ptr() != unit->shard.data_ptr()) unit->shard.detach().copy_(mine);
      }
    }
  }
  release();
}

torch::Tensor FullyShardedDataParallelImpl::clip_grad_norm_(double max_norm, double norm_type) {
  if (!(max_norm > 0) || !(norm_type > 0)) {
    throw ConfigError(fmt::format(
        "FullyShardedDataParallel::clip_grad_norm_: max_norm ({}) and norm_type ({}) must be "
        "positive (norm_type may be INFINITY)",
        max_norm, norm_type));
  }
  torch::NoGradGuard no_grad;
  const bool infinity = std::isinf(norm_type);
  // Per wrapper: the shards' contribution (sum of |g|^p, or the max), combined over the ranks
  // that hold different shards (its shard group; NO_SHARD's and HYBRID's replicas hold the same
  // elements and are not counted twice). Float64, so the sum over ranks does not round.
  double total = 0.0;
  std::vector<torch::Tensor> gradients;
  for (auto* wrapper : tree()) {
    double local = 0.0;
    for (const auto& unit : wrapper->units_) {
      const auto& grad = unit->shard.grad();
      if (!grad.defined()) continue;
      gradients.push_back(grad);
      const auto g = grad.detach().to(torch::kFloat64);
      local = infinity ? std::max(local, g.abs().max().item<double>())
                       : local + g.abs().pow(norm_type).sum().item<double>();
    }
    // On the shards' device: a nccl group reads no host memory.
    auto combined = torch::tensor({local}, torch::kFloat64).to(wrapper->device_);
    if (wrapper->options_.sharding_strategy != ShardingStrategy::kNoShard) {
      all_reduce(combined, infinity ? ReduceOp::kMax : ReduceOp::kSum, *wrapper->shard_group_);
    }
    total = infinity ? std::max(total, combined.item<double>()) : total + combined.item<double>();
  }
  const double norm = infinity ? total : std::pow(total, 1.0 / norm_type);
  const double coefficient = max_norm / (norm + 1e-6);
  if (coefficient < 1.0) {
    for (auto& grad : gradients)
      grad.mul_(coefficient);
  }
  return torch::tensor(norm, torch::kFloat);
}

void FullyShardedDataParallelImpl::release_free_heap() const {
  // What this frees is the heap memory of libtorch's temporaries (autograd's weight gradients
  // before they are added into the flat buffer, the optimizer's per-step tensors, and at
  // construction the unwrapped parameters): under ddprun's GLIBC_TUNABLES (mmap_max=0, a 1 GiB
  // trim threshold) malloc keeps all of it resident, and the next unit's transients land beside
  // it, so the process's peak grew by their sum. Measured with ddp-train-bench --model large,
  // Adam, world 2: peak 1,081 MB -> about 830 MB (docs/sharding.md); no step-time cost measured.
  if (options_.release_free_heap && options_.sharding_strategy != ShardingStrategy::kNoShard) {
    malloc_trim(0);
  }
}

torch::OrderedDict<std::string, torch::Tensor> FullyShardedDataParallelImpl::full_state_dict(
    int to) {
  if (to < 0 || to >= group_->size()) {
    throw ConfigError(fmt::format(
        "FullyShardedDataParallel::full_state_dict: rank {} is not in the group of {} ranks", to,
        group_->size()));
  }
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> flats;
  for (auto& unit : units_) {
    if (options_.sharding_strategy == ShardingStrategy::kNoShard) {
      flats.push_back(unit->shard.detach());
    } else {
      auto flat = torch::empty({unit->padded}, torch::TensorOptions(torch::kFloat).device(device_));
      // cpu_offload's host shard goes to the device first (the group may read device memory
      // only).
      all_gather_into_tensor(flat, unit->shard.detach().to(device_), *shard_group_);
      flats.push_back(flat);
    }
  }
  // Then each nested wrapper's, in the same order on every rank (collective).
  std::vector<torch::OrderedDict<std::string, torch::Tensor>> nested_states;
  for (const auto& [path, wrapper] : nested_)
    nested_states.push_back(wrapper->full_state_dict(to));
  torch::OrderedDict<std::string, torch::Tensor> out;
  if (group_->rank() != to) return out;
  std::unordered_map<const void*, std::pair<std::size_t, std::size_t>> where;
  for (std::size_t u = 0; u < units_.size(); ++u)
    for (std::size_t i = 0; i < units_[u]->params.size(); ++i)
      where.emplace(units_[u]->params[i].unsafeGetTensorImpl(), std::make_pair(u, i));
  std::vector<bool> nested_done(nested_.size(), false);
  for (const auto& item : wrapped_->named_parameters()) {
    const auto it = where.find(item.value().unsafeGetTensorImpl());
    if (it == where.end()) {
      // A nested wrapper's shard: its whole state goes here, under its path, once.
      for (std::size_t n = 0; n < nested_.size(); ++n) {
        if (nested_done[n] || item.key().rfind(nested_[n].first + ".", 0) != 0) continue;
        nested_done[n] = true;
        for (const auto& entry : nested_states[n])
          out.insert(nested_[n].first + "." + entry.key(), entry.value());
      }
      continue;
    }
    const auto [u, i] = it->second;
    const auto& p = units_[u]->params[i];
    out.insert(item.key(),
               flats[u].narrow(0, units_[u]->offsets[i], p.numel()).view(p.sizes()).clone());
  }
  std::unordered_map<const void*, torch::ScalarType> original_dtype;
  for (const auto& [buffer, dtype] : cast_buffers_)
    original_dtype.emplace(buffer.unsafeGetTensorImpl(), dtype);
  for (std::size_t n = 0; n < nested_.size(); ++n) {
    if (nested_done[n]) continue;  // a nested wrapper of buffers only
    for (const auto& entry : nested_states[n])
      out.insert(nested_[n].first + "." + entry.key(), entry.value());
  }
  for (const auto& item : wrapped_->named_buffers()) {
    const auto it = original_dtype.find(item.value().unsafeGetTensorImpl());
    out.insert(item.key(), it == original_dtype.end() ? item.value().detach().clone()
                                                      : item.value().detach().to(it->second));
  }
  return out;
}

void FullyShardedDataParallelImpl::check_join_setup() const {
  if (join_optimizer_ == nullptr) {
    throw ConfigError(
        "FullyShardedDataParallel under ddp::Join needs the optimizer over its shards: call "
        "model->set_join_optimizer(optimizer) before the Join (a rank that runs out of data keeps "
        "stepping the shards it owns, which the other ranks gather)");
  }
  if (!join_state()->options.divide_by_initial_world_size) {
    throw ConfigError(
        "FullyShardedDataParallel under ddp::Join averages the gradients over every rank (the "
        "joined ones contribute zeros): JoinOptions::divide_by_initial_world_size must be true");
  }
}

// One step of the ranks still training, with no data: the same collectives (the all-gathers of
// forward and backward, the reduce-scatters of backward) over an empty batch, whose gradients are
// zeros; then the shard's step, with the gradients averaged over the ranks.
void FullyShardedDataParallelImpl::join_main_hook() {
  check_join_setup();
  if (last_input_sizes_.empty()) {
    throw ConfigError(
        "FullyShardedDataParallel under ddp::Join: this rank joined before its first forward, so "
        "it does not know the input's shape for the shadow steps; give every rank at least one "
        "batch");
  }
  auto sizes = last_input_sizes_;
  sizes[0] = 0;
  const auto empty = torch::zeros(
      sizes, torch::TensorOptions().dtype(last_input_dtype_).device(last_input_device_));
  join_optimizer_->zero_grad();
  shadowing_ = true;
  try {
    const torch::Tensor out = forward(empty);
    shadowing_ = false;
    // Any scalar of an empty output has zero gradients; sum() reaches every unit.
    if (out.requires_grad()) out.sum().backward();
  } catch (...) {
    shadowing_ = false;
    throw;
  }
  join_optimizer_->step();
}

// Every rank stepped its shards in every step (the joined ones while shadowing): nothing to copy.
void FullyShardedDataParallelImpl::join_post_hook(bool /*is_last_joiner*/) {}

std::string FullyShardedDataParallelImpl::join_description() const {
  return fmt::format("FullyShardedDataParallel({}, {} units)",
                     to_string(options_.sharding_strategy), units_.size());
}

}  // namespace ddp
