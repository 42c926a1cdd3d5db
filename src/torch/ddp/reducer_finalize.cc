// Reducer: the end of backward: waiting for the buckets, delivering the averages (and the sparse
// gradients, the gradient scale), the pass's stats and trace, and a joined rank's shadow pass.
#include <algorithm>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "ddp/comm/trace.h"
#include "ddp/error.h"
#include "ddp/timeouts.h"
#include "ddp/torch/ddp/reducer.h"
#include "torch/core/device_staging.h"
#include "torch/core/host_values.h"
#include "torch/core/sparse_allreduce.h"
#include "torch/core/wrapper_phase.h"
#include "torch/ddp/reducer_internal.h"

namespace ddp {

namespace {

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
  timeline_.backward_finished = detail::Clock::now();
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
      timeline_.bucket_completed[b] = done != 0
                                          ? detail::Clock::time_point(detail::Clock::duration(done))
                                          : detail::Clock::now();
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
  timeline_.synchronised = detail::Clock::now();
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
      if (!staging_->wait_copied_out(b, detail::Clock::now() + kDefaultTimeout)) {
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

ReducerStats Reducer::stats() const {
  std::lock_guard lock(mutex_);
  return stats_;
}

std::vector<std::string> Reducer::unused_parameter_names() const {
  std::lock_guard lock(mutex_);
  std::vector<std::string> names;
  for (const auto i : last_unused_)
    names.push_back(names_[i]);
  return names;
}

BackwardTimeline Reducer::last_timeline() const {
  std::lock_guard lock(mutex_);
  return last_timeline_;
}

}  // namespace ddp
