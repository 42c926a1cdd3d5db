// wrap_c10d: a ddp::ProcessGroup over a libtorch c10d group, for C++ code that already holds one
// (gloo, built over a c10d FileStore or TCPStore) and wants ddp's DistributedDataParallel, ZeRO,
// SyncBatchNorm or Join on it.
//
//   auto store = c10::make_intrusive<c10d::FileStore>(path, world_size);
//   auto gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, world_size, gloo_options);
//   std::shared_ptr<ddp::ProcessGroup> pg = ddp::wrap_c10d(gloo, {.name = "gloo", .timeout = 60s});
//   auto model = ddp::DistributedDataParallel(std::make_shared<Net>(), pg);
//
// libtorch 2.x: pass a c10d::Backend (ProcessGroupGloo is one), or a c10d::ProcessGroup, whose
// CPU backend is taken. libtorch 1.13 has no backends behind its groups (ProcessGroupGloo derives
// from c10d::ProcessGroup): pass the group.
//
// The group runs behind ddp's one front (ddp/comm/external_backend.h), as ring and mpi do: the same
// argument checks, call record and sequence numbers, queue, poisoning and errors by kind. Each
// call hands the caller's buffers to c10d as tensors made with torch::from_blob (no copy) and
// waits for c10d's Work within the call's deadline, which it also passes to c10d as the
// operation's own timeout, so c10d gives the buffers up by then (2.x; 1.13's gloo keeps its
// group-wide ProcessGroupGloo::Options::timeout: set it no longer than ddp's). ReduceOp::kAvg is a
// sum divided by the group size (c10d's gloo has no average); reduce_scatter is an allreduce plus a
// copy of this rank's block where c10d's backend refuses reduce_scatter (gloo in 1.13). The uneven
// collectives are the front's (padded to the largest block).
//
// Errors: ConfigError from wrap_c10d for a null group; from a call, before anything is queued,
// for a bad argument or a dtype the backend cannot reduce (naming the operation and the backend);
// from new_group when options.new_group is not set (a c10d group cannot split itself without a
// store). CommError from Work::wait: kTimeout when the deadline passed, kTransport when c10d
// reported a failure (its message included). Ranks that issue different collectives are not
// named as with ring and mpi: c10d's gloo sends no call header to compare.
//
// Threads: as any ProcessGroup (process_group.h). The c10d group must not be used directly while
// the wrapper has calls in flight (c10d would see two interleaved streams of collectives).
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "ddp/comm/process_group.h"

namespace c10d {
class Backend;
}  // namespace c10d

// Exported by ddp's shared libraries, which hide the rest (src/CMakeLists.txt).
#pragma GCC visibility push(default)
namespace ddp {

struct C10dWrapOptions {
  // The group's name in messages and the flight recorder.
  std::string name = "c10d";
  // A call's deadline; 0: ddp's default (ddp/timeouts.h).
  std::chrono::milliseconds timeout{0};
  // new_group(ranks) on a member: builds the subgroup of those ranks (numbered as in this group)
  // with libtorch, e.g. a ProcessGroupGloo over a c10d::PrefixStore of the job's store, and
  // returns it wrapped. Called on members only. Unset: new_group throws ConfigError.
  std::function<std::shared_ptr<ProcessGroup>(const std::vector<int>& ranks)> new_group;
};

// `group`: a c10d::ProcessGroup or (libtorch 2.x) a c10d::Backend, or a class derived from
// either (ProcessGroupGloo). Throws ConfigError for a null group, a 2.x group without a CPU
// backend, or a c10d::Backend with libtorch 1.13 (pass the c10d::ProcessGroup there).
template <class Group>
std::shared_ptr<ProcessGroup> wrap_c10d(const c10::intrusive_ptr<Group>& group,
                                        C10dWrapOptions options = {});

// The two kinds wrap_c10d takes (intrusive_ptr converts to either, so overloads would be
// ambiguous for a ProcessGroupGloo).
std::shared_ptr<ProcessGroup> wrap_c10d_group(c10::intrusive_ptr<c10d::ProcessGroup> group,
                                              C10dWrapOptions options);
std::shared_ptr<ProcessGroup> wrap_c10d_backend(c10::intrusive_ptr<c10d::Backend> backend,
                                                C10dWrapOptions options);

template <class Group>
std::shared_ptr<ProcessGroup> wrap_c10d(const c10::intrusive_ptr<Group>& group,
                                        C10dWrapOptions options) {
  if constexpr (std::is_base_of_v<c10d::ProcessGroup, Group>) {
    return wrap_c10d_group(group, std::move(options));
  } else {
    return wrap_c10d_backend(group, std::move(options));
  }
}

}  // namespace ddp
#pragma GCC visibility pop
