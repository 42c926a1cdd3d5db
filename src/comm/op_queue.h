// OpQueue: the operation queue and scheduler of a process group, shared by the backends.
//
// A backend turns each call into a QueuedWork (its own subclass, carrying the call's arguments),
// hands it to enqueue(), and returns it to the caller as a Work. The queue does the rest:
//  - issue order: sequence numbers (one counter for collectives, one per peer and direction for
//    point-to-point) are assigned under the queue's lock, in the order operations are queued, and
//    operations run one at a time in that order;
//  - threads: one worker thread runs the queue; a caller waiting for its Work (Work::wait) runs
//    queued operations itself when nobody else is running them (no thread hand-off), and once
//    callers are seen to wait at once, the idle worker is not woken for small operations at all
//    ("lazy wake-up", docs/algorithms.md); after its last operation the worker lingers a moment;
//  - completion: every QueuedWork is completed exactly once, with its error or successfully;
//  - failure: the first error poisons the queue: the failing operation, everything queued and
//    everything queued later complete with that first error, and the backend's on_poison hook runs
//    (to tell the peers and shut its connections);
//  - the flight recorder (flight_recorder.h): the queue records each operation's queueing, start
//    and end in its group's FlightRecorder, under its lock and with the times it takes anyway, and
//    dumps it on the first error (timeout, mismatch, failure).
// What the backend supplies is Runner::run: "run this operation by this deadline", which throws
// on failure (CommError; any other std::exception is wrapped in a CommError naming the
// operation). run() is called on one thread at a time (the worker or a waiting caller), so a
// backend may keep per-operation scratch state without locking; it may block (e.g. on MPI calls).
//
// Lifetime: the backend owns the queue (usually a member), calls start() once it is owned by a
// shared_ptr, and stop() at the start of its destructor, before the state run() uses goes away.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "comm/flight_recorder.h"
#include "comm/wire.h"
#include "ddp/comm/process_group.h"
#include "ddp/comm/work.h"
#include "net/socket.h"

namespace ddp::comm {

class OpQueue;

// An operation on a queue. Backends derive from it to carry their arguments and to name the
// operation (description()).
class QueuedWork : public Work {
 public:
  // `bytes`: the operation's payload on this rank, for the lazy wake-up's size limit.
  QueuedWork(std::chrono::milliseconds timeout, std::size_t bytes)
      : Work(timeout), timeout_(timeout), bytes_(bytes), enqueued_at_(net::Clock::now()) {}

  std::chrono::milliseconds timeout() const { return timeout_; }
  std::size_t bytes() const { return bytes_; }
  net::Clock::time_point enqueued_at() const { return enqueued_at_; }
  // Assigned by OpQueue::enqueue.
  std::uint64_t sequence() const { return sequence_; }
  // The operation's fingerprint for the flight recorder (kind, dtype, count, root, reduce op), or
  // null when the backend has none. Read under the queue's lock right after on_sequenced.
  virtual const OpHeader* fingerprint() const { return nullptr; }

 protected:
  // Called once by OpQueue::enqueue under the queue's lock, with the operation's sequence number
  // (e.g. to put it into a message header). Must not block or call into the queue.
  virtual void on_sequenced(std::uint64_t sequence) { static_cast<void>(sequence); }
  void help_until_completed() override;

 private:
  friend class OpQueue;
  const std::chrono::milliseconds timeout_;
  const std::size_t bytes_;
  const net::Clock::time_point enqueued_at_;
  std::uint64_t sequence_ = 0;
  FlightRecorder::Handle flight_;  // its entry in the queue's FlightRecorder
  OpQueue* queue_ = nullptr;
  std::weak_ptr<const void> owner_;  // keeps the backend (and its queue) alive while helping
};

// For calls that do not go through an OpQueue (send/recv): by the rules of CallOptions::blocking,
// waits for `work` (throwing its error) and returns Work::completed_blocking_call(); else `work`.
inline std::shared_ptr<Work> finish_if_blocking(std::shared_ptr<Work> work,
                                                const CallOptions& options) {
  if (!options.blocking) return work;
  work->wait();
  return Work::completed_blocking_call();
}

class OpQueue {
 public:
  // What the backend does for the queue.
  class Runner {
   public:
    virtual ~Runner() = default;
    // Runs `work` (the backend's own subclass) by `deadline`; throws on failure. Called on one
    // thread at a time, in issue order.
    virtual void run(QueuedWork& work, net::Deadline deadline) = 0;
    // The queue was poisoned with an error whose text is `reason` (called each time an operation
    // fails, and by poison()): tell the peers, shut connections. Must not throw.
    virtual void on_poison(const std::string& reason) noexcept = 0;
  };

  struct Options {
    std::string group;  // for messages
    int rank = 0;       // for messages
    int size = 1;       // for messages and the flight recorder
    // After its last operation the worker stays awake this long, yielding the core, so that
    // back-to-back calls need no wake-up (0: it sleeps at once).
    std::chrono::microseconds worker_linger{0};
    // A caller waiting for an operation another thread runs polls this long before it sleeps.
    std::chrono::microseconds spin{0};
    // The flight recorder: off unless the backend passes the resolved settings
    // (DDP_FLIGHT_RECORDER_ENTRIES, DDP_DUMP_DIR), and what its dumps say about this process.
    FlightRecorderOptions flight_recorder{.entries = 0, .dump_dir = {}};
    std::string backend;
    int job_rank = -1;
    int job_world_size = -1;
  };

  OpQueue(Runner& runner, Options options);
  OpQueue(const OpQueue&) = delete;
  OpQueue& operator=(const OpQueue&) = delete;
  ~OpQueue();  // stop()

  // Starts the worker thread. `owner` is the object that owns this queue: a waiting caller keeps
  // it alive while it runs operations inline. Call once.
  void start(std::weak_ptr<const void> owner);
  // Stops the worker after the operations already queued (joins it; detaches it when called on
  // the worker itself, from a callback that dropped the last reference). Idempotent.
  void stop();

  // The timeout of a call: CallOptions::timeout when set, else the group's `fallback`. Throws
  // ConfigError for a negative timeout.
  static std::chrono::milliseconds call_timeout(const CallOptions& options,
                                                std::chrono::milliseconds fallback);

  // Assigns `work` the group's next sequence number and queues it; completes it at once with the
  // poison error when the queue is poisoned. Any thread. (Point-to-point operations do not come
  // here: each backend's p2p engine matches them by peer and tag, so they progress independently.)
  void enqueue(const std::shared_ptr<QueuedWork>& work);

  // Poisons the queue from outside an operation (e.g. a parent group failed): keeps the first
  // error, fails everything queued, calls on_poison. Any thread.
  void poison(std::exception_ptr error);
  bool poisoned() const { return poisoned_.load(std::memory_order_acquire); }
  // The first error, or null.
  std::exception_ptr poison_error() const;

  // Writes the flight recorder's dump now (e.g. before a backend ends the process on a failure);
  // `reason` as FlightRecorder::dump. Must not be called with the queue's lock held. Any thread.
  void dump_flight_recorder(std::string_view reason, const std::string& error) {
    recorder_.dump(reason, error);
  }
  const FlightRecorder& flight_recorder() const { return recorder_; }

  // Runs queued operations on the calling thread until `work` is done, unless another thread runs
  // them already (then polls for up to Options::spin and returns). For Work::wait.
  void run_inline_until(QueuedWork& work);

  // For blocking calls (CallOptions::blocking): when the group is idle (nothing queued or
  // running, not poisoned), assigns `work` its sequence number, runs it on the calling thread at
  // once and returns true, having thrown its error if it failed (the queue is then poisoned as by
  // any failure). Otherwise returns false without touching `work`: the caller queues it instead.
  // Keeps no reference to `work`, which may live on the caller's stack; no Work is allocated, and
  // the queue's lock is taken twice, against three times and the Work's own lock for
  // enqueue + wait (docs/mpi.md, "Blocking calls").
  bool try_run_now(QueuedWork& work);

  // A backend's call, by the rules of CallOptions::blocking. Blocking: a `WorkT` built on the
  // stack runs at once when the group is idle (try_run_now), or else is rebuilt on the heap from
  // its arguments (WorkT::take_arguments()), queued and waited for; either way the call throws the
  // operation's error and returns Work::completed_blocking_call(). Otherwise the WorkT is queued
  // and returned.
  template <class WorkT, class Arguments, class... Extra>
  std::shared_ptr<Work> submit(Arguments arguments, bool blocking, Extra... extra) {
    if (blocking) {
      WorkT now(std::move(arguments), extra...);
      if (try_run_now(now)) return Work::completed_blocking_call();
      auto queued = std::make_shared<WorkT>(now.take_arguments(), extra...);
      enqueue(queued);
      queued->wait();
      return Work::completed_blocking_call();
    }
    auto work = std::make_shared<WorkT>(std::move(arguments), extra...);
    enqueue(work);
    return work;
  }

 private:
  // Gives `work` the group's next sequence number and records it as queued. REQUIRES: mutex_ held.
  void assign_sequence(QueuedWork& work);
  void worker_loop();
  bool worker_should_run(net::Clock::time_point now) const;
  void worker_idle_wait(std::unique_lock<std::mutex>& lock);
  void linger(std::unique_lock<std::mutex>& lock);
  // Pops the next operation and records its start at `now`. REQUIRES: mutex_ held.
  std::shared_ptr<QueuedWork> pop_front(net::Clock::time_point now);
  // Runs `work` on this thread; its deadline counts from `start` (now, or just before). Returns
  // when it ended (read once, also the next operation's start); records a failure itself, and the
  // caller records a success under mutex_ (`ok`). A success completes `work` unless
  // `complete_success` is false (try_run_now: nobody waits for it).
  net::Clock::time_point execute(QueuedWork& work, net::Clock::time_point start, bool& ok,
                                 bool complete_success = true);
  void fail(QueuedWork& work, std::exception_ptr error);
  // Sets the poison (the first error wins) and returns it; `first`: whether it was this one.
  std::exception_ptr keep_first_error(std::exception_ptr error, bool& first);
  // The first error's dump: "timeout", "mismatch" or "failure", with its text.
  void dump_first_error(const std::exception_ptr& error);
  // Completes everything queued with `error`, then calls Runner::on_poison.
  void fail_queued(const std::exception_ptr& error);

  Runner& runner_;
  const Options options_;
  std::weak_ptr<const void> owner_;

  // Issue order: sequence numbers are assigned under mutex_.
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<QueuedWork>> queue_;
  bool stopping_ = false;
  std::uint64_t next_sequence_ = 0;

  // Whether a thread (the worker, or a waiter) holds the executor role. Guarded by mutex_.
  bool executing_ = false;
  bool worker_lingering_ = false;  // the worker polls the queue for a moment after its last work
  // Lazy wake-up (see worker_idle_wait): how many operations in a row a caller waited for at once
  // and ran itself; whether the idle worker polls the queue instead of sleeping until notified;
  // whether queued work was left to its caller without notifying the worker.
  int prompt_waits_ = 0;
  bool worker_polling_ = false;
  bool work_left_to_caller_ = false;
  net::Clock::time_point last_enqueue_{};
  std::thread worker_;

  // Written under mutex_ (see FlightRecorder).
  FlightRecorder recorder_;

  std::atomic<bool> poisoned_{false};
  mutable std::mutex poison_mutex_;
  std::exception_ptr poison_;
};

}  // namespace ddp::comm
