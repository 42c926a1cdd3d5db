// DistributedDataParallel: construction (options, the parameters' agreement across ranks, rank
// 0's state broadcast, the Reducer and its hooks), no_sync's guard and the mixed-precision casts
// (forward's steps are in ddp_forward.cc, Join's in ddp_join.cc).
#include "ddp/torch/ddp/distributed_data_parallel.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <unordered_set>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "ddp/error.h"
#include "ddp/runtime/init.h"
#include "ddp/torch/api/distributed.h"
#include "ddp/torch/core/tensor_collectives.h"
#include "torch/api/rank_agreement.h"
#include "torch/core/parameter_devices.h"
#include "torch/core/parameter_loads.h"
#include "torch/core/split_parameters.h"
#include "torch/core/wrapper_phase.h"
#include "torch/ddp/distributed_data_parallel_internal.h"

namespace ddp {
namespace detail {

void collect_trainable(const WrappedModuleTensors& module, std::vector<torch::Tensor>& params,
                       std::vector<std::string>& names) {
  params.clear();
  names.clear();
  std::unordered_set<const c10::TensorImpl*> seen;
  for (const auto& item : module.named_parameters()) {
    if (!item.value().requires_grad()) continue;
    if (!seen.insert(item.value().unsafeGetTensorImpl()).second) continue;
    params.push_back(item.value());
    names.push_back(item.key());
  }
}

std::vector<torch::Tensor> parameters_and_buffers(const WrappedModuleTensors& module) {
  std::vector<torch::Tensor> state = module.named_parameters().values();
  const auto buffers = module.named_buffers().values();
  state.insert(state.end(), buffers.begin(), buffers.end());
  return state;
}

std::vector<const void*> storage_of(const std::vector<torch::Tensor>& params) {
  std::vector<const void*> storage;
  storage.reserve(params.size());
  for (const auto& p : params)
    storage.push_back(p.data_ptr());
  return storage;
}

}  // namespace detail

namespace {

using detail::collect_trainable;
using detail::in_ddp_phase;
using detail::parameters_and_buffers;
using detail::storage_of;

std::int64_t divergence_interval(std::optional<std::int64_t> option) {
  if (option) {
    if (*option < 0) {
      throw ConfigError(fmt::format(
          "DdpOptions::divergence_check_every = {} must be 0 (off) or a positive number of "
          "forwards",
          *option));
    }
    return *option;
  }
  const char* text = std::getenv("DDP_DIVERGENCE_CHECK_EVERY");
  if (text == nullptr || *text == '\0') return kDefaultDivergenceCheckEvery;
  char* end = nullptr;
  errno = 0;
  const long long value = std::strtoll(text, &end, 10);
  if (errno != 0 || *end != '\0' || value < 0 || !std::isdigit(static_cast<unsigned char>(*text))) {
    throw ConfigError(fmt::format(
        "DDP_DIVERGENCE_CHECK_EVERY='{}' is not a number of forwards; use 0 (off) or e.g. 100",
        text));
  }
  return value;
}

WrappedModuleTensors tensors_of(const std::shared_ptr<torch::nn::Module>& module) {
  if (!module) throw ConfigError("DistributedDataParallel: the module is null");
  return {.named_parameters = [module] { return module->named_parameters(/*recurse=*/true); },
          .named_buffers = [module] { return module->named_buffers(/*recurse=*/true); }};
}

// `module` without the parameters and buffers named in `ignored` (DdpOptions::
// parameters_to_ignore); ConfigError for a name that is neither.
WrappedModuleTensors without_ignored(WrappedModuleTensors module,
                                     const std::vector<std::string>& ignored) {
  if (ignored.empty()) return module;
  const auto parameters = module.named_parameters();
  const auto buffers = module.named_buffers();
  for (const auto& name : ignored) {
    if (parameters.contains(name) || buffers.contains(name)) continue;
    std::vector<std::string> known = parameters.keys();
    const auto buffer_names = buffers.keys();
    known.insert(known.end(), buffer_names.begin(), buffer_names.end());
    throw ConfigError(fmt::format(
        "DdpOptions::parameters_to_ignore names '{}', which is neither a parameter nor a buffer "
        "of the module; use the dotted names of named_parameters()/named_buffers(): {}",
        name, fmt::join(known, ", ")));
  }
  auto keep = [ignored](torch::OrderedDict<std::string, torch::Tensor> all) {
    torch::OrderedDict<std::string, torch::Tensor> kept;
    for (const auto& item : all) {
      if (std::find(ignored.begin(), ignored.end(), item.key()) == ignored.end())
        kept.insert(item.key(), item.value());
    }
    return kept;
  };
  return {
      .named_parameters = [all = std::move(module.named_parameters), keep] { return keep(all()); },
      .named_buffers = [all = std::move(module.named_buffers), keep] { return keep(all()); }};
}

// Which of `params` get sparse gradients: the weights of the Embedding and EmbeddingBag modules
// inside `module` with sparse = true (PyTorch's expect_sparse_gradient).
std::vector<bool> sparse_gradient_parameters(const torch::nn::Module& module,
                                             const std::vector<torch::Tensor>& params) {
  std::unordered_set<const void*> sparse;
  for (const auto& m : module.modules(/*include_self=*/true)) {
    if (const auto* e = m->as<torch::nn::EmbeddingImpl>(); e && e->options.sparse()) {
      sparse.insert(e->weight.unsafeGetTensorImpl());
    }
    if (const auto* e = m->as<torch::nn::EmbeddingBagImpl>(); e && e->options.sparse()) {
      sparse.insert(e->weight.unsafeGetTensorImpl());
    }
  }
  std::vector<bool> flags(params.size(), false);
  for (std::size_t i = 0; i < params.size(); ++i)
    flags[i] = sparse.contains(params[i].unsafeGetTensorImpl());
  return flags;
}

// The default group for the module's parameters (default_process_group_for their device): under
// DDP_BACKEND=auto, the nccl group for CUDA parameters where every rank has a GPU of its own.
std::shared_ptr<ProcessGroup> default_group_for(const WrappedModuleTensors& wrapped) {
  for (const auto& item : wrapped.named_parameters()) {
    if (item.value().requires_grad()) return default_process_group_for(item.value().device());
  }
  return default_process_group();
}

// A bucket larger than 1 TiB is a mistake (or 1e300, whose conversion to a byte count was
// undefined and came out as 0: "bucket caps must be positive").
constexpr double kMaxBucketCapMb = 1024.0 * 1024.0;

std::size_t megabytes_to_bytes(double mb, const char* option) {
  if (!std::isfinite(mb) || mb <= 0 || mb > kMaxBucketCapMb) {
    throw ConfigError(
        fmt::format("DdpOptions::{} = {} must be a positive number of MiB, at most {} (1 TiB)",
                    option, mb, kMaxBucketCapMb));
  }
  return static_cast<std::size_t>(std::max(1.0, mb * 1024.0 * 1024.0));
}

using detail::shape_text;

// Every rank describes its parameters (name, shape, dtype; one line each, the count last) and the
// ranks compare the descriptions (rank_agreement.h: one small allgather when they agree). The first
// line that differs is named by every rank (so none waits in a later collective).
//
// The device type is part of the description (not its index: ranks on cuda:0 and cuda:1 agree),
// so ranks with parameters on the CPU and on CUDA are named; a rank whose own parameters are on
// two devices reports that instead, and every rank fails with its error.
void verify_same_parameters(ProcessGroup& group, const std::vector<std::string>& names,
                            const std::vector<torch::Tensor>& params) {
  std::string description;
  bool split = false;
  std::string wrong_ranks;  // a parameter whose gradient needs another number of ranks
  for (std::size_t i = 0; i < params.size(); ++i) {
    const auto needs = detail::gradient_ranks_of(params[i]);
    if (needs && needs->ranks != group.size() && wrong_ranks.empty()) {
      wrong_ranks = fmt::format(
          "DistributedDataParallel: parameter '{}' ({}) must have its gradient averaged over {} "
          "ranks, but the group has {}; wrap the model over a group of the ranks it names (a "
          "mesh's dp group for tensor or expert parallel layers), or average it yourself",
          names[i], needs->what, needs->ranks, group.size());
    }
    description += fmt::format("parameter '{}' {} on {}", names[i], shape_text(params[i]),
                               c10::DeviceTypeName(params[i].device().type(), /*lower_case=*/true));
    // A part of a split tensor (a tensor-parallel layer's, a MoeLayer's experts): the group's
    // ranks must hold the same part, or averaging would mix different weights.
    if (const auto part = detail::split_part_of(params[i])) {
      description += fmt::format(" ({} part {} of {})", part->kind, part->part, part->parts);
      split = true;
    }
    description += "\n";
  }
  description += fmt::format("{} trainable parameters\n", params.size());
  const auto mixed = detail::mixed_devices(params, names);
  const auto agreement =
      detail::compare_across_ranks(group, description, mixed.value_or(wrong_ranks));
  if (agreement.failed_rank >= 0) {
    throw ConfigError(fmt::format("rank {}: {}", agreement.failed_rank, agreement.failure));
  }
  if (agreement.difference.empty()) return;
  throw Error(fmt::format(
      "DistributedDataParallel: the model differs across ranks: {}. Every rank must construct the "
      "same model (the same architecture, sizes and requires_grad, on the same kind of device: "
      "module->to(device) on every rank) before wrapping it{}",
      agreement.difference,
      split ? "; a model split by tensor or expert parallelism is wrapped over the dp dimension "
              "of its mesh (mesh.group(\"dp\")), whose ranks hold the same parts, not over the "
              "tp or ep one"
            : ""));
}

}  // namespace

NoSyncGuard::NoSyncGuard(Reducer& reducer) : reducer_(&reducer), previous_(reducer.require_sync()) {
  reducer_->set_require_sync(false);
}

NoSyncGuard::NoSyncGuard(NoSyncGuard&& other) noexcept
    : reducer_(std::exchange(other.reducer_, nullptr)), previous_(other.previous_) {}

NoSyncGuard::~NoSyncGuard() {
  if (reducer_ != nullptr) reducer_->set_require_sync(previous_);
}

DistributedDataParallelBase::DistributedDataParallelBase(std::shared_ptr<torch::nn::Module> module,
                                                         std::shared_ptr<ProcessGroup> group,
                                                         DdpOptions options)
    : DistributedDataParallelBase(module, tensors_of(module), std::move(group), options) {}

DistributedDataParallelBase::DistributedDataParallelBase(
    std::shared_ptr<torch::nn::Module> registered, WrappedModuleTensors wrapped,
    std::shared_ptr<ProcessGroup> group, DdpOptions options)
    : wrapped_(without_ignored(std::move(wrapped), options.parameters_to_ignore)),
      group_(group ? std::move(group) : default_group_for(wrapped_)),
      options_(options) {
  if (!registered) throw ConfigError("DistributedDataParallel: the module is null");
  options_.divergence_check_every = divergence_interval(options_.divergence_check_every);
  if (!group_) {
    throw ConfigError(
        "DistributedDataParallel: no process group; call ddp::init_process_group() "
        "first or pass a group");
  }
  ReducerOptions reducer_options{
      .bucket_cap_bytes = megabytes_to_bytes(options_.bucket_cap_mb, "bucket_cap_mb"),
      .first_bucket_cap_bytes =
          megabytes_to_bytes(options_.first_bucket_cap_mb, "first_bucket_cap_mb"),
      .find_unused_parameters = options_.find_unused_parameters,
      .gradient_as_bucket_view = options_.gradient_as_bucket_view,
      .static_graph = options_.static_graph,
      .staging_for_tests = options_.staging_for_tests};
  register_module("module", registered);

  std::vector<torch::Tensor> params;
  std::vector<std::string> names;
  collect_trainable(wrapped_, params, names);
  buffers_ = wrapped_.named_buffers().values();
  reducer_options.sparse_gradients = sparse_gradient_parameters(*registered, params);
  if (options_.param_dtype) {
    if (!c10::isFloatingType(*options_.param_dtype)) {
      throw ConfigError(fmt::format(
          "DdpOptions::param_dtype is {}; forward and backward run in a floating-point dtype "
          "(torch::kBFloat16 or torch::kHalf; leave it unset for the parameters' own)",
          c10::toString(*options_.param_dtype)));
    }
    for (std::size_t i = 0; i < params.size(); ++i) {
      if (reducer_options.sparse_gradients[i]) {
        throw ConfigError(fmt::format(
            "DdpOptions::param_dtype with parameter '{}', which has sparse gradients (an "
            "Embedding with sparse = true): use sparse = false, or no param_dtype",
            names[i]));
      }
    }
    reducer_options.gradient_dtype = *options_.param_dtype;
  }
  if (options_.buffer_dtype && !c10::isFloatingType(*options_.buffer_dtype)) {
    throw ConfigError(fmt::format(
        "DdpOptions::buffer_dtype is {}; buffers are cast to a floating-point dtype (e.g. "
        "torch::kBFloat16), or leave it unset to keep theirs",
        c10::toString(*options_.buffer_dtype)));
  }

  in_ddp_phase([] { return std::string("parameter check at construction"); },
               [&] { verify_same_parameters(*group_, names, params); });
  // Every rank starts from rank 0's state.
  std::vector<torch::Tensor> state = parameters_and_buffers(wrapped_);
  if (group_->size() > 1) {
    in_ddp_phase([] { return std::string("parameter broadcast at construction"); },
                 [&] { broadcast_coalesced(*group_, state, /*root=*/0); });
  }

  if (options_.buffer_dtype) {
    torch::NoGradGuard no_grad;
    for (auto& buffer : buffers_) {
      if (buffer.is_floating_point()) buffer.set_data(buffer.detach().to(*options_.buffer_dtype));
    }
  }
  parameter_storage_ = storage_of(params);
  loads_seen_ = detail::parameters_loaded_count();
  reducer_ =
      std::make_unique<Reducer>(std::move(params), std::move(names), group_, reducer_options);
  if (options_.reduce_dtype) {
    switch (*options_.reduce_dtype) {
      case torch::kBFloat16:
        reducer_->register_comm_hook(bf16_compress_hook(), "bf16_compress_hook");
        break;
      case torch::kHalf:
        reducer_->register_comm_hook(fp16_compress_hook(), "fp16_compress_hook");
        break;
      default:
        throw ConfigError(fmt::format(
            "DdpOptions::reduce_dtype is {}; gradients are reduced in torch::kBFloat16 or "
            "torch::kHalf (or leave it unset for their own dtype)",
            c10::toString(*options_.reduce_dtype)));
    }
  }
  if (options_.param_dtype) {
    reducer_->set_end_of_backward([this] { restore_full_precision_parameters(); });
  }
}

torch::Tensor DistributedDataParallelBase::mixed_precision_input(const torch::Tensor& input) const {
  if (!options_.param_dtype || !input.defined() || !input.is_floating_point()) return input;
  return input.to(*options_.param_dtype);
}

void DistributedDataParallelBase::cast_parameters_for_forward() {
  torch::NoGradGuard no_grad;
  // Every floating-point parameter, trainable or not (a frozen one takes part in the same ops).
  for (auto& param : wrapped_.named_parameters().values()) {
    if (!param.is_floating_point() || param.scalar_type() == *options_.param_dtype) continue;
    torch::Tensor data = param.variable_data();  // shares the master's storage
    param.set_data(data.to(*options_.param_dtype));
    cast_parameters_.push_back(param);
    full_precision_data_.push_back(std::move(data));
  }
  reducer_->follow_gradient_accumulators();
}

void DistributedDataParallelBase::restore_full_precision_parameters() {
  torch::NoGradGuard no_grad;
  for (std::size_t i = 0; i < cast_parameters_.size(); ++i) {
    torch::Tensor& param = cast_parameters_[i];
    const auto dtype = full_precision_data_[i].scalar_type();
    param.set_data(full_precision_data_[i]);
    // A gradient that backward left in the low dtype (no_sync, or unused by DDP): upcast, as the
    // optimizer steps the full-precision parameter.
    torch::Tensor& grad = param.mutable_grad();
    if (grad.defined() && grad.scalar_type() != dtype) grad = grad.to(dtype);
  }
  const bool restored = !cast_parameters_.empty();
  cast_parameters_.clear();
  full_precision_data_.clear();
  if (restored) reducer_->follow_gradient_accumulators();
}

}  // namespace ddp
