// FullyShardedDataParallel: construction (strategy, mixed precision, hybrid groups, nested
// wrappers), the accessors, the heap release and Join (the phases are in fsdp_sharding.cc,
// fsdp_forward.cc, fsdp_backward.cc and fsdp_full_params.cc).
#include "ddp/torch/fsdp/fully_sharded_data_parallel.h"

#include <malloc.h>

#include <algorithm>
#include <cstdint>

#include <fmt/format.h>

#include "ddp/error.h"
#include "torch/core/host_values.h"
#include "torch/core/parameter_devices.h"
#include "torch/fsdp/fsdp_flat_memory.h"
#include "torch/fsdp/fsdp_unit.h"

namespace ddp {

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

FullyShardedDataParallelImpl::~FullyShardedDataParallelImpl() {
  // The list may be shared with the wrappers around this one, which outlive it.
  forget_own_reductions();
}

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
  return options_.mixed_precision.param_dtype.value_or(storage_dtype_);
}

torch::ScalarType FullyShardedDataParallelImpl::reduce_dtype() const {
  return options_.mixed_precision.reduce_dtype.value_or(compute_dtype());
}

void FullyShardedDataParallelImpl::check_mixed_precision() const {
  const auto& mp = options_.mixed_precision;
  const auto check = [](const char* field, const std::optional<torch::ScalarType>& dtype) {
    if (!dtype || detail::is_16_bit(*dtype) || *dtype == torch::kFloat) return;
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

std::vector<FullyShardedDataParallelImpl*> FullyShardedDataParallelImpl::tree() {
  std::vector<FullyShardedDataParallelImpl*> all{this};
  for (const auto& [path, wrapper] : nested_) {
    const auto below = wrapper->tree();
    all.insert(all.end(), below.begin(), below.end());
  }
  return all;
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
