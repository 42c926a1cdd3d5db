// GroupFront: the one front of every backend's ProcessGroup (internal).
//
// It does what every backend would otherwise write again: the argument checks, the call record
// (call.h) with its fingerprint header, sequencing, blocking and async forms, the flight recorder
// and poisoning (all through its OpQueue), and point-to-point's checks and blocking form. A
// backend derives from it and supplies only what differs (c10d's ProcessGroup front over a
// Backend, gloo's algorithms over a transport pair):
//   run_call            run this call by this deadline (on one thread at a time, in issue order);
//                       throw a CommError of the right kind on failure
//   on_poison           the group failed: tell the peers, shut connections (OpQueue::Runner)
//   algorithm_for       which algorithm a call takes (part of the fingerprint); default none
//   post_send/post_recv start a point-to-point operation (past the queue);
//   post_recv_any_source where the backend can (default: refused)
//   make_subgroup       new_group after the rank list was checked
//   prepare_call        on the caller's thread, before the call is queued: capture what must be
//                       captured when the call is made (the nccl backend records an event on
//                       CallOptions::cuda_stream into Call::backend_state); default nothing
//   and what it supports: max_count(), min_tag()/max_tag(), and ProcessGroup's
//   allreduce_segments_in_place().
// Lifetime: the derived destructor calls stop_queue() first, before the state run_call() uses
// goes away; start_queue() once the group is owned by a shared_ptr.
#pragma once

#include <chrono>
#include <climits>
#include <cstddef>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "comm/call.h"
#include "comm/op_queue.h"
#include "ddp/comm/process_group.h"

namespace ddp::comm {

class GroupFront : public ProcessGroup, protected OpQueue::Runner {
 public:
  using ProcessGroup::allreduce;

  std::shared_ptr<Work> allreduce(const void* send, void* recv, std::size_t count, DType dtype,
                                  ReduceOp op, CallOptions options) final;
  std::shared_ptr<Work> allreduce_segments(std::vector<BufferSegment> segments, DType dtype,
                                           ReduceOp op, CallOptions options) final;
  std::shared_ptr<Work> broadcast(void* buf, std::size_t count, DType dtype, int root,
                                  CallOptions options) final;
  std::shared_ptr<Work> reduce(const void* send, void* recv, std::size_t count, DType dtype,
                               ReduceOp op, int root, CallOptions options) final;
  std::shared_ptr<Work> allgather(const void* send, void* recv, std::size_t count_per_rank,
                                  DType dtype, CallOptions options) final;
  std::shared_ptr<Work> gather(const void* send, void* recv, std::size_t count_per_rank,
                               DType dtype, int root, CallOptions options) final;
  std::shared_ptr<Work> scatter(const void* send, void* recv, std::size_t count_per_rank,
                                DType dtype, int root, CallOptions options) final;
  std::shared_ptr<Work> reduce_scatter(const void* send, void* recv, std::size_t count_per_rank,
                                       DType dtype, ReduceOp op, CallOptions options) final;
  std::shared_ptr<Work> alltoall(const void* send, void* recv, std::size_t count_per_rank,
                                 DType dtype, CallOptions options) final;
  std::shared_ptr<Work> barrier(CallOptions options) final;
  std::shared_ptr<Work> send(const void* buf, std::size_t count, DType dtype, int dst, int tag,
                             CallOptions options) final;
  std::shared_ptr<Work> recv(void* buf, std::size_t count, DType dtype, int src, int tag,
                             CallOptions options) final;
  std::shared_ptr<Work> recv_any_source(void* buf, std::size_t count, DType dtype, int* source,
                                        int tag, CallOptions options) final;
  std::shared_ptr<ProcessGroup> new_group(std::vector<int> ranks) final;

  const std::string& name() const { return name_; }
  std::chrono::milliseconds group_timeout() const { return timeout_; }

 protected:
  // `timeout`: the group's deadline for a call without its own (already resolved, > 0).
  // `observer`: told each call's header once sequenced (may be null; must outlive the group).
  GroupFront(int rank, int size, std::string name, std::chrono::milliseconds timeout,
             OpQueue::Options queue_options, SequenceObserver* observer = nullptr);
  ~GroupFront() override;

  void start_queue(std::weak_ptr<const void> owner) { queue_.start(std::move(owner)); }
  void stop_queue() { queue_.stop(); }
  OpQueue& queue() { return queue_; }
  const OpQueue& queue() const { return queue_; }

  // The backend. See the file comment.
  virtual void run_call(Call& call, net::Deadline deadline) = 0;
  // Called by submit() on the caller's thread after the checks, before the call is queued (so in
  // the caller's order of calls, not the queue's). May throw (the call is then not issued).
  virtual void prepare_call(Call& call, const CallOptions& options) {
    static_cast<void>(call);
    static_cast<void>(options);
  }
  virtual Algorithm algorithm_for(const Call& call) const {
    static_cast<void>(call);
    return Algorithm::kNone;
  }
  virtual std::shared_ptr<Work> post_send(const void* buf, std::size_t count, DType dtype, int dst,
                                          int tag, CallOptions options) = 0;
  virtual std::shared_ptr<Work> post_recv(void* buf, std::size_t count, DType dtype, int src,
                                          int tag, CallOptions options) = 0;
  // A backend that can receive from any source (ProcessGroup::recv_any_source); the default
  // refuses, naming the backend.
  virtual std::shared_ptr<Work> post_recv_any_source(void* buf, std::size_t count, DType dtype,
                                                     int* source, int tag, CallOptions options) {
    return ProcessGroup::recv_any_source(buf, count, dtype, source, tag, options);
  }
  virtual std::shared_ptr<ProcessGroup> make_subgroup(std::vector<int> ranks) = 0;
  // The most elements one call may name (a larger count is a ConfigError before anything runs).
  virtual std::size_t max_count() const { return SIZE_MAX; }
  // Tags a send/recv may use: min_tag()..max_tag().
  virtual int min_tag() const { return INT_MIN; }
  virtual int max_tag() const { return INT_MAX; }

 private:
  void run(QueuedWork& work, net::Deadline deadline) final {
    run_call(static_cast<CallWork&>(work).call(), deadline);
  }
  void check_buffer(const void* p, std::size_t count, const char* op, const char* name) const;
  void check_rank(int r, const char* op, const char* name) const;
  void check_point_to_point(const void* buf, std::size_t count, DType dtype, int peer, int tag,
                            const char* op, const char* peer_name) const;
  void check_message(DType dtype, int tag, const char* op) const;
  // Checks the enums and builds the call and its header; the backend picks the algorithm.
  Call make_call(Collective kind, const void* send, void* recv, std::size_t count, DType dtype,
                 std::optional<ReduceOp> op, int root) const;
  std::shared_ptr<Work> submit(Call call, const CallOptions& options);

  const std::string name_;
  const std::chrono::milliseconds timeout_;
  SequenceObserver* const observer_;
  // Order, threads, completion and poisoning of the calls; runs them through run_call().
  OpQueue queue_;
};

}  // namespace ddp::comm
