// Point-to-point operations of the mpi backend (internal): each send/recv is posted at once, on
// the calling thread, as one MPI_Isend/MPI_Irecv (tag = the user's tag) on the group's
// communicator dedicated to point-to-point, and so never waits behind the group's queue of
// collectives: sends and receives progress independently and match by source and tag in posting
// order, as MPI does, so a cycle in which every rank sends before it receives completes.
//
// A Work completes when MPI_Test says so, polled by whoever waits for it (help_until_completed)
// and by the group's watchdog thread (P2pPending::poll_all), so then() callbacks run without a
// waiter. It fails with a CommError naming the peer and tag when its deadline passes (the request
// is then cancelled where MPI can), when a peer's notice says that it failed or left the group,
// or when the counts differ (MPI_ERR_TRUNCATE on a receive shorter than the message; MPI_Get_count
// on a longer one). With abort_on_failure every such failure ends the job instead.
// Threads: under MPI_THREAD_SERIALIZED every MPI call holds MpiRuntime::lock(), as elsewhere in
// the backend, so posting and polling from several threads stays legal.
#pragma once

#include <chrono>
#include <cstddef>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "comm/mpi/mpi_runtime.h"
#include "ddp/comm/comm_error.h"
#include "ddp/comm/types.h"
#include "ddp/comm/work.h"

namespace ddp::comm::mpi {

// What a peer's notice (MpiProcessGroup::failed_notice, left_notice) says happened: it failed
// (and aborted the group) or it left.
CommErrorKind notice_kind(std::string_view notice);

// What a point-to-point Work needs of its group; shared, so that a Work may outlive the group.
struct P2pContext {
  std::string group;
  std::string notice_key;  // the group's key for MpiRuntime::notices
  int rank = 0;
  bool abort_on_failure = true;
  std::chrono::milliseconds stall_check_after{1000};
};

struct P2pCall {
  bool is_recv = false;
  const void* send = nullptr;
  void* recv = nullptr;
  std::size_t count = 0;
  DType dtype = DType::kFloat32;
  int peer = -1;  // MPI_ANY_SOURCE for a receive from any source
  int tag = 0;
  std::chrono::milliseconds timeout{0};
  int* source = nullptr;  // a receive from any source: the sender's rank, set on success
};

class MpiP2pWork final : public Work {
 public:
  // Posts the call on `comm` and returns its Work (failed already when MPI refused to post it).
  static std::shared_ptr<MpiP2pWork> post(std::shared_ptr<const P2pContext> context, MPI_Comm comm,
                                          const P2pCall& call);
  MpiP2pWork(std::shared_ptr<const P2pContext> context, const P2pCall& call);

  // "recv(float32 x 8) from rank 1, tag 3"
  std::string description() const override;

  // One look without blocking: completes the Work (running its callbacks on this thread) when MPI
  // is done with it, its deadline passed or a peer's notice makes it impossible. Returns whether
  // the Work is done. Any thread; returns false at once while another thread polls it.
  bool poll();

 protected:
  void help_until_completed() override;

 private:
  using Clock = std::chrono::steady_clock;
  // Under mutex_: cancels the request and returns the error to complete with.
  std::exception_ptr fail_locked(CommErrorKind kind, const std::string& what);
  bool poll_locked(std::exception_ptr& error);

  std::shared_ptr<const P2pContext> context_;
  P2pCall call_;
  std::mutex mutex_;
  MPI_Request request_ = MPI_REQUEST_NULL;  // under mutex_
  MPI_Status status_{};
  bool done_ = false;  // under mutex_: completion decided (complete() runs after, unlocked)
  Clock::time_point deadline_;
  Clock::time_point next_notice_check_;
};

// A group's point-to-point Works not yet completed, for its watchdog thread.
class P2pPending {
 public:
  void add(std::shared_ptr<MpiP2pWork> work);
  bool empty();
  // Polls each once and forgets the completed ones.
  void poll_all();

 private:
  std::mutex mutex_;
  std::vector<std::shared_ptr<MpiP2pWork>> works_;
};

}  // namespace ddp::comm::mpi
