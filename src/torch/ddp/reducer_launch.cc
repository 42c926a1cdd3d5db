// Reducer: backward's launch phase: the gradient hook, buckets counted down and launched in bucket
// order (in place, through the comm hook, or staged through host twins on the staging thread).
#include <atomic>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "ddp/error.h"
#include "ddp/timeouts.h"
#include "ddp/torch/core/tensor_collectives.h"
#include "ddp/torch/ddp/reducer.h"
#include "torch/core/device_staging.h"
#include "torch/core/libtorch_compat.h"
#include "torch/core/staging_thread.h"
#include "torch/ddp/reducer_internal.h"

namespace ddp {

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
    timeline_.bucket_ready[slot.bucket] = detail::Clock::now();
    launch_ready_buckets();
  }
}

void Reducer::launch_ready_buckets() {
  // Buckets start in bucket order only, so every rank issues the same collectives in the same
  // order even when gradients become ready in a different order on different ranks.
  while (next_bucket_ < buckets_.size() && buckets_[next_bucket_].pending == 0) {
    const std::size_t b = next_bucket_++;
    auto& bucket = buckets_[b];
    timeline_.bucket_launched[b] = detail::Clock::now();
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
        done->store(detail::Clock::now().time_since_epoch().count(), std::memory_order_relaxed);
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
    const auto deadline = detail::Clock::now() + kDefaultTimeout;
    if (!staging_->wait_copied_out(b, deadline)) {
      throw TimeoutError(fmt::format(
          "the copy of {} to host memory did not complete within {} s (the device is stuck or "
          "far behind)",
          bucket_phase(b), kDefaultTimeout.count() / 1000));
    }
    torch::NoGradGuard no_grad;
    timeline_.bucket_launched[b] = detail::Clock::now();
    GradBucket grad_bucket = hook_bucket(b);
    bucket.reduction = comm_hook_(*group_, grad_bucket);
    timeline_.bucket_bytes_sent[b] =
        bucket.reduction.bytes_sent.value_or(static_cast<std::size_t>(bucket.twin.nbytes()));
    auto& work = bucket.reduction.work;
    if (work) {
      work->then([done = bucket.completed_ns](Work&) {
        done->store(detail::Clock::now().time_since_epoch().count(), std::memory_order_relaxed);
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
  if (!staging_thread_->drain(detail::Clock::now() + kDefaultTimeout)) {
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

}  // namespace ddp
