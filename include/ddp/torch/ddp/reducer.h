// Reducer: the gradient-averaging engine behind DistributedDataParallel.
//
// Parameters are grouped into buckets (reverse registration order at first, by dtype, a small
// first bucket so communication starts early, then up to bucket_cap_bytes). Each bucket is one
// flat tensor. A post-hook on every parameter's gradient accumulator copies the fresh gradient
// into its slot (or, with gradient_as_bucket_view, the gradient *is* the slot) and counts the
// bucket down; a full bucket's reduction starts at once, in bucket order, on the group's worker
// thread, while backward goes on computing earlier layers. A callback queued on the autograd
// engine runs when backward ends: it waits for every bucket and writes the averages back, so the
// gradients are synchronised when backward() returns.
//
// After the first synchronised iteration the buckets are rebuilt once, in the order in which
// gradients actually became ready on rank 0 (broadcast, so every rank agrees), at the start of
// the next forward.
//
// Devices: the parameters must all be on one device, the CPU or a CUDA device; buckets live there
// and the gradients are views into them (gradient_as_bucket_view) or copied. CUDA buckets on a
// group of host memory (ProcessGroup::memory_space() == kHost: ring, mpi) are staged through
// pinned host twins without blocking the autograd thread: copy-out after the bucket is ready,
// the comm hook runs on a staging thread over the twin (in bucket order), copy-in when its Work
// completes, and the current stream waits for the copies before backward() returns
// (src/torch/core/device_staging.h). On a CUDA group (nccl) the hook gets the device bucket and the
// collectives take the current stream; waiting for a bucket blocks the host until it is done.
//
// Threads: hooks and the final callback run on the autograd thread (comm hooks of staged buckets
// run on the staging thread, one at a time, in bucket order); prepare_* and the setters on
// the thread that runs forward. Do not run two backward passes over one Reducer at once.
// Lifetime: destroying the Reducer waits (bounded by the group's timeout) for reductions in flight
// and removes its hooks; it must not be destroyed while a backward pass over its parameters runs.
// Errors surface from backward(): a comm hook that threw (Error naming the bucket; the Reducer
// then refuses every later synchronised forward and backward), a parameter that received no
// gradient without
// find_unused_parameters (Error naming the parameters and the option), a gradient received twice
// in one pass, a backward over a forward that did not go through DistributedDataParallel (or ran
// inside no_sync), and the group's CommError (its message names the bucket and its parameters).
//
// Parameters replaced after construction (Module::load and torch::load assign new storage and may
// give a parameter a new gradient accumulator; register_parameter puts a new tensor in its place)
// are found by check_parameters() before every forward: a parameter of the same name, shape, dtype
// and device is re-attached (the hooks move to its accumulator), anything else is an Error naming
// the parameter and the fix. Without it the hooks would stay on orphaned accumulators and the ranks
// would silently train apart.
#pragma once

#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <torch/torch.h>

#include "ddp/comm/process_group.h"
#include "ddp/torch/ddp/hooks/comm_hooks.h"

// Exported by ddp's shared libraries, which hide the rest (src/CMakeLists.txt).
#pragma GCC visibility push(default)
namespace ddp {

namespace libtorch_compat {
class GradReadyHook;  // src/torch/core/libtorch_compat.h
}  // namespace libtorch_compat
namespace detail {
class DeviceStaging;  // src/torch/core/device_staging.h
class StagingThread;  // src/torch/core/staging_thread.h
}  // namespace detail

struct ReducerOptions {
  std::size_t bucket_cap_bytes = std::size_t{25} << 20;
  std::size_t first_bucket_cap_bytes = std::size_t{1} << 20;
  bool find_unused_parameters = false;
  bool gradient_as_bucket_view = false;
  // The set of used parameters and their ready order never change: unused parameters are found
  // once (first iteration) instead of in every forward.
  bool static_graph = false;
  // For tests only: CPU buckets take the staged path that CUDA buckets on a host group take (host
  // twins, copy-out, reduction on the staging thread, copy-in, join;
  // src/torch/core/device_staging.h), and `observer` (may be empty; called from several threads) is
  // told each step: "twin", "copy_out", "copied_out", "copy_in" with the bucket and its twin's
  // address, then "join".
  struct StagingForTests {
    bool enabled = false;
    std::function<void(std::string_view step, std::size_t bucket, const void* twin)> observer;
  };
  StagingForTests staging_for_tests;
  // Per parameter (empty: none): its gradient is sparse (an Embedding or EmbeddingBag with
  // sparse = true; DistributedDataParallel finds them), as PyTorch's expect_sparse_gradient. Such
  // a parameter has no bucket: at the end of backward, after the buckets, its gradient is summed
  // over the ranks as a sparse tensor (every rank's rows and values gathered, as gloo does) and
  // averaged, so the bytes sent grow with the rows touched, not with the table. Comm hooks take
  // dense buckets: register_comm_hook with such a parameter is a ConfigError, as is a CUDA one.
  std::vector<bool> sparse_gradients;
  // Gradients may arrive in this dtype instead of the parameters' (DDP's param_dtype: backward
  // runs on low-precision copies); they are upcast into the buckets and delivered in the
  // parameters' dtype.
  std::optional<c10::ScalarType> gradient_dtype;
};

// What happened in the last synchronised backward pass (for tests and profiling).
struct BackwardTimeline {
  using TimePoint = std::chrono::steady_clock::time_point;
  TimePoint backward_prepared{};  // end of the forward that prepared this pass (its backward starts
                                  // later)
  std::vector<TimePoint> bucket_ready;      // per bucket, when its last gradient arrived
  std::vector<TimePoint> bucket_launched;   // per bucket, when its reduction started
  std::vector<TimePoint> bucket_completed;  // per bucket, when its reduction finished
  // Per bucket: its gradients were averaged where they lie (ProcessGroup::allreduce_segments)
  // instead of through the bucket's flat buffer and the comm hook. Happens with the default hook,
  // gradient_as_bucket_view off, contiguous gradients and a group that reduces them where they
  // lie (ProcessGroup::allreduce_segments_in_place: shared memory).
  std::vector<bool> bucket_in_place;
  // Per bucket: the payload bytes its reduction handed to collectives (BucketReduction::
  // bytes_sent, or the bucket's size); and their sum over the pass.
  std::vector<std::size_t> bucket_bytes_sent;
  // The bytes the sparse gradients' reductions contributed (entry counts, indices and values).
  std::size_t sparse_bytes_sent = 0;
  // Every bucket's bytes_sent and sparse_bytes_sent.
  std::size_t bytes_sent = 0;
  TimePoint backward_finished{};  // when autograd finished computing (final callback)
  TimePoint synchronised{};       // when every average was in place
};

// Totals over every synchronised backward pass so far (DistributedDataParallel::logging_data).
// The intervals are PyTorch's (c10d::Logger): compute = prepare (end of forward) to the end of
// autograd, communication = first bucket launched to last bucket completed, overlap = first
// bucket launched to the end of autograd (0 when communication started after it).
struct ReducerStats {
  std::int64_t iterations = 0;  // synchronised backward passes
  std::chrono::nanoseconds backward_compute{0};
  std::chrono::nanoseconds backward_comm{0};
  std::chrono::nanoseconds backward_compute_comm_overlap{0};
  // Walks of the autograd graph for unused parameters: one per synchronised pass with
  // find_unused_parameters, the first only with static_graph.
  std::int64_t unused_parameter_searches = 0;
};

class Reducer {
 public:
  // `parameters` must be distinct leaf tensors that require grad; `names` label them in errors.
  Reducer(std::vector<torch::Tensor> parameters, std::vector<std::string> names,
          std::shared_ptr<ProcessGroup> group, ReducerOptions options);
  ~Reducer();
  Reducer(const Reducer&) = delete;
  Reducer& operator=(const Reducer&) = delete;

  // Compares the module's current trainable parameters (names and tensors, in registration
  // order) with the ones the Reducer was built over: re-attaches the hooks of replaced tensors of
  // the same shape, dtype and device; throws Error for anything else (another parameter set, a
  // changed shape, dtype or device). Local: no collective. Returns how many were re-attached.
  std::size_t check_parameters(const std::vector<torch::Tensor>& parameters,
                               const std::vector<std::string>& names);

  // Moves the hooks to the parameters' current gradient accumulators where those changed while
  // the tensors stayed (libtorch gives a parameter a new accumulator when set_data changes its
  // dtype: DDP's param_dtype does, before and after each pass). Local.
  void follow_gradient_accumulators();

  // True once the first synchronised backward has recorded the order in which gradients became
  // ready: the next training forward must call rebuild_buckets() on every rank.
  bool rebuild_due() const;
  // Rebuilds the buckets in rank 0's recorded order (a collective: a broadcast from rank 0).
  void rebuild_buckets();
  // Call at the end of a forward pass whose gradients will be synchronised, with its outputs:
  // with find_unused_parameters (or static_graph's first pass) walks the autograd graph from them
  // to find the parameters this pass does not use. A backward that reaches the hooks without it
  // is an error (the forward bypassed DistributedDataParallel).
  void prepare_for_backward(const std::vector<torch::Tensor>& outputs);

  // Multiplies the averaged gradients of the next synchronised backward by `scale` (Join with
  // divide_by_initial_world_size = false: world size / ranks still training). 1 = plain average.
  void set_gradient_scale(double scale);

  // For a rank that has run out of data under ddp::Join: makes the collectives of one
  // synchronised backward pass (every bucket through the comm hook with zeros, the unused map)
  // so that the ranks still training can complete theirs. Waits for them, then leaves the
  // averaged gradients in the parameters' .grad as a training rank's backward would (scaled by
  // set_gradient_scale), so that a sharded optimizer can step this rank's shard with them.
  void shadow_backward();

  // Runs at the end of every backward pass that reaches a parameter's hook, synchronised or not
  // (no_sync), after the gradients are delivered: on the autograd thread, outside the Reducer's
  // lock. Empty: nothing. Set it before the first backward.
  void set_end_of_backward(std::function<void()> callback);

  // false = gradients accumulate locally (no_sync); true = the next backward synchronises.
  void set_require_sync(bool require_sync);
  bool require_sync() const;

  // Replaces how buckets are reduced (default allreduce_hook()). Call before the first backward.
  // `name` labels it in logging data and traces.
  void register_comm_hook(CommHook hook, std::string name = "custom");
  std::string comm_hook_name() const;  // "allreduce" (the default) or the registered name

  // Parameter indices per bucket, in launch order.
  std::vector<std::vector<std::size_t>> bucket_assignment() const;
  BackwardTimeline last_timeline() const;
  bool buckets_rebuilt() const;
  // gradient_as_bucket_view on a group whose ranks share one host (ProcessGroup::
  // allocate_shared_buffer): whether the buckets, and so the gradients, live in memory the ranks
  // map into each other, so that each bucket's allreduce reads the peers' buckets where they lie;
  // else why not ("" where the group has no such memory).
  bool buckets_shared() const;
  std::string shared_buckets_why_not() const;
  ReducerStats stats() const;
  // Per bucket, in launch order: its size in bytes.
  std::vector<std::size_t> bucket_sizes_bytes() const;
  // Names of the parameters unused in the last synchronised backward pass, as found by
  // find_unused_parameters or static_graph; empty otherwise.
  std::vector<std::string> unused_parameter_names() const;
  const ReducerOptions& options() const { return options_; }

 private:
  struct Bucket;
  struct Slot {
    std::size_t bucket = 0;
    std::size_t index = 0;  // position within the bucket
  };

  void assign_buckets(const std::vector<std::size_t>& order);
  // The buckets' memory, shared with the host's peers where the group can (see buckets_shared):
  // one buffer for every bucket, each at a cache-line-aligned offset; null otherwise. Collective.
  std::shared_ptr<void> allocate_shared_buckets(const std::vector<std::size_t>& offsets,
                                                std::size_t total_bytes);
  torch::Tensor slot_view(std::size_t param) const;
  bool is_bucket_view(std::size_t param, const torch::Tensor& grad) const;
  void autograd_hook(std::size_t param);
  void mark_ready(std::size_t param, bool has_grad);
  void launch_ready_buckets();
  bool can_reduce_in_place(const torch::Tensor& grad) const;
  void reduce_in_place(Bucket& bucket);
  void launch_through_hook(std::size_t bucket);
  void launch_staged(std::size_t bucket);
  void run_staged(std::size_t bucket) noexcept;  // on the staging thread
  void finish_staging();                         // end of backward: every staged bucket launched
  BucketReduction run_comm_hook(std::size_t bucket, const char* context);
  void throw_if_hook_failed() const;
  GradBucket hook_bucket(std::size_t bucket) const;  // what the comm hook gets for a bucket
  void finalize_backward();
  // The reduced buckets into the parameters' gradients (skipping parameters no rank used when
  // `used_anywhere` is not empty), then the gradient scale.
  void deliver_gradients(const std::vector<std::int32_t>& used_anywhere);
  // The sparse gradients summed over the ranks and averaged, into .grad (skipping parameters no
  // rank used when `used_anywhere` is not empty). `contribute` false: this rank adds nothing (a
  // joined rank's shadow pass). Collective, in parameter order.
  void reduce_sparse_gradients(const std::vector<std::int32_t>& used_anywhere, bool contribute);
  void wait_for_launched_buckets() noexcept;
  void reset_iteration();
  void attach_hook(std::size_t param);
  void queue_end_of_backward();  // at most once per pass
  std::string bucket_phase(std::size_t bucket) const;
  void after_synchronised_pass();
  void record_pass_stats();
  void trace_pass() const;
  void find_unused(const std::vector<torch::Tensor>& outputs);

  std::vector<torch::Tensor> parameters_;
  std::vector<std::string> names_;
  std::shared_ptr<ProcessGroup> group_;
  ReducerOptions options_;
  CommHook comm_hook_;
  std::string comm_hook_name_ = "allreduce";
  bool custom_hook_ = false;  // register_comm_hook was called: buckets go through comm_hook_
  // Set when the comm hook threw: this rank skipped a collective the others made, so every later
  // synchronised pass is refused (it would pair with the wrong collectives).
  std::string hook_failure_;

  std::vector<std::unique_ptr<libtorch_compat::GradReadyHook>> grad_hooks_;  // per parameter

  // Buckets on a device the group cannot read (CUDA on a host group; or staging_for_tests) are
  // reduced through host twins; null otherwise. The staging thread launches them in bucket order.
  std::unique_ptr<detail::DeviceStaging> staging_;
  bool buckets_shared_ = false;
  std::string shared_buckets_why_not_;
  std::unique_ptr<detail::StagingThread> staging_thread_;
  bool staging_failed_ = false;  // staging thread only (read after StagingThread::drain)

  std::vector<Bucket> buckets_;
  std::vector<Slot> slots_;   // per parameter (none for a sparse one)
  std::vector<bool> sparse_;  // per parameter: ReducerOptions::sparse_gradients

  mutable std::mutex mutex_;
  bool require_sync_ = true;
  std::function<void()> end_of_backward_;
  bool end_of_backward_queued_ = false;
  // Per backward pass.
  std::vector<bool> ready_;
  std::vector<bool> used_;  // got a gradient in this pass (find_unused bookkeeping)
  std::size_t next_bucket_ = 0;
  bool callback_queued_ = false;
  bool expect_hooks_ = false;  // prepare_for_backward ran since the last synchronised backward
  double gradient_scale_ = 1.0;
  bool unused_marked_ = false;
  std::vector<std::size_t> unused_;
  bool unused_known_ = false;  // static_graph: unused_ found once
  BackwardTimeline timeline_;
  BackwardTimeline last_timeline_;
  BackwardTimeline::TimePoint prepared_at_{};
  std::vector<std::size_t> last_unused_;  // unused_ of the last synchronised pass
  ReducerStats stats_;
  // Bucket rebuilding.
  std::vector<std::size_t> ready_order_;
  bool record_ready_order_ = true;
  bool rebuild_due_ = false;
  bool rebuilt_ = false;
};

}  // namespace ddp
#pragma GCC visibility pop
