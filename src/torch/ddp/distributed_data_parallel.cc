#include "ddp/torch/ddp/distributed_data_parallel.h"

#include <algorithm>
#include <array>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <map>
#include <unordered_set>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "ddp/error.h"
#include "ddp/init.h"
#include "ddp/torch/api/distributed.h"
#include "ddp/torch/core/tensor_collectives.h"
#include "ddp/trace.h"
#include "torch/api/rank_agreement.h"
#include "torch/core/host_values.h"
#include "torch/core/parameter_devices.h"
#include "torch/core/parameter_loads.h"
#include "torch/core/wrapper_phase.h"

namespace ddp {
namespace {

using detail::in_ddp_phase;

// The parameters that train, each once (a parameter shared by two submodules appears twice), in
// registration order: what the Reducer works on.
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

// Every parameter (trainable or not) and every buffer: what rank 0 sends at construction and
// after a Join.
std::vector<torch::Tensor> parameters_and_buffers(const WrappedModuleTensors& module) {
  std::vector<torch::Tensor> state = module.named_parameters().values();
  const auto buffers = module.named_buffers().values();
  state.insert(state.end(), buffers.begin(), buffers.end());
  return state;
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

std::vector<const void*> storage_of(const std::vector<torch::Tensor>& params) {
  std::vector<const void*> storage;
  storage.reserve(params.size());
  for (const auto& p : params)
    storage.push_back(p.data_ptr());
  return storage;
}

// A 64-bit checksum of a tensor's bytes (four independent lanes of xxHash64's round, so the
// multiplications overlap): any changed bit changes it.
std::int64_t checksum(const torch::Tensor& tensor) {
  const torch::Tensor data = tensor.detach().cpu().contiguous();
  const auto* bytes = static_cast<const unsigned char*>(data.data_ptr());
  const std::size_t size = static_cast<std::size_t>(data.numel()) * data.element_size();
  constexpr std::uint64_t kPrime1 = 11400714785074694791ull;
  constexpr std::uint64_t kPrime2 = 14029467366897019727ull;
  const auto round = [](std::uint64_t lane, std::uint64_t word) {
    lane += word * kPrime2;
    lane = (lane << 31) | (lane >> 33);
    return lane * kPrime1;
  };
  std::uint64_t lanes[4] = {kPrime1 + kPrime2, kPrime2, 0, ~kPrime1};
  std::size_t at = 0;
  for (; at + 32 <= size; at += 32) {
    std::uint64_t words[4];
    std::memcpy(words, bytes + at, sizeof words);
    for (int k = 0; k < 4; ++k)
      lanes[k] = round(lanes[k], words[k]);
  }
  std::uint64_t hash = size;
  for (const auto lane : lanes)
    hash = round(hash, lane);
  for (; at < size; ++at)
    hash = round(hash, bytes[at]);
  return static_cast<std::int64_t>(hash);
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
  for (std::size_t i = 0; i < params.size(); ++i) {
    description += fmt::format("parameter '{}' {} on {}\n", names[i], shape_text(params[i]),
                               c10::DeviceTypeName(params[i].device().type(), /*lower_case=*/true));
  }
  description += fmt::format("{} trainable parameters\n", params.size());
  const auto mixed = detail::mixed_devices(params, names);
  const auto agreement = detail::compare_across_ranks(group, description, mixed.value_or(""));
  if (agreement.failed_rank >= 0) {
    throw ConfigError(fmt::format("rank {}: {}", agreement.failed_rank, agreement.failure));
  }
  if (agreement.difference.empty()) return;
  throw Error(fmt::format(
      "DistributedDataParallel: the model differs across ranks: {}. Every rank must construct the "
      "same model (the same architecture, sizes and requires_grad, on the same kind of device: "
      "module->to(device) on every rank) before wrapping it",
      agreement.difference));
}

}  // namespace

// What the ranks do in one training step under Join, agreed by one allreduce (max) in which a
// joined rank contributes zeros.
struct DistributedDataParallelBase::StepPlan {
  bool sync = false;               // gradients of this step are synchronised
  bool broadcast_buffers = false;  // buffers are broadcast before forward
  bool rebuild = false;            // buckets are rebuilt before forward
  int buffer_root = 0;             // the highest rank still training
  bool loaded = false;             // some rank loaded or replaced parameters (divergence guard)
};

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

std::size_t DistributedDataParallelBase::check_parameters() {
  std::vector<torch::Tensor> params;
  std::vector<std::string> names;
  collect_trainable(wrapped_, params, names);
  return reducer_->check_parameters(params, names);
}

// What the reducer multiplies the averaged gradients by under a Join: averaged over the ranks
// still training instead of all (divide_by_initial_world_size false), or 1.
double DistributedDataParallelBase::join_gradient_scale(const JoinState& join,
                                                        int nonjoined) const {
  return join.options.divide_by_initial_world_size || nonjoined <= 0
             ? 1.0
             : static_cast<double>(group_->size()) / nonjoined;
}

void DistributedDataParallelBase::pre_forward() {
  if (!options_.param_dtype) {
    pre_forward_in_full_precision();
    return;
  }
  // A forward whose backward never ran (or failed) left the parameters cast: the checks below
  // compare the full-precision ones.
  restore_full_precision_parameters();
  pre_forward_in_full_precision();
  cast_parameters_for_forward();
}

void DistributedDataParallelBase::pre_forward_in_full_precision() {
  forward_started_ = std::chrono::steady_clock::now();
  const std::size_t reattached = check_parameters();
  // Only in training mode: evaluation (often on rank 0 alone) must not wait for other ranks.
  if (!is_training()) return;
  // The guard counts only forwards that a synchronised backward may follow: a training-mode
  // forward under NoGradGuard (an evaluation that forgot eval()) communicates no more than before.
  const bool guarded = torch::GradMode::is_enabled() &&
                       options_.divergence_check_every.value_or(0) > 0 && group_->size() > 1;
  const bool loaded_here = guarded && parameters_loaded_since_last_forward(reattached);
  buffers_ = wrapped_.named_buffers().values();  // a load may have replaced some
  const auto& join = join_state();
  if (join && join->options.enable) {
    const int nonjoined = in_ddp_phase([] { return std::string("Join notification"); },
                                       [&] { return Join::notify_join_context(*this); });
    const StepPlan plan = plan_join_step(/*joined=*/false, loaded_here);
    reducer_->set_gradient_scale(join_gradient_scale(*join, nonjoined));
    if (plan.rebuild) reducer_->rebuild_buckets();
    ++training_forwards_;
    // With a rank joined, its parameters are stale by design: compare only while all train.
    if (guarded) {
      ++guarded_forwards_;
      if (nonjoined == group_->size() &&
          (plan.loaded || guarded_forwards_ % *options_.divergence_check_every == 0)) {
        check_divergence_because({});
      }
    }
    if (plan.broadcast_buffers) broadcast_buffers_from(plan.buffer_root);
    return;
  }
  reducer_->set_gradient_scale(1.0);
  if (reducer_->rebuild_due()) reducer_->rebuild_buckets();
  ++training_forwards_;
  // After the forward, once the reducer has accepted the backward to come (a reducer that
  // refuses, after a failed comm hook, says so before this rank joins a collective).
  guard_after_forward_ = guarded;
  loaded_before_forward_ = loaded_here;
  if (options_.broadcast_buffers && !buffers_.empty() && group_->size() > 1) {
    broadcast_buffers_from(0);
  }
}

bool DistributedDataParallelBase::parameters_loaded_since_last_forward(std::size_t reattached) {
  std::vector<torch::Tensor> params;
  std::vector<std::string> names;
  collect_trainable(wrapped_, params, names);
  auto storage = storage_of(params);
  const auto loads = detail::parameters_loaded_count();
  const bool loaded = reattached > 0 || storage != parameter_storage_ || loads != loads_seen_;
  parameter_storage_ = std::move(storage);
  loads_seen_ = loads;
  return loaded;
}

void DistributedDataParallelBase::guard_divergence(bool loaded_here) {
  ++guarded_forwards_;
  // Every rank says whether it loaded: 4 bytes, and the ranks that did are named in the error.
  std::vector<std::int32_t> loaded(static_cast<std::size_t>(group_->size()));
  const std::int32_t mine = loaded_here ? 1 : 0;
  in_ddp_phase(
      [] { return std::string("divergence guard (did any rank load parameters?)"); },
      [&] {
        detail::HostValues(*group_)->allgather(&mine, loaded.data(), 1, DType::kInt32)->wait();
      });
  std::vector<int> loaded_ranks;
  for (int r = 0; r < group_->size(); ++r) {
    if (loaded[static_cast<std::size_t>(r)] != 0) loaded_ranks.push_back(r);
  }
  if (!loaded_ranks.empty() || guarded_forwards_ % *options_.divergence_check_every == 0) {
    check_divergence_because(loaded_ranks);
  }
}

void DistributedDataParallelBase::post_forward(const std::vector<torch::Tensor>& outputs) {
  // As PyTorch: a forward with gradients enabled prepares the synchronised backward, whatever
  // the mode (a backward after an eval-mode forward is averaged too).
  if (torch::GradMode::is_enabled()) {
    reducer_->prepare_for_backward(outputs);
  } else if (options_.param_dtype) {
    restore_full_precision_parameters();  // no backward follows
  }
  if (std::exchange(guard_after_forward_, false)) guard_divergence(loaded_before_forward_);
  const auto finished = std::chrono::steady_clock::now();
  if (is_training()) {
    ++timed_forwards_;
    forward_time_ += finished - forward_started_;
  }
  if (trace_enabled()) {
    trace_complete("forward", "ddp", trace_thread_lane(), trace_clock_ns(forward_started_),
                   trace_clock_ns(finished), {{"training", is_training()}});
  }
}

DdpLoggingData DistributedDataParallelBase::logging_data() const {
  DdpLoggingData data;
  data.world_size = group_->size();
  data.rank = group_->rank();
  data.backend_name = std::string(group_->backend());
  const auto& options = reducer_->options();
  data.bucket_cap_bytes = options.bucket_cap_bytes;
  data.first_bucket_cap_bytes = options.first_bucket_cap_bytes;
  data.broadcast_buffers = options_.broadcast_buffers;
  data.find_unused_parameters = options.find_unused_parameters;
  data.gradient_as_bucket_view = options.gradient_as_bucket_view;
  data.static_graph = options.static_graph;
  data.comm_hook = reducer_->comm_hook_name();

  std::vector<torch::Tensor> params;
  std::vector<std::string> names;
  collect_trainable(wrapped_, params, names);
  std::map<std::string, std::int64_t> bytes_by_name;
  for (std::size_t i = 0; i < params.size(); ++i) {
    const auto bytes = static_cast<std::int64_t>(params[i].nbytes());
    data.total_parameter_size_bytes += bytes;
    bytes_by_name[names[i]] = bytes;
    const std::string dtype = c10::toString(params[i].scalar_type());
    if (std::find(data.dtypes.begin(), data.dtypes.end(), dtype) == data.dtypes.end()) {
      data.dtypes.push_back(dtype);
    }
  }
  data.num_parameter_tensors = static_cast<std::int64_t>(params.size());
  for (const auto bytes : reducer_->bucket_sizes_bytes())
    data.bucket_sizes.push_back(static_cast<std::int64_t>(bytes));
  for (const auto& bucket : reducer_->bucket_assignment())
    data.bucket_parameter_counts.push_back(static_cast<std::int64_t>(bucket.size()));
  data.has_rebuilt_buckets = reducer_->buckets_rebuilt();
  data.shared_buckets = reducer_->buckets_shared();
  data.shared_buckets_why_not = reducer_->shared_buckets_why_not();
  data.unused_parameter_names = reducer_->unused_parameter_names();
  for (const auto& name : data.unused_parameter_names) {
    if (const auto it = bytes_by_name.find(name); it != bytes_by_name.end()) {
      data.unused_parameter_size += it->second;
    }
  }
  const ReducerStats stats = reducer_->stats();
  data.iteration = stats.iterations;
  data.unused_parameter_searches = stats.unused_parameter_searches;
  data.forward_passes = timed_forwards_;
  if (timed_forwards_ > 0) data.avg_forward_compute_time = forward_time_.count() / timed_forwards_;
  if (stats.iterations > 0) {
    data.avg_backward_compute_time = stats.backward_compute.count() / stats.iterations;
    data.avg_backward_comm_time = stats.backward_comm.count() / stats.iterations;
    data.avg_backward_compute_comm_overlap_time =
        stats.backward_compute_comm_overlap.count() / stats.iterations;
  }
  data.last_bytes_sent = static_cast<std::int64_t>(reducer_->last_timeline().bytes_sent);
  return data;
}

void DistributedDataParallelBase::broadcast_buffers_from(int root) {
  in_ddp_phase(
      [root] {
        return root == 0 ? std::string("buffer broadcast before forward")
                         : fmt::format("buffer broadcast before forward (from rank {})", root);
      },
      [&] { broadcast_coalesced(*group_, buffers_, root); });
}

void DistributedDataParallelBase::sync_buffers() {
  buffers_ = wrapped_.named_buffers().values();
  if (buffers_.empty() || group_->size() == 1) return;
  in_ddp_phase([] { return std::string("sync_buffers()"); },
               [&] { broadcast_coalesced(*group_, buffers_, /*root=*/0); });
}

void DistributedDataParallelBase::check_divergence_because(const std::vector<int>& loaded_ranks) {
  std::vector<torch::Tensor> params;
  std::vector<std::string> names;
  collect_trainable(wrapped_, params, names);
  std::vector<std::int64_t> mine;
  mine.reserve(params.size());
  for (const auto& p : params)
    mine.push_back(checksum(p));
  const auto world = static_cast<std::size_t>(group_->size());
  std::vector<std::int64_t> all(mine.size() * world);
  in_ddp_phase([] { return std::string("divergence check"); },
               [&] {
                 detail::HostValues(*group_)
                     ->allgather(mine.data(), all.data(), mine.size(), DType::kInt64)
                     ->wait();
               });
  std::size_t differing_params = 0;
  std::size_t first = mine.size();
  std::vector<int> ranks;
  for (std::size_t i = 0; i < mine.size(); ++i) {
    bool differs = false;
    for (std::size_t r = 1; r < world; ++r) {
      if (all[r * mine.size() + i] == all[i]) continue;
      differs = true;
      if (first == mine.size() || first == i) ranks.push_back(static_cast<int>(r));
    }
    if (!differs) continue;
    ++differing_params;
    if (first == mine.size()) first = i;
  }
  if (differing_params == 0) return;
  const std::string when =
      loaded_ranks.empty()
          ? fmt::format("divergence check after {} training forwards", guarded_forwards_)
          : fmt::format(
                "checked because rank(s) {} loaded or replaced parameters since the last "
                "forward",
                fmt::join(loaded_ranks, ", "));
  throw Error(fmt::format(
      "DistributedDataParallel: the ranks' parameters have drifted apart ({}): parameter '{}' {} "
      "differs on rank(s) {} from rank 0's ({} of {} parameters differ). Something changed "
      "parameters on some ranks only: a checkpoint loaded on one rank, an optimizer step skipped "
      "or repeated, a forward or backward outside the wrapper, or a non-deterministic update. "
      "Load checkpoints on every rank (or load before wrapping: the wrapper copies rank 0's "
      "parameters to every rank) and step the optimizer on every rank",
      when, names[first], shape_text(params[first]), fmt::join(ranks, ", "), differing_params,
      mine.size()));
}

DistributedDataParallelBase::StepPlan DistributedDataParallelBase::plan_join_step(
    bool joined, bool loaded_here) {
  std::array<std::int32_t, 6> flags{};
  if (!joined) {
    const bool sync = reducer_->require_sync();
    flags = {sync ? 1 : 0,
             sync ? 0 : 1,
             options_.broadcast_buffers && !buffers_.empty() && group_->size() > 1 ? 1 : 0,
             reducer_->rebuild_due() ? 1 : 0,
             group_->rank() + 1,
             loaded_here ? 1 : 0};
  }
  in_ddp_phase([] { return std::string("Join step agreement"); },
               [&] {
                 detail::HostValues(*group_)
                     ->allreduce(flags.data(), flags.size(), DType::kInt32, ReduceOp::kMax)
                     ->wait();
               });
  if (flags[0] != 0 && flags[1] != 0) {
    throw Error(
        "DistributedDataParallel under Join: in this step some ranks run inside no_sync() and "
        "others do not. Every rank still training must synchronise the same steps");
  }
  return StepPlan{.sync = flags[0] != 0,
                  .broadcast_buffers = flags[2] != 0,
                  .rebuild = flags[3] != 0,
                  .buffer_root = std::max(0, flags[4] - 1),
                  .loaded = flags[5] != 0};
}

void DistributedDataParallelBase::join_main_hook() {
  buffers_ = wrapped_.named_buffers().values();
  const StepPlan plan = plan_join_step(/*joined=*/true, /*loaded_here=*/false);
  if (plan.rebuild) reducer_->rebuild_buckets();
  if (plan.broadcast_buffers) broadcast_buffers_from(plan.buffer_root);
  // The gradients the shadow step leaves here (for a sharded optimizer's step) are scaled as the
  // training ranks scale theirs.
  if (const auto& join = join_state()) {
    reducer_->set_gradient_scale(join_gradient_scale(*join, join->nonjoined));
  }
  if (plan.sync) reducer_->shadow_backward();
}

void DistributedDataParallelBase::join_post_hook(bool is_last_joiner) {
  // Ranks that joined early did not step their optimizers while shadowing: every rank takes the
  // model of the (highest) rank that trained longest.
  std::int64_t root = is_last_joiner ? group_->rank() : -1;
  in_ddp_phase(
      [] { return std::string("Join's final model synchronisation"); },
      [&] {
        detail::HostValues(*group_)->allreduce(&root, 1, DType::kInt64, ReduceOp::kMax)->wait();
        std::vector<torch::Tensor> state = parameters_and_buffers(wrapped_);
        broadcast_coalesced(*group_, state, static_cast<int>(root));
      });
  reducer_->set_gradient_scale(1.0);
}

std::string DistributedDataParallelBase::join_description() const {
  return fmt::format("DistributedDataParallel({} parameters, {} buffers)",
                     wrapped_.named_parameters().size(), wrapped_.named_buffers().values().size());
}

}  // namespace ddp
