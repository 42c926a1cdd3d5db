// The mpi process group's calls: argument checks, the queue glue, notices to peers, and running
// one polled operation (see mpi_group.h).
#include "comm/mpi/mpi_group.h"

namespace ddp::comm::mpi {

bool overlaps(const void* a, std::size_t a_bytes, const void* b, std::size_t b_bytes) {
  const auto x = reinterpret_cast<std::uintptr_t>(a);
  const auto y = reinterpret_cast<std::uintptr_t>(b);
  return a_bytes > 0 && b_bytes > 0 && x < y + b_bytes && y < x + a_bytes;
}

// One poll of `request`: whether it completed (or failed), with MPI's code in `rc`.
bool test_request(MPI_Request& request, int& rc, MPI_Status* status) {
  auto lock = MpiRuntime::instance().lock();
  int done = 0;
  rc = MPI_Test(&request, &done, status);
  if (rc != MPI_SUCCESS) request = MPI_REQUEST_NULL;
  return done || rc != MPI_SUCCESS;
}

// Between two polls: spin at first (each MPI_Test drives MPI's progress; a small collective
// completes within microseconds, and a yield costs a system call each), then yield, then sleep
// up to 250 µs so that ranks oversubscribing the cores leave them to each other.
void back_off(int idle) {
  constexpr int kSpins = 256;
  constexpr int kYields = 64;
  if (idle < kSpins) return;
  if (idle < kSpins + kYields) {
    std::this_thread::yield();
  } else {
    std::this_thread::sleep_for(
        std::chrono::microseconds(std::min(250, 2 * (idle - kSpins - kYields + 1))));
  }
}

// MPI_Comm_idup / MPI_Iallreduce etc. polled against a deadline; false when it passed.
bool wait_request(MPI_Request& request, Clock::time_point deadline, int& rc, MPI_Status* status) {
  for (int idle = 0;; ++idle) {
    if (test_request(request, rc, status)) return true;
    if (Clock::now() >= deadline) return false;
    back_off(idle);
  }
}

// How long a caller waiting for an operation that the worker runs polls before it sleeps (as the
// ring backend): a sleeping waiter's wake-up costs milliseconds on a busy host. Not when this
// host's ranks outnumber its cores, where polling would take a core from a peer.
std::chrono::microseconds waiter_spin(int local_size) {
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  return static_cast<unsigned>(local_size) <= cores ? std::chrono::microseconds(50)
                                                    : std::chrono::microseconds(0);
}

MpiProcessGroup::~MpiProcessGroup() {
  MpiRuntime::instance().remove_exit_listener(this);
  stop_queue();  // before the state run_call() uses goes away
  destroyed_->store(true);
  if (watchdog_.joinable()) {
    {
      std::lock_guard lock(watch_.mutex);
      watch_.stop = true;
    }
    watch_.cv.notify_all();
    if (watchdog_.get_id() == std::this_thread::get_id()) {
      watchdog_.detach();
    } else {
      watchdog_.join();
    }
  }
  int finalized = 0;
  MPI_Finalized(&finalized);
  // A poisoned communicator may still have an abandoned request posted: leave it to MPI_Finalize,
  // and its buffers to MPI.
  if (finalized || queue().poisoned()) {
    MpiRuntime::instance().keep_until_exit(
        std::shared_ptr<CheckBuffers>(std::move(check_buffers_)));
    return;
  }
  // A peer still waiting in a call of this group learns that this rank will not issue it.
  notify_peers(left_notice("the group was destroyed"));
  auto lock = MpiRuntime::instance().lock();
  MPI_Comm_free(&comm_);
  MPI_Comm_free(&check_);
  MPI_Comm_free(&control_);
  // Point-to-point operations still pending complete on MPI's side first (MPI_Comm_free defers).
  MPI_Comm_free(&p2p_);
}

// The two notices a group sends its peers; notice_kind tells them apart.
std::string MpiProcessGroup::failed_notice(const std::string& reason) const {
  return fmt::format("rank {} failed: {}", rank(), reason);
}

CommErrorKind notice_kind(std::string_view notice) {
  return notice.find(" left group '") != std::string_view::npos ? CommErrorKind::kPeerGone
                                                                : CommErrorKind::kAborted;
}

std::string MpiProcessGroup::left_notice(std::string_view why) {
  const std::optional<comm::OpHeader> last = issue_log_.last();
  return fmt::format("rank {} left group '{}' ({}) after issuing {} collectives{}", rank(), name(),
                     why, last ? last->sequence + 1 : 0,
                     last ? fmt::format(", the last {}", comm::describe(*last)) : std::string());
}

void MpiProcessGroup::notify_peers(const std::string& text) {
  if (size() < 2 || left_.exchange(true)) return;
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) return;
  std::vector<int> peers;
  for (int r = 0; r < size(); ++r) {
    if (r != rank()) peers.push_back(world_ranks_[static_cast<std::size_t>(r)]);
  }
  MpiRuntime::instance().send_notice(options_.notice_key, peers, text);
}

std::shared_ptr<Work> MpiProcessGroup::post_p2p(comm::mpi::P2pCall call, CallOptions options) {
  call.timeout = comm::OpQueue::call_timeout(options, group_timeout());
  if (queue().poisoned()) {
    // As every operation of a failed group: its first error, at once.
    auto failed = std::make_shared<comm::mpi::MpiP2pWork>(p2p_context_, call);
    failed->complete(queue().poison_error());
    return failed;
  }
  auto work = comm::mpi::MpiP2pWork::post(p2p_context_, p2p_, call);
  if (work->is_completed()) return work;
  p2p_pending_.add(work);
  ensure_watchdog();
  {
    std::lock_guard lock(watch_.mutex);
    watch_.p2p_posted = true;
  }
  watch_.cv.notify_one();
  return work;
}

// With abort_on_failure the first failure ends the job here, before any caller sees the error
// (MPI cannot interrupt the peers' calls, so they would wait for their deadlines).
void MpiProcessGroup::run_call(Call& op, net::Deadline deadline) {
  if (!options_.abort_on_failure) return run_op(op, deadline);
  try {
    run_op(op, deadline);
  } catch (const std::exception& e) {
    // The queue's own dump would come too late: the job ends here.
    const auto* comm_error = dynamic_cast<const CommError*>(&e);
    queue().dump_flight_recorder(
        comm_error != nullptr ? comm::dump_reason(comm_error->kind()) : "failure", e.what());
    MpiRuntime::abort_job(
        fmt::format("{} (MpiOptions::abort_on_failure is on; turn it off to "
                    "handle the CommError in the program instead)",
                    e.what()));
  }
}

// The queue is poisoned (the first error, or a later operation failing with it): the peers are
// sent the error once, and read it when one of their calls stalls.
void MpiProcessGroup::on_poison(const std::string& reason) noexcept {
  if (options_.abort_on_failure) MpiRuntime::abort_job(reason);
  try {
    notify_peers(failed_notice(reason));
  } catch (...) {
    // Best effort: the peers then fail at their own deadlines.
  }
}

void MpiProcessGroup::run_op(Call& op, Clock::time_point deadline) {
  if (use_checked_allreduce(op)) return run_checked_allreduce(op, deadline);
  MPI_Request check = MPI_REQUEST_NULL;
  if (size() > 1) {
    const std::uint64_t h = fingerprint_hash(op.header);
    check_buffers_->mine[0] = h;
    check_buffers_->mine[1] = ~h;
    auto lock = MpiRuntime::instance().lock();
    const int rc = MPI_Iallreduce(check_buffers_->mine, check_buffers_->combined, 2, MPI_UINT64_T,
                                  MPI_MAX, check_, &check);
    if (rc != MPI_SUCCESS) {
      throw error(op, CommErrorKind::kTransport,
                  fmt::format("could not start its fingerprint check: {}", mpi_error_text(rc)));
    }
  }
  MPI_Request request = MPI_REQUEST_NULL;
  // Zero elements move nothing; the fingerprint check still runs (a count of 0 on one rank and 8
  // on another is a mismatch).
  if (op.count != 0 || op.kind == Collective::kBarrier) {
    const int rc = start(op, &request);
    if (rc != MPI_SUCCESS)
      throw error(op, CommErrorKind::kTransport,
                  fmt::format("could not start: {}", mpi_error_text(rc)));
  }
  wait_for_op(op, deadline, request, check);
  if (op.count == 0 && op.kind != Collective::kBarrier) return;
  const std::size_t bytes = op.count * dtype_size(op.dtype);
  const bool average = op.op == ReduceOp::kAvg;
  switch (op.kind) {
    case Collective::kAllreduce:
    case Collective::kReduceScatter:
      if (average) comm::divide(op.recv, op.count, op.dtype, size());
      break;
    case Collective::kReduce:
      if (average && rank() == op.root) comm::divide(op.recv, op.count, op.dtype, size());
      break;
    case Collective::kScatter:
      // The root scattered with MPI_IN_PLACE (its block stayed in `send`); copying it only now
      // keeps a `recv` that overlaps other blocks of `send` from corrupting them.
      if (rank() == op.root) {
        std::memmove(op.recv, op.send + static_cast<std::size_t>(op.root) * bytes, bytes);
      }
      break;
    default:
      break;
  }
}

void MpiProcessGroup::wait_for_op(Call& op, Clock::time_point deadline, MPI_Request& data,
                                  MPI_Request& check) {
  StallCheck stall(*this, op, deadline);
  int data_rc = MPI_SUCCESS;
  for (int idle = 0;; ++idle) {
    if (check != MPI_REQUEST_NULL) {
      int rc = MPI_SUCCESS;
      const bool done = test_request(check, rc, MPI_STATUS_IGNORE);
      if (rc != MPI_SUCCESS) {
        throw error(op, CommErrorKind::kTransport,
                    fmt::format("failed in its fingerprint check: {}", mpi_error_text(rc)));
      }
      if (done && (check_buffers_->combined[0] != check_buffers_->mine[0] ||
                   check_buffers_->combined[1] != check_buffers_->mine[1])) {
        fail_mismatch(op, deadline);
      }
    }
    // An error (MPI_ERR_TRUNCATE for a count mismatch, say) is reported once the fingerprints
    // are known, so that a mismatch is named as one.
    if (data != MPI_REQUEST_NULL) test_request(data, data_rc, MPI_STATUS_IGNORE);
    if (data == MPI_REQUEST_NULL && check == MPI_REQUEST_NULL) break;
    stall.check();
    back_off(idle);
  }
  if (data_rc != MPI_SUCCESS)
    throw error(op, CommErrorKind::kTransport, fmt::format("failed: {}", mpi_error_text(data_rc)));
}

MpiProcessGroup::StallCheck::StallCheck(MpiProcessGroup& group, const Call& op,
                                        Clock::time_point deadline)
    : group_(group),
      op_(op),
      deadline_(deadline),
      // The operation started at its deadline less its timeout: no clock read per operation.
      next_notice_check_(deadline - op.timeout + group.options_.stall_check_after) {}

void MpiProcessGroup::StallCheck::check() {
  const auto now = Clock::now();
  if (now >= deadline_) {
    // MPI cannot cancel a collective: the request stays posted and the group stays poisoned.
    const std::string notice = group_.receive_notice();
    throw group_.error(op_, CommErrorKind::kTimeout,
                       fmt::format("did not complete within {} ms: {}; this group is unusable "
                                   "from now on",
                                   op_.timeout.count(),
                                   notice.empty() ? "a rank of the group did not issue it, or "
                                                    "is stuck or gone"
                                                  : notice));
  }
  if (now >= next_notice_check_) {
    next_notice_check_ = now + milliseconds(10);
    if (auto problem = group_.stall_problem(op_, announced_)) throw *problem;
  }
}

int MpiProcessGroup::start(Call& op, MPI_Request* request) {
  auto& runtime = MpiRuntime::instance();
  const MPI_Datatype type = runtime.datatype(op.dtype);
  const MPI_Op reduce_op = runtime.reduce_op(op.dtype, op.op);
  const int count = static_cast<int>(op.count);
  const std::size_t bytes = op.count * dtype_size(op.dtype);
  const std::size_t all_bytes = bytes * static_cast<std::size_t>(size());
  // An input that overlaps the output (other than exactly, which is MPI_IN_PLACE) is copied.
  auto private_copy = [&](std::size_t n) -> const std::byte* {
    scratch_.assign(op.send, op.send + n);
    return scratch_.data();
  };
  // The send argument of an operation that may run in place: MPI_IN_PLACE when send is recv.
  auto input = [&](std::size_t send_bytes, std::size_t recv_bytes) -> const void* {
    if (op.send == op.recv) return MPI_IN_PLACE;
    return overlaps(op.send, send_bytes, op.recv, recv_bytes) ? private_copy(send_bytes) : op.send;
  };
  switch (op.kind) {
    case Collective::kAllreduce: {
      const void* in = input(bytes, bytes);
      auto lock = runtime.lock();
      return MPI_Iallreduce(in, op.recv, count, type, reduce_op, comm_, request);
    }
    case Collective::kBroadcast: {
      auto lock = runtime.lock();
      return MPI_Ibcast(op.recv, count, type, op.root, comm_, request);
    }
    case Collective::kReduce: {
      const void* in = rank() == op.root ? input(bytes, bytes) : op.send;
      auto lock = runtime.lock();
      return MPI_Ireduce(in, rank() == op.root ? op.recv : nullptr, count, type, reduce_op, op.root,
                         comm_, request);
    }
    case Collective::kAllgather: {
      std::byte* own = op.recv + static_cast<std::size_t>(rank()) * bytes;
      if (own != op.send) std::memmove(own, op.send, bytes);
      auto lock = runtime.lock();
      return MPI_Iallgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, op.recv, count, type, comm_,
                            request);
    }
    case Collective::kGather: {
      auto lock = std::unique_lock<std::mutex>();
      if (rank() == op.root) {
        std::byte* own = op.recv + static_cast<std::size_t>(rank()) * bytes;
        if (own != op.send) std::memmove(own, op.send, bytes);
        lock = runtime.lock();
        return MPI_Igather(MPI_IN_PLACE, count, type, op.recv, count, type, op.root, comm_,
                           request);
      }
      lock = runtime.lock();
      return MPI_Igather(op.send, count, type, nullptr, count, type, op.root, comm_, request);
    }
    case Collective::kScatter: {
      auto lock = runtime.lock();
      if (rank() == op.root) {
        return MPI_Iscatter(op.send, count, type, MPI_IN_PLACE, count, type, op.root, comm_,
                            request);
      }
      return MPI_Iscatter(nullptr, count, type, op.recv, count, type, op.root, comm_, request);
    }
    case Collective::kReduceScatter: {
      const void* in = input(all_bytes, bytes);
      auto lock = runtime.lock();
      return MPI_Ireduce_scatter_block(in, op.recv, count, type, reduce_op, comm_, request);
    }
    case Collective::kAlltoall: {
      const void* in =
          overlaps(op.send, all_bytes, op.recv, all_bytes) ? private_copy(all_bytes) : op.send;
      auto lock = runtime.lock();
      return MPI_Ialltoall(in, count, type, op.recv, count, type, comm_, request);
    }
    case Collective::kBarrier: {
      auto lock = runtime.lock();
      return MPI_Ibarrier(comm_, request);
    }
    case Collective::kSend:
      break;  // send/recv never run from the queue (mpi_p2p.h)
  }
  return MPI_ERR_OTHER;
}

}  // namespace ddp::comm::mpi
