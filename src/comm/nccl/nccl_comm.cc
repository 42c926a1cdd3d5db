// A non-blocking NCCL communicator (see nccl_comm.h).
#include "comm/nccl/nccl_comm.h"

#include <cstring>

#include "comm/nccl/poll_pacer.h"

namespace ddp::comm::nccl {
namespace {

ncclConfig_t non_blocking_config() {
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  return config;
}

// How long a healthy communicator's finalisation may take before it is aborted instead.
constexpr auto kFinalizeBound = std::chrono::seconds(10);

}  // namespace

std::unique_ptr<NcclComm> NcclComm::init_rank(const NcclLibrary& lib, const UniqueIdBytes& id,
                                              int size, int rank, net::Deadline deadline,
                                              Result& result) {
  ncclUniqueId unique{};
  static_assert(sizeof unique.internal == kUniqueIdBytes);
  std::memcpy(unique.internal, id.data(), kUniqueIdBytes);
  ncclConfig_t config = non_blocking_config();
  ncclComm_t handle = nullptr;
  const ncclResult_t rc = lib.CommInitRankConfig(&handle, size, unique, rank, &config);
  if (handle == nullptr) {
    result = {Outcome::kFailed, rc == ncclSuccess ? ncclInternalError : rc, {}};
    return nullptr;
  }
  auto comm = std::make_unique<NcclComm>(lib, handle);
  if (rc != ncclSuccess && rc != ncclInProgress) {
    std::lock_guard lock(comm->mutex_);
    result = comm->failure(rc);
  } else {
    result = comm->settle(deadline);
  }
  if (!result.ok()) {
    comm->abort();
    return nullptr;
  }
  return comm;
}

std::unique_ptr<NcclComm> NcclComm::split(const NcclLibrary& lib, NcclComm& parent,
                                          net::Deadline deadline, Result& result) {
  ncclComm_t handle = nullptr;
  ncclConfig_t config = non_blocking_config();
  {
    std::lock_guard lock(parent.mutex_);
    if (parent.handle_ == nullptr) {
      result = {Outcome::kAborted, ncclSuccess, {}};
      return nullptr;
    }
    const ncclResult_t rc = lib.CommSplit(parent.handle_, /*color=*/0, /*key=*/0, &handle, &config);
    if (rc != ncclSuccess && rc != ncclInProgress) {
      result = parent.failure(rc);
      return nullptr;
    }
  }
  // The split completes on the parent (its async error) and on the child.
  result = parent.settle(deadline);
  if (handle == nullptr) {
    if (result.ok())
      result = {Outcome::kFailed, ncclInternalError, "ncclCommSplit made no communicator"};
    return nullptr;
  }
  auto comm = std::make_unique<NcclComm>(lib, handle);
  if (result.ok()) result = comm->settle(deadline);
  if (!result.ok()) {
    comm->abort();
    return nullptr;
  }
  return comm;
}

NcclComm::~NcclComm() {
  bool finalized = false;
  bool pending = false;
  {
    std::lock_guard lock(mutex_);
    if (handle_ == nullptr) return;
    if (!failed_) {
      const ncclResult_t rc = lib_.CommFinalize(handle_);
      finalized = rc == ncclSuccess;
      pending = rc == ncclInProgress;
    }
  }
  if (pending) finalized = settle(net::deadline_after(kFinalizeBound)).ok();
  if (finalized) {
    std::lock_guard lock(mutex_);
    lib_.CommDestroy(handle_);
    handle_ = nullptr;
    return;
  }
  abort();  // failed, or its finalisation did not settle: nothing may wait on the peers
}

NcclComm::Result NcclComm::failure(ncclResult_t code) {
  failed_ = true;
  const char* said = handle_ != nullptr ? lib_.GetLastError(handle_) : nullptr;
  return {Outcome::kFailed, code, said != nullptr ? said : ""};
}

NcclComm::Result NcclComm::run(const std::function<ncclResult_t(ncclComm_t)>& enqueue,
                               net::Deadline deadline) {
  {
    std::lock_guard lock(mutex_);
    if (handle_ == nullptr) return {Outcome::kAborted, ncclSuccess, {}};
    const ncclResult_t rc = enqueue(handle_);
    if (rc == ncclSuccess) return {};
    if (rc != ncclInProgress) return failure(rc);
  }
  return settle(deadline);
}

NcclComm::Result NcclComm::poll() {
  std::lock_guard lock(mutex_);
  if (handle_ == nullptr) return {Outcome::kAborted, ncclSuccess, {}};
  ncclResult_t state = ncclSuccess;
  const ncclResult_t rc = lib_.CommGetAsyncError(handle_, &state);
  if (rc != ncclSuccess) return failure(rc);
  if (state != ncclSuccess && state != ncclInProgress) return failure(state);
  return {};
}

NcclComm::Result NcclComm::settle(net::Deadline deadline) {
  PollPacer pacer;
  for (;;) {
    {
      std::lock_guard lock(mutex_);
      if (handle_ == nullptr) return {Outcome::kAborted, ncclSuccess, {}};
      ncclResult_t state = ncclSuccess;
      const ncclResult_t rc = lib_.CommGetAsyncError(handle_, &state);
      if (rc != ncclSuccess) return failure(rc);
      if (state == ncclSuccess) return {};
      if (state != ncclInProgress) return failure(state);
    }
    if (net::Clock::now() >= deadline) return {Outcome::kTimedOut, ncclInProgress, {}};
    pacer.pause();
  }
}

void NcclComm::abort() noexcept {
  std::lock_guard lock(mutex_);
  if (handle_ == nullptr) return;
  lib_.CommAbort(handle_);
  handle_ = nullptr;
  failed_ = true;
}

bool NcclComm::aborted() const {
  std::lock_guard lock(mutex_);
  return handle_ == nullptr;
}

}  // namespace ddp::comm::nccl
