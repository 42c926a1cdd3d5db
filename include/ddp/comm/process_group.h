// ProcessGroup: a fixed set of ranks and the collectives they run together on raw buffers.
//
// Every member issues the same collectives in the same order; each call returns a Work at once
// and the operation runs asynchronously, in issue order, on the group's worker thread. Calls may
// come from any thread (the group serialises them; the order in which they were issued is the
// order in which they run). Buffers are (pointer, element count, DType) and must stay valid and
// untouched until the Work completes; send == recv means in place where a collective allows it.
//
//   std::shared_ptr<ddp::ProcessGroup> pg = ddp::make_ring_process_group(store, rank, size);
//   pg->allreduce(grads.data(), grads.size(), ddp::DType::kFloat32, ddp::ReduceOp::kAvg)->wait();
//   pg->broadcast(params.data(), params.size(), ddp::DType::kFloat32, /*root=*/0)->wait();
//
// Errors: ConfigError at once for bad arguments (null buffer with a non-zero count, root or peer
// outside the group, unsorted ranks for new_group). CommError from Work::wait when the operation
// fails: peer gone, deadline passed, or ranks issued different collectives (the message names
// both calls). After the first CommError of a collective the group is poisoned: every pending and
// later call fails at once with that error. Point to point: see send/recv below.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "ddp/comm/comm_error.h"
#include "ddp/comm/types.h"
#include "ddp/comm/work.h"

// Exported by ddp's shared libraries, which hide the rest (src/CMakeLists.txt).
#pragma GCC visibility push(default)
namespace ddp {
namespace comm {
class GroupFront;
}

struct CallOptions {
  // Deadline of this call, counted from when it starts to run (send/recv: from the call). 0 = the
  // group's timeout.
  std::chrono::milliseconds timeout{0};
  // Returns only once the operation has completed, as MPI's blocking calls and PyTorch's
  // async_op=False do: the call throws the operation's error itself, and the Work it returns is
  // already complete (one Work shared by such calls: it takes no result). On an idle group the
  // operation runs on the calling thread without a Work of its own or a lock round trip more; on
  // a busy one it is queued behind the others and waited for. Collectives only (not send/recv).
  bool blocking = false;
  // For a group whose buffers are device memory (memory_space() == MemorySpace::kCuda): the CUDA
  // stream (a cudaStream_t, opaque here) whose work queued so far the call must follow, captured
  // when the call is made. nullptr = the device's default stream. Host groups ignore it.
  void* cuda_stream = nullptr;
  // Stream order instead of host completion, for a group whose buffers are device memory (a
  // cudaEvent_t the caller owns, opaque here; host groups ignore it): the Work completes once the
  // call is queued on the device, and the group records this event on its stream right after the
  // call, so a stream that waits on it (cudaStreamWaitEvent) sees the results, as with PyTorch's
  // work.wait() on NCCL. Only where completes_on_stream() says so. The host never waits for the
  // device. The group's watchdog then follows the call on the device: if it fails or outlives its
  // deadline there, the process ends with a message naming the call (its results were handed out
  // as done and are wrong; nothing may go on with them), as PyTorch's NCCL watchdog does.
  // Collectives only; DistributedDataParallel uses it for its buckets.
  void* cuda_done_event = nullptr;
};

// Where the buffers a group's calls name must live.
enum class MemorySpace : std::uint8_t {
  kHost,  // ring, mpi: host memory (a CUDA tensor is staged through a host twin by the torch layer)
  kCuda,  // nccl: device memory on the CUDA device this process selected
};

// One piece of a buffer made of several (see ProcessGroup::allreduce_segments): `count` elements
// at `data`.
struct BufferSegment {
  void* data = nullptr;
  std::size_t count = 0;
};

class ProcessGroup {
 public:
  ProcessGroup(int rank, int size);
  ProcessGroup(const ProcessGroup&) = delete;
  ProcessGroup& operator=(const ProcessGroup&) = delete;
  // Runs the operations still queued, then closes the connections.
  virtual ~ProcessGroup() = default;

  int rank() const { return rank_; }
  int size() const { return size_; }
  // The rank of each of this group's ranks, in order, in the group at the top of the new_group
  // chain it came from (the one init_process_group or a make_*_process_group made: "the world";
  // PyTorch's get_process_group_ranks). 0..size()-1 for a group that is not a subgroup.
  const std::vector<int>& world_ranks() const { return world_ranks_; }
  virtual std::string_view backend() const = 0;
  // Where the buffers of this group's calls live (see MemorySpace). Host by default.
  virtual MemorySpace memory_space() const { return MemorySpace::kHost; }
  // Whether this group honours CallOptions::cuda_done_event (nccl does). A group that does not
  // ignores it, and its callers wait for the Work as usual; false by default.
  virtual bool completes_on_stream() const { return false; }
  // For a CUDA group: the index of the CUDA device whose memory its calls take; -1 when the group
  // does not say (the caller's current device) and for host groups.
  virtual int cuda_device() const { return -1; }
  // This rank's index among the ranks of this group on the caller's host (0..local_size()-1, in
  // rank order), and how many ranks of this group that host has. Backends that know their
  // topology override these; the default throws ConfigError.
  virtual int local_rank() const;
  virtual int local_size() const;

  // recv[i] = op over ranks of send[i], on every rank.
  virtual std::shared_ptr<Work> allreduce(const void* send, void* recv, std::size_t count,
                                          DType dtype, ReduceOp op, CallOptions options = {}) = 0;
  std::shared_ptr<Work> allreduce(void* buf, std::size_t count, DType dtype, ReduceOp op,
                                  CallOptions options = {}) {
    return allreduce(buf, buf, count, dtype, op, options);
  }

  // In-place allreduce of the concatenation of `segments` (elements of `dtype`): the same
  // collective as allreduce() of their total count, so ranks may mix the two calls. A backend that
  // can read and write the pieces where they lie (ring over shared memory) does so; the others
  // pack them into a temporary buffer and unpack it when the operation completes (before wait()
  // returns). The pieces must not overlap and must stay valid until the Work completes.
  virtual std::shared_ptr<Work> allreduce_segments(std::vector<BufferSegment> segments, DType dtype,
                                                   ReduceOp op, CallOptions options = {});
  // Whether allreduce_segments reduces the pieces where they lie (ring over shared memory). When
  // it does not, it packs them into a temporary buffer per call: a caller that owns a flat buffer
  // (DistributedDataParallel's bucket) copies into that and calls allreduce instead.
  virtual bool allreduce_segments_in_place() const { return false; }

  // Host memory that this group's allreduce need not copy (zeroed; freed when the last owner lets
  // go). Where every rank of the group is on one host (the ring backend over shared memory) the
  // ranks map each other's buffers, and an in-place allreduce of a range of it, called by every
  // rank at the same offset, reduces straight from the peers' copies and writes the result into
  // all of them. Collective: every rank calls it with the same `bytes`, in the same order as its
  // collectives, and it waits for them. Null on every rank where the group cannot: `*why_not`
  // (when given) is then empty if the group has no such memory (another backend, TCP, several
  // hosts), else names the rank that could not and why (memory, access to a peer's /proc,
  // DDP_SHM_SHARED_BUFFERS=0), for a log line. Ranks asking for different sizes: ConfigError on
  // every rank.
  virtual std::shared_ptr<void> allocate_shared_buffer(std::size_t bytes,
                                                       std::string* why_not = nullptr);

  // buf on every rank = buf on `root`.
  virtual std::shared_ptr<Work> broadcast(void* buf, std::size_t count, DType dtype, int root,
                                          CallOptions options = {}) = 0;

  // recv on `root` = op over ranks of send; `recv` is used at the root only (may be null
  // elsewhere).
  virtual std::shared_ptr<Work> reduce(const void* send, void* recv, std::size_t count, DType dtype,
                                       ReduceOp op, int root, CallOptions options = {}) = 0;

  // recv[r * count_per_rank ...] = send of rank r, on every rank. recv holds size() blocks.
  virtual std::shared_ptr<Work> allgather(const void* send, void* recv, std::size_t count_per_rank,
                                          DType dtype, CallOptions options = {}) = 0;

  // Like allgather, but only `root` receives (recv may be null elsewhere).
  virtual std::shared_ptr<Work> gather(const void* send, void* recv, std::size_t count_per_rank,
                                       DType dtype, int root, CallOptions options = {}) = 0;

  // Rank r receives block r of `root`'s send (send may be null elsewhere).
  virtual std::shared_ptr<Work> scatter(const void* send, void* recv, std::size_t count_per_rank,
                                        DType dtype, int root, CallOptions options = {}) = 0;

  // Rank r receives block r of the reduction of every rank's send (size() blocks).
  virtual std::shared_ptr<Work> reduce_scatter(const void* send, void* recv,
                                               std::size_t count_per_rank, DType dtype, ReduceOp op,
                                               CallOptions options = {}) = 0;

  // recv block j on rank r = send block r of rank j.
  virtual std::shared_ptr<Work> alltoall(const void* send, void* recv, std::size_t count_per_rank,
                                         DType dtype, CallOptions options = {}) = 0;

  // Uneven sizes. Blocks are contiguous in rank order (rank r's block starts after the blocks of
  // ranks 0..r-1); a count may be 0. The default implementations (process_group.cc) first exchange
  // every rank's counts in a small allgather that the caller waits for (so the call returns once
  // the group's earlier operations have run; do not call them from a Work callback), check them,
  // and then run the equal-size collective on blocks padded to the largest count, asynchronously.
  // Counts that disagree between ranks are a ConfigError thrown by the call on every rank, naming
  // the ranks and counts; nothing else is issued then. A backend may override them natively with
  // the same contract.
  //
  // recv = the blocks of every rank, rank r's holding recv_counts[r] elements (recv_counts has
  // size() entries, the same on every rank); send holds send_count == recv_counts[rank()].
  virtual std::shared_ptr<Work> allgather_v(const void* send, std::size_t send_count, void* recv,
                                            std::vector<std::size_t> recv_counts, DType dtype,
                                            CallOptions options = {});
  // Rank r sends send_counts[j] elements (its j-th block) to rank j and receives recv_counts[j]
  // elements from rank j into its j-th recv block. recv_counts[j] on rank r must equal
  // send_counts[r] on rank j.
  virtual std::shared_ptr<Work> alltoall_v(const void* send, std::vector<std::size_t> send_counts,
                                           void* recv, std::vector<std::size_t> recv_counts,
                                           DType dtype, CallOptions options = {});
  // send holds sum(recv_counts) elements on every rank; rank r receives block r (recv_counts[r]
  // elements) of their reduction. recv_counts is the same on every rank.
  virtual std::shared_ptr<Work> reduce_scatter_v(const void* send, void* recv,
                                                 std::vector<std::size_t> recv_counts, DType dtype,
                                                 ReduceOp op, CallOptions options = {});

  // Completes once every rank has called it.
  virtual std::shared_ptr<Work> barrier(CallOptions options = {}) = 0;

  // Point to point, as MPI: a recv from `src` with `tag` matches the earliest send from `src` to
  // this rank with that tag that no earlier recv matched (sends from one rank with one tag match
  // in posting order; other tags do not hold it up). The two must agree on count and dtype, else
  // both fail with a CommError naming both calls (the receive buffer is left as it was). Sends and
  // receives progress independently of each other and of the collectives: they are not ordered
  // against collectives (a recv posted before an allreduce may complete after it and does not
  // hold it up), and a cycle in which every rank posts its send before its recv completes at any
  // size. A send completes once its bytes are handed to the network (small ones at once, larger
  // ones once the receiver has posted its recv); a recv once its buffer is filled. The deadline
  // counts from the call. Ring backend: a p2p timeout or failure fails the point-to-point
  // operations with that peer (and shuts that connection) but does not poison the collectives;
  // a collective's failure fails pending sends and receives too.
  virtual std::shared_ptr<Work> send(const void* buf, std::size_t count, DType dtype, int dst,
                                     int tag = 0, CallOptions options = {}) = 0;
  virtual std::shared_ptr<Work> recv(void* buf, std::size_t count, DType dtype, int src,
                                     int tag = 0, CallOptions options = {}) = 0;
  // A recv from whichever rank's send with `tag` comes first (MPI_ANY_SOURCE): messages already
  // here in arrival order, and a recv naming that rank posted earlier takes a message first.
  // `*source` holds the sender's rank once the Work completed without error (`source` must stay
  // valid until then, like `buf`). It fails at its deadline, and when no rank is left that could
  // send. Ring and mpi backends; the default is a ConfigError naming the backend.
  virtual std::shared_ptr<Work> recv_any_source(void* buf, std::size_t count, DType dtype,
                                                int* source, int tag = 0, CallOptions options = {});

  // Collective over this group: every member calls it with the same ranks (sorted, unique, ranks
  // of this group). Returns the subgroup (ranks renumbered 0..n-1 in that order) for members,
  // nullptr for the others. Runs on the calling thread; it does not wait for queued work.
  virtual std::shared_ptr<ProcessGroup> new_group(std::vector<int> ranks) = 0;

 protected:
  // The seams of the default uneven collectives above, for a group whose buffers are not host
  // memory (the nccl backend's are device memory). Defaults: host memory and memcpy.
  //   exchange_words  every rank's `mine` (the same length everywhere) in rank order, waited for;
  //                   `mine` and the result are host vectors whatever the group's memory space
  //   make_scratch    `bytes` of the group's memory space (zeroed for host memory), freed when
  //                   the last owner lets go
  //   block_copier    copies between buffers of the group's memory space, ordered as the call
  //                   whose `options` it is given (the nccl backend: on CallOptions::cuda_stream)
  using BlockCopier = std::function<void(void* dst, const void* src, std::size_t bytes)>;
  virtual std::vector<std::int64_t> exchange_words(const std::vector<std::int64_t>& mine,
                                                   CallOptions options);
  virtual std::shared_ptr<void> make_scratch(std::size_t bytes);
  virtual BlockCopier block_copier(const CallOptions& options);

 private:
  friend class comm::GroupFront;  // sets a subgroup's world_ranks_ in new_group
  int rank_;
  int size_;
  std::vector<int> world_ranks_;
};

}  // namespace ddp
#pragma GCC visibility pop
