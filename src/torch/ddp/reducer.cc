#include "ddp/torch/ddp/reducer.h"

#include <malloc.h>

#include <algorithm>
#include <atomic>
#include <map>
#include <numeric>
#include <unordered_set>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "ddp/error.h"
#include "ddp/timeouts.h"
#include "ddp/torch/core/tensor_collectives.h"
#include "ddp/trace.h"
#include "torch/core/device_staging.h"
#include "torch/core/host_values.h"
#include "torch/core/libtorch_compat.h"
#include "torch/core/parameter_devices.h"
#include "torch/core/sparse_allreduce.h"
#include "torch/core/staging_thread.h"
#include "torch/core/wrapper_phase.h"

namespace ddp {

struct Reducer::Bucket {
  torch::Tensor contents;             // flat buffer of one dtype
  std::vector<std::size_t> params;    // parameter indices, in bucket order
  std::vector<std::int64_t> offsets;  // element offset of each parameter in contents
  std::vector<torch::Tensor> views;   // contents' pieces shaped like the parameters
  std::size_t pending = 0;            // parameters not yet ready in this pass
  BucketReduction reduction;          // the reduction in flight, once launched
  bool launched = false;
  // Per parameter of this pass: its gradient was left where it is (not copied into `views`), to
  // be reduced in place if the whole bucket can be (see mark_ready). Set once reduced that way.
  std::vector<char> left_in_place;
  std::size_t left_in_place_count = 0;
  bool reduced_in_place = false;
  // Set by the Work's completion callback (any thread): steady-clock nanoseconds, 0 = not yet.
  std::shared_ptr<std::atomic<std::int64_t>> completed_ns;
  // Staged buckets (device_staging.h): the host twin the engine reduces, and its pieces shaped
  // like the parameters (what the comm hook gets).
  torch::Tensor twin;
  std::vector<torch::Tensor> twin_views;
  // Written by the staging thread, read after StagingThread::drain: why the bucket's reduction
  // did not start.
  std::string staging_error;
  // Written by the copy-in callback, read after the Work's wait: why the copy-in failed.
  std::shared_ptr<std::string> copy_in_error;
  // A CUDA bucket on a device group without a comm hook: its allreduce is stream-ordered
  // (CallOptions::cuda_done_event), and the end of backward makes the current stream wait on
  // this event instead of the host waiting for the device. Made on first use, kept.
  std::unique_ptr<detail::DoneEvent> done_event;
  bool stream_ordered = false;  // this pass's reduction is
};

namespace {

using Clock = std::chrono::steady_clock;

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

std::string name_list(const std::vector<std::string>& names, const std::vector<std::size_t>& which,
                      std::size_t limit = 8) {
  std::vector<std::string> quoted;
  for (std::size_t i = 0; i < which.size() && i < limit; ++i) {
    quoted.push_back("'" + names[which[i]] + "'");
  }
  std::string text = fmt::format("{}", fmt::join(quoted, ", "));
  if (which.size() > limit) text += fmt::format(" and {} more", which.size() - limit);
  return text;
}

}  // namespace

Reducer::Reducer(std::vector<torch::Tensor> parameters, std::vector<std::string> names,
                 std::shared_ptr<ProcessGroup> group, ReducerOptions options)
    : parameters_(std::move(parameters)),
      names_(std::move(names)),
      group_(std::move(group)),
      options_(options),
      comm_hook_(allreduce_hook()) {
  if (!group_) throw ConfigError("Reducer needs a process group");
  if (names_.size() != parameters_.size()) {
    throw ConfigError("Reducer: one name per parameter is needed");
  }
  if (options_.bucket_cap_bytes == 0 || options_.first_bucket_cap_bytes == 0) {
    throw ConfigError("bucket caps must be positive (bucket_cap_mb, first bucket)");
  }
  for (std::size_t i = 0; i < parameters_.size(); ++i) {
    const auto& p = parameters_[i];
    check_collective_tensor(p, fmt::format("parameter '{}'", names_[i]));
    if (!p.requires_grad() || !p.is_leaf()) {
      throw ConfigError(
          fmt::format("parameter '{}' must be a leaf tensor that requires grad", names_[i]));
    }
  }
  if (const auto mixed = detail::mixed_devices(parameters_, names_)) throw ConfigError(*mixed);
  const c10::Device device =
      parameters_.empty() ? c10::Device(c10::kCPU) : parameters_.front().device();
  if (group_->memory_space() == MemorySpace::kCuda && !detail::takes_as_is(*group_, device)) {
    throw ConfigError(fmt::format(
        "DistributedDataParallel: the parameters are on {}, but the process group ({}) takes "
        "CUDA memory only; move the module to its GPU (module->to(torch::Device(\"cuda:<local "
        "rank>\"))) or use a host group (ring, mpi)",
        device.str(), group_->backend()));
  }
  if (options_.staging_for_tests.enabled) {
    staging_ = detail::make_host_staging(options_.staging_for_tests.observer);
  } else if (device.is_cuda() && group_->memory_space() == MemorySpace::kHost) {
    staging_ = detail::make_cuda_staging(device);
  }
  if (staging_) staging_thread_ = std::make_unique<detail::StagingThread>();
  sparse_ = options_.sparse_gradients;
  if (sparse_.empty()) sparse_.assign(parameters_.size(), false);
  if (sparse_.size() != parameters_.size()) {
    throw ConfigError(fmt::format("Reducer: sparse_gradients has {} entries for {} parameters",
                                  sparse_.size(), parameters_.size()));
  }
  for (std::size_t i = 0; i < parameters_.size(); ++i) {
    if (sparse_[i] &&
        (staging_ || !device.is_cpu() || group_->memory_space() != MemorySpace::kHost)) {
      throw ConfigError(fmt::format(
          "DistributedDataParallel: parameter '{}' has sparse gradients (an Embedding with "
          "sparse = true) on {}; ddp reduces sparse gradients of CPU parameters only: use "
          "sparse = false on a GPU",
          names_[i], device.str()));
    }
  }
  ready_.assign(parameters_.size(), false);
  used_.assign(parameters_.size(), false);

  std::vector<std::size_t> reverse_order(parameters_.size());
  std::iota(reverse_order.rbegin(), reverse_order.rend(), std::size_t{0});
  assign_buckets(reverse_order);

  grad_hooks_.resize(parameters_.size());
  for (std::size_t i = 0; i < parameters_.size(); ++i)
    attach_hook(i);
}

void Reducer::attach_hook(std::size_t param) {
  grad_hooks_[param] = std::make_unique<libtorch_compat::GradReadyHook>(
      parameters_[param], [this, param] { autograd_hook(param); });
}

std::size_t Reducer::check_parameters(const std::vector<torch::Tensor>& parameters,
                                      const std::vector<std::string>& names) {
  std::lock_guard lock(mutex_);
  if (names != names_) {
    std::size_t i = 0;
    while (i < names.size() && i < names_.size() && names[i] == names_[i])
      ++i;
    const auto describe = [](const std::vector<std::string>& list, std::size_t k) {
      return k < list.size() ? fmt::format("'{}'", list[k]) : std::string("none");
    };
    throw Error(fmt::format(
        "DistributedDataParallel: the wrapped module's trainable parameters changed after it was "
        "wrapped ({} then, {} now; at position {} it was {}, now {}). A parameter was added, "
        "removed, or its requires_grad changed. Construct a new DistributedDataParallel after "
        "changing which parameters train",
        names_.size(), names.size(), i, describe(names_, i), describe(names, i)));
  }
  std::size_t reattached = 0;
  for (std::size_t i = 0; i < parameters.size(); ++i) {
    const auto& now = parameters[i];
    // What the parameter was: its slot in a bucket, or (no bucket: sparse, or none left after a
    // failed rebuild) the tensor itself.
    const auto& view = sparse_[i] || buckets_.empty()
                           ? parameters_[i]
                           : buckets_[slots_[i].bucket].views[slots_[i].index];
    if (now.sizes() != view.sizes() || now.scalar_type() != view.scalar_type() ||
        now.device() != view.device()) {
      throw Error(fmt::format(
          "DistributedDataParallel: parameter '{}' is now [{}] {} on {}, but it was [{}] {} on {} "
          "when the model was wrapped. Its gradient bucket no longer fits, and the ranks would "
          "train apart. Change shapes, dtypes and devices (module->to(...), a checkpoint of "
          "another model) before wrapping, or construct a new DistributedDataParallel afterwards",
          names_[i], fmt::join(now.sizes(), ", "), c10::toString(now.scalar_type()),
          now.device().str(), fmt::join(view.sizes(), ", "), c10::toString(view.scalar_type()),
          view.device().str()));
    }
    const bool same_tensor = now.unsafeGetTensorImpl() == parameters_[i].unsafeGetTensorImpl();
    if (same_tensor && grad_hooks_[i]->attached_to(now)) continue;
    if (!now.requires_grad() || !now.is_leaf()) {
      throw Error(fmt::format(
          "DistributedDataParallel: parameter '{}' was replaced by a tensor that is not a leaf "
          "requiring grad; construct a new DistributedDataParallel after replacing parameters",
          names_[i]));
    }
    // A load (Module::load, torch::load) or a replaced tensor: the hook must follow the
    // parameter to its current accumulator, or its gradients would never be averaged again.
    parameters_[i] = now;
    attach_hook(i);  // and the hook on the old accumulator goes
    ++reattached;
  }
  return reattached;
}

void Reducer::follow_gradient_accumulators() {
  std::lock_guard lock(mutex_);
  for (std::size_t i = 0; i < parameters_.size(); ++i) {
    if (!grad_hooks_[i]->attached_to(parameters_[i])) attach_hook(i);
  }
}

Reducer::~Reducer() {
  grad_hooks_.clear();      // first: no hook may run into a Reducer being destroyed
  staging_thread_.reset();  // lets a launch in progress finish; nothing launches after it
  std::lock_guard lock(mutex_);
  wait_for_launched_buckets();
}

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

void Reducer::autograd_hook(std::size_t param) {
  std::lock_guard lock(mutex_);
  if (!require_sync_) {  // no_sync: gradients just accumulate
    queue_end_of_backward();
    return;
  }
  if (!expect_hooks_) {
    throw Error(fmt::format(
        "DistributedDataParallel (rank {}): backward reached parameter '{}', but the forward pass "
        "that produced this loss did not go through the DistributedDataParallel wrapper with "
        "gradient synchronisation on: the inner module was called directly (model->module()->"
        "forward(x) instead of model->forward(x)), or the forward ran inside no_sync() or with "
        "gradients disabled while backward runs outside it. Its gradients would not be averaged "
        "across ranks. Call the wrapper's forward, or run this backward inside no_sync() if local "
        "gradients are what you want",
        group_->rank(), names_[param]));
  }
  used_[param] = true;
  if (!callback_queued_) {
    callback_queued_ = true;
    timeline_ = BackwardTimeline{};
    timeline_.backward_prepared = prepared_at_;
    timeline_.bucket_ready.resize(buckets_.size());
    timeline_.bucket_launched.resize(buckets_.size());
    timeline_.bucket_completed.resize(buckets_.size());
    timeline_.bucket_in_place.resize(buckets_.size());
    timeline_.bucket_bytes_sent.resize(buckets_.size());
    libtorch_compat::at_end_of_backward([this] { finalize_backward(); });
    queue_end_of_backward();  // after finalize_backward: the gradients are delivered then
  }
  if (!unused_marked_) {
    // Parameters this pass does not use still have to fill their buckets (with zeros).
    unused_marked_ = true;
    for (const auto i : unused_)
      mark_ready(i, /*has_grad=*/false);
  }
  mark_ready(param, /*has_grad=*/true);
}

void Reducer::mark_ready(std::size_t param, bool has_grad) {
  torch::NoGradGuard no_grad;
  if (ready_[param]) {
    throw Error(fmt::format(
        "DistributedDataParallel: parameter '{}' received a gradient twice in one backward pass. "
        "Each parameter may take part in one backward pass per iteration; for gradient "
        "accumulation over several backward passes use no_sync(){}",
        names_[param],
        options_.find_unused_parameters ? ""
                                        : ", and if it was reported unused, check "
                                          "find_unused_parameters"));
  }
  ready_[param] = true;
  if (record_ready_order_ && has_grad) ready_order_.push_back(param);
  if (sparse_[param]) return;  // reduced at the end of backward (reduce_sparse_gradients)

  const auto& slot = slots_[param];
  auto& bucket = buckets_[slot.bucket];
  torch::Tensor& view = bucket.views[slot.index];
  torch::Tensor& grad = parameters_[param].mutable_grad();
  if (has_grad && grad.defined()) {
    if (grad.is_sparse()) {
      throw Error(fmt::format(
          "DistributedDataParallel: parameter '{}' received a sparse gradient, but it was wrapped "
          "as a dense one (DDP finds the weights of torch::nn::Embedding and EmbeddingBag with "
          "sparse = true; another module's sparse gradients are not supported): use "
          "sparse = false, or one of those modules",
          names_[param]));
    }
    if (!is_bucket_view(param, grad)) {
      const bool dtype_fits =
          grad.scalar_type() == view.scalar_type() || grad.scalar_type() == options_.gradient_dtype;
      if (grad.sizes() != view.sizes() || !dtype_fits) {
        throw Error(fmt::format(
            "DistributedDataParallel: the gradient of '{}' has shape {} and "
            "dtype {}, but the parameter has {} and {}",
            names_[param], fmt::join(grad.sizes(), "x"), c10::toString(grad.scalar_type()),
            fmt::join(view.sizes(), "x"), c10::toString(view.scalar_type())));
      }
      if (grad.scalar_type() == view.scalar_type() && can_reduce_in_place(grad)) {
        // Copied (or not at all) only when the bucket is launched: if every gradient of the
        // bucket qualifies, the engine reduces them where they are, without the round trip
        // through the bucket (for a large model the copies cost as much as the reduction).
        bucket.left_in_place[slot.index] = 1;
        ++bucket.left_in_place_count;
      } else {
        view.copy_(grad);
        if (options_.gradient_as_bucket_view) grad = slot_view(param);
      }
    }
  } else {
    view.zero_();
  }
  if (--bucket.pending == 0) {
    timeline_.bucket_ready[slot.bucket] = Clock::now();
    launch_ready_buckets();
  }
}

void Reducer::launch_ready_buckets() {
  // Buckets start in bucket order only, so every rank issues the same collectives in the same
  // order even when gradients become ready in a different order on different ranks.
  while (next_bucket_ < buckets_.size() && buckets_[next_bucket_].pending == 0) {
    const std::size_t b = next_bucket_++;
    auto& bucket = buckets_[b];
    timeline_.bucket_launched[b] = Clock::now();
    bucket.launched = true;
    bucket.completed_ns = std::make_shared<std::atomic<std::int64_t>>(0);
    if (staging_) {
      launch_staged(b);  // the staging thread records the launch, its bytes and its completion
      continue;
    }
    if (bucket.left_in_place_count == bucket.params.size()) {
      reduce_in_place(bucket);
      timeline_.bucket_in_place[b] = true;
    } else {
      launch_through_hook(b);
    }
    timeline_.bucket_bytes_sent[b] =
        bucket.reduction.bytes_sent.value_or(static_cast<std::size_t>(bucket.contents.nbytes()));
    if (bucket.reduction.work) {
      bucket.reduction.work->then([done = bucket.completed_ns](Work&) {
        done->store(Clock::now().time_since_epoch().count(), std::memory_order_relaxed);
      });
    }
  }
}

bool Reducer::can_reduce_in_place(const torch::Tensor& grad) const {
  // Only where the group reduces the pieces where they lie: elsewhere allreduce_segments would pack
  // them into a temporary per call, and the bucket's own flat buffer is the better target.
  return !staging_ && !custom_hook_ && !options_.gradient_as_bucket_view && grad.is_contiguous() &&
         grad.device().is_cpu() && !grad.is_sparse() &&
         group_->memory_space() == MemorySpace::kHost && group_->allreduce_segments_in_place();
}

void Reducer::reduce_in_place(Bucket& bucket) {
  std::vector<BufferSegment> segments;
  segments.reserve(bucket.params.size());
  for (const auto i : bucket.params) {
    torch::Tensor& grad = parameters_[i].mutable_grad();
    segments.push_back({grad.data_ptr(), static_cast<std::size_t>(grad.numel())});
  }
  bucket.reduction = {
      group_->allreduce_segments(std::move(segments), to_dtype(bucket.contents.scalar_type()),
                                 ReduceOp::kAvg),
      {}};
  bucket.reduced_in_place = true;
}

void Reducer::launch_through_hook(std::size_t b) {
  auto& bucket = buckets_[b];
  {
    torch::NoGradGuard no_grad;
    // Gradients left in place for a reduction that this bucket cannot do: into the bucket now.
    for (std::size_t k = 0; k < bucket.params.size() && bucket.left_in_place_count > 0; ++k) {
      if (!bucket.left_in_place[k]) continue;
      bucket.views[k].copy_(parameters_[bucket.params[k]].mutable_grad());
      bucket.left_in_place[k] = 0;
      --bucket.left_in_place_count;
    }
  }
  if (!custom_hook_ && group_->completes_on_stream() && bucket.contents.is_cuda()) {
    // As allreduce_hook, but stream-ordered: the host does not wait for the device at the end of
    // backward (PyTorch's reducer makes the current stream wait on the work the same way).
    if (!bucket.done_event)
      bucket.done_event = detail::make_cuda_done_event(bucket.contents.device());
    torch::Tensor& contents = bucket.contents;
    bucket.reduction = {
        group_->allreduce(contents.data_ptr(), contents.data_ptr(),
                          static_cast<std::size_t>(contents.numel()),
                          to_dtype(contents.scalar_type()), ReduceOp::kAvg,
                          {.cuda_stream = detail::current_cuda_stream(contents.device()),
                           .cuda_done_event = bucket.done_event->handle()}),
        {},
        static_cast<std::size_t>(contents.nbytes())};
    bucket.stream_ordered = true;
    return;
  }
  bucket.reduction = run_comm_hook(b, "");
}

void Reducer::launch_staged(std::size_t b) {
  auto& bucket = buckets_[b];
  bucket.copy_in_error = std::make_shared<std::string>();
  staging_->copy_out(b, bucket.contents, bucket.twin);  // queued behind the gradients; no wait
  staging_thread_->submit([this, b] { run_staged(b); });
}

void Reducer::run_staged(std::size_t b) noexcept {
  // Touches only this bucket's fields and its timeline slots; the autograd thread reads them
  // after StagingThread::drain (finish_staging).
  auto& bucket = buckets_[b];
  if (staging_failed_) return;  // an earlier bucket did not start: later ones must not either
  try {
    const auto deadline = Clock::now() + kDefaultTimeout;
    if (!staging_->wait_copied_out(b, deadline)) {
      throw TimeoutError(fmt::format(
          "the copy of {} to host memory did not complete within {} s (the device is stuck or "
          "far behind)",
          bucket_phase(b), kDefaultTimeout.count() / 1000));
    }
    torch::NoGradGuard no_grad;
    timeline_.bucket_launched[b] = Clock::now();
    GradBucket grad_bucket = hook_bucket(b);
    bucket.reduction = comm_hook_(*group_, grad_bucket);
    timeline_.bucket_bytes_sent[b] =
        bucket.reduction.bytes_sent.value_or(static_cast<std::size_t>(bucket.twin.nbytes()));
    auto& work = bucket.reduction.work;
    if (work) {
      work->then([done = bucket.completed_ns](Work&) {
        done->store(Clock::now().time_since_epoch().count(), std::memory_order_relaxed);
      });
    }
    if (bucket.reduction.finish) return;  // copied in after finish (finalize_backward)
    if (!work) {
      staging_->copy_in(b, bucket.twin, bucket.contents);
      return;
    }
    // Copied back as soon as the engine is done with it, while later buckets are on the wire.
    work->then([staging = staging_.get(), b, twin = bucket.twin, contents = bucket.contents,
                error = bucket.copy_in_error](Work& done) mutable {
      if (done.error()) return;  // reported by the wait in finalize_backward
      try {
        staging->copy_in(b, twin, contents);
      } catch (const std::exception& e) {
        *error = e.what();
      }
    });
  } catch (const std::exception& e) {
    staging_failed_ = true;
    bucket.staging_error = e.what();
  }
}

void Reducer::finish_staging() {
  if (!staging_thread_->drain(Clock::now() + kDefaultTimeout)) {
    throw TimeoutError(fmt::format(
        "DistributedDataParallel (rank {}): the staging thread did not launch the gradient "
        "buckets within {} s of the end of backward",
        group_->rank(), kDefaultTimeout.count() / 1000));
  }
  for (std::size_t b = 0; b < buckets_.size(); ++b) {
    if (buckets_[b].staging_error.empty()) continue;
    hook_failure_ = fmt::format(
        "DistributedDataParallel (rank {}): {} was not reduced: {}. This rank did not make the "
        "bucket's collectives, so the other ranks fail in them within the group's timeout; the "
        "ranks are out of step and this DistributedDataParallel refuses to synchronise again: "
        "fix the cause, then start again with a new process group (from a checkpoint)",
        group_->rank(), bucket_phase(b), buckets_[b].staging_error);
    throw Error(hook_failure_);
  }
}

BucketReduction Reducer::run_comm_hook(std::size_t b, const char* context) {
  GradBucket grad_bucket = hook_bucket(b);
  try {
    return comm_hook_(*group_, grad_bucket);
  } catch (const std::exception& e) {
    hook_failure_ = fmt::format(
        "DistributedDataParallel (rank {}): the comm hook threw{} for {}: {}. This rank did not "
        "make the bucket's collectives, so the other ranks fail in them within the group's "
        "timeout; the ranks are out of step and this DistributedDataParallel refuses to "
        "synchronise again: fix the hook, then start again with a new process group (from a "
        "checkpoint)",
        group_->rank(), context, bucket_phase(b), e.what());
  }
  // Drain what this pass already started (the others make those collectives too), and leave the
  // Reducer ready to report hook_failure_ instead of waiting for buckets that never start.
  wait_for_launched_buckets();
  reset_iteration();
  throw Error(hook_failure_);
}

void Reducer::throw_if_hook_failed() const {
  if (!hook_failure_.empty()) {
    throw Error("refusing to synchronise gradients after an earlier failure: " + hook_failure_);
  }
}

GradBucket Reducer::hook_bucket(std::size_t b) const {
  const auto& bucket = buckets_[b];
  const bool staged = bucket.twin.defined();  // the hook reduces the host twin
  GradBucket grad_bucket{.index = b,
                         .buffer = staged ? bucket.twin : bucket.contents,
                         .gradients = staged ? bucket.twin_views : bucket.views,
                         .is_last = b + 1 == buckets_.size()};
  for (const auto i : bucket.params) {
    grad_bucket.parameter_names.push_back(names_[i]);
    grad_bucket.parameters.push_back(parameters_[i]);
  }
  return grad_bucket;
}

void Reducer::wait_for_launched_buckets() noexcept {
  for (auto& bucket : buckets_) {
    if (!bucket.launched || !bucket.reduction.work) continue;
    try {
      bucket.reduction.work->wait();  // bounded by the operation's timeout
    } catch (...) {
      // Only draining here: the error is reported where the reduction was awaited.
    }
  }
}

void Reducer::reset_iteration() {
  std::fill(ready_.begin(), ready_.end(), false);
  std::fill(used_.begin(), used_.end(), false);
  for (auto& bucket : buckets_) {
    bucket.pending = bucket.params.size();
    bucket.reduction = {};
    bucket.launched = false;
    std::fill(bucket.left_in_place.begin(), bucket.left_in_place.end(), 0);
    bucket.left_in_place_count = 0;
    bucket.reduced_in_place = false;
    bucket.stream_ordered = false;
    bucket.staging_error.clear();
  }
  staging_failed_ = false;
  next_bucket_ = 0;
  callback_queued_ = false;
  expect_hooks_ = false;
  unused_marked_ = false;
  if (record_ready_order_) ready_order_.clear();  // a failed first pass records nothing
  if (!(options_.static_graph && unused_known_)) unused_.clear();
}

void Reducer::finalize_backward() {
  std::lock_guard lock(mutex_);
  timeline_.backward_finished = Clock::now();
  try {
    if (staging_thread_) finish_staging();  // first: the staging thread touches the buckets
    bool sparse_missing = false;
    for (std::size_t i = 0; i < parameters_.size(); ++i)
      sparse_missing = sparse_missing || (sparse_[i] && !ready_[i]);
    if (next_bucket_ < buckets_.size() || sparse_missing) {
      std::vector<std::size_t> missing;
      for (std::size_t i = 0; i < parameters_.size(); ++i) {
        if (!ready_[i]) missing.push_back(i);
      }
      throw Error(fmt::format(
          "DistributedDataParallel (rank {}): {} parameter(s) received no gradient in this "
          "backward pass: {}. Their buckets could not be reduced. If parts of the model are "
          "unused in some iterations, construct DistributedDataParallel with "
          "find_unused_parameters = true (and return every output from forward); otherwise "
          "make sure every parameter takes part in the loss",
          group_->rank(), missing.size(), name_list(names_, missing)));
    }
    // Which parameters some rank used, so that parameters unused everywhere keep their
    // gradients untouched (as in PyTorch).
    std::vector<std::int32_t> used_anywhere;
    if (options_.find_unused_parameters || options_.static_graph) {
      used_anywhere.assign(parameters_.size(), 0);
      for (std::size_t i = 0; i < parameters_.size(); ++i)
        used_anywhere[i] = used_[i] ? 1 : 0;
    }
    std::shared_ptr<Work> used_work;
    if (!used_anywhere.empty()) {
      used_work = detail::HostValues(*group_)->allreduce(used_anywhere.data(), used_anywhere.size(),
                                                         DType::kInt32, ReduceOp::kMax);
    }
    for (std::size_t b = 0; b < buckets_.size(); ++b) {
      auto& bucket = buckets_[b];
      detail::in_ddp_phase([&] { return bucket_phase(b); },
                           [&] {
                             if (bucket.reduction.work) bucket.reduction.work->wait();
                           });
      // Queued on the device: what reads the bucket from here on runs after it there.
      if (bucket.stream_ordered) bucket.done_event->wait_on_current_stream();
      const auto done = bucket.completed_ns ? bucket.completed_ns->load() : 0;
      timeline_.bucket_completed[b] =
          done != 0 ? Clock::time_point(Clock::duration(done)) : Clock::now();
      // A finish step may make further collectives (PowerSGD's Q): their errors name the bucket.
      detail::in_ddp_phase([&] { return bucket_phase(b); },
                           [&] {
                             if (bucket.reduction.finish) bucket.reduction.finish();
                           });
      if (bucket.twin.defined()) {
        if (bucket.reduction.finish) staging_->copy_in(b, bucket.twin, bucket.contents);
        if (bucket.copy_in_error && !bucket.copy_in_error->empty()) {
          throw Error(
              fmt::format("DistributedDataParallel (rank {}): copying the average of {} "
                          "back to {} failed: {}",
                          group_->rank(), bucket_phase(b), bucket.contents.device().str(),
                          *bucket.copy_in_error));
        }
      }
    }
    // The current stream (the one backward() returns on) reads the buckets only after the copies.
    if (staging_) staging_->join();
    if (used_work) {
      detail::in_ddp_phase([] { return std::string("unused-parameter map after backward"); },
                           [&] { used_work->wait(); });
    }
    reduce_sparse_gradients(used_anywhere, /*contribute=*/true);
    deliver_gradients(used_anywhere);
  } catch (...) {
    wait_for_launched_buckets();
    reset_iteration();
    throw;
  }
  timeline_.synchronised = Clock::now();
  timeline_.bytes_sent = timeline_.sparse_bytes_sent;
  for (const auto bytes : timeline_.bucket_bytes_sent)
    timeline_.bytes_sent += bytes;
  last_timeline_ = timeline_;
  record_pass_stats();
  if (trace_enabled()) trace_pass();
  after_synchronised_pass();
  reset_iteration();
}

void Reducer::reduce_sparse_gradients(const std::vector<std::int32_t>& used_anywhere,
                                      bool contribute) {
  torch::NoGradGuard no_grad;
  for (std::size_t i = 0; i < parameters_.size(); ++i) {
    if (!sparse_[i]) continue;
    const torch::Tensor& param = parameters_[i];
    torch::Tensor& grad = param.mutable_grad();
    // An Embedding's gradient: rows (sparse dim 0) of the table's other dims. A rank that did not
    // use the table (or shadows the others) adds no rows.
    torch::Tensor local;
    if (contribute && used_[i] && grad.defined()) {
      local = grad.is_sparse() ? grad : grad.to_sparse(1);
      if (local.sparse_dim() != 1 || local.dense_dim() != param.dim() - 1) {
        throw Error(fmt::format(
            "DistributedDataParallel: the sparse gradient of '{}' has {} sparse and {} dense "
            "dimensions; ddp reduces sparse gradients of rows (1 sparse dimension, as "
            "Embedding's)",
            names_[i], local.sparse_dim(), local.dense_dim()));
      }
    } else {
      std::vector<std::int64_t> value_shape = param.sizes().vec();
      value_shape[0] = 0;
      local = torch::sparse_coo_tensor(torch::empty({1, 0}, torch::kLong),
                                       torch::empty(value_shape, param.options()), param.sizes());
    }
    torch::Tensor sum;
    detail::in_ddp_phase(
        [&] { return fmt::format("sparse gradient of '{}'", names_[i]); },
        [&] { sum = detail::sparse_all_reduce_sum(local, *group_, timeline_.sparse_bytes_sent); });
    if (!used_anywhere.empty() && used_anywhere[i] == 0) continue;
    sum.div_(group_->size());  // as the dense buckets' kAvg: the sum, divided once
    grad = sum;
  }
}

void Reducer::deliver_gradients(const std::vector<std::int32_t>& used_anywhere) {
  torch::NoGradGuard no_grad;
  for (std::size_t i = 0; i < parameters_.size(); ++i) {
    if (!used_anywhere.empty() && used_anywhere[i] == 0) continue;
    if (sparse_[i]) continue;  // reduce_sparse_gradients
    torch::Tensor& grad = parameters_[i].mutable_grad();
    if (buckets_[slots_[i].bucket].reduced_in_place) continue;  // averaged where it lies
    if (is_bucket_view(i, grad)) continue;  // gradient_as_bucket_view: already in place
    const auto& view = buckets_[slots_[i].bucket].views[slots_[i].index];
    if (options_.gradient_as_bucket_view) {
      grad = slot_view(i);
    } else if (grad.defined() && grad.scalar_type() == view.scalar_type()) {
      grad.copy_(view);
    } else {
      grad = view.clone();
    }
  }
  if (gradient_scale_ != 1.0) {
    for (std::size_t i = 0; i < parameters_.size(); ++i) {
      if (!used_anywhere.empty() && used_anywhere[i] == 0) continue;
      torch::Tensor& grad = parameters_[i].mutable_grad();
      if (grad.defined()) grad.mul_(gradient_scale_);
    }
  }
}

void Reducer::record_pass_stats() {
  const auto& t = timeline_;
  ++stats_.iterations;
  last_unused_ = unused_;  // reset_iteration clears unused_ (outside static_graph)
  if (t.backward_prepared != BackwardTimeline::TimePoint{}) {
    stats_.backward_compute += t.backward_finished - t.backward_prepared;
  }
  if (t.bucket_launched.empty()) return;
  const auto comm_start = *std::min_element(t.bucket_launched.begin(), t.bucket_launched.end());
  const auto comm_end = *std::max_element(t.bucket_completed.begin(), t.bucket_completed.end());
  stats_.backward_comm += comm_end - comm_start;
  if (t.backward_finished > comm_start) {
    stats_.backward_compute_comm_overlap += t.backward_finished - comm_start;
  }
}

void Reducer::trace_pass() const {
  // Emitted once per pass from the times the timeline holds anyway, so the hooks stay untouched.
  const auto& t = timeline_;
  // A lane of its own: these spans overlap the training script's "backward" on the main thread.
  const int lane = trace_lane("DDP backward");
  if (t.backward_prepared != BackwardTimeline::TimePoint{}) {
    trace_complete("backward compute (DDP)", "ddp", lane, trace_clock_ns(t.backward_prepared),
                   trace_clock_ns(t.backward_finished),
                   {{"iteration", stats_.iterations}, {"from", "end of forward"}});
  }
  trace_complete("wait for gradient buckets", "ddp", lane, trace_clock_ns(t.backward_finished),
                 trace_clock_ns(t.synchronised),
                 {{"iteration", stats_.iterations}, {"bytes_sent", t.bytes_sent}});
  for (std::size_t b = 0; b < t.bucket_launched.size(); ++b) {
    const int bucket_lane = trace_lane(fmt::format("bucket {} collective", b));
    trace_instant("bucket ready", "ddp", bucket_lane, trace_clock_ns(t.bucket_ready[b]),
                  {{"bucket", b}, {"parameters", buckets_[b].params.size()}});
    trace_complete(custom_hook_ ? comm_hook_name_ : std::string("allreduce"), "comm", bucket_lane,
                   trace_clock_ns(t.bucket_launched[b]), trace_clock_ns(t.bucket_completed[b]),
                   {{"bucket", b},
                    {"bytes", static_cast<std::size_t>(buckets_[b].contents.nbytes())},
                    {"bytes_sent", t.bucket_bytes_sent[b]},
                    {"parameters", buckets_[b].params.size()},
                    {"in_place", static_cast<bool>(t.bucket_in_place[b])},
                    {"iteration", stats_.iterations}});
  }
}

void Reducer::after_synchronised_pass() {
  if (record_ready_order_) {
    record_ready_order_ = false;
    rebuild_due_ = !rebuilt_;
  }
  if (options_.static_graph) unused_known_ = true;
}

std::string Reducer::bucket_phase(std::size_t b) const {
  const auto& params = buckets_[b].params;
  const std::string names =
      params.size() == 1 ? names_[params.front()]
                         : fmt::format("{} {} {}", names_[params.front()],
                                       params.size() == 2 ? "and" : "…", names_[params.back()]);
  return fmt::format("gradient bucket {} of {} (parameters {})", b + 1, buckets_.size(), names);
}

void Reducer::shadow_backward() {
  std::lock_guard lock(mutex_);
  throw_if_hook_failed();
  torch::NoGradGuard no_grad;
  // The same collectives, in the same order, as a synchronised backward on a rank that trains:
  // every bucket through the same path (the default path's allreduce_segments is the same
  // collective as an allreduce of the bucket), then the unused map. Zeros add nothing.
  std::vector<BucketReduction> reductions;
  for (std::size_t b = 0; b < buckets_.size(); ++b) {
    auto& bucket = buckets_[b];
    bucket.contents.zero_();
    if (bucket.twin.defined()) {
      // Through the stream order (the twin may still be read by the last pass's copy-in).
      staging_->copy_out(b, bucket.contents, bucket.twin);
      if (!staging_->wait_copied_out(b, Clock::now() + kDefaultTimeout)) {
        throw TimeoutError(fmt::format("the copy of {} to host memory did not complete within {} s",
                                       bucket_phase(b), kDefaultTimeout.count() / 1000));
      }
    }
    reductions.push_back(run_comm_hook(b, " while this joined rank shadowed the others"));
  }
  std::vector<std::int32_t> unused_map;
  std::shared_ptr<Work> used_work;
  if (options_.find_unused_parameters || options_.static_graph) {
    unused_map.assign(parameters_.size(), 0);
    used_work = detail::HostValues(*group_)->allreduce(unused_map.data(), unused_map.size(),
                                                       DType::kInt32, ReduceOp::kMax);
  }
  try {
    for (std::size_t b = 0; b < reductions.size(); ++b) {
      detail::in_ddp_phase([&] { return "joined rank shadowing " + bucket_phase(b); },
                           [&] {
                             if (reductions[b].work) reductions[b].work->wait();
                             if (reductions[b].finish) reductions[b].finish();
                           });
      if (buckets_[b].twin.defined()) staging_->copy_in(b, buckets_[b].twin, buckets_[b].contents);
    }
    if (staging_) staging_->join();
    if (used_work) {
      detail::in_ddp_phase([] { return std::string("joined rank shadowing the unused map"); },
                           [&] { used_work->wait(); });
    }
    reduce_sparse_gradients(unused_map, /*contribute=*/false);
    deliver_gradients(unused_map);
  } catch (...) {
    for (auto& reduction : reductions) {
      if (!reduction.work) continue;
      try {
        reduction.work->wait();
      } catch (...) {
      }
    }
    throw;
  }
  after_synchronised_pass();
}

void Reducer::set_gradient_scale(double scale) {
  std::lock_guard lock(mutex_);
  gradient_scale_ = scale;
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

void Reducer::prepare_for_backward(const std::vector<torch::Tensor>& outputs) {
  std::lock_guard lock(mutex_);
  // A new pass: a failed one may have dropped its queued callbacks.
  end_of_backward_queued_ = false;
  if (callback_queued_) {
    // The last backward threw inside autograd after its first hook (a hook of the user's, an
    // allocation): finalize_backward never ran, and every parameter it reached would count as
    // ready twice in this pass. That pass is dropped: what it launched completes first (as on the
    // other ranks, or within the group's timeout), and nothing of it is delivered; the local
    // gradients autograd accumulated before the failure stay in .grad, as without DDP.
    if (staging_thread_) staging_thread_->drain(Clock::now() + kDefaultTimeout);
    wait_for_launched_buckets();
    reset_iteration();
  }
  if (!require_sync_) return;
  throw_if_hook_failed();
  expect_hooks_ = true;
  prepared_at_ = Clock::now();
  if (!options_.find_unused_parameters && !options_.static_graph) return;
  if (options_.static_graph && unused_known_) return;
  find_unused(outputs);
}

void Reducer::find_unused(const std::vector<torch::Tensor>& outputs) {
  ++stats_.unused_parameter_searches;
  const auto seen = libtorch_compat::reachable_nodes(outputs);
  unused_.clear();
  for (std::size_t i = 0; i < parameters_.size(); ++i) {
    if (seen.count(grad_hooks_[i]->node()) == 0) unused_.push_back(i);
  }
}

void Reducer::set_end_of_backward(std::function<void()> callback) {
  std::lock_guard lock(mutex_);
  end_of_backward_ = std::move(callback);
}

void Reducer::queue_end_of_backward() {
  if (!end_of_backward_ || end_of_backward_queued_) return;
  end_of_backward_queued_ = true;
  libtorch_compat::at_end_of_backward([this] {
    std::function<void()> callback;
    {
      std::lock_guard lock(mutex_);
      end_of_backward_queued_ = false;
      callback = end_of_backward_;
    }
    callback();
  });
}

void Reducer::set_require_sync(bool require_sync) {
  std::lock_guard lock(mutex_);
  require_sync_ = require_sync;
}

bool Reducer::require_sync() const {
  std::lock_guard lock(mutex_);
  return require_sync_;
}

void Reducer::register_comm_hook(CommHook hook, std::string name) {
  if (!hook) throw ConfigError("register_comm_hook: the hook is empty");
  std::lock_guard lock(mutex_);
  for (std::size_t i = 0; i < parameters_.size(); ++i) {
    if (!sparse_[i]) continue;
    throw ConfigError(fmt::format(
        "register_comm_hook ({}): parameter '{}' has sparse gradients (an Embedding with "
        "sparse = true), and comm hooks take dense buckets; use sparse = false to compress it, or "
        "no hook",
        name, names_[i]));
  }
  comm_hook_ = std::move(hook);
  comm_hook_name_ = std::move(name);
  custom_hook_ = true;
}

std::string Reducer::comm_hook_name() const {
  std::lock_guard lock(mutex_);
  return comm_hook_name_;
}

ReducerStats Reducer::stats() const {
  std::lock_guard lock(mutex_);
  return stats_;
}

std::vector<std::size_t> Reducer::bucket_sizes_bytes() const {
  std::lock_guard lock(mutex_);
  std::vector<std::size_t> sizes;
  for (const auto& bucket : buckets_)
    sizes.push_back(static_cast<std::size_t>(bucket.contents.nbytes()));
  return sizes;
}

std::vector<std::string> Reducer::unused_parameter_names() const {
  std::lock_guard lock(mutex_);
  std::vector<std::string> names;
  for (const auto i : last_unused_)
    names.push_back(names_[i]);
  return names;
}

std::vector<std::vector<std::size_t>> Reducer::bucket_assignment() const {
  std::lock_guard lock(mutex_);
  std::vector<std::vector<std::size_t>> result;
  for (const auto& bucket : buckets_)
    result.push_back(bucket.params);
  return result;
}

BackwardTimeline Reducer::last_timeline() const {
  std::lock_guard lock(mutex_);
  return last_timeline_;
}

bool Reducer::buckets_rebuilt() const {
  std::lock_guard lock(mutex_);
  return rebuilt_;
}

}  // namespace ddp
