#include "ddp/torch/distributed_data_parallel.h"

#include <cmath>
#include <unordered_set>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "ddp/error.h"
#include "ddp/init.h"
#include "ddp/torch/tensor_collectives.h"

namespace ddp {
namespace {

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
    : group_(group ? std::move(group) : default_process_group()), options_(options) {
  if (!module) throw ConfigError("DistributedDataParallel: the module is null");
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

  // Parameters that train, each once (a parameter shared by two submodules appears twice).
  std::vector<torch::Tensor> params;
  std::vector<std::string> names;
  std::unordered_set<const c10::TensorImpl*> seen;
  for (const auto& item : module->named_parameters(/*recurse=*/true)) {
    if (!item.value().requires_grad()) continue;
    if (!seen.insert(item.value().unsafeGetTensorImpl()).second) continue;
    params.push_back(item.value());
    names.push_back(item.key());
  }
  for (const auto& buffer : module->buffers(/*recurse=*/true))
    buffers_.push_back(buffer);

  verify_same_parameters(*group_, names, params);
  // Every rank starts from rank 0's state.
  std::vector<torch::Tensor> state;
  for (const auto& p : module->parameters(/*recurse=*/true))
    state.push_back(p);
  state.insert(state.end(), buffers_.begin(), buffers_.end());
  if (group_->size() > 1) broadcast_coalesced(*group_, state, /*root=*/0);

  reducer_ =
      std::make_unique<Reducer>(std::move(params), std::move(names), group_, reducer_options);
}

void DistributedDataParallelBase::pre_forward() {
  reducer_->prepare_for_forward();
  // Only in training mode: evaluation (often on rank 0 alone) must not wait for other ranks.
  if (options_.broadcast_buffers && is_training() && !buffers_.empty() && group_->size() > 1) {
    broadcast_coalesced(*group_, buffers_, /*root=*/0);
  }
}

void DistributedDataParallelBase::post_forward(const std::vector<torch::Tensor>& outputs) {
  if (is_training()) reducer_->prepare_for_backward(outputs);
}

}  // namespace ddp
