#include "ddp/torch/distributed_data_parallel.h"

#include <algorithm>
#include <array>
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
#include "ddp/torch/tensor_collectives.h"
#include "ddp/trace.h"
#include "ddp_phase.h"

namespace ddp {
namespace {

using detail::in_ddp_phase;

// The parameters that train, each once (a parameter shared by two submodules appears twice), in
// registration order: what the Reducer works on.
void collect_trainable(const torch::nn::Module& module, std::vector<torch::Tensor>& params,
                       std::vector<std::string>& names) {
  params.clear();
  names.clear();
  std::unordered_set<const c10::TensorImpl*> seen;
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    if (!item.value().requires_grad()) continue;
    if (!seen.insert(item.value().unsafeGetTensorImpl()).second) continue;
    params.push_back(item.value());
    names.push_back(item.key());
  }
}

std::int64_t divergence_interval(std::int64_t option) {
  if (option < 0) {
    throw ConfigError(fmt::format(
        "DdpOptions::divergence_check_every = {} must be 0 (off) or a positive number of forwards",
        option));
  }
  if (option > 0) return option;
  const char* text = std::getenv("DDP_DIVERGENCE_CHECK_EVERY");
  if (text == nullptr || *text == '\0') return 0;
  char* end = nullptr;
  errno = 0;
  const long long value = std::strtoll(text, &end, 10);
  if (errno != 0 || *end != '\0' || value < 0) {
    throw ConfigError(fmt::format(
        "DDP_DIVERGENCE_CHECK_EVERY='{}' is not a number of forwards; use 0 (off) or e.g. 100",
        text));
  }
  return value;
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

std::size_t megabytes_to_bytes(double mb, const char* option) {
  if (!std::isfinite(mb) || mb <= 0) {
    throw ConfigError(
        fmt::format("DdpOptions::{} = {} must be a positive number of MiB", option, mb));
  }
  return static_cast<std::size_t>(std::max(1.0, mb * 1024.0 * 1024.0));
}

std::string shape_text(const torch::Tensor& t) {
  return fmt::format("[{}] {}", fmt::join(t.sizes(), ", "), c10::toString(t.scalar_type()));
}

// Every rank compares its parameters with rank 0's: count, then each one's dtype and shape. The
// first difference on any rank is reported by every rank (so none waits in a later collective).
void verify_same_parameters(ProcessGroup& group, const std::vector<std::string>& names,
                            const std::vector<torch::Tensor>& params) {
  std::vector<std::int64_t> mine{static_cast<std::int64_t>(params.size())};
  for (const auto& p : params) {
    mine.push_back(static_cast<std::int64_t>(p.scalar_type()));
    mine.push_back(p.dim());
    for (const auto d : p.sizes())
      mine.push_back(d);
  }
  std::int64_t length = static_cast<std::int64_t>(mine.size());
  group.broadcast(&length, 1, DType::kInt64, 0)->wait();
  std::vector<std::int64_t> reference(static_cast<std::size_t>(length));
  if (group.rank() == 0) reference = mine;
  group.broadcast(reference.data(), reference.size(), DType::kInt64, 0)->wait();

  // Walk both descriptions; note the first parameter that differs (-1: none, -2: count).
  std::int64_t first_difference = -1;
  std::string reference_text;
  if (reference.empty() || reference[0] != mine[0]) {
    first_difference = -2;
  } else {
    std::size_t pos = 1;
    for (std::size_t i = 0; i < params.size(); ++i) {
      const std::size_t dims = static_cast<std::size_t>(mine[pos + 1]);
      const std::size_t entry = 2 + dims;
      const bool same = pos + entry <= reference.size() &&
                        std::equal(mine.begin() + static_cast<std::ptrdiff_t>(pos),
                                   mine.begin() + static_cast<std::ptrdiff_t>(pos + entry),
                                   reference.begin() + static_cast<std::ptrdiff_t>(pos));
      if (!same) {
        first_difference = static_cast<std::int64_t>(i);
        if (pos + 1 < reference.size()) {
          const auto ref_dims = static_cast<std::size_t>(reference[pos + 1]);
          std::vector<std::int64_t> ref_sizes;
          for (std::size_t d = 0; d < ref_dims && pos + 2 + d < reference.size(); ++d) {
            ref_sizes.push_back(reference[pos + 2 + d]);
          }
          reference_text = fmt::format("[{}] {}", fmt::join(ref_sizes, ", "),
                                       c10::toString(static_cast<c10::ScalarType>(reference[pos])));
        }
        break;
      }
      pos += entry;
    }
  }
  std::vector<std::int64_t> all(static_cast<std::size_t>(group.size()));
  group.allgather(&first_difference, all.data(), 1, DType::kInt64)->wait();
  std::vector<int> differing;
  for (int r = 0; r < group.size(); ++r) {
    if (all[static_cast<std::size_t>(r)] != -1) differing.push_back(r);
  }
  if (differing.empty()) return;
  std::string detail;
  if (first_difference == -2) {
    detail = fmt::format(" This rank has {} parameters, rank 0 has {}.", params.size(),
                         reference.empty() ? 0 : reference[0]);
  } else if (first_difference >= 0) {
    const auto i = static_cast<std::size_t>(first_difference);
    detail = fmt::format(
        " Here the first difference is parameter '{}': {} on this rank, {} on "
        "rank 0.",
        names[i], shape_text(params[i]), reference_text);
  }
  throw Error(fmt::format(
      "DistributedDataParallel: the model differs across ranks: rank(s) {} have parameters "
      "(count, shapes or dtypes) unlike rank 0's.{} Every rank must construct the same model",
      fmt::join(differing, ", "), detail));
}

}  // namespace

// What the ranks do in one training step under Join, agreed by one allreduce (max) in which a
// joined rank contributes zeros.
struct DistributedDataParallelBase::StepPlan {
  bool sync = false;               // gradients of this step are synchronised
  bool broadcast_buffers = false;  // buffers are broadcast before forward
  bool rebuild = false;            // buckets are rebuilt before forward
  int buffer_root = 0;             // the highest rank still training
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
    : wrapped_(module),
      group_(group ? std::move(group) : default_process_group()),
      options_(options) {
  if (!module) throw ConfigError("DistributedDataParallel: the module is null");
  options_.divergence_check_every = divergence_interval(options_.divergence_check_every);
  if (!group_) {
    throw ConfigError(
        "DistributedDataParallel: no process group; call ddp::init_process_group() "
        "first or pass a group");
  }
  const ReducerOptions reducer_options{
      .bucket_cap_bytes = megabytes_to_bytes(options_.bucket_cap_mb, "bucket_cap_mb"),
      .first_bucket_cap_bytes =
          megabytes_to_bytes(options_.first_bucket_cap_mb, "first_bucket_cap_mb"),
      .find_unused_parameters = options_.find_unused_parameters,
      .gradient_as_bucket_view = options_.gradient_as_bucket_view,
      .static_graph = options_.static_graph};
  register_module("module", module);

  std::vector<torch::Tensor> params;
  std::vector<std::string> names;
  collect_trainable(*module, params, names);
  buffers_ = module->buffers(/*recurse=*/true);

  in_ddp_phase([] { return std::string("parameter check at construction"); },
               [&] { verify_same_parameters(*group_, names, params); });
  // Every rank starts from rank 0's state.
  std::vector<torch::Tensor> state = module->parameters(/*recurse=*/true);
  state.insert(state.end(), buffers_.begin(), buffers_.end());
  if (group_->size() > 1) {
    in_ddp_phase([] { return std::string("parameter broadcast at construction"); },
                 [&] { broadcast_coalesced(*group_, state, /*root=*/0); });
  }

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
}

std::size_t DistributedDataParallelBase::check_parameters() {
  std::vector<torch::Tensor> params;
  std::vector<std::string> names;
  collect_trainable(*wrapped_, params, names);
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
  forward_started_ = std::chrono::steady_clock::now();
  check_parameters();
  // Only in training mode: evaluation (often on rank 0 alone) must not wait for other ranks.
  if (!is_training()) return;
  buffers_ = wrapped_->buffers(/*recurse=*/true);  // a load may have replaced some
  const auto& join = join_state();
  if (join && join->options.enable) {
    const int nonjoined = in_ddp_phase([] { return std::string("Join notification"); },
                                       [&] { return Join::notify_join_context(*this); });
    const StepPlan plan = plan_join_step(/*joined=*/false);
    reducer_->set_gradient_scale(join_gradient_scale(*join, nonjoined));
    if (plan.rebuild) reducer_->rebuild_buckets();
    // With a rank joined, its parameters are stale by design: compare only while all train.
    ++training_forwards_;
    if (nonjoined == group_->size()) maybe_check_divergence();
    if (plan.broadcast_buffers) broadcast_buffers_from(plan.buffer_root);
    return;
  }
  reducer_->set_gradient_scale(1.0);
  if (reducer_->rebuild_due()) reducer_->rebuild_buckets();
  ++training_forwards_;
  maybe_check_divergence();
  if (options_.broadcast_buffers && !buffers_.empty() && group_->size() > 1) {
    broadcast_buffers_from(0);
  }
}

void DistributedDataParallelBase::post_forward(const std::vector<torch::Tensor>& outputs) {
  // As PyTorch: a forward with gradients enabled prepares the synchronised backward, whatever
  // the mode (a backward after an eval-mode forward is averaged too).
  if (torch::GradMode::is_enabled()) reducer_->prepare_for_backward(outputs);
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
  collect_trainable(*wrapped_, params, names);
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
  data.unused_parameter_names = reducer_->unused_parameter_names();
  for (const auto& name : data.unused_parameter_names) {
    if (const auto it = bytes_by_name.find(name); it != bytes_by_name.end()) {
      data.unused_parameter_size += it->second;
    }
  }
  const ReducerStats stats = reducer_->stats();
  data.iteration = stats.iterations;
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
  buffers_ = wrapped_->buffers(/*recurse=*/true);
  if (buffers_.empty() || group_->size() == 1) return;
  in_ddp_phase([] { return std::string("sync_buffers()"); },
               [&] { broadcast_coalesced(*group_, buffers_, /*root=*/0); });
}

void DistributedDataParallelBase::maybe_check_divergence() {
  const auto every = options_.divergence_check_every;
  if (every > 0 && training_forwards_ % every == 0) check_divergence();
}

void DistributedDataParallelBase::check_divergence() {
  std::vector<torch::Tensor> params;
  std::vector<std::string> names;
  collect_trainable(*wrapped_, params, names);
  std::vector<std::int64_t> mine;
  mine.reserve(params.size());
  for (const auto& p : params)
    mine.push_back(checksum(p));
  const auto world = static_cast<std::size_t>(group_->size());
  std::vector<std::int64_t> all(mine.size() * world);
  in_ddp_phase(
      [] { return std::string("divergence check"); },
      [&] { group_->allgather(mine.data(), all.data(), mine.size(), DType::kInt64)->wait(); });
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
  throw Error(fmt::format(
      "DistributedDataParallel: the ranks' parameters have drifted apart (divergence check after "
      "{} training forwards): parameter '{}' differs on rank(s) {} from rank 0's ({} of {} "
      "parameters differ). Something changed parameters on some ranks only: a checkpoint loaded "
      "on one rank, an optimizer step skipped or repeated, a forward or backward outside the "
      "wrapper, or a non-deterministic update. Load checkpoints on every rank and step the "
      "optimizer on every rank",
      training_forwards_, names[first], fmt::join(ranks, ", "), differing_params, mine.size()));
}

DistributedDataParallelBase::StepPlan DistributedDataParallelBase::plan_join_step(bool joined) {
  std::array<std::int32_t, 5> flags{};
  if (!joined) {
    const bool sync = reducer_->require_sync();
    flags = {sync ? 1 : 0, sync ? 0 : 1,
             options_.broadcast_buffers && !buffers_.empty() && group_->size() > 1 ? 1 : 0,
             reducer_->rebuild_due() ? 1 : 0, group_->rank() + 1};
  }
  in_ddp_phase(
      [] { return std::string("Join step agreement"); },
      [&] {
        group_->allreduce(flags.data(), flags.size(), DType::kInt32, ReduceOp::kMax)->wait();
      });
  if (flags[0] != 0 && flags[1] != 0) {
    throw Error(
        "DistributedDataParallel under Join: in this step some ranks run inside no_sync() and "
        "others do not. Every rank still training must synchronise the same steps");
  }
  return StepPlan{.sync = flags[0] != 0,
                  .broadcast_buffers = flags[2] != 0,
                  .rebuild = flags[3] != 0,
                  .buffer_root = std::max(0, flags[4] - 1)};
}

void DistributedDataParallelBase::join_main_hook() {
  buffers_ = wrapped_->buffers(/*recurse=*/true);
  const StepPlan plan = plan_join_step(/*joined=*/true);
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
  in_ddp_phase([] { return std::string("Join's final model synchronisation"); },
               [&] {
                 group_->allreduce(&root, 1, DType::kInt64, ReduceOp::kMax)->wait();
                 std::vector<torch::Tensor> state = wrapped_->parameters(/*recurse=*/true);
                 const auto buffers = wrapped_->buffers(/*recurse=*/true);
                 state.insert(state.end(), buffers.begin(), buffers.end());
                 broadcast_coalesced(*group_, state, static_cast<int>(root));
               });
  reducer_->set_gradient_scale(1.0);
}

std::string DistributedDataParallelBase::join_description() const {
  return fmt::format("DistributedDataParallel({} parameters, {} buffers)",
                     wrapped_->parameters(/*recurse=*/true).size(),
                     wrapped_->buffers(/*recurse=*/true).size());
}

}  // namespace ddp
