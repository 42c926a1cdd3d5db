// Reducer: the gradient buckets: their assignment and memory (shared between the ranks of a host
// where the group can), the slot views, and the rebuild in rank 0's ready order.
#include <malloc.h>

#include <algorithm>
#include <map>

#include <fmt/format.h>

#include "ddp/error.h"
#include "ddp/torch/ddp/reducer.h"
#include "torch/core/device_staging.h"
#include "torch/core/host_values.h"
#include "torch/core/wrapper_phase.h"
#include "torch/ddp/reducer_internal.h"

namespace ddp {

namespace {

// A tensor that aliases `storage` at `offset` with `like`'s shape, but is not an autograd view:
// optimizers may detach_() and zero_() it in place (they refuse views).
torch::Tensor alias_of(const torch::Tensor& contents, std::int64_t offset,
                       const torch::Tensor& like) {
  torch::NoGradGuard no_grad;
  const auto sizes = like.sizes();
  std::vector<std::int64_t> strides(sizes.size(), 1);
  for (std::size_t d = sizes.size(); d-- > 1;)
    strides[d - 1] = strides[d] * sizes[d];
  return torch::empty({0}, contents.options())
      .set_(contents.storage(), contents.storage_offset() + offset, sizes, strides);
}

}  // namespace

void Reducer::assign_buckets(const std::vector<std::size_t>& order) {
  torch::NoGradGuard no_grad;
  // Open bucket per dtype; the first bucket of each dtype gets the small cap.
  struct Open {
    std::vector<std::size_t> params;
    std::size_t bytes = 0;
    bool first = true;
  };
  std::map<c10::ScalarType, Open> open;
  std::vector<std::vector<std::size_t>> closed;
  for (const std::size_t i : order) {
    if (sparse_[i]) continue;  // reduced as a sparse tensor, without a bucket
    auto& bucket = open[parameters_[i].scalar_type()];
    bucket.params.push_back(i);
    bucket.bytes += static_cast<std::size_t>(parameters_[i].numel()) *
                    static_cast<std::size_t>(parameters_[i].element_size());
    const auto cap = bucket.first ? options_.first_bucket_cap_bytes : options_.bucket_cap_bytes;
    if (bucket.bytes >= cap) {
      closed.push_back(std::move(bucket.params));
      bucket = Open{.first = false};
    }
  }
  for (auto& [type, bucket] : open) {
    if (!bucket.params.empty()) closed.push_back(std::move(bucket.params));
  }
  // Launch order: by the position of each bucket's first parameter in `order`.
  std::vector<std::size_t> position(parameters_.size());
  for (std::size_t k = 0; k < order.size(); ++k)
    position[order[k]] = k;
  std::sort(closed.begin(), closed.end(), [&](const auto& a, const auto& b) {
    return position[a.front()] < position[b.front()];
  });

  std::vector<Bucket> buckets(closed.size());
  slots_.assign(parameters_.size(), Slot{});
  // Where each bucket would lie in one shared buffer (cache-line aligned, so that no two ranks'
  // slices of two buckets share a line).
  std::vector<std::size_t> shared_offsets;
  std::size_t shared_bytes = 0;
  for (const auto& params : closed) {
    shared_offsets.push_back(shared_bytes);
    for (const auto i : params) {
      shared_bytes += static_cast<std::size_t>(parameters_[i].numel()) *
                      static_cast<std::size_t>(parameters_[i].element_size());
    }
    shared_bytes = (shared_bytes + 63) / 64 * 64;
  }
  const auto shared = allocate_shared_buckets(shared_offsets, shared_bytes);
  for (std::size_t b = 0; b < closed.size(); ++b) {
    auto& bucket = buckets[b];
    bucket.params = std::move(closed[b]);
    std::int64_t total = 0;
    for (const auto i : bucket.params) {
      bucket.offsets.push_back(total);
      total += parameters_[i].numel();
    }
    const auto options = parameters_[bucket.params.front()].options().requires_grad(false);
    try {
      if (shared) {
        // Zeroed already; the buffer lives as long as any bucket tensor (or view) of it.
        bucket.contents = torch::from_blob(
            static_cast<std::byte*>(shared.get()) + shared_offsets[b], {total}, [shared](void*) {},
            options);
      } else {
        bucket.contents = torch::zeros({total}, options);
      }
    } catch (const c10::Error& e) {
      // A device out of memory: a named error rather than libtorch's allocator trace.
      throw Error(fmt::format(
          "DistributedDataParallel: could not allocate gradient bucket {} ({} bytes) on {}: {}. "
          "The buckets hold a copy of every gradient (gradient_as_bucket_view = true makes the "
          "gradients live in them instead); free memory or use a smaller model or batch",
          b + 1,
          total * static_cast<std::int64_t>(c10::elementSize(options.dtype().toScalarType())),
          options.device().str(), e.what_without_backtrace()));
    }
    for (std::size_t k = 0; k < bucket.params.size(); ++k) {
      const auto i = bucket.params[k];
      bucket.views.push_back(alias_of(bucket.contents, bucket.offsets[k], parameters_[i]));
      slots_[i] = Slot{b, k};
    }
    bucket.pending = bucket.params.size();
    bucket.left_in_place.assign(bucket.params.size(), 0);
  }
  if (staging_) {
    // Twins made (and the old ones dropped) whenever the buckets are built.
    std::vector<torch::Tensor> contents;
    for (const auto& bucket : buckets)
      contents.push_back(bucket.contents);
    auto twins = staging_->make_twins(contents);
    for (std::size_t b = 0; b < buckets.size(); ++b) {
      auto& bucket = buckets[b];
      bucket.twin = std::move(twins[b]);
      for (std::size_t k = 0; k < bucket.params.size(); ++k)
        bucket.twin_views.push_back(
            alias_of(bucket.twin, bucket.offsets[k], parameters_[bucket.params[k]]));
    }
  }
  buckets_ = std::move(buckets);

  if (options_.gradient_as_bucket_view) {
    // Gradients become aliases of their slots; keep any values they already hold.
    for (std::size_t i = 0; i < parameters_.size(); ++i) {
      torch::Tensor& grad = parameters_[i].mutable_grad();
      if (!grad.defined() || sparse_[i]) continue;
      torch::Tensor view = slot_view(i);
      view.copy_(grad);
      grad = view;
    }
  }
}

std::shared_ptr<void> Reducer::allocate_shared_buckets(const std::vector<std::size_t>& offsets,
                                                       std::size_t total_bytes) {
  // Only where the bucket is what the allreduce reduces in place and the gradients live in it:
  // copying gradients into a shared bucket and back costs what sharing saves (the default path
  // reduces the gradients where they lie instead).
  buckets_shared_ = false;
  shared_buckets_why_not_.clear();
  if (!options_.gradient_as_bucket_view || staging_ || offsets.empty() ||
      group_->memory_space() != MemorySpace::kHost) {
    return nullptr;
  }
  for (const auto& parameter : parameters_) {
    if (!parameter.device().is_cpu()) return nullptr;
  }
  auto buffer = group_->allocate_shared_buffer(total_bytes, &shared_buckets_why_not_);
  buckets_shared_ = buffer != nullptr;
  const std::string own = fmt::format("rank {} ", group_->rank());
  if (!buffer && shared_buckets_why_not_.rfind(own, 0) == 0 &&
      shared_buckets_why_not_.find("DDP_SHM_SHARED_BUFFERS=0") == std::string::npos) {
    // The logs name the fallback where it comes from (once per bucket layout).
    fmt::print(stderr,
               "ddp: DistributedDataParallel: the gradient buckets are not shared between the "
               "ranks of this host ({}); their allreduces copy through the shared segment\n",
               shared_buckets_why_not_);
  }
  return buffer;
}

bool Reducer::buckets_shared() const {
  std::lock_guard lock(mutex_);
  return buckets_shared_;
}

std::string Reducer::shared_buckets_why_not() const {
  std::lock_guard lock(mutex_);
  return shared_buckets_why_not_;
}

torch::Tensor Reducer::slot_view(std::size_t param) const {
  const auto& slot = slots_[param];
  const auto& bucket = buckets_[slot.bucket];
  return alias_of(bucket.contents, bucket.offsets[slot.index], parameters_[param]);
}

bool Reducer::is_bucket_view(std::size_t param, const torch::Tensor& grad) const {
  if (sparse_[param] || buckets_.empty()) return false;
  const auto& view = buckets_[slots_[param].bucket].views[slots_[param].index];
  return grad.defined() && grad.data_ptr() == view.data_ptr() && grad.sizes() == view.sizes() &&
         grad.is_contiguous();
}

bool Reducer::rebuild_due() const {
  std::lock_guard lock(mutex_);
  return rebuild_due_;
}

void Reducer::rebuild_buckets() {
  std::lock_guard lock(mutex_);
  rebuild_due_ = false;
  rebuilt_ = true;
  // Rank 0's observed order decides; parameters that never became ready go last, in reverse
  // registration order.
  const std::size_t n = parameters_.size();
  std::vector<std::int64_t> order;
  order.reserve(n);
  std::vector<bool> placed(n, false);
  for (const auto i : ready_order_) {
    if (!placed[i]) {
      order.push_back(static_cast<std::int64_t>(i));
      placed[i] = true;
    }
  }
  for (std::size_t i = n; i-- > 0;) {
    if (!placed[i]) order.push_back(static_cast<std::int64_t>(i));
  }
  ready_order_.clear();
  record_ready_order_ = false;
  detail::in_ddp_phase([] { return std::string("bucket rebuild before forward"); },
                       [&] {
                         detail::HostValues(*group_)
                             ->broadcast(order.data(), order.size(), DType::kInt64, /*root=*/0)
                             ->wait();
                       });
  std::vector<std::size_t> new_order;
  std::vector<bool> seen(n, false);
  for (const auto i : order) {
    if (i < 0 || static_cast<std::size_t>(i) >= n || seen[static_cast<std::size_t>(i)]) {
      throw Error(
          "DistributedDataParallel: rank 0 broadcast an invalid bucket order; do all "
          "ranks wrap the same model?");
    }
    seen[static_cast<std::size_t>(i)] = true;
    new_order.push_back(static_cast<std::size_t>(i));
  }
  // The old buckets go before the new ones are made, so that the rebuild never holds two sets of
  // buckets (the peak of a training step's memory otherwise: once the gradients, and a third
  // time with the copies this used to make). A gradient that lives in an old bucket keeps its
  // values (no_sync's accumulation, or values the user still reads): when it is all zeros (the
  // usual case, zero_grad() before forward) it becomes a view of its new, zeroed slot without a
  // copy; any other keeps its old bucket alive until assign_buckets() has copied it over.
  torch::NoGradGuard no_grad;
  std::vector<char> zero_view(n, 0);
  for (std::size_t i = 0; i < n; ++i) {
    torch::Tensor& grad = parameters_[i].mutable_grad();
    if (!grad.defined() || !is_bucket_view(i, grad) || grad.any().item<bool>()) continue;
    zero_view[i] = 1;
    grad = torch::Tensor();
  }
  buckets_.clear();
#ifdef __GLIBC__
  // glibc keeps freed heap memory resident: the old buckets' pages go back to the kernel now, or
  // new buckets of other sizes would be made beside them all the same (once per training).
  ::malloc_trim(0);
#endif
  try {
    assign_buckets(new_order);
  } catch (const std::exception& e) {
    // No buckets are left to reduce into: every later synchronisation is refused by name.
    hook_failure_ = fmt::format(
        "DistributedDataParallel (rank {}): rebuilding the gradient buckets failed: {}. This "
        "DistributedDataParallel has no buckets left and refuses to synchronise again: free "
        "memory, then start again with a new process group (from a checkpoint)",
        group_->rank(), e.what());
    throw Error(hook_failure_);  // says what failed and that this DDP cannot go on
  }
  for (std::size_t i = 0; i < n; ++i) {
    if (zero_view[i] != 0) parameters_[i].mutable_grad() = slot_view(i);
  }
}

std::vector<std::size_t> Reducer::bucket_sizes_bytes() const {
  std::lock_guard lock(mutex_);
  std::vector<std::size_t> sizes;
  for (const auto& bucket : buckets_)
    sizes.push_back(static_cast<std::size_t>(bucket.contents.nbytes()));
  return sizes;
}

std::vector<std::vector<std::size_t>> Reducer::bucket_assignment() const {
  std::lock_guard lock(mutex_);
  std::vector<std::vector<std::size_t>> result;
  for (const auto& bucket : buckets_)
    result.push_back(bucket.params);
  return result;
}

bool Reducer::buckets_rebuilt() const {
  std::lock_guard lock(mutex_);
  return rebuilt_;
}

}  // namespace ddp
