// Work: the result of an asynchronous operation of a ProcessGroup.
//
// A ProcessGroup call returns a std::shared_ptr<Work> at once; the operation runs later on the
// group's worker thread (or on a thread that waits for it, see below). Any thread may call any
// method, concurrently.
//
//   auto work = pg->allreduce(grads, n, ddp::DType::kFloat32, ddp::ReduceOp::kAvg);
//   work->then([](ddp::Work& w) { if (!w.error()) mark_ready(); });   // runs on completion
//   work->wait();                                                    // throws CommError on failure
//
// wait() (not wait_for) may run queued operations of the group on the calling thread (up to and
// including this one) when the worker is idle: that saves a thread hand-off per call, which
// dominates the latency of small collectives. Callbacks therefore run on whichever thread completed
// the operation, or on the caller of then() when the operation had already completed. A callback
// must not throw (exceptions are caught and reported on stderr) and must not wait for later work of
// the group.
//
// Chains and results: and_then() starts the next operation when this one has succeeded and returns
// a Work for the whole chain, so several collectives can run in a row without blocking the caller:
//
//   auto chain = pg->allreduce(p, n, dt, ddp::ReduceOp::kSum)
//                    ->and_then([&](ddp::Work&) { return pg->allreduce(q, m, dt, kSum); });
//   chain->wait();                        // both done (or the first error of either)
//
// Not for DDP comm hooks: a chain's next stage is issued when the previous one completes, which can
// fall before or after the next bucket's collectives differently on each rank; a hook with several
// collectives uses BucketReduction::finish (comm_hooks.h), which runs in bucket order everywhere.
//
// A Work may carry a typed result (set_result / result_as), e.g. the output tensors of a
// torch-level collective; a chain carries the result of its last operation.
#pragma once

#include <any>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

// Exported by ddp's shared libraries, which hide the rest (src/CMakeLists.txt).
#pragma GCC visibility push(default)
namespace ddp {

class Work : public std::enable_shared_from_this<Work> {
 public:
  // `description` names the operation for messages; `timeout` bounds wait().
  Work(std::string description, std::chrono::milliseconds timeout);
  Work(const Work&) = delete;
  Work& operator=(const Work&) = delete;
  virtual ~Work() = default;

  bool is_completed() const { return completed_.load(std::memory_order_acquire); }

  // Blocks until the operation completes and the callbacks registered before that have run;
  // rethrows its error (usually CommError). Throws
  // TimeoutError when it has not completed within 2 x its timeout + 1 s: a safety net, since the
  // group enforces the operation's deadline itself from when it starts running.
  void wait();

  // Blocks up to `timeout`; returns whether the operation completed (callbacks included, as
  // wait()). Does not throw, not even when the operation failed (see error()).
  bool wait_for(std::chrono::milliseconds timeout);

  // The operation's error once completed with one, else nullptr.
  std::exception_ptr error() const;

  // Runs `callback` once the operation has completed: at once on this thread if it already has.
  void then(std::function<void(Work&)> callback);

  // Once this operation has succeeded, calls `next` (on the thread that completed it, as then()
  // callbacks) to start the next operation, and returns at once a Work that completes when that
  // one does, with its error and result. `next` may return nullptr: the chain then completes at
  // once with this operation's result. This operation's error, or an exception thrown by `next`,
  // completes the chain with that error without calling `next`. wait() on the chain helps run the
  // current stage like wait() on the stage itself, and its safety-net deadline is this Work's.
  // Ordering: `next` issues its collectives when this one completes, so every rank must chain the
  // same operations and issue nothing on the same group in between that could interleave
  // differently (as with any collective issued from a callback).
  std::shared_ptr<Work> and_then(std::function<std::shared_ptr<Work>(Work&)> next);

  // A typed result for the caller (e.g. output tensors); set by whoever started the operation,
  // normally before it completes, and kept for the Work's lifetime. Thread-safe.
  void set_result(std::any value);
  // A copy of the result (empty when none was set).
  std::any result() const;
  // The result as a T; ConfigError naming the operation when there is none or it is not a T.
  template <class T>
  T result_as() const {
    std::any value = result();
    if (const T* typed = std::any_cast<T>(&value)) return *typed;
    throw_bad_result(value.has_value() ? value.type().name() : nullptr);
  }

  // Names the operation (e.g. "allreduce #7 (256 x float32, sum)"), for messages.
  virtual std::string description() const { return description_; }

  // The Work that calls made with CallOptions::blocking return: completed successfully, shared by
  // every such call; set_result on it throws ConfigError.
  static const std::shared_ptr<Work>& completed_blocking_call();

  // For implementations: marks the operation done (with `error`, or successful when null), wakes
  // waiters, runs callbacks. Called exactly once.
  void complete(std::exception_ptr error = nullptr);

 protected:
  // Hook for implementations: called by wait()/wait_for() before they block, so the group may run
  // the operation on the waiting thread. Returns without blocking when it cannot.
  virtual void help_until_completed() {}
  // For implementations that override description() (formatting it only when asked).
  explicit Work(std::chrono::milliseconds timeout) : timeout_(timeout) {}

 private:
  friend class ChainedWork;
  [[noreturn]] void throw_bad_result(const char* held_type) const;
  bool finished_or_own_callback() const;
  bool wait_until(std::chrono::steady_clock::time_point deadline);

  const std::string description_;
  const std::chrono::milliseconds timeout_;
  std::atomic<bool> completed_{false};
  mutable std::mutex mutex_;
  std::condition_variable done_cv_;
  std::exception_ptr error_;
  std::vector<std::function<void(Work&)>> callbacks_;
  // Completed and the callbacks registered before have run (set under mutex_, read without).
  std::atomic<bool> finished_{false};
  std::thread::id completing_thread_;
  std::any result_;               // under mutex_
  bool takes_no_result_ = false;  // completed_blocking_call()
};

}  // namespace ddp
#pragma GCC visibility pop
