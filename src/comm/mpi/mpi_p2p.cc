#include "comm/mpi/mpi_p2p.h"

#include <algorithm>
#include <thread>
#include <utility>

#include <fmt/format.h>

#include "comm/mpi/mpi_group.h"  // back_off, shared with the collectives
#include "ddp/comm/comm_error.h"

namespace ddp::comm::mpi {
namespace {

// How long a cancelled request may take to complete before it is abandoned (left to MPI).
constexpr auto kCancelGrace = std::chrono::milliseconds(200);
// How often a stalled operation reads its peers' notices.
constexpr auto kNoticeInterval = std::chrono::milliseconds(10);

}  // namespace

MpiP2pWork::MpiP2pWork(std::shared_ptr<const P2pContext> context, const P2pCall& call)
    : Work(call.timeout), context_(std::move(context)), call_(call) {
  const auto now = Clock::now();
  deadline_ = now + call_.timeout;
  next_notice_check_ = now + context_->stall_check_after;
}

std::shared_ptr<MpiP2pWork> MpiP2pWork::post(std::shared_ptr<const P2pContext> context,
                                             MPI_Comm comm, const P2pCall& call) {
  auto work = std::make_shared<MpiP2pWork>(std::move(context), call);
  auto& runtime = MpiRuntime::instance();
  const MPI_Datatype type = runtime.datatype(call.dtype);
  const int count = static_cast<int>(call.count);
  int rc;
  {
    std::lock_guard guard(work->mutex_);
    auto lock = runtime.lock();
    rc = call.is_recv
             ? MPI_Irecv(call.recv, count, type, call.peer, call.tag, comm, &work->request_)
             : MPI_Isend(call.send, count, type, call.peer, call.tag, comm, &work->request_);
  }
  if (rc != MPI_SUCCESS) {
    std::exception_ptr error;
    {
      std::lock_guard guard(work->mutex_);
      work->done_ = true;
      work->request_ = MPI_REQUEST_NULL;
      error = work->fail_locked(CommErrorKind::kTransport,
                                fmt::format("could not start: {}", mpi_error_text(rc)));
    }
    work->complete(error);
  }
  return work;
}

std::string MpiP2pWork::description() const {
  if (call_.peer == MPI_ANY_SOURCE) {
    return fmt::format("recv({} x {}) from any rank, tag {}", to_string(call_.dtype), call_.count,
                       call_.tag);
  }
  return fmt::format("{}({} x {}) {} rank {}, tag {}", call_.is_recv ? "recv" : "send",
                     to_string(call_.dtype), call_.count, call_.is_recv ? "from" : "to", call_.peer,
                     call_.tag);
}

std::exception_ptr MpiP2pWork::fail_locked(CommErrorKind kind, const std::string& what) {
  const std::string description = this->description();
  const std::string message = fmt::format("rank {} of group '{}' (mpi backend): {} {}",
                                          context_->rank, context_->group, description, what);
  if (context_->abort_on_failure) {
    MpiRuntime::abort_job(
        fmt::format("{} (MpiOptions::abort_on_failure is on; turn it off to "
                    "handle the CommError in the program instead)",
                    message));
  }
  if (request_ != MPI_REQUEST_NULL) {
    // A cancelled request must still complete before its buffer may be reused; one that does not
    // within kCancelGrace (a send MPI has handed over already) is abandoned to MPI.
    auto& runtime = MpiRuntime::instance();
    {
      auto lock = runtime.lock();
      MPI_Cancel(&request_);
    }
    const auto until = Clock::now() + kCancelGrace;
    for (int idle = 0; request_ != MPI_REQUEST_NULL && Clock::now() < until; ++idle) {
      int flag = 0;
      auto lock = runtime.lock();
      if (MPI_Test(&request_, &flag, MPI_STATUS_IGNORE) != MPI_SUCCESS || flag) {
        request_ = MPI_REQUEST_NULL;
      }
      lock = {};
      back_off(idle);
    }
    request_ = MPI_REQUEST_NULL;
  }
  return std::make_exception_ptr(
      CommError(kind, message, context_->group, description, 0, call_.peer));
}

bool MpiP2pWork::poll_locked(std::exception_ptr& error) {
  if (done_) return false;  // decided by another thread, which completes it
  auto& runtime = MpiRuntime::instance();
  int flag = 0;
  int rc;
  {
    auto lock = runtime.lock();
    rc = MPI_Test(&request_, &flag, call_.is_recv ? &status_ : MPI_STATUS_IGNORE);
  }
  if (rc != MPI_SUCCESS) {
    request_ = MPI_REQUEST_NULL;
    done_ = true;
    int error_class = MPI_SUCCESS;
    MPI_Error_class(rc, &error_class);
    if (error_class == MPI_ERR_IN_STATUS && call_.is_recv)
      MPI_Error_class(status_.MPI_ERROR, &error_class);
    if (call_.is_recv && error_class == MPI_ERR_TRUNCATE) {
      error = fail_locked(CommErrorKind::kMismatch,
                          fmt::format("failed: rank {} sent more than the {} elements this receive "
                                      "posted (MPI_ERR_TRUNCATE); "
                                      "sender and receiver must agree on count and dtype",
                                      status_.MPI_SOURCE, call_.count));
    } else {
      error = fail_locked(CommErrorKind::kTransport, fmt::format("failed: {}", mpi_error_text(rc)));
    }
    return true;
  }
  if (flag) {
    done_ = true;
    if (call_.is_recv) {
      int received = 0;
      MPI_Get_count(&status_, MpiRuntime::instance().datatype(call_.dtype), &received);
      if (received < 0 || static_cast<std::size_t>(received) != call_.count) {
        error = fail_locked(CommErrorKind::kMismatch,
                            fmt::format("received {} elements from rank {} but expected {}: sender "
                                        "and receiver must agree on "
                                        "count and dtype",
                                        received, status_.MPI_SOURCE, call_.count));
      } else if (call_.source != nullptr) {
        *call_.source = status_.MPI_SOURCE;
      }
    }
    return true;
  }
  const auto now = Clock::now();
  if (now >= deadline_) {
    done_ = true;
    std::string notice;
    for (std::string& text : MpiRuntime::instance().notices(context_->notice_key)) {
      if (text.rfind("stall ", 0) != 0) {
        notice = std::move(text);
        break;
      }
    }
    error = fail_locked(
        CommErrorKind::kTimeout,
        fmt::format(
            "did not complete within {} ms: {}", call_.timeout.count(),
            notice.empty()
                ? fmt::format("{} did not post the matching {} with tag {}, or is "
                              "stuck or gone",
                              call_.peer == MPI_ANY_SOURCE ? std::string("no rank")
                                                           : fmt::format("rank {}", call_.peer),
                              call_.is_recv ? "send" : "receive", call_.tag)
                : notice));
    return true;
  }
  if (now >= next_notice_check_) {
    next_notice_check_ = now + kNoticeInterval;
    for (std::string& text : MpiRuntime::instance().notices(context_->notice_key)) {
      if (text.rfind("stall ", 0) == 0) continue;
      done_ = true;
      error = fail_locked(notice_kind(text), fmt::format("cannot complete: {}", text));
      return true;
    }
  }
  return false;
}

bool MpiP2pWork::poll() {
  std::exception_ptr error;
  bool finished;
  {
    std::unique_lock guard(mutex_, std::try_to_lock);
    if (!guard.owns_lock()) return false;
    if (done_) return true;
    finished = poll_locked(error);
  }
  if (finished) complete(error);
  return finished;
}

void MpiP2pWork::help_until_completed() {
  for (int idle = 0; !is_completed(); ++idle) {
    {
      std::exception_ptr error;
      bool finished;
      {
        std::lock_guard guard(mutex_);
        if (done_) return;  // another thread completes it; Work::wait blocks until then
        finished = poll_locked(error);
      }
      if (finished) {
        complete(error);
        return;
      }
    }
    back_off(idle);
  }
}

void P2pPending::add(std::shared_ptr<MpiP2pWork> work) {
  std::lock_guard lock(mutex_);
  works_.push_back(std::move(work));
}

bool P2pPending::empty() {
  std::lock_guard lock(mutex_);
  return works_.empty();
}

void P2pPending::poll_all() {
  std::vector<std::shared_ptr<MpiP2pWork>> works;
  {
    std::lock_guard lock(mutex_);
    works = works_;
  }
  // Unlocked: a completed Work's callbacks may post new operations (add).
  std::vector<MpiP2pWork*> done;
  for (const auto& work : works) {
    if (work->is_completed() || work->poll()) done.push_back(work.get());
  }
  if (done.empty()) return;
  std::lock_guard lock(mutex_);
  std::erase_if(works_, [&](const auto& w) {
    return w->is_completed() || std::find(done.begin(), done.end(), w.get()) != done.end();
  });
}

}  // namespace ddp::comm::mpi
