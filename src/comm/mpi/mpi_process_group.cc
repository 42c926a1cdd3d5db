// The mpi backend: the per-group queue and worker, deadlines over MPI_Test, mismatch detection,
// poisoning (and aborting the job), subgroups.
//
// Each group owns three duplicates of its communicator: `comm_` carries the operations' data and
// `check_` their fingerprints and the notices between ranks (both used by whichever thread runs
// the operations, in issue order), and `control_` is used only by new_group on the caller's thread.
// Separate communicators keep new_group's own collectives from interleaving, in a different order
// on different ranks, with the operations running meanwhile, and keep a mismatched data operation
// (which MPI may match with the wrong call) from disturbing the fingerprint exchange.
//
// Mismatches. Alongside every collective, a 16-byte MPI_Iallreduce(MAX) on `check_` combines the
// (hash, ~hash) of each rank's call (kind, dtype, count, root, reduce op, sequence number): the
// result equals this rank's pair on every rank exactly when every rank issued the same call. It
// is polled together with the data operation (measured: no added latency at world 2, since MPI
// progresses both at once; docs/benchmarks.md) and the operation completes only when both have,
// so a count mismatch that MPI answers with a short receive (no error, wrong data) is still named.
// On a mismatch every rank gathers all 32-byte headers on `check_` and names every call. A rank
// that issues nothing more on the group leaves no fingerprint: a call still running after
// stall_check_after reads the notices its peers sent on `check_` (a peer failed, or left the group
// or the process), so those are named within seconds as well.
//
// An operation is one non-blocking MPI call (MPI_Iallreduce, MPI_Ibcast, ...) followed by
// MPI_Test polling until it completes or its deadline passes: polling keeps the deadline ours (MPI
// has none) and drives MPI's progress engine; it backs off from yielding to short sleeps so that
// ranks oversubscribing the cores leave them to each other. Operations run one at a time so that
// a later call sees the buffers of an earlier one completed, as with the ring backend.
#include "ddp/mpi_process_group.h"

#include <algorithm>
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
#include "comm/mpi/mpi_p2p.h"
#include "comm/mpi/mpi_runtime.h"
#include "comm/op_queue.h"
#include "comm/reduce_kernels.h"
#include "comm/ring/wire.h"
#include "ddp/error.h"
#include "ddp/rendezvous.h"

namespace ddp {
namespace {

using comm::OpKind;
using comm::mpi::mpi_error_text;
using comm::mpi::MpiRuntime;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

struct MpiOp {
  OpKind kind = OpKind::kAllreduce;
  const std::byte* send = nullptr;
  std::byte* recv = nullptr;
  std::size_t count = 0;
  DType dtype = DType::kFloat32;
  ReduceOp op = ReduceOp::kSum;
  int root = -1;  // or the tag of a send/recv
  int peer = -1;  // send/recv
  bool is_recv = false;
  comm::OpHeader header;  // the fingerprint compared across ranks (collectives)
  milliseconds timeout{0};

  // Formatted when needed (errors), not on every call: it allocates.
  std::string description() const {
    return kind == OpKind::kSend ? comm::describe(header, peer, is_recv) : comm::describe(header);
  }
};

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
bool wait_request(MPI_Request& request, Clock::time_point deadline, int& rc,
                  MPI_Status* status = MPI_STATUS_IGNORE) {
  for (int idle = 0;; ++idle) {
    if (test_request(request, rc, status)) return true;
    if (Clock::now() >= deadline) return false;
    back_off(idle);
  }
}

class MpiProcessGroup;

// How long a caller waiting for an operation that the worker runs polls before it sleeps (as the
// ring backend): a sleeping waiter's wake-up costs milliseconds on a busy host. Not when this
// host's ranks outnumber its cores, where polling would take a core from a peer.
std::chrono::microseconds waiter_spin(int local_size) {
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  return static_cast<unsigned>(local_size) <= cores ? std::chrono::microseconds(50)
                                                    : std::chrono::microseconds(0);
}

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
// abandoned request's result into them (they are then leaked with the communicator).
struct CheckBuffers {
  std::uint64_t mine[2] = {};
  std::uint64_t combined[2] = {};
};

std::uint64_t hash_bytes(const void* data, std::size_t n) {
  std::uint64_t h = 14695981039346656037ull;  // FNV-1a
  const auto* p = static_cast<const unsigned char*>(data);
  for (std::size_t i = 0; i < n; ++i) {
    h ^= p[i];
    h *= 1099511628211ull;
  }
  return h;
}

// With abort_on_failure on, allreduces (and barriers) run as blocking MPI_Allreduce calls
// (run_checked_allreduce): MPI's non-blocking collectives cost about 1 µs more than the blocking
// ones, nearly all of a 1 KiB allreduce, and polling them costs more again once the host is busy
// (docs/benchmarks.md, "mpi backend").
// Up to this many bytes with its 32-byte header, the fingerprint travels in-band (one call);
// above, in a 16-byte allreduce of its own before the data (two calls, no copies). 4 KiB is
// OpenMPI's shared-memory eager limit (btl_vader_eager_limit): a message past it takes a
// rendezvous round trip, which made a packed 4 KiB allreduce 1.45x slower than the plain one.
constexpr std::size_t kInBandMaxBytes = 4096;
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
// by MpiWork::on_sequenced under the queue's lock, read by whoever sends the notice.
struct IssueLog {
  std::mutex mutex;
  std::uint64_t issued = 0;
  comm::OpHeader last;
};

// An operation on the group's comm::OpQueue (src/comm/op_queue.h: issue order, worker, inline
// execution by a waiting caller, poisoning).
class MpiWork final : public comm::QueuedWork {
 public:
  MpiWork(MpiOp op, IssueLog* log)
      : QueuedWork(op.timeout, op.count * dtype_size(op.dtype)), op_(std::move(op)), log_(log) {}
  MpiOp& op() { return op_; }
  std::string description() const override { return op_.description(); }

 protected:
  void on_sequenced(std::uint64_t sequence) override {
    op_.header.sequence = sequence;
    if (op_.kind == OpKind::kSend) return;
    std::lock_guard lock(log_->mutex);
    log_->issued = sequence + 1;
    log_->last = op_.header;
  }

 private:
  MpiOp op_;
  IssueLog* log_;  // the group's; outlives every enqueue
};

class MpiProcessGroup final : public ProcessGroup,
                              public comm::OpQueue::Runner,
                              public comm::mpi::ExitListener,
                              public std::enable_shared_from_this<MpiProcessGroup> {
 public:
  MpiProcessGroup(MPI_Comm comm, MPI_Comm check, MPI_Comm control, MPI_Comm p2p,
                  GroupOptions options, int rank, int size, int local_rank, int local_size,
                  std::vector<int> world_ranks)
      : ProcessGroup(rank, size),
        comm_(comm),
        check_(check),
        control_(control),
        p2p_(p2p),
        options_(std::move(options)),
        name_(options_.name),
        timeout_(options_.timeout),
        local_rank_(local_rank),
        local_size_(local_size),
        world_ranks_(std::move(world_ranks)),
        queue_(*this,
               comm::OpQueue::Options{
                   .group = name_, .rank = rank, .size = size, .spin = waiter_spin(local_size)}) {
    p2p_context_ = std::make_shared<const comm::mpi::P2pContext>(
        comm::mpi::P2pContext{.group = name_,
                              .notice_key = options_.notice_key,
                              .rank = rank,
                              .abort_on_failure = options_.abort_on_failure,
                              .stall_check_after = options_.stall_check_after});
    MpiRuntime::instance().add_exit_listener(this);
  }
  ~MpiProcessGroup() override;
  void start() { queue_.start(weak_from_this()); }

  std::string_view backend() const override { return "mpi"; }
  int local_rank() const override { return local_rank_; }
  int local_size() const override { return local_size_; }
  void on_process_exit() override { notify_peers(left_notice("the process exited")); }
  using ProcessGroup::allreduce;

  std::shared_ptr<Work> allreduce(const void* send, void* recv, std::size_t count, DType dtype,
                                  ReduceOp op, CallOptions options) override {
    check_buffer(send, count, "allreduce", "send");
    check_buffer(recv, count, "allreduce", "recv");
    return enqueue(make_op(OpKind::kAllreduce, send, recv, count, dtype, op, -1), options);
  }

  std::shared_ptr<Work> broadcast(void* buf, std::size_t count, DType dtype, int root,
                                  CallOptions options) override {
    check_buffer(buf, count, "broadcast", "buf");
    check_rank(root, "broadcast", "root");
    return enqueue(make_op(OpKind::kBroadcast, buf, buf, count, dtype, std::nullopt, root),
                   options);
  }

  std::shared_ptr<Work> reduce(const void* send, void* recv, std::size_t count, DType dtype,
                               ReduceOp op, int root, CallOptions options) override {
    check_rank(root, "reduce", "root");
    check_buffer(send, count, "reduce", "send");
    if (rank() == root) check_buffer(recv, count, "reduce", "recv (at the root)");
    return enqueue(make_op(OpKind::kReduce, send, recv, count, dtype, op, root), options);
  }

  std::shared_ptr<Work> allgather(const void* send, void* recv, std::size_t count_per_rank,
                                  DType dtype, CallOptions options) override {
    check_buffer(send, count_per_rank, "allgather", "send");
    check_buffer(recv, count_per_rank, "allgather", "recv");
    return enqueue(make_op(OpKind::kAllgather, send, recv, count_per_rank, dtype, std::nullopt, -1),
                   options);
  }

  std::shared_ptr<Work> gather(const void* send, void* recv, std::size_t count_per_rank,
                               DType dtype, int root, CallOptions options) override {
    check_rank(root, "gather", "root");
    check_buffer(send, count_per_rank, "gather", "send");
    if (rank() == root) check_buffer(recv, count_per_rank, "gather", "recv (at the root)");
    return enqueue(make_op(OpKind::kGather, send, recv, count_per_rank, dtype, std::nullopt, root),
                   options);
  }

  std::shared_ptr<Work> scatter(const void* send, void* recv, std::size_t count_per_rank,
                                DType dtype, int root, CallOptions options) override {
    check_rank(root, "scatter", "root");
    if (rank() == root) check_buffer(send, count_per_rank, "scatter", "send (at the root)");
    check_buffer(recv, count_per_rank, "scatter", "recv");
    return enqueue(make_op(OpKind::kScatter, send, recv, count_per_rank, dtype, std::nullopt, root),
                   options);
  }

  std::shared_ptr<Work> reduce_scatter(const void* send, void* recv, std::size_t count_per_rank,
                                       DType dtype, ReduceOp op, CallOptions options) override {
    check_buffer(send, count_per_rank, "reduce_scatter", "send");
    check_buffer(recv, count_per_rank, "reduce_scatter", "recv");
    return enqueue(make_op(OpKind::kReduceScatter, send, recv, count_per_rank, dtype, op, -1),
                   options);
  }

  std::shared_ptr<Work> alltoall(const void* send, void* recv, std::size_t count_per_rank,
                                 DType dtype, CallOptions options) override {
    check_buffer(send, count_per_rank, "alltoall", "send");
    check_buffer(recv, count_per_rank, "alltoall", "recv");
    return enqueue(make_op(OpKind::kAlltoall, send, recv, count_per_rank, dtype, std::nullopt, -1),
                   options);
  }

  std::shared_ptr<Work> barrier(CallOptions options) override {
    return enqueue(make_op(OpKind::kBarrier, nullptr, nullptr, 0, DType::kUInt8, std::nullopt, -1),
                   options);
  }

  std::shared_ptr<Work> send(const void* buf, std::size_t count, DType dtype, int dst, int tag,
                             CallOptions options) override {
    check_buffer(buf, count, "send", "buf");
    check_peer(dst, "send", "dst");
    check_tag(tag, "send");
    return post_p2p(
        comm::mpi::P2pCall{
            .is_recv = false, .send = buf, .count = count, .dtype = dtype, .peer = dst, .tag = tag},
        options);
  }

  std::shared_ptr<Work> recv(void* buf, std::size_t count, DType dtype, int src, int tag,
                             CallOptions options) override {
    check_buffer(buf, count, "recv", "buf");
    check_peer(src, "recv", "src");
    check_tag(tag, "recv");
    return post_p2p(
        comm::mpi::P2pCall{
            .is_recv = true, .recv = buf, .count = count, .dtype = dtype, .peer = src, .tag = tag},
        options);
  }

  std::shared_ptr<ProcessGroup> new_group(std::vector<int> ranks) override;

 private:
  MpiOp make_op(OpKind kind, const void* send, void* recv, std::size_t count, DType dtype,
                std::optional<ReduceOp> op, int root) const;
  std::shared_ptr<Work> enqueue(MpiOp op, CallOptions options);
  // Posts a send/recv at once, past the queue (comm/mpi/mpi_p2p.h).
  std::shared_ptr<Work> post_p2p(comm::mpi::P2pCall call, CallOptions options);
  // Starts the watchdog thread once (the first blocking call or point-to-point operation).
  void ensure_watchdog();

  // comm::OpQueue::Runner.
  void run(comm::QueuedWork& work, net::Deadline deadline) override;
  void on_poison(const std::string& reason) noexcept override;

  void run_op(MpiOp& op, Clock::time_point deadline);
  // Starts the MPI call of `op` (under the runtime lock); returns MPI's code.
  int start(MpiOp& op, MPI_Request* request);
  CommError error(const MpiOp& op, const std::string& what) const {
    const std::string description = op.description();
    return CommError(
        fmt::format("rank {} of group '{}' (mpi backend): {} {}", rank(), name_, description, what),
        name_, description, op.header.sequence, op.peer);
  }
  // Polls the data request and the fingerprint request of `op` until both completed; throws the
  // CommError of a mismatch, an MPI error, a peer's notice or the deadline.
  void wait_for_op(MpiOp& op, Clock::time_point deadline, MPI_Request& data, MPI_Request& check,
                   MPI_Status* status);
  bool use_checked_allreduce(const MpiOp& op) const;
  void run_checked_allreduce(MpiOp& op, Clock::time_point deadline);
  void watchdog_loop(const std::weak_ptr<MpiProcessGroup>& weak,
                     const std::shared_ptr<std::atomic<bool>>& destroyed_here);
  // The watchdog's look at the blocking call in flight (run_checked_allreduce): ends the job when
  // it passed its deadline or a stall check names why it cannot complete.
  void check_blocking_call(std::uint64_t& announced_id);
  // For a call of this rank stalled in `header`: sends the peers its fingerprint (once per call)
  // and returns what makes the call impossible, if anything is known: a peer that issued a
  // different call at this sequence number, or a peer's notice (failed, left). Else empty.
  std::string stall_problem(const comm::OpHeader& header, bool& announced);
  [[noreturn]] void fail_mismatch(const MpiOp& op, Clock::time_point deadline,
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

  void check_buffer(const void* p, std::size_t count, const char* op, const char* name) const;
  void check_rank(int r, const char* op, const char* name) const;
  void check_peer(int r, const char* op, const char* name) const;
  void check_tag(int tag, const char* op) const;

  MPI_Comm comm_;
  MPI_Comm check_;
  MPI_Comm control_;
  MPI_Comm p2p_;  // point-to-point only: never matches the collectives' traffic
  GroupOptions options_;
  std::string name_;
  milliseconds timeout_;
  int local_rank_;
  int local_size_;
  std::vector<int> world_ranks_;  // of each rank of the group, for notices
  std::unique_ptr<CheckBuffers> check_buffers_ = std::make_unique<CheckBuffers>();
  std::atomic<bool> left_{false};  // the "left" notice went out
  IssueLog issue_log_;
  BlockingWatch watch_;
  std::thread watchdog_;  // started by ensure_watchdog
  std::once_flag watchdog_once_;
  // Set by the destructor: when the watchdog thread itself dropped the last reference, it must
  // not touch the group any more.
  std::shared_ptr<std::atomic<bool>> destroyed_ = std::make_shared<std::atomic<bool>>(false);
  std::shared_ptr<const comm::mpi::P2pContext> p2p_context_;
  comm::mpi::P2pPending p2p_pending_;
  std::vector<std::byte> packed_;  // run() only: the checked allreduce's buffers
  std::size_t packed_bytes_ = SIZE_MAX;
  MPI_Datatype packed_type_ = MPI_DATATYPE_NULL;

  std::mutex new_group_mutex_;
  int subgroups_created_ = 0;
  std::exception_ptr control_error_;  // new_group timed out: control_ is unusable

  // run() only (one thread at a time): copies of inputs that overlap outputs.
  std::vector<std::byte> scratch_;
  // Last: stopped first (in the destructor), before the state run() uses goes away.
  comm::OpQueue queue_;
};

MpiProcessGroup::~MpiProcessGroup() {
  MpiRuntime::instance().remove_exit_listener(this);
  queue_.stop();  // before the state run() uses goes away
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
  if (finalized || queue_.poisoned()) {
    static_cast<void>(check_buffers_.release());
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

std::string MpiProcessGroup::left_notice(std::string_view why) {
  std::lock_guard lock(issue_log_.mutex);
  return fmt::format("rank {} left group '{}' ({}) after issuing {} collectives{}", rank(), name_,
                     why, issue_log_.issued,
                     issue_log_.issued > 0
                         ? fmt::format(", the last {}", comm::describe(issue_log_.last))
                         : std::string());
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

void MpiProcessGroup::check_buffer(const void* p, std::size_t count, const char* op,
                                   const char* name) const {
  comm::check_buffer(p, count, op, name);
  if (count > static_cast<std::size_t>(INT_MAX)) {
    throw ConfigError(
        fmt::format("{}: count {} is above {} elements, the most one MPI call "
                    "takes; split the buffer into several calls",
                    op, count, INT_MAX));
  }
}

void MpiProcessGroup::check_rank(int r, const char* op, const char* name) const {
  comm::check_rank(r, size(), name_, op, name);
}

void MpiProcessGroup::check_peer(int r, const char* op, const char* name) const {
  comm::check_peer(r, rank(), size(), name_, op, name);
}

void MpiProcessGroup::check_tag(int tag, const char* op) const {
  const int max_tag = MpiRuntime::instance().max_tag();
  if (tag < 0 || tag > max_tag) {
    throw ConfigError(
        fmt::format("{}: tag {} is outside 0..{}, the tags this MPI accepts", op, tag, max_tag));
  }
}

MpiOp MpiProcessGroup::make_op(OpKind kind, const void* send, void* recv, std::size_t count,
                               DType dtype, std::optional<ReduceOp> op, int root) const {
  comm::check_enums(std::string(comm::to_string(kind)).c_str(), dtype, op);
  MpiOp result;
  result.kind = kind;
  result.send = static_cast<const std::byte*>(send);
  result.recv = static_cast<std::byte*>(recv);
  result.count = count;
  result.dtype = dtype;
  result.op = op.value_or(ReduceOp::kSum);
  result.root = root;
  return result;
}

std::shared_ptr<Work> MpiProcessGroup::enqueue(MpiOp op, CallOptions options) {
  op.timeout = comm::OpQueue::call_timeout(options, timeout_);
  // The same names as the ring backend's messages ("allreduce(float32 x 8, sum) #3"); the queue
  // sets the sequence number.
  op.header.kind = op.kind;
  op.header.dtype = static_cast<std::uint8_t>(op.dtype);
  op.header.reduce_op = op.kind == OpKind::kAllreduce || op.kind == OpKind::kReduce ||
                                op.kind == OpKind::kReduceScatter
                            ? static_cast<std::uint8_t>(op.op)
                            : comm::kNoReduceOp;
  op.header.count = op.count;
  op.header.root = op.root;
  using Channel = comm::OpQueue::Channel;
  const Channel channel = op.kind != OpKind::kSend ? Channel::collective()
                          : op.is_recv             ? Channel::recv_from(op.peer)
                                                   : Channel::send_to(op.peer);
  auto work = std::make_shared<MpiWork>(std::move(op), &issue_log_);
  queue_.enqueue(work, channel);
  return work;
}

std::shared_ptr<Work> MpiProcessGroup::post_p2p(comm::mpi::P2pCall call, CallOptions options) {
  comm::check_enums(call.is_recv ? "recv" : "send", call.dtype, std::nullopt);
  call.timeout = comm::OpQueue::call_timeout(options, timeout_);
  if (queue_.poisoned()) {
    // As every operation of a failed group: its first error, at once.
    auto failed = std::make_shared<comm::mpi::MpiP2pWork>(p2p_context_, call);
    failed->complete(queue_.poison_error());
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
void MpiProcessGroup::run(comm::QueuedWork& work, net::Deadline deadline) {
  MpiOp& op = static_cast<MpiWork&>(work).op();
  if (!options_.abort_on_failure) return run_op(op, deadline);
  try {
    run_op(op, deadline);
  } catch (const std::exception& e) {
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
    notify_peers(fmt::format("rank {} failed: {}", rank(), reason));
  } catch (...) {
    // Best effort: the peers then fail at their own deadlines.
  }
}

bool MpiProcessGroup::use_checked_allreduce(const MpiOp& op) const {
  // A blocking call cannot return a CommError at its deadline, only end the job (the watchdog);
  // under MPI_THREAD_SERIALIZED it would hold the process-wide MPI lock for its whole duration.
  // A barrier is the checked allreduce of a header alone (that is also what keeps the ranks'
  // exit from it as close together as MPI_Barrier's).
  return (op.kind == OpKind::kAllreduce || op.kind == OpKind::kBarrier) && size() > 1 &&
         options_.abort_on_failure && MpiRuntime::instance().thread_level() == MPI_THREAD_MULTIPLE;
}

// A small allreduce as one blocking MPI_Allreduce of [OpHeader | payload] with the runtime's
// checked operation: the fingerprints travel with the data, so the check costs no message of its
// own, and every rank's result says whether every rank issued the same call (a count mismatch
// included: the header says how many bytes to expect). The group's watchdog thread enforces the
// deadline and the stall checks, ending the job (abort_on_failure is on) since a blocking call
// cannot be interrupted.
void MpiProcessGroup::run_checked_allreduce(MpiOp& op, Clock::time_point deadline) {
  auto& runtime = MpiRuntime::instance();
  constexpr std::size_t kHeader = sizeof(comm::OpHeader);
  const std::size_t bytes = op.count * dtype_size(op.dtype);
  ensure_watchdog();
  if (kHeader + bytes > kInBandMaxBytes) {
    // The fingerprints first (equal everywhere exactly when every rank issued this call), then
    // the data where it lies.
    const std::uint64_t h = hash_bytes(&op.header, sizeof op.header);
    check_buffers_->mine[0] = h;
    check_buffers_->mine[1] = ~h;
    watch_.begin(op.header, deadline, op.timeout);
    int rc = MPI_Allreduce(check_buffers_->mine, check_buffers_->combined, 2, MPI_UINT64_T, MPI_MAX,
                           check_);
    if (rc == MPI_SUCCESS && (check_buffers_->combined[0] != check_buffers_->mine[0] ||
                              check_buffers_->combined[1] != check_buffers_->mine[1])) {
      watch_.end();
      fail_mismatch(op, deadline);
    }
    if (rc == MPI_SUCCESS) {
      const void* in = op.send;
      if (op.send == op.recv) {
        in = MPI_IN_PLACE;
      } else if (overlaps(op.send, bytes, op.recv, bytes)) {
        scratch_.assign(op.send, op.send + bytes);
        in = scratch_.data();
      }
      rc = MPI_Allreduce(in, op.recv, static_cast<int>(op.count), runtime.datatype(op.dtype),
                         runtime.reduce_op(op.dtype, op.op), comm_);
    }
    watch_.end();
    if (rc != MPI_SUCCESS) throw error(op, fmt::format("failed: {}", mpi_error_text(rc)));
    if (op.op == ReduceOp::kAvg) comm::divide(op.recv, op.count, op.dtype, size());
    return;
  }
  if (packed_.size() < 2 * (kHeader + bytes)) packed_.resize(2 * (kHeader + bytes));
  std::byte* in = packed_.data();
  std::byte* out = in + kHeader + bytes;
  std::memcpy(in, &op.header, kHeader);
  if (bytes > 0) std::memcpy(in + kHeader, op.send, bytes);
  if (bytes != packed_bytes_) {
    packed_type_ = runtime.packed_type(bytes);
    packed_bytes_ = bytes;
  }
  watch_.begin(op.header, deadline, op.timeout);
  const int rc = MPI_Allreduce(in, out, 1, packed_type_, runtime.checked_op(), comm_);
  watch_.end();
  if (rc != MPI_SUCCESS) {
    const CommError failed = error(op, fmt::format("failed: {}", mpi_error_text(rc)));
    fail_mismatch(op, deadline, &failed);
  }
  comm::OpHeader result;
  std::memcpy(&result, out, kHeader);
  if (result.reserved != 0) fail_mismatch(op, deadline);
  if (bytes > 0) std::memcpy(op.recv, out + kHeader, bytes);
  if (op.op == ReduceOp::kAvg) comm::divide(op.recv, op.count, op.dtype, size());
}

void MpiProcessGroup::ensure_watchdog() {
  std::call_once(watchdog_once_, [this] {
    watchdog_ = std::thread([this, weak = weak_from_this(), destroyed = destroyed_] {
      watchdog_loop(weak, destroyed);
    });
  });
}

// Every kWatchdogInterval: the blocking call in flight. Every kP2pPollInterval while
// point-to-point operations are pending (or at once when one is posted): polls them, completing
// them and running their callbacks without a waiter.
void MpiProcessGroup::watchdog_loop(const std::weak_ptr<MpiProcessGroup>& weak,
                                    const std::shared_ptr<std::atomic<bool>>& destroyed_here) {
  constexpr auto kP2pPollInterval = std::chrono::microseconds(500);
  std::uint64_t announced_id = 0;
  auto next_blocking_check = Clock::now() + kWatchdogInterval;
  for (;;) {
    {
      const bool p2p = !p2p_pending_.empty();
      std::unique_lock lock(watch_.mutex);
      watch_.cv.wait_for(lock,
                         p2p ? std::chrono::duration_cast<Clock::duration>(kP2pPollInterval)
                             : std::chrono::duration_cast<Clock::duration>(kWatchdogInterval),
                         [&] { return watch_.stop || watch_.p2p_posted; });
      if (watch_.stop) return;
      watch_.p2p_posted = false;
    }
    {
      // Held while the group is used: a callback run here cannot destroy it meanwhile.
      const std::shared_ptr<MpiProcessGroup> self = weak.lock();
      if (!self) return;
      p2p_pending_.poll_all();
      if (Clock::now() >= next_blocking_check) {
        next_blocking_check = Clock::now() + kWatchdogInterval;
        check_blocking_call(announced_id);
      }
    }
    // Released `self` last: the destructor ran on this thread, which must leave at once.
    if (destroyed_here->load()) return;
  }
}

void MpiProcessGroup::check_blocking_call(std::uint64_t& announced_id) {
  const std::uint64_t id = watch_.id.load(std::memory_order_acquire);
  if (id % 2 == 0) return;  // no call in flight
  std::uint64_t words[4];
  for (int i = 0; i < 4; ++i)
    words[i] = watch_.header[i].load(std::memory_order_relaxed);
  const Clock::time_point deadline{
      Clock::duration(watch_.deadline_ns.load(std::memory_order_relaxed))};
  const milliseconds timeout{watch_.timeout_ms.load(std::memory_order_relaxed)};
  std::atomic_thread_fence(std::memory_order_acquire);
  if (watch_.id.load(std::memory_order_relaxed) != id) return;  // changed while read
  const auto now = Clock::now();
  if (now - (deadline - timeout) < options_.stall_check_after) return;
  MpiOp op;  // for the message
  std::memcpy(&op.header, words, sizeof words);
  op.kind = op.header.kind;
  bool announced = announced_id == id;
  announced_id = id;
  const std::string problem = stall_problem(op.header, announced);
  if (!problem.empty()) MpiRuntime::abort_job(problem);
  if (now >= deadline) {
    MpiRuntime::abort_job(
        fmt::format("rank {} of group '{}' (mpi backend): {} did not complete within {} ms: "
                    "a rank of the group did not issue it, or is stuck or gone",
                    rank(), name_, op.description(), timeout.count()));
  }
}

std::string MpiProcessGroup::stall_problem(const comm::OpHeader& header, bool& announced) {
  auto& runtime = MpiRuntime::instance();
  const std::uint64_t mine = hash_bytes(&header, sizeof header);
  if (!announced) {
    announced = true;
    std::vector<int> peers;
    for (int r = 0; r < size(); ++r) {
      if (r != rank()) peers.push_back(world_ranks_[static_cast<std::size_t>(r)]);
    }
    // "stall RANK SEQUENCE HASH DESCRIPTION"
    runtime.send_notice(
        options_.notice_key, peers,
        fmt::format("stall {} {} {} {}", rank(), header.sequence, mine, comm::describe(header)));
  }
  for (const std::string& text : runtime.notices(options_.notice_key)) {
    if (text.rfind("stall ", 0) != 0) {
      return fmt::format("rank {} of group '{}' (mpi backend): {} cannot complete: {}", rank(),
                         name_, comm::describe(header), text);
    }
    int peer = -1;
    unsigned long long sequence = 0;
    unsigned long long hash = 0;
    int consumed = 0;
    if (std::sscanf(text.c_str(), "stall %d %llu %llu %n", &peer, &sequence, &hash, &consumed) <
            3 ||
        sequence != header.sequence || hash == mine) {
      continue;
    }
    return fmt::format(
        "collective mismatch in group '{}': rank {} called {} but rank {} called {}; every rank "
        "must issue the same collectives in the same order with the same count, dtype, op and "
        "root",
        name_, rank(), comm::describe(header), peer,
        text.substr(static_cast<std::size_t>(consumed)));
  }
  return {};
}

void MpiProcessGroup::run_op(MpiOp& op, Clock::time_point deadline) {
  if (use_checked_allreduce(op)) return run_checked_allreduce(op, deadline);
  const bool collective = op.kind != OpKind::kSend;
  MPI_Request check = MPI_REQUEST_NULL;
  if (collective && size() > 1) {
    const std::uint64_t h = hash_bytes(&op.header, sizeof op.header);
    check_buffers_->mine[0] = h;
    check_buffers_->mine[1] = ~h;
    auto lock = MpiRuntime::instance().lock();
    const int rc = MPI_Iallreduce(check_buffers_->mine, check_buffers_->combined, 2, MPI_UINT64_T,
                                  MPI_MAX, check_, &check);
    if (rc != MPI_SUCCESS) {
      throw error(op, fmt::format("could not start its fingerprint check: {}", mpi_error_text(rc)));
    }
  }
  MPI_Request request = MPI_REQUEST_NULL;
  // Zero elements move nothing; the fingerprint check still runs (a count of 0 on one rank and 8
  // on another is a mismatch).
  if (op.count != 0 || op.kind == OpKind::kBarrier || op.kind == OpKind::kSend) {
    const int rc = start(op, &request);
    if (rc != MPI_SUCCESS) throw error(op, fmt::format("could not start: {}", mpi_error_text(rc)));
  }
  MPI_Status status;
  wait_for_op(op, deadline, request, check, op.is_recv ? &status : MPI_STATUS_IGNORE);
  if (op.count == 0 && op.kind != OpKind::kBarrier && op.kind != OpKind::kSend) return;
  const std::size_t bytes = op.count * dtype_size(op.dtype);
  if (op.is_recv) {
    int received = 0;
    MPI_Get_count(&status, MpiRuntime::instance().datatype(op.dtype), &received);
    if (received != static_cast<int>(op.count)) {
      throw error(op, fmt::format("received {} elements from rank {} but expected {}: sender and "
                                  "receiver must agree on count and dtype",
                                  received, op.peer, op.count));
    }
  }
  const bool average = op.op == ReduceOp::kAvg;
  switch (op.kind) {
    case OpKind::kAllreduce:
    case OpKind::kReduceScatter:
      if (average) comm::divide(op.recv, op.count, op.dtype, size());
      break;
    case OpKind::kReduce:
      if (average && rank() == op.root) comm::divide(op.recv, op.count, op.dtype, size());
      break;
    case OpKind::kScatter:
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

void MpiProcessGroup::wait_for_op(MpiOp& op, Clock::time_point deadline, MPI_Request& data,
                                  MPI_Request& check, MPI_Status* status) {
  const auto start = Clock::now();
  const auto stall = start + options_.stall_check_after;
  auto next_notice_check = stall;
  const bool collective = op.kind != OpKind::kSend;
  bool announced = false;
  int data_rc = MPI_SUCCESS;
  for (int idle = 0;; ++idle) {
    if (check != MPI_REQUEST_NULL) {
      int rc = MPI_SUCCESS;
      const bool done = test_request(check, rc, MPI_STATUS_IGNORE);
      if (rc != MPI_SUCCESS) {
        throw error(op, fmt::format("failed in its fingerprint check: {}", mpi_error_text(rc)));
      }
      if (done && (check_buffers_->combined[0] != check_buffers_->mine[0] ||
                   check_buffers_->combined[1] != check_buffers_->mine[1])) {
        fail_mismatch(op, deadline);
      }
    }
    // An error (MPI_ERR_TRUNCATE for a count mismatch, say) is reported once the fingerprints
    // are known, so that a mismatch is named as one.
    if (data != MPI_REQUEST_NULL) test_request(data, data_rc, status);
    if (data == MPI_REQUEST_NULL && check == MPI_REQUEST_NULL) break;
    const auto now = Clock::now();
    if (now >= deadline) {
      // MPI cannot cancel a collective: the request stays posted and the group stays poisoned.
      const std::string notice = receive_notice();
      throw error(op, fmt::format("did not complete within {} ms: {}; this group is unusable "
                                  "from now on",
                                  op.timeout.count(),
                                  notice.empty() ? "a rank of the group did not issue it, or is "
                                                   "stuck or gone"
                                                 : notice));
    }
    if (now >= next_notice_check) {
      next_notice_check = now + milliseconds(10);
      if (collective) {
        const std::string problem = stall_problem(op.header, announced);
        if (!problem.empty())
          throw CommError(problem, name_, op.description(), op.header.sequence, -1);
      } else {
        const std::string notice = receive_notice();
        if (!notice.empty()) throw error(op, fmt::format("cannot complete: {}", notice));
      }
    }
    back_off(idle);
  }
  if (data_rc != MPI_SUCCESS) throw error(op, fmt::format("failed: {}", mpi_error_text(data_rc)));
}

// Every rank saw the same combined fingerprint, so every rank gets here for this call: gather all
// headers (bounded by the deadline) and name each rank's call. With `fallback` (an MPI error that
// may be a mismatch: MPI_ERR_TRUNCATE on the rank that got the longer message, whose peer sees a
// marked result) the gather waits 2 s at most, and `fallback` is thrown when it finds no
// difference.
void MpiProcessGroup::fail_mismatch(const MpiOp& op, Clock::time_point deadline,
                                    const CommError* fallback) {
  constexpr std::size_t kHeaderBytes = sizeof(comm::OpHeader);
  // On the heap and leaked on a timeout: MPI may still write it later.
  auto headers = std::make_unique<comm::OpHeader[]>(static_cast<std::size_t>(size()) + 1);
  headers[0] = op.header;
  MPI_Request request = MPI_REQUEST_NULL;
  int rc;
  {
    auto lock = MpiRuntime::instance().lock();
    rc = MPI_Iallgather(&headers[0], kHeaderBytes, MPI_BYTE, &headers[1], kHeaderBytes, MPI_BYTE,
                        check_, &request);
  }
  const std::string generic = fmt::format(
      "collective mismatch in group '{}': rank {} called {}, but not every rank of the group "
      "called the same; every rank must issue the same collectives in the same order with the "
      "same count, dtype, op and root",
      name_, rank(), op.description());
  const CommError unknown =
      fallback ? *fallback : CommError(generic, name_, op.description(), op.header.sequence, -1);
  if (rc != MPI_SUCCESS) throw unknown;
  const auto limit = std::min(deadline, Clock::now() + std::chrono::seconds(fallback ? 2 : 10));
  if (!wait_request(request, limit, rc) || rc != MPI_SUCCESS) {
    static_cast<void>(headers.release());
    throw unknown;
  }
  // Group the ranks by the call they issued: "rank 1 called broadcast(...) #3".
  std::vector<std::pair<std::string, std::vector<int>>> calls;
  int first_other = -1;
  for (int r = 0; r < size(); ++r) {
    const comm::OpHeader& theirs = headers[static_cast<std::size_t>(r) + 1];
    if (theirs == op.header) continue;
    if (first_other < 0) first_other = r;
    const std::string call = comm::describe(theirs);
    auto it =
        std::find_if(calls.begin(), calls.end(), [&](const auto& c) { return c.first == call; });
    if (it == calls.end()) {
      calls.push_back({call, {r}});
    } else {
      it->second.push_back(r);
    }
  }
  if (calls.empty()) throw unknown;
  std::vector<std::string> others;
  for (const auto& [call, ranks] : calls) {
    others.push_back(fmt::format("rank{} {} called {}", ranks.size() > 1 ? "s" : "",
                                 fmt::join(ranks, ", "), call));
  }
  throw CommError(fmt::format("collective mismatch in group '{}': rank {} called {} but {}; every "
                              "rank must issue the same collectives in the same order with the "
                              "same count, dtype, op and root",
                              name_, rank(), op.description(), fmt::join(others, " and ")),
                  name_, op.description(), op.header.sequence, first_other);
}

int MpiProcessGroup::start(MpiOp& op, MPI_Request* request) {
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
    case OpKind::kAllreduce: {
      const void* in = input(bytes, bytes);
      auto lock = runtime.lock();
      return MPI_Iallreduce(in, op.recv, count, type, reduce_op, comm_, request);
    }
    case OpKind::kBroadcast: {
      auto lock = runtime.lock();
      return MPI_Ibcast(op.recv, count, type, op.root, comm_, request);
    }
    case OpKind::kReduce: {
      const void* in = rank() == op.root ? input(bytes, bytes) : op.send;
      auto lock = runtime.lock();
      return MPI_Ireduce(in, rank() == op.root ? op.recv : nullptr, count, type, reduce_op, op.root,
                         comm_, request);
    }
    case OpKind::kAllgather: {
      std::byte* own = op.recv + static_cast<std::size_t>(rank()) * bytes;
      if (own != op.send) std::memmove(own, op.send, bytes);
      auto lock = runtime.lock();
      return MPI_Iallgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, op.recv, count, type, comm_,
                            request);
    }
    case OpKind::kGather: {
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
    case OpKind::kScatter: {
      auto lock = runtime.lock();
      if (rank() == op.root) {
        return MPI_Iscatter(op.send, count, type, MPI_IN_PLACE, count, type, op.root, comm_,
                            request);
      }
      return MPI_Iscatter(nullptr, count, type, op.recv, count, type, op.root, comm_, request);
    }
    case OpKind::kReduceScatter: {
      const void* in = input(all_bytes, bytes);
      auto lock = runtime.lock();
      return MPI_Ireduce_scatter_block(in, op.recv, count, type, reduce_op, comm_, request);
    }
    case OpKind::kAlltoall: {
      const void* in =
          overlaps(op.send, all_bytes, op.recv, all_bytes) ? private_copy(all_bytes) : op.send;
      auto lock = runtime.lock();
      return MPI_Ialltoall(in, count, type, op.recv, count, type, comm_, request);
    }
    case OpKind::kBarrier: {
      auto lock = runtime.lock();
      return MPI_Ibarrier(comm_, request);
    }
    case OpKind::kSend: {
      auto lock = runtime.lock();
      if (op.is_recv) {
        return MPI_Irecv(op.recv, count, type, op.peer, op.root, comm_, request);
      }
      return MPI_Isend(op.send, count, type, op.peer, op.root, comm_, request);
    }
  }
  return MPI_ERR_OTHER;
}

// This rank's position among the ranks of `comm` that share its host, and their number
// (MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)). Collective over `comm`; blocking, so call it only
// once every rank is known to be there.
std::pair<int, int> local_layout(MPI_Comm comm) {
  auto lock = MpiRuntime::instance().lock();
  MPI_Comm node = MPI_COMM_NULL;
  const int rc = MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node);
  if (rc != MPI_SUCCESS) {
    throw CommError(fmt::format("mpi backend: MPI_Comm_split_type(MPI_COMM_TYPE_SHARED) failed: {}",
                                mpi_error_text(rc)),
                    "", "local_layout", 0, -1);
  }
  int local_rank = 0;
  int local_size = 1;
  MPI_Comm_rank(node, &local_rank);
  MPI_Comm_size(node, &local_size);
  MPI_Comm_free(&node);
  return {local_rank, local_size};
}

std::uint64_t hash_ranks(const std::vector<int>& ranks) {
  std::uint64_t h = 14695981039346656037ull;  // FNV-1a
  auto mix = [&](std::uint64_t v) {
    for (int i = 0; i < 8; ++i) {
      h ^= (v >> (8 * i)) & 0xff;
      h *= 1099511628211ull;
    }
  };
  mix(ranks.size());
  for (int r : ranks)
    mix(static_cast<std::uint32_t>(r));
  return h;
}

std::shared_ptr<ProcessGroup> MpiProcessGroup::new_group(std::vector<int> ranks) {
  comm::check_subgroup_ranks(ranks, size(), name_);
  auto& runtime = MpiRuntime::instance();
  std::lock_guard guard(new_group_mutex_);
  if (control_error_) std::rethrow_exception(control_error_);
  const int index = subgroups_created_++;
  auto comm_error = [&](const std::string& what) {
    return CommError(fmt::format("rank {} of group '{}' (mpi backend): new_group({}) {}", rank(),
                                 name_, fmt::join(ranks, ", "), what),
                     name_, "new_group", 0, -1);
  };

  // Every rank must pass the same list: max over ranks of (h, ~h) is (h, ~h) on every rank iff
  // all hashes are equal. The Iallreduce also bounds the wait for the other ranks by a deadline;
  // the blocking MPI_Comm_split after it then finds every rank there.
  const std::uint64_t h = hash_ranks(ranks);
  // On the heap: after a timeout MPI may still write `most`, so the buffer is then leaked.
  auto buffer = std::make_unique<std::uint64_t[]>(4);
  std::uint64_t* mine = buffer.get();
  std::uint64_t* most = buffer.get() + 2;
  mine[0] = h;
  mine[1] = ~h;
  MPI_Request request = MPI_REQUEST_NULL;
  int rc;
  {
    auto lock = runtime.lock();
    rc = MPI_Iallreduce(mine, most, 2, MPI_UINT64_T, MPI_MAX, control_, &request);
  }
  if (rc != MPI_SUCCESS) throw comm_error(fmt::format("failed: {}", mpi_error_text(rc)));
  if (!wait_request(request, Clock::now() + timeout_, rc)) {
    // The request stays posted on control_ (and writes `most` if the peers come): never reuse it.
    static_cast<void>(buffer.release());
    control_error_ = std::make_exception_ptr(comm_error(fmt::format(
        "timed out after {} ms waiting for the other ranks of the group to call it (every rank "
        "of the group calls new_group, members or not)",
        timeout_.count())));
    std::rethrow_exception(control_error_);
  }
  if (rc != MPI_SUCCESS) throw comm_error(fmt::format("failed: {}", mpi_error_text(rc)));
  if (most[0] != h || most[1] != ~h) {
    throw ConfigError(
        fmt::format("new_group on group '{}': the ranks passed different rank lists "
                    "(rank {} passed [{}]); pass the same list on every rank",
                    name_, rank(), fmt::join(ranks, ", ")));
  }
  const auto it = std::find(ranks.begin(), ranks.end(), rank());
  const bool member = it != ranks.end();
  const int key = member ? static_cast<int>(it - ranks.begin()) : 0;
  MPI_Comm sub = MPI_COMM_NULL;
  MPI_Comm sub_check = MPI_COMM_NULL;
  MPI_Comm sub_control = MPI_COMM_NULL;
  MPI_Comm sub_p2p = MPI_COMM_NULL;
  {
    auto lock = runtime.lock();
    rc = MPI_Comm_split(control_, member ? 0 : MPI_UNDEFINED, key, &sub);
    if (rc == MPI_SUCCESS && member) rc = MPI_Comm_dup(sub, &sub_check);
    if (rc == MPI_SUCCESS && member) rc = MPI_Comm_dup(sub, &sub_control);
    if (rc == MPI_SUCCESS && member) rc = MPI_Comm_dup(sub, &sub_p2p);
    if (rc == MPI_SUCCESS && member) {
      MPI_Comm_set_errhandler(sub, MPI_ERRORS_RETURN);
      MPI_Comm_set_errhandler(sub_check, MPI_ERRORS_RETURN);
      MPI_Comm_set_errhandler(sub_control, MPI_ERRORS_RETURN);
      MPI_Comm_set_errhandler(sub_p2p, MPI_ERRORS_RETURN);
    }
  }
  if (rc != MPI_SUCCESS) throw comm_error(fmt::format("failed: {}", mpi_error_text(rc)));
  if (!member) return nullptr;
  const auto [local_rank, local_size] = local_layout(sub_control);
  GroupOptions options = options_;
  options.name = fmt::format("{}/sub{}", name_, index);
  options.notice_key = fmt::format("{}/sub{}", options_.notice_key, index);
  std::vector<int> world_ranks;
  for (int r : ranks)
    world_ranks.push_back(world_ranks_[static_cast<std::size_t>(r)]);
  auto group = std::make_shared<MpiProcessGroup>(
      sub, sub_check, sub_control, sub_p2p, std::move(options), key, static_cast<int>(ranks.size()),
      local_rank, local_size, std::move(world_ranks));
  group->start();
  return group;
}

}  // namespace

std::shared_ptr<ProcessGroup> make_mpi_process_group(MpiOptions options) {
  if (options.group_name.empty()) {
    throw ConfigError("make_mpi_process_group: MpiOptions::group_name is empty");
  }
  if (options.timeout.count() < 0) {
    throw ConfigError(
        fmt::format("MpiOptions::timeout is negative ({} ms); use a positive "
                    "value, or 0 for DDP_TIMEOUT / the default",
                    options.timeout.count()));
  }
  if (options.stall_check_after.count() <= 0) {
    throw ConfigError(fmt::format("MpiOptions::stall_check_after must be positive (got {} ms)",
                                  options.stall_check_after.count()));
  }
  const milliseconds timeout =
      options.timeout.count() > 0 ? options.timeout : resolve_timeout(std::nullopt);
  auto& runtime = MpiRuntime::instance();
  int world_rank = 0;
  int world_size = 0;
  // On the heap: after a timeout MPI may still complete the duplication into it (then leaked).
  // Data, check and control communicators (see the top of this file).
  // The first group also makes the process-wide communicator of notices (MpiRuntime).
  const int count = runtime.has_notice_comm() ? 3 : 4;
  auto comms_buffer = std::make_unique<MPI_Comm[]>(4);
  MPI_Comm* comms = comms_buffer.get();
  comms[0] = comms[1] = comms[2] = comms[3] = MPI_COMM_NULL;
  MPI_Request requests[4] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL, MPI_REQUEST_NULL,
                             MPI_REQUEST_NULL};
  int rc = MPI_SUCCESS;
  {
    auto lock = runtime.lock();
    MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
    MPI_Comm_size(MPI_COMM_WORLD, &world_size);
    // Later groups duplicate the notice communicator (MPI_ERRORS_RETURN) rather than
    // MPI_COMM_WORLD: an abandoned request of a failed group can make OpenMPI's progress engine
    // fail an MPI_Comm_idup in flight, and MPI_COMM_WORLD's handler (by default
    // MPI_ERRORS_ARE_FATAL) would then end the process.
    const MPI_Comm base = count == 4 ? MPI_COMM_WORLD : runtime.notice_comm();
    for (int i = 0; i < count && rc == MPI_SUCCESS; ++i) {
      rc = MPI_Comm_idup(base, &comms[i], &requests[i]);
    }
  }
  auto comm_error = [&](const std::string& what) {
    return CommError(fmt::format("rank {} of {} (mpi backend): creating group '{}' {}", world_rank,
                                 world_size, options.group_name, what),
                     options.group_name, "make_mpi_process_group", 0, -1);
  };
  if (rc != MPI_SUCCESS) throw comm_error(fmt::format("failed: {}", mpi_error_text(rc)));
  const auto deadline = Clock::now() + timeout;
  for (int i = 0; i < count; ++i) {
    if (!wait_request(requests[i], deadline, rc)) {
      static_cast<void>(comms_buffer.release());
      throw comm_error(
          fmt::format("timed out after {} ms waiting for every rank of "
                      "MPI_COMM_WORLD to call make_mpi_process_group",
                      timeout.count()));
    }
    if (rc != MPI_SUCCESS) throw comm_error(fmt::format("failed: {}", mpi_error_text(rc)));
  }
  {
    auto lock = runtime.lock();
    for (int i = 0; i < count; ++i)
      MPI_Comm_set_errhandler(comms[i], MPI_ERRORS_RETURN);
  }
  if (count == 4) runtime.set_notice_comm(comms[3]);
  // Point-to-point's own communicator (blocking: every rank completed the duplications above).
  MPI_Comm p2p = MPI_COMM_NULL;
  {
    auto lock = runtime.lock();
    rc = MPI_Comm_dup(comms[0], &p2p);
    if (rc == MPI_SUCCESS) MPI_Comm_set_errhandler(p2p, MPI_ERRORS_RETURN);
  }
  if (rc != MPI_SUCCESS) throw comm_error(fmt::format("failed: {}", mpi_error_text(rc)));
  const auto [local_rank, local_size] = local_layout(comms[2]);
  std::vector<int> world_ranks(static_cast<std::size_t>(world_size));
  for (int r = 0; r < world_size; ++r)
    world_ranks[static_cast<std::size_t>(r)] = r;
  auto group = std::make_shared<MpiProcessGroup>(
      comms[0], comms[1], comms[2], p2p,
      GroupOptions{.name = options.group_name,
                   .notice_key = std::to_string(runtime.next_world_group()),
                   .timeout = timeout,
                   .abort_on_failure = options.abort_on_failure,
                   .stall_check_after = options.stall_check_after},
      world_rank, world_size, local_rank, local_size, std::move(world_ranks));
  group->start();
  return group;
}

bool mpi_backend_available() {
  return true;
}

}  // namespace ddp
