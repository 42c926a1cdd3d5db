// Private to the Reducer's sources (reducer*.cc): its gradient bucket, and the clock of its
// backward timeline.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "ddp/torch/ddp/reducer.h"
#include "torch/core/device_staging.h"

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

namespace detail {

// BackwardTimeline's clock.
using Clock = std::chrono::steady_clock;

}  // namespace detail
}  // namespace ddp
