// NcclComm: one non-blocking NCCL communicator and the rules of using it from several threads
// (internal).
//
// Non-blocking (ncclConfig_t::blocking = 0) so that no NCCL call can hang a ddp thread: creation
// and every enqueue may return ncclInProgress, and settle() polls ncclCommGetAsyncError until the
// communicator is ready, failed, or the deadline passed. Abort is the way out of a stuck
// communicator (a peer that never arrives, a deadline passed, the group poisoned): ncclCommAbort
// frees it and makes its kernels exit.
//
// Thread safety: every call on the handle holds the communicator's mutex, so abort() from another
// thread (the group's poisoning, the destructor) never frees it under a call; after abort() every
// call answers kAborted without touching NCCL. Polls release the mutex between polls.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <string>

#include "comm/nccl/nccl_library.h"
#include "comm/nccl/nccl_unique_id.h"
#include "net/socket.h"

namespace ddp::comm::nccl {

class NcclComm {
 public:
  // What a communicator call ended with.
  enum class Outcome { kReady, kFailed, kTimedOut, kAborted };
  struct Result {
    Outcome outcome = Outcome::kReady;
    ncclResult_t code = ncclSuccess;  // kFailed: NCCL's code
    std::string last_error;           // kFailed: ncclGetLastError's text, when it said anything
    bool ok() const { return outcome == Outcome::kReady; }
  };

  // ncclCommInitRankConfig (non-blocking) on the calling thread's current device, settled by
  // `deadline`; on a timeout or failure the half-made communicator is aborted and `result` says
  // why (the returned pointer is then null).
  static std::unique_ptr<NcclComm> init_rank(const NcclLibrary& lib, const UniqueIdBytes& id,
                                             int size, int rank, net::Deadline deadline,
                                             Result& result);
  // ncclCommSplit of `parent` (every rank of the parent calls it): a communicator of the same
  // ranks for traffic of its own (point to point).
  static std::unique_ptr<NcclComm> split(const NcclLibrary& lib, NcclComm& parent,
                                         net::Deadline deadline, Result& result);

  NcclComm(const NcclLibrary& lib, ncclComm_t handle) : lib_(lib), handle_(handle) {}
  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;
  // Destroys a healthy communicator (ncclCommFinalize, bounded, then ncclCommDestroy); aborts one
  // that failed or whose finalisation did not settle in time.
  ~NcclComm();

  // Runs `enqueue` (NCCL calls on handle(), e.g. a grouped send/recv) under the mutex and settles
  // what it returned: immediate success, a failure, or ncclInProgress polled until `deadline`.
  Result run(const std::function<ncclResult_t(ncclComm_t)>& enqueue, net::Deadline deadline);
  // One look at the communicator's asynchronous error (a peer's failure shows here while a
  // kernel waits for it). kReady while healthy (ncclInProgress counts as healthy here).
  Result poll();
  // ncclCommAbort, once; any thread. Later calls answer kAborted.
  void abort() noexcept;
  bool aborted() const;

 private:
  // Polls ncclCommGetAsyncError until it is no longer ncclInProgress or the deadline passed.
  // REQUIRES: mutex_ not held (it is taken per poll).
  Result settle(net::Deadline deadline);
  Result failure(ncclResult_t code);  // REQUIRES: mutex_ held

  const NcclLibrary& lib_;
  mutable std::mutex mutex_;
  ncclComm_t handle_;  // null once aborted
  bool failed_ = false;
};

}  // namespace ddp::comm::nccl
