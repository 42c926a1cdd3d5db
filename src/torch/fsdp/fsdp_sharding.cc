// FullyShardedDataParallel: sharding at construction (build): the units, checked alike on every
// rank, flattened into rank 0's values and cut into this rank's shards.
#include <algorithm>
#include <sstream>
#include <unordered_map>

#include <fmt/format.h>

#include "ddp/error.h"
#include "ddp/torch/core/tensor_collectives.h"
#include "ddp/torch/fsdp/fully_sharded_data_parallel.h"
#include "torch/api/rank_agreement.h"
#include "torch/core/libtorch_compat.h"
#include "torch/core/split_parameters.h"
#include "torch/fsdp/fsdp_flat_memory.h"
#include "torch/fsdp/fsdp_unit.h"

namespace ddp {

namespace {

using detail::shape_text;

std::string dtype_text(const std::optional<torch::ScalarType>& dtype) {
  return dtype ? std::string(c10::toString(*dtype)) : std::string("unset");
}

}  // namespace

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
      // Trailing children: their own unit if they hold parameters, else they join the last one;
      // with no unit at all (every parameter in nested wrappers: fsdp_build_sharded,
      // fsdp_auto_wrap), they run outside any, as children between explicit units do.
      if (begin < children) {
        if (numel > 0) {
          ranges.emplace_back(begin, children);
        } else if (!ranges.empty()) {
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
                << "low-memory backward: " << options_.low_memory_backward << "\n"
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
          const bool storable =
              p.scalar_type() == torch::kFloat || p.scalar_type() == torch::kDouble;
          if (!storable || !(p.is_cpu() || p.is_cuda()) || p.is_sparse()) {
            throw ConfigError(fmt::format(
                "FullyShardedDataParallel: parameter {} of child {} is {} on {}; it must be a "
                "dense fp32 or fp64 tensor on the CPU or a CUDA device (the flat buffers hold "
                "the parameters' own dtype; for 16-bit compute keep fp32 parameters and set "
                "FsdpOptions::mixed_precision)",
                shape_text(p), c, c10::toString(p.scalar_type()), p.device().str()));
          }
          if (unit_of.size() == 1) {
            device_ = p.device();
            storage_dtype_ = p.scalar_type();
          }
          if (p.scalar_type() != storage_dtype_) {
            throw ConfigError(fmt::format(
                "FullyShardedDataParallel: parameter {} of child {} is {}, but the first "
                "parameter is {}; one wrapper flattens one dtype (convert the model with "
                "->to(dtype), or wrap the parts of each dtype in wrappers of their own)",
                shape_text(p), c, c10::toString(p.scalar_type()), c10::toString(storage_dtype_)));
          }
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
          description << "  parameter " << shape_text(p);
          // A tensor-parallel part: FSDP over the dp dimension sees the same part on every rank;
          // over the tp one, different parts, which the agreement below names.
          if (const auto needs = detail::gradient_ranks_of(p);
              needs && needs->ranks != group_->size()) {
            throw ConfigError(fmt::format(
                "FullyShardedDataParallel: a parameter of child {} ({}) must have its gradient "
                "averaged over {} ranks, but the group has {}; wrap it over a group of those "
                "ranks",
                c, needs->what, needs->ranks, group_->size()));
          }
          if (const auto split = detail::split_part_of(p)) {
            description << " (" << split->kind << " part " << split->part << " of " << split->parts
                        << ")";
          }
          description << "\n";
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
    if (units_.empty()) {
      device_ = nested_.front().second->device_;
      storage_dtype_ = nested_.front().second->storage_dtype_;
    }
    if (storage_dtype_ != torch::kFloat &&
        (options_.mixed_precision.param_dtype || options_.mixed_precision.reduce_dtype)) {
      throw ConfigError(fmt::format(
          "FullyShardedDataParallel: FsdpOptions::mixed_precision with {} parameters; mixed "
          "precision computes from fp32 shards (convert the model with ->to(torch::kFloat)), or "
          "leave it unset to compute in {}",
          c10::toString(storage_dtype_), c10::toString(storage_dtype_)));
    }
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
                << " in " << c10::toString(storage_dtype_) << "\n";
    for (const auto& b : wrapped_->buffers())
      description << "buffer " << shape_text(b) << "\n";
  } catch (const std::exception& e) {
    local_error = e.what();
  }

  const bool tensor_parallel = description.str().find("-parallel part ") != std::string::npos;
  detail::agree_or_throw(
      *group_, description.str(), local_error,
      {.wrapper = "FullyShardedDataParallel",
       .requirement = tensor_parallel
                          ? "Every rank must wrap the same model (children, parameter shapes and "
                            "dtypes, buffers) with the same strategy and units; a model split by "
                            "tensor (or expert) parallelism is wrapped over the dp dimension of "
                            "its mesh (mesh.group(\"dp\")), whose ranks hold the same parts, "
                            "not over the tp (or ep) one"
                          : "Every rank must wrap the same model (children, parameter shapes and "
                            "dtypes, buffers) with the same strategy and units"});

  torch::NoGradGuard no_grad;
  const int rank = shard_group_->rank();
  const bool separate_copy = low_precision_parameters();
  for (std::size_t u = 0; u < units_.size(); ++u) {
    auto& unit = *units_[u];
    if (frees_full_parameters() && !separate_copy) {
      // FULL_SHARD and HYBRID_SHARD free the full parameters at once, so the unit is sharded
      // straight from its parameters: each is broadcast in place (every rank starts from rank 0's
      // values, as DDP), the rank's slice is copied out, and the flat buffer is never filled (on
      // the host its pages are mapped untouched, and released below). So wrapping a child holds
      // it and its shard only, not a flat copy of it as well (fsdp_build_sharded's peak).
      for (const auto& p : unit.params) {
        auto values = p.detach();
        if (values.is_contiguous()) {
          broadcast(values, 0, *group_);
        } else {  // the group takes contiguous memory
          auto contiguous = values.contiguous();
          broadcast(contiguous, 0, *group_);
          values.copy_(contiguous);
        }
      }
      const std::int64_t first = rank * unit.shard_numel;
      unit.shard =
          torch::zeros({unit.shard_numel}, torch::TensorOptions(storage_dtype_).device(device_));
      for (std::size_t i = 0; i < unit.params.size(); ++i) {
        const auto lo = std::max(unit.offsets[i], first);
        const auto hi =
            std::min(unit.offsets[i] + unit.params[i].numel(), first + unit.shard_numel);
        if (lo >= hi) continue;
        unit.shard.narrow(0, lo - first, hi - lo)
            .copy_(unit.params[i].detach().reshape(-1).narrow(0, lo - unit.offsets[i], hi - lo));
      }
      unit.full = flat_zeros(unit.padded, storage_dtype_);
    } else {
      // The parameters' values (fp32 or fp64): the gathered parameters themselves, or
      // (param_dtype) their master copy.
      torch::Tensor master = flat_zeros(unit.padded, storage_dtype_);
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
    }
    // cpu_offload: the shard lives in pinned host memory, so that each gather's copy to the device
    // is asynchronous; the optimizer then steps on the CPU.
    if (offloads_shards()) unit.shard = unit.shard.to(torch::kCPU).pin_memory();
    unit.shard.set_requires_grad(true);
    for (std::size_t i = 0; i < unit.params.size(); ++i) {
      auto& p = unit.params[i];
      p.set_data(unit.full.detach().narrow(0, unit.offsets[i], p.numel()).view(p.sizes()));
    }
    for (std::size_t i = 0; i < unit.params.size(); ++i) {
      unit.hooks.push_back(std::make_unique<libtorch_compat::GradReadyHook>(
          unit.params[i], [this, u, i] { on_grad_ready(u, i); }));
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
  // One list of reductions in flight for the whole tree (this wrapper is its outermost so far).
  for (auto* wrapper : tree())
    wrapper->in_flight_ = in_flight_;
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

}  // namespace ddp
