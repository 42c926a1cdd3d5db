// Running one call of the nccl backend: ordering after the caller's stream, the fingerprint check,
// completion by polling under the deadline, errors and poisoning (see nccl_group.h).
#include <algorithm>
#include <functional>
#include <string>
#include <utility>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "comm/nccl/nccl_device_guard.h"
#include "comm/nccl/nccl_errors.h"
#include "comm/nccl/nccl_group.h"
#include "comm/nccl/poll_pacer.h"
#include "ddp/error.h"

namespace ddp::comm::nccl {

ncclDataType_t nccl_dtype(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return ncclFloat32;
    case DType::kFloat64:
      return ncclFloat64;
    case DType::kFloat16:
      return ncclFloat16;
    case DType::kBFloat16:
      return ncclBfloat16;
    case DType::kInt8:
      return ncclInt8;
    case DType::kUInt8:
      return ncclUint8;
    case DType::kInt32:
      return ncclInt32;
    case DType::kInt64:
      return ncclInt64;
  }
  throw ConfigError(
      fmt::format("the nccl backend has no NCCL data type for dtype {}", static_cast<int>(dtype)));
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return ncclSum;
    case ReduceOp::kAvg:
      return ncclAvg;  // NCCL divides itself (integers: truncated, as the other backends)
    case ReduceOp::kMin:
      return ncclMin;
    case ReduceOp::kMax:
      return ncclMax;
    case ReduceOp::kProduct:
      return ncclProd;
    case ReduceOp::kBand:
    case ReduceOp::kBor:
    case ReduceOp::kBxor:
      throw ConfigError(fmt::format(
          "the nccl backend cannot reduce with {}: NCCL has no bitwise reductions; reduce "
          "integers bitwise on a CPU group (ring, shm or mpi)",
          to_string(op)));
  }
  throw ConfigError(
      fmt::format("the nccl backend has no NCCL reduction for reduce op {}", static_cast<int>(op)));
}

void DeviceBuffer::reset() {
  if (data == nullptr) return;
  if (pinned_host) {
    lib->FreeHost(data);
  } else {
    lib->Free(data);
  }
  data = nullptr;
  bytes = 0;
}

CommError NcclProcessGroup::error(const Call& call, CommErrorKind kind,
                                  const std::string& what) const {
  const std::string description = call.description();
  return CommError(kind,
                   fmt::format("rank {} of group '{}' (nccl backend, CUDA device {}): {} {}",
                               rank(), name(), device_, description, what),
                   name(), description, call.header.sequence, -1);
}

void NcclProcessGroup::throw_if_failed(const Call& call, const NcclComm::Result& result,
                                       const char* what, NcclComm& comm) const {
  switch (result.outcome) {
    case NcclComm::Outcome::kReady:
      return;
    case NcclComm::Outcome::kTimedOut:
      comm.abort();
      throw error(call, CommErrorKind::kTimeout,
                  fmt::format("did not complete within {} ms ({}); the NCCL communicator was "
                              "aborted: a peer is stuck, stopped, or never issued the call",
                              call.timeout.count(), what));
    case NcclComm::Outcome::kAborted:
      throw error(call, CommErrorKind::kAborted,
                  "cannot run: the group's NCCL communicator was aborted after an earlier failure");
    case NcclComm::Outcome::kFailed:
      break;
  }
  throw error(call, kind_of(result.code),
              fmt::format("{} {}", what,
                          describe_nccl_failure(result.code, lib_.GetErrorString(result.code),
                                                result.last_error.c_str())));
}

void NcclProcessGroup::check_cuda(const Call& call, cudaError_t rc, const char* what) const {
  if (rc == cudaSuccess) return;
  throw error(call, kind_of(rc),
              describe_cuda_failure(what, rc, lib_.GetErrorName(rc), lib_.GetErrorStringCuda(rc)));
}

// A host buffer handed to NCCL would fault inside its kernel (and take the CUDA context with
// it): refuse it by name before anything is queued. Pageable host memory is "unregistered";
// pinned or managed memory the device can address is let through, as NCCL allows it.
void NcclProcessGroup::check_device_memory(const void* buffer, const char* which,
                                           const std::function<std::string()>& call) const {
  if (buffer == nullptr) return;
  cudaPointerAttributes attributes{};
  const cudaError_t rc = lib_.PointerGetAttributes(&attributes, buffer);
  if (rc != cudaSuccess) lib_.GetLastErrorCuda();  // clear the error an unknown pointer leaves
  if (rc == cudaSuccess && attributes.type != cudaMemoryTypeUnregistered) return;
  throw ConfigError(fmt::format(
      "rank {} of group '{}' (nccl backend): {}: the {} buffer {} is host memory, and NCCL reads "
      "and writes device memory only; pass a buffer on CUDA device {} (a CUDA tensor), or use a "
      "host group (ring, mpi) for host buffers",
      rank(), name(), call(), which, buffer, device_));
}

// The event of the caller's stream, recorded now, on the caller's thread: the call must see what
// the caller queued before it, not what it queues after.
void NcclProcessGroup::prepare_call(Call& call, const CallOptions& options) {
  DeviceGuard guard(lib_, device_);
  const auto described = [&call] { return call.description(); };
  check_device_memory(call.send, "send", described);
  check_device_memory(call.recv, "receive", described);
  for (const auto& segment : call.segments)
    check_device_memory(segment.data, "segment", described);
  cudaEvent_t event = nullptr;
  check_cuda(call, events_->acquire(&event),
             "cudaEventCreateWithFlags (the caller's stream event)");
  const cudaError_t recorded =
      lib_.EventRecord(event, static_cast<cudaStream_t>(options.cuda_stream));
  if (recorded != cudaSuccess) {
    events_->discard(event);  // not handed out again
    check_cuda(call, recorded, "cudaEventRecord on CallOptions::cuda_stream");
  }
  call.backend_state = events_->hold(event);  // back to events_ once the call is done with it
  call.cuda_done_event = options.cuda_done_event;
}

void NcclProcessGroup::wait_for_event(const Call& call, cudaEvent_t event, NcclComm& comm,
                                      net::Deadline deadline, const char* what) {
  PollPacer pacer;
  for (;;) {
    const cudaError_t rc = lib_.EventQuery(event);
    if (rc == cudaSuccess) return;
    if (rc != cudaErrorNotReady) {
      comm.abort();  // the device failed under the call: its kernels cannot be trusted to end
      check_cuda(call, rc, "cudaEventQuery (the call's completion)");
    }
    // A peer's failure shows as the communicator's asynchronous error while this event waits.
    throw_if_failed(call, comm.poll(), what, comm);
    if (net::Clock::now() >= deadline) {
      throw_if_failed(call, {NcclComm::Outcome::kTimedOut, ncclInProgress, {}}, what, comm);
    }
    pacer.pause();
  }
}

void NcclProcessGroup::check_fingerprints(Call& call, net::Deadline deadline) {
  constexpr std::size_t kHeader = sizeof(OpHeader);
  auto* host = static_cast<OpHeader*>(check_host_.data);
  auto* device = static_cast<std::byte*>(check_device_.data);
  host[0] = call.header;
  check_cuda(call, lib_.MemcpyAsync(device, host, kHeader, cudaMemcpyHostToDevice, stream_),
             "cudaMemcpyAsync (the fingerprint to the device)");
  const auto result = comm_->run(
      [&](ncclComm_t comm) {
        return lib_.AllGather(device, device + kHeader, kHeader, ncclUint8, comm, stream_);
      },
      deadline);
  throw_if_failed(call, result, "in its fingerprint check", *comm_);
  check_cuda(
      call,
      lib_.MemcpyAsync(host + 1, device + kHeader, kHeader * static_cast<std::size_t>(size()),
                       cudaMemcpyDeviceToHost, stream_),
      "cudaMemcpyAsync (the fingerprints to the host)");
  check_cuda(call, lib_.EventRecord(check_done_, stream_), "cudaEventRecord");
  wait_for_event(call, check_done_, *comm_, deadline, "in its fingerprint check");
  // Group the ranks by the call they issued: "rank 1 called broadcast(...) #3".
  std::vector<std::pair<std::string, std::vector<int>>> calls;
  int first_other = -1;
  for (int r = 0; r < size(); ++r) {
    const OpHeader& theirs = host[1 + r];
    if (theirs == call.header) continue;
    if (first_other < 0) first_other = r;
    const std::string described = describe(theirs);
    auto it = std::find_if(calls.begin(), calls.end(),
                           [&](const auto& c) { return c.first == described; });
    if (it == calls.end()) {
      calls.push_back({described, {r}});
    } else {
      it->second.push_back(r);
    }
  }
  if (calls.empty()) return;
  std::vector<std::string> others;
  for (const auto& [described, ranks] : calls) {
    others.push_back(fmt::format("rank{} {} called {}", ranks.size() > 1 ? "s" : "",
                                 fmt::join(ranks, ", "), described));
  }
  const std::string description = call.description();
  throw CommError(CommErrorKind::kMismatch,
                  fmt::format("collective mismatch in group '{}' (nccl backend): rank {} called {} "
                              "but {}; every rank must issue the same collectives in the same "
                              "order with the same count, dtype, op and root",
                              name(), rank(), description, fmt::join(others, " and ")),
                  name(), description, call.header.sequence, first_other);
}

void NcclProcessGroup::run_call(Call& call, net::Deadline deadline) {
  DeviceGuard guard(lib_, device_);
  if (call.backend_state) {
    auto* event = static_cast<CUevent_st*>(call.backend_state.get());
    check_cuda(call, lib_.StreamWaitEvent(stream_, event, 0),
               "cudaStreamWaitEvent (ordering after the caller's stream)");
  }
  // A group of one has nobody to disagree with.
  if (size() > 1) check_fingerprints(call, deadline);
  if (call.kind == Collective::kBarrier) return;  // the fingerprint allgather was the barrier
  std::size_t total = call.count;
  if (!call.segments.empty()) {
    total = 0;
    for (const auto& segment : call.segments)
      total += segment.count;
  }
  if (total == 0) return;
  const auto result =
      comm_->run([&](ncclComm_t comm) { return enqueue_collective(call, comm); }, deadline);
  throw_if_failed(call, result, "when it was enqueued", *comm_);
  if (call.cuda_done_event != nullptr) {
    complete_on_stream(call, static_cast<cudaEvent_t>(call.cuda_done_event), deadline);
    return;
  }
  check_cuda(call, lib_.EventRecord(call_done_, stream_), "cudaEventRecord");
  wait_for_event(call, call_done_, *comm_, deadline, "on the device");
}

void NcclProcessGroup::complete_on_stream(const Call& call, cudaEvent_t done_event,
                                          net::Deadline deadline) {
  check_cuda(call, lib_.EventRecord(done_event, stream_),
             "cudaEventRecord of CallOptions::cuda_done_event");
  cudaEvent_t watched = nullptr;
  check_cuda(call, events_->acquire(&watched),
             "cudaEventCreateWithFlags (a stream-ordered call's watched event)");
  const cudaError_t recorded = lib_.EventRecord(watched, stream_);
  if (recorded != cudaSuccess) {
    events_->discard(watched);
    check_cuda(call, recorded, "cudaEventRecord (a stream-ordered call's watched event)");
  }
  // The watcher's thread polls the event and the communicator; a failure there names the call
  // as the executor would have ("... did not complete within ...").
  watcher_->watch(
      {.poll =
           [this, watched](std::string& why) {
             DeviceGuard guard(lib_, device_);  // the watcher's thread
             const cudaError_t rc = lib_.EventQuery(watched);
             if (rc == cudaSuccess) return CompletionWatcher::Status::kDone;
             if (rc != cudaErrorNotReady) {
               lib_.GetLastErrorCuda();
               why = describe_cuda_failure("cudaEventQuery (the call's completion on the device)",
                                           rc, lib_.GetErrorName(rc), lib_.GetErrorStringCuda(rc));
               return CompletionWatcher::Status::kFailed;
             }
             const NcclComm::Result state = comm_->poll();
             if (state.outcome == NcclComm::Outcome::kReady) {
               return CompletionWatcher::Status::kPending;
             }
             why = state.outcome == NcclComm::Outcome::kAborted
                       ? std::string("the group's NCCL communicator was aborted")
                       : describe_nccl_failure(state.code, lib_.GetErrorString(state.code),
                                               state.last_error.c_str());
             return CompletionWatcher::Status::kFailed;
           },
       .deadline = deadline,
       .description = call.description(),
       .release = [events = events_, watched] { events->release(watched); }});
}

void NcclProcessGroup::on_watched_failure(const CompletionWatcher::Failure& failure) {
  // Not a poisoned group that lives on: the results went out as done (completion_watcher.h).
  abort_after_watched_failure(
      failure,
      fmt::format("rank {} of group '{}' (nccl backend, CUDA device {})", rank(), name(), device_));
}

// The first failure: abort both communicators (every kernel of this group exits, every later
// call fails at once) and fail the point-to-point operations with the same error.
void NcclProcessGroup::on_poison(const std::string& reason) noexcept {
  static_cast<void>(reason);
  if (comm_) comm_->abort();
  if (p2p_comm_) p2p_comm_->abort();
  if (const auto first = queue().poison_error()) p2p_queue_.poison(first);
}

}  // namespace ddp::comm::nccl
