// The nccl backend's process group (internal; one concept per file):
//   nccl_library.h        libnccl and libcudart loaded with dlopen (the function table)
//   nccl_errors.h         NCCL and CUDA codes as CommError kinds
//   nccl_unique_id.h      the communicator's id through the rendezvous store
//   nccl_comm.h           one non-blocking communicator: settle, poll, abort
//   nccl_group.h          this class
//   nccl_process_group.cc running a call: order after the caller's stream, the fingerprint
//                         check, completion by event polling under the deadline, poisoning
//   nccl_collectives.cc   each collective as NCCL calls on the communication stream
//   nccl_group_create.cc  make_nccl_process_group, subgroups, point to point, the uneven seams
//
// How a call runs (on the queue's executor, one at a time, in issue order):
//  1. the communication stream waits on the event prepare_call() recorded on the caller's
//     CallOptions::cuda_stream when the call was made (so the call sees what the caller queued);
//  2. the fingerprint check: every rank's 32-byte OpHeader is allgathered through a device
//     scratch buffer and compared on the host; a difference is a kMismatch CommError naming each
//     rank's call, and no data moves (a mismatched NCCL call could hang or write garbage). This
//     costs one small allgather and a host round trip per call; it doubles as the barrier.
//  3. the data: NCCL calls on the communication stream (nccl_collectives.cc), then an event;
//  4. completion: cudaEventQuery and ncclCommGetAsyncError are polled until the event is done, the
//     communicator failed (a peer's failure shows here), or the deadline passed, in which case the
//     communicator is aborted (its kernels exit) and a kTimeout CommError names the call. A
//     stream-ordered call (CallOptions::cuda_done_event) records the caller's event instead and
//     returns: its Work completes now, and the watcher (completion_watcher.h) follows it on the
//     device under the same deadline; a failure there ends the process (its results went out).
// The first failure poisons the queue; on_poison aborts both communicators, so the point-to-point
// operations in flight fail too, and nothing of this group can wait on the device any more.
#pragma once

#include <atomic>
#include <cstddef>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "comm/group_front.h"
#include "comm/nccl/completion_watcher.h"
#include "comm/nccl/cuda_event_pool.h"
#include "comm/nccl/nccl_comm.h"
#include "comm/nccl/nccl_library.h"
#include "ddp/comm/nccl_process_group.h"
#include "ddp/store/store.h"

namespace ddp::comm::nccl {

// The data type and reduction of a call in NCCL's terms; ConfigError naming the ones NCCL lacks.
ncclDataType_t nccl_dtype(DType dtype);
ncclRedOp_t nccl_op(ReduceOp op);

// Device memory owned by a group (cudaFree on release, on the group's device).
struct DeviceBuffer {
  const NcclLibrary* lib = nullptr;
  void* data = nullptr;
  std::size_t bytes = 0;
  bool pinned_host = false;  // cudaMallocHost instead of cudaMalloc
  DeviceBuffer() = default;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { reset(); }
  void reset();
};

class NcclProcessGroup final : public GroupFront,
                               public std::enable_shared_from_this<NcclProcessGroup> {
 public:
  // `options.timeout` is resolved (> 0); `device` is current on the calling thread.
  NcclProcessGroup(std::shared_ptr<Store> store, const NcclLibrary& lib, int device, int rank,
                   int size, NcclOptions options);
  ~NcclProcessGroup() override;
  // Shares the id, creates the communicators, streams, events and scratch; blocks until every
  // rank joined or the deadline passed (CommError kTimeout; the half-made communicator aborted).
  void connect();
  void start() {
    start_queue(weak_from_this());
    p2p_queue_.start(weak_from_this());
  }

  std::string_view backend() const override { return "nccl"; }
  MemorySpace memory_space() const override { return MemorySpace::kCuda; }
  bool completes_on_stream() const override { return true; }
  int cuda_device() const override { return device_; }
  // The front queues allreduce_segments as one call; run_call reduces each piece where it lies
  // (one NCCL allreduce per piece, grouped), since the portable default packs into host memory.
  bool allreduce_segments_in_place() const override { return true; }
  int device() const { return device_; }

 protected:
  void prepare_call(Call& call, const CallOptions& options) override;
  // Throws ConfigError when `buffer` (non-null) is host memory NCCL cannot address; `call`
  // describes the operation for the message (formatted only then).
  void check_device_memory(const void* buffer, const char* which,
                           const std::function<std::string()>& call) const;
  void run_call(Call& call, net::Deadline deadline) override;
  void on_poison(const std::string& reason) noexcept override;
  std::shared_ptr<Work> post_send(const void* buf, std::size_t count, DType dtype, int dst, int tag,
                                  CallOptions options) override;
  std::shared_ptr<Work> post_recv(void* buf, std::size_t count, DType dtype, int src, int tag,
                                  CallOptions options) override;
  std::shared_ptr<ProcessGroup> make_subgroup(std::vector<int> ranks) override;
  // The uneven collectives' seams (process_group.h): the counts travel through device scratch,
  // the padding lives in device memory and is copied on the caller's stream.
  std::vector<std::int64_t> exchange_words(const std::vector<std::int64_t>& mine,
                                           CallOptions options) override;
  std::shared_ptr<void> make_scratch(std::size_t bytes) override;
  BlockCopier block_copier(const CallOptions& options) override;

 private:
  class P2pRunner;
  friend class P2pRunner;

  CommError error(const Call& call, CommErrorKind kind, const std::string& what) const;
  // Throws the CommError of a communicator result that is not ok (kind by nccl_errors.h).
  void throw_if_failed(const Call& call, const NcclComm::Result& result, const char* what,
                       NcclComm& comm) const;
  // Throws the CommError of a failed CUDA runtime call.
  void check_cuda(const Call& call, cudaError_t rc, const char* what) const;
  // Polls `event` (recorded on a stream after the call's NCCL work) and `comm`'s asynchronous
  // error until the event completed; aborts `comm` and throws at the deadline or on an error.
  void wait_for_event(const Call& call, cudaEvent_t event, NcclComm& comm, net::Deadline deadline,
                      const char* what);
  // Step 2 above: allgathers the headers and throws the mismatch naming each rank's call.
  void check_fingerprints(Call& call, net::Deadline deadline);
  // Step 3: enqueues the call's NCCL work on stream_ (nccl_collectives.cc).
  ncclResult_t enqueue_collective(const Call& call, ncclComm_t comm);
  // Device scratch of at least `bytes` for the executor (alltoall/gather staging); grows.
  void* executor_scratch(std::size_t bytes, const Call& call);
  // Step 4 of a stream-ordered call: records the caller's done event and a watched one of
  // events_ on stream_, and hands the watched one to watcher_.
  void complete_on_stream(const Call& call, cudaEvent_t done_event, net::Deadline deadline);
  // The watcher found a stream-ordered call failed or late: ends the process (its thread).
  void on_watched_failure(const CompletionWatcher::Failure& failure);

  std::shared_ptr<Store> store_;
  const NcclLibrary& lib_;
  const int device_;
  const NcclOptions options_;
  std::unique_ptr<NcclComm> comm_;      // collectives
  std::unique_ptr<NcclComm> p2p_comm_;  // send/recv: never ordered behind a collective's kernel
  cudaStream_t stream_ = nullptr;       // the communication stream of the collectives
  cudaStream_t p2p_stream_ = nullptr;
  cudaEvent_t check_done_ = nullptr;  // executor only
  cudaEvent_t call_done_ = nullptr;   // executor only
  DeviceBuffer check_device_;         // (size + 1) headers: this rank's, then every rank's
  DeviceBuffer check_host_;           // pinned twin of check_device_
  DeviceBuffer scratch_;              // executor only
  int subgroups_created_ = 0;
  std::mutex new_group_mutex_;
  // The events of the caller's streams (prepare_call) and of the stream-ordered calls the watcher
  // follows, reused (created on demand; calls hold it until they give their event back).
  std::shared_ptr<CudaEventPool> events_;
  std::unique_ptr<CompletionWatcher> watcher_;  // made in the constructor's body

  // Point to point: its own queue (issue order, worker, deadlines, poisoning) on p2p_comm_.
  std::unique_ptr<P2pRunner> p2p_runner_;
  OpQueue p2p_queue_;
  std::mutex p2p_mutex_;  // the per-peer sequence numbers
  std::vector<std::uint64_t> sends_to_;
  std::vector<std::uint64_t> recvs_from_;
};

}  // namespace ddp::comm::nccl
