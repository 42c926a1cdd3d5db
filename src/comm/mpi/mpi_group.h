// The mpi backend's process group (internal; one concept per file):
//   mpi_group.h                this class and its state
//   mpi_process_group.cc       the calls: checks, the queue glue, running a polled operation
//   mpi_checked_allreduce.cc   the blocking allreduce/barrier with their fingerprints checked
//   mpi_in_band_fingerprint.h  the fingerprint as extra elements of the call's own dtype
//   mpi_watchdog.cc            the watchdog thread (blocking calls' deadlines, polling p2p)
//   mpi_mismatch.cc            naming mismatched calls (fingerprints, stall notices)
//   mpi_group_create.cc        make_mpi_process_group and new_group (communicators)
//   mpi_p2p.h                  point to point, past the queue
//
// How it works: the per-group queue and worker, deadlines over MPI_Test, mismatch detection,
// poisoning (and aborting the job), subgroups.
//
// Each group owns four duplicates of its communicator: `comm_` carries the operations' data and
// `check_` their fingerprints and the notices between ranks (both used by whichever thread runs
// the operations, in issue order), `control_` is used only by new_group on the caller's thread,
// and `p2p_` only by send/recv (posted on the caller's thread, past the queue: mpi_p2p.h).
// Separate communicators keep new_group's own collectives from interleaving, in a different order
// on different ranks, with the operations running meanwhile, and keep a mismatched data operation
// (which MPI may match with the wrong call) from disturbing the fingerprint exchange.
//
// Mismatches. Small allreduces and barriers carry their call's fingerprint in band
// (mpi_in_band_fingerprint.h). Alongside every other collective, a 16-byte MPI_Iallreduce(MAX) on
// `check_` combines the (hash, ~hash) of each rank's call (kind, dtype, count, root, reduce op,
// sequence number): the result equals this rank's pair on every rank exactly when every rank
// issued the same call. It progresses together with the data operation (measured: no added
// latency, since MPI progresses both at once; docs/benchmarks.md) and the operation completes
// only when both have, so a count mismatch that MPI answers with a short receive (no error, wrong
// data) is still named.
// On a mismatch every rank gathers all 32-byte headers on `check_` and names every call. A rank
// that issues nothing more on the group leaves no fingerprint: a call still running after
// stall_check_after reads the notices its peers sent on `check_` (a peer failed, or left the group
// or the process), so those are named within seconds as well.
//
// An operation other than a checked allreduce (mpi_checked_allreduce.cc) is one non-blocking MPI
// call (MPI_Ibcast, ...) followed by MPI_Test polling until it completes or its deadline passes:
// polling keeps the deadline ours (MPI has none) and drives MPI's progress engine; it backs off
// from yielding to short sleeps so that ranks oversubscribing the cores leave them to each other.
// Collectives run one at a time so that a later call sees the buffers of an earlier one completed,
// as with the ring backend.
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <climits>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "comm/argument_checks.h"
#include "comm/group_front.h"
#include "comm/mpi/mpi_in_band_fingerprint.h"
#include "comm/mpi/mpi_p2p.h"
#include "comm/mpi/mpi_runtime.h"
#include "comm/reduce_kernels.h"
#include "comm/wire.h"
#include "ddp/comm/mpi_process_group.h"
#include "ddp/comm/process_group.h"
#include "ddp/error.h"
#include "settings/settings.h"

namespace ddp::comm::mpi {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

bool overlaps(const void* a, std::size_t a_bytes, const void* b, std::size_t b_bytes);
// One poll of `request`: whether it completed (or failed), with MPI's code in `rc`.
bool test_request(MPI_Request& request, int& rc, MPI_Status* status);
// Between two polls: spin at first (each MPI_Test drives MPI's progress; a small collective
// completes within microseconds, and a yield costs a system call each), then yield, then sleep
// up to 250 µs so that ranks oversubscribing the cores leave them to each other.
void back_off(int idle);
// MPI_Comm_idup / MPI_Iallreduce etc. polled against a deadline; false when it passed.
bool wait_request(MPI_Request& request, std::chrono::steady_clock::time_point deadline, int& rc,
                  MPI_Status* status = MPI_STATUS_IGNORE);
// How long a caller waiting for an operation that the worker runs polls before it sleeps (as the
// ring backend): a sleeping waiter's wake-up costs milliseconds on a busy host. Not when this
// host's ranks outnumber its cores, where polling would take a core from a peer.
std::chrono::microseconds waiter_spin(int local_size);

struct GroupOptions {
  std::string name;
  // Identifies the group in notices, also against an earlier group of the same name: the world
  // group's creation count in the process (the same on every rank, since creating one is
  // collective over MPI_COMM_WORLD), then "/sub<k>" per level of subgroup.
  std::string notice_key;
  milliseconds timeout{0};
  bool abort_on_failure = true;
  milliseconds stall_check_after{1000};
};

// The fingerprint exchange's buffers: on the heap, since after a failure MPI may still write the
// abandoned request's result into them (they are then kept until exit,
// MpiRuntime::keep_until_exit).
struct CheckBuffers {
  std::uint64_t mine[2] = {};
  std::uint64_t combined[2] = {};
};

// With abort_on_failure on, allreduces (and barriers) run as blocking MPI_Allreduce calls
// (run_checked_allreduce): MPI's non-blocking collectives cost about 1 µs more than the blocking
// ones, nearly all of a 1 KiB allreduce, and polling them costs more again once the host is busy
// (docs/benchmarks.md, "mpi backend").
// How often the watchdog of blocking calls looks at the one in flight.
constexpr auto kWatchdogInterval = milliseconds(50);

// The blocking call in flight (run_checked_allreduce), for the group's watchdog thread. The
// executor publishes it with a few relaxed stores and one release store of an odd `id` (even
// again when the call returned): no lock and no wake-up on the path of every small allreduce. The
// watchdog polls it every kWatchdogInterval and reads it as a sequence lock (id unchanged around
// the reads).
struct BlockingWatch {
  std::mutex mutex;  // with cv: only to stop the watchdog
  std::condition_variable cv;
  bool stop = false;
  bool p2p_posted = false;  // a point-to-point operation was posted: poll it
  std::atomic<std::uint64_t> id{0};
  std::atomic<std::int64_t> deadline_ns{0};  // steady clock
  std::atomic<std::int64_t> timeout_ms{0};
  std::atomic<std::uint64_t> header[4] = {};  // the call's OpHeader

  void begin(const comm::OpHeader& h, Clock::time_point deadline, milliseconds timeout) {
    std::uint64_t words[4];
    std::memcpy(words, &h, sizeof words);
    for (int i = 0; i < 4; ++i)
      header[i].store(words[i], std::memory_order_relaxed);
    deadline_ns.store(deadline.time_since_epoch().count(), std::memory_order_relaxed);
    timeout_ms.store(timeout.count(), std::memory_order_relaxed);
    id.store(id.load(std::memory_order_relaxed) + 1, std::memory_order_release);  // odd
  }
  void end() { id.store(id.load(std::memory_order_relaxed) + 1, std::memory_order_release); }
};
static_assert(sizeof(comm::OpHeader) == 4 * sizeof(std::uint64_t));

// The last collective a group issued (for the notice when this rank leaves the group). Written
// by MpiWork::on_sequenced under the queue's lock (so one writer at a time), read by whoever sends
// the notice, as a sequence lock: a few plain stores on the path of every call, no lock.
class IssueLog {
 public:
  void record(const comm::OpHeader& header) {
    std::uint64_t words[4];
    std::memcpy(words, &header, sizeof words);
    const std::uint64_t version = version_.load(std::memory_order_relaxed);
    version_.store(version + 1, std::memory_order_relaxed);  // odd: being written
    std::atomic_thread_fence(std::memory_order_release);
    for (int i = 0; i < 4; ++i)
      words_[i].store(words[i], std::memory_order_relaxed);
    version_.store(version + 2, std::memory_order_release);
  }
  // The last collective issued, or nothing when none was.
  std::optional<comm::OpHeader> last() const {
    for (;;) {
      const std::uint64_t version = version_.load(std::memory_order_acquire);
      if (version == 0) return std::nullopt;
      std::uint64_t words[4];
      for (int i = 0; i < 4; ++i)
        words[i] = words_[i].load(std::memory_order_relaxed);
      std::atomic_thread_fence(std::memory_order_acquire);
      if (version % 2 == 0 && version_.load(std::memory_order_relaxed) == version) {
        comm::OpHeader header;
        std::memcpy(&header, words, sizeof header);
        return header;
      }
      std::this_thread::yield();
    }
  }

 private:
  std::atomic<std::uint64_t> version_{0};
  std::atomic<std::uint64_t> words_[4] = {};
};

// An operation on the group's comm::OpQueue (src/comm/op_queue.h: issue order, worker, inline
// execution by a waiting caller, poisoning).
class MpiProcessGroup final : public comm::GroupFront,
                              public comm::SequenceObserver,
                              public comm::mpi::ExitListener,
                              public std::enable_shared_from_this<MpiProcessGroup> {
 public:
  MpiProcessGroup(MPI_Comm comm, MPI_Comm check, MPI_Comm control, MPI_Comm p2p,
                  GroupOptions options, int rank, int size, int local_rank, int local_size,
                  std::vector<int> world_ranks)
      : GroupFront(rank, size, options.name, options.timeout,
                   comm::OpQueue::Options{
                       .group = options.name,
                       .rank = rank,
                       .size = size,
                       .spin = waiter_spin(local_size),
                       .flight_recorder = {.entries = settings::flight_recorder_entries(),
                                           .dump_dir = settings::dump_dir()},
                       .backend = "mpi",
                       .job_rank = settings::job_place().rank,
                       .job_world_size = settings::job_place().world_size},
                   this),
        comm_(comm),
        check_(check),
        control_(control),
        p2p_(p2p),
        options_(std::move(options)),
        local_rank_(local_rank),
        local_size_(local_size),
        world_ranks_(std::move(world_ranks)) {
    p2p_context_ = std::make_shared<const comm::mpi::P2pContext>(
        comm::mpi::P2pContext{.group = name(),
                              .notice_key = options_.notice_key,
                              .rank = rank,
                              .abort_on_failure = options_.abort_on_failure,
                              .stall_check_after = options_.stall_check_after});
    for (std::size_t d = 0; d < kDTypes; ++d) {
      for (std::size_t o = 0; o < kReduceOps; ++o) {
        (*in_band_)[d * kReduceOps + o] =
            InBandFingerprint(static_cast<DType>(d), static_cast<ReduceOp>(o), size);
      }
    }
    MpiRuntime::instance().add_exit_listener(this);
  }
  ~MpiProcessGroup() override;
  void start() { start_queue(weak_from_this()); }

  std::string_view backend() const override { return "mpi"; }
  int local_rank() const override { return local_rank_; }
  int local_size() const override { return local_size_; }
  void on_process_exit() override { notify_peers(left_notice("the process exited")); }
  // comm::SequenceObserver: the last call issued, for the "left" notices.
  void on_sequenced(const comm::OpHeader& header) noexcept override { issue_log_.record(header); }

 protected:
  // comm::GroupFront: the backend's part of each call.
  void run_call(Call& call, net::Deadline deadline) override;
  void on_poison(const std::string& reason) noexcept override;
  // Posts a send/recv at once, past the queue (comm/mpi/mpi_p2p.h).
  std::shared_ptr<Work> post_send(const void* buf, std::size_t count, DType dtype, int dst, int tag,
                                  CallOptions options) override {
    return post_p2p(
        comm::mpi::P2pCall{
            .is_recv = false, .send = buf, .count = count, .dtype = dtype, .peer = dst, .tag = tag},
        options);
  }
  std::shared_ptr<Work> post_recv(void* buf, std::size_t count, DType dtype, int src, int tag,
                                  CallOptions options) override {
    return post_p2p(
        comm::mpi::P2pCall{
            .is_recv = true, .recv = buf, .count = count, .dtype = dtype, .peer = src, .tag = tag},
        options);
  }
  std::shared_ptr<Work> post_recv_any_source(void* buf, std::size_t count, DType dtype, int* source,
                                             int tag, CallOptions options) override {
    return post_p2p(comm::mpi::P2pCall{.is_recv = true,
                                       .recv = buf,
                                       .count = count,
                                       .dtype = dtype,
                                       .peer = MPI_ANY_SOURCE,
                                       .tag = tag,
                                       .source = source},
                    options);
  }
  std::shared_ptr<ProcessGroup> make_subgroup(std::vector<int> ranks) override;
  // One MPI call takes an int count.
  std::size_t max_count() const override { return static_cast<std::size_t>(INT_MAX); }
  int min_tag() const override { return 0; }
  int max_tag() const override { return MpiRuntime::instance().max_tag(); }

 private:
  std::shared_ptr<Work> post_p2p(comm::mpi::P2pCall call, CallOptions options);
  // Starts the watchdog thread once (the first blocking call or point-to-point operation).
  void ensure_watchdog();

  void run_op(Call& op, Clock::time_point deadline);
  // Starts the MPI call of `op` (under the runtime lock); returns MPI's code.
  int start(Call& op, MPI_Request* request);
  CommError error(const Call& op, CommErrorKind kind, const std::string& what) const {
    const std::string description = op.description();
    return CommError(kind,
                     fmt::format("rank {} of group '{}' (mpi backend): {} {}", rank(), name(),
                                 description, what),
                     name(), description, op.header.sequence, -1);
  }
  // Polls the data request and the fingerprint request of `op` until both completed; throws the
  // CommError of a mismatch, an MPI error, a peer's notice or the deadline.
  void wait_for_op(Call& op, Clock::time_point deadline, MPI_Request& data, MPI_Request& check);
  // What a polled operation checks between polls: check() throws the CommError of its passed
  // deadline (with a peer's notice, if one came), or, once it has run for stall_check_after, of a
  // peer's notice or a peer that issued a different call at this sequence number (every 10 ms).
  class StallCheck {
   public:
    StallCheck(MpiProcessGroup& group, const Call& op, Clock::time_point deadline);
    void check();

   private:
    MpiProcessGroup& group_;
    const Call& op_;
    const Clock::time_point deadline_;
    Clock::time_point next_notice_check_;
    bool announced_ = false;
  };
  // The most bytes (fingerprint and payload) an allreduce on a group of `world` ranks may have to
  // run as run_small_allreduce (mpi_small_allreduce.cc).
  static std::size_t small_allreduce_max_bytes(int world);
  // The in-band checked allreduce of small buffers (mpi_small_allreduce.cc): recursive doubling
  // over point-to-point messages, polled.
  void run_small_allreduce(Call& op, const InBandFingerprint& in_band, DType dtype,
                           ReduceOp reduce_op, Clock::time_point deadline);
  // Combines `bytes` at `mine` (`elements` of `dtype`) with every rank's by `combine`, using
  // `theirs` (as large) for what the peers send. With `leave_last_step`, may return true with
  // the last step's data received into `theirs` but not yet combined into `mine` (the caller
  // combines it where it wants the result); false when `mine` holds the result.
  bool recursive_doubling(Call& op, std::byte* mine, std::byte* theirs, std::size_t bytes,
                          std::size_t elements, DType dtype, ReduceOp combine, bool leave_last_step,
                          Clock::time_point deadline);
  // One step of it: posts a receive from `peer` into `into` (when not null) and a send of
  // `bytes` from `from` (when not null), and polls both to completion; a message of another size
  // is a mismatch.
  void exchange_step(Call& op, int peer, const std::byte* from, std::byte* into, std::size_t bytes,
                     StallCheck& stall, Clock::time_point deadline);
  bool use_checked_allreduce(const Call& op) const;
  void run_checked_allreduce(Call& op, Clock::time_point deadline);
  // The data where it lies, its fingerprint in an allreduce of its own first.
  void run_separately_checked(Call& op, Clock::time_point deadline);
  const InBandFingerprint& in_band_fingerprint(DType dtype, ReduceOp op) const;
  void watchdog_loop(const std::weak_ptr<MpiProcessGroup>& weak,
                     const std::shared_ptr<std::atomic<bool>>& destroyed_here);
  // The watchdog's look at the blocking call in flight (run_checked_allreduce): ends the job when
  // it passed its deadline or a stall check names why it cannot complete.
  void check_blocking_call(std::uint64_t& announced_id);
  // For a call of this rank stalled in `header`: sends the peers its fingerprint (once per call)
  // and returns what makes the call impossible, if anything is known: a peer that issued a
  // different call at this sequence number, or a peer's notice (failed, left). Else nullopt.
  std::optional<CommError> stall_problem(const Call& op, bool& announced);
  [[noreturn]] void fail_mismatch(const Call& op, Clock::time_point deadline,
                                  const CommError* fallback = nullptr);
  // The first notice a peer sent about this group (empty when none).
  // (Not the stall fingerprints: stall_problem reads those.)
  std::string receive_notice() {
    for (std::string& text : MpiRuntime::instance().notices(options_.notice_key)) {
      if (text.rfind("stall ", 0) != 0) return std::move(text);
    }
    return {};
  }
  // Sends `text` to every other rank of the group, without waiting (never blocks). Once.
  void notify_peers(const std::string& text);
  std::string left_notice(std::string_view why);
  std::string failed_notice(const std::string& reason) const;

  MPI_Comm comm_;
  MPI_Comm check_;
  MPI_Comm control_;
  MPI_Comm p2p_;  // point-to-point only: never matches the collectives' traffic
  GroupOptions options_;
  int local_rank_;
  int local_size_;
  std::vector<int> world_ranks_;  // of each rank of the group, for notices
  std::unique_ptr<CheckBuffers> check_buffers_ = std::make_unique<CheckBuffers>();
  std::atomic<bool> left_{false};  // the "left" notice went out
  IssueLog issue_log_;
  BlockingWatch watch_;
  std::thread watchdog_;  // started by ensure_watchdog
  std::once_flag watchdog_once_;
  std::atomic<bool> watchdog_started_{false};
  // Set by the destructor: when the watchdog thread itself dropped the last reference, it must
  // not touch the group any more.
  std::shared_ptr<std::atomic<bool>> destroyed_ = std::make_shared<std::atomic<bool>>(false);
  std::shared_ptr<const comm::mpi::P2pContext> p2p_context_;
  comm::mpi::P2pPending p2p_pending_;
  std::vector<std::byte> packed_;  // run() only: the checked allreduce's buffers
  const std::size_t small_allreduce_max_bytes_ = small_allreduce_max_bytes(size());
  // The in-band encoding of each (dtype, reduce op) for this group's size.
  static constexpr std::size_t kDTypes = 8;
  static constexpr std::size_t kReduceOps = 8;
  std::unique_ptr<std::array<InBandFingerprint, kDTypes* kReduceOps>> in_band_ =
      std::make_unique<std::array<InBandFingerprint, kDTypes * kReduceOps>>();

  std::mutex new_group_mutex_;
  int subgroups_created_ = 0;
  std::exception_ptr control_error_;  // new_group timed out: control_ is unusable

  // run() only (one thread at a time): copies of inputs that overlap outputs.
  std::vector<std::byte> scratch_;
};

}  // namespace ddp::comm::mpi
