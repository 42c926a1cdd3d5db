#include "comm/op_queue.h"

#include <sched.h>

#include <optional>

#include <fmt/format.h>

#include "ddp/comm/comm_error.h"
#include "ddp/error.h"

namespace ddp::comm {
namespace {

// Lazy wake-up of the worker (OpQueue::worker_idle_wait).
constexpr auto kPromptWait = std::chrono::microseconds(50);  // waited "at once"
constexpr int kPromptWaitsForLazyWake = 2;
constexpr std::size_t kLazyWakeMaxBytes = std::size_t{1} << 20;
constexpr auto kLazyWakePoll = std::chrono::milliseconds(1);
constexpr auto kLazyWakeIdle = std::chrono::milliseconds(50);

std::string text_of(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "unknown error";
  }
}

// What kind of first error a dump records: a CommError's kind; a TimeoutError is a timeout.
std::string_view failure_kind(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const CommError& e) {
    return dump_reason(e.kind());
  } catch (const TimeoutError&) {
    return "timeout";
  } catch (...) {
  }
  return "failure";
}

}  // namespace

void QueuedWork::help_until_completed() {
  if (queue_ == nullptr) return;
  if (auto owner = owner_.lock()) queue_->run_inline_until(*this);
}

OpQueue::OpQueue(Runner& runner, Options options)
    : runner_(runner),
      options_(std::move(options)),
      recorder_(FlightIdentity{.group = options_.group,
                               .backend = options_.backend,
                               .rank = options_.rank,
                               .size = options_.size,
                               .job_rank = options_.job_rank,
                               .job_world_size = options_.job_world_size},
                options_.flight_recorder, mutex_) {}

OpQueue::~OpQueue() {
  stop();
}

void OpQueue::start(std::weak_ptr<const void> owner) {
  owner_ = std::move(owner);
  worker_ = std::thread([this] { worker_loop(); });
}

void OpQueue::stop() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (worker_.joinable()) {
    if (worker_.get_id() == std::this_thread::get_id()) {
      worker_.detach();  // dropped from a callback on the worker; it exits on its own
    } else {
      worker_.join();
    }
  }
}

std::chrono::milliseconds OpQueue::call_timeout(const CallOptions& options,
                                                std::chrono::milliseconds fallback) {
  if (options.timeout.count() < 0) {
    throw ConfigError(
        fmt::format("CallOptions::timeout is negative ({} ms)", options.timeout.count()));
  }
  return options.timeout.count() > 0 ? options.timeout : fallback;
}

std::exception_ptr OpQueue::poison_error() const {
  std::lock_guard lock(poison_mutex_);
  return poison_;
}

void OpQueue::enqueue(const std::shared_ptr<QueuedWork>& work) {
  work->queue_ = this;
  work->owner_ = owner_;
  bool queued = false;
  bool wake_worker = false;
  {
    std::lock_guard lock(mutex_);
    assign_sequence(*work);
    if (!poisoned_.load(std::memory_order_acquire)) {
      const bool idle = queue_.empty() && !executing_ && !worker_lingering_;
      queue_.push_back(work);
      queued = true;
      last_enqueue_ = work->enqueued_at();
      if (idle && worker_polling_ && prompt_waits_ >= kPromptWaitsForLazyWake &&
          work->bytes() <= kLazyWakeMaxBytes) {
        work_left_to_caller_ = true;  // the polling worker takes it if the caller does not
      } else {
        // A second operation behind one left to its caller means the caller is not waiting.
        wake_worker = idle || (work_left_to_caller_ && !executing_);
        work_left_to_caller_ = false;
      }
    }
  }
  if (queued) {
    // Only an idle worker needs waking: an executor picks the new work up after its current one.
    if (wake_worker) cv_.notify_one();
  } else {
    {
      std::lock_guard lock(mutex_);
      recorder_.record_cancelled(work->flight_);
    }
    work->complete(poison_error());
  }
}

// One thread at a time holds the executor role (executing_, under mutex_): the worker, or a
// thread waiting for its own work (see Work::wait). The worker only wakes for work nobody runs, so
// a caller that waits at once runs its operation itself without a hand-off.
void OpQueue::worker_loop() {
  std::unique_lock lock(mutex_);
  for (;;) {
    worker_idle_wait(lock);
    if (queue_.empty()) return;  // stopping, and nothing left to run
    if (work_left_to_caller_) {
      // Its caller did not come for it within the poll interval: stop guessing that callers wait
      // at once, until they show it again.
      work_left_to_caller_ = false;
      prompt_waits_ = 0;
    }
    executing_ = true;
    while (!queue_.empty()) {
      // A fresh start for each: the previous operation's callbacks ran since its end. (The inline
      // path below reuses the end instead, saving a clock read where latency counts most.)
      auto now = net::Clock::now();
      std::shared_ptr<QueuedWork> next = pop_front(now);
      lock.unlock();
      bool ok = false;
      now = execute(*next, now, ok);
      const FlightRecorder::Handle flight = next->flight_;
      next.reset();  // callbacks may hold the last references; drop them outside the lock
      lock.lock();
      if (ok) recorder_.record_ended(flight, now, true);
    }
    executing_ = false;
    linger(lock);
  }
}

bool OpQueue::worker_should_run(net::Clock::time_point now) const {
  if (executing_) return false;
  if (queue_.empty() || stopping_) return stopping_ || !queue_.empty();
  return !work_left_to_caller_ || now - queue_.front()->enqueued_at() >= kLazyWakePoll;
}

// Waking the idle worker for every operation costs a futex wake-up and a context switch, and on a
// busy host a thread that competes with the peers for the cores: for a caller that waits at once
// (allreduce(...)->wait()), and so runs the operation itself (run_inline_until), that is pure
// overhead, 60 µs of a 1 MiB shared-memory allreduce and most of a 64 KiB one (docs/benchmarks.md).
// So once kPromptWaitsForLazyWake operations in a row were waited for at once, enqueue leaves new
// work of up to kLazyWakeMaxBytes on an idle group to its caller, and the idle worker polls the
// queue every kLazyWakePoll instead of sleeping until notified: work nobody came for by then is
// the worker's, and the guess is dropped. A group idle for kLazyWakeIdle stops polling (its next
// operation wakes the worker as before).
void OpQueue::worker_idle_wait(std::unique_lock<std::mutex>& lock) {
  for (;;) {
    const auto now = net::Clock::now();
    if (worker_should_run(now)) return;
    const bool poll = prompt_waits_ >= kPromptWaitsForLazyWake && !stopping_ &&
                      (work_left_to_caller_ || now - last_enqueue_ < kLazyWakeIdle);
    if (!poll) {
      worker_polling_ = false;
      cv_.wait(lock);
      continue;
    }
    worker_polling_ = true;
    cv_.wait_for(lock, kLazyWakePoll);
    worker_polling_ = false;
  }
}

// After its last work the worker stays awake for Options::worker_linger, yielding the core, so
// that back-to-back calls (a training step's buckets, a benchmark loop) need no futex wake-up: on a
// busy two-core host the wake-up and its context switch cost more than a small collective. New
// work is left for a moment to a caller that waits for it at once (it runs it inline, without a
// hand-off); the worker takes it only if nobody has.
void OpQueue::linger(std::unique_lock<std::mutex>& lock) {
  constexpr auto kLeaveToCaller = std::chrono::microseconds(20);
  // Callers that wait at once run their work themselves: a lingering worker would only compete
  // with them for the cores (and, having taken one operation, go on taking the next ones, each a
  // hand-off: 1 KiB over shared memory took 54 µs instead of 1.3 in that state).
  if (options_.worker_linger.count() <= 0 || prompt_waits_ >= kPromptWaitsForLazyWake) return;
  worker_lingering_ = true;
  const auto until = net::Clock::now() + options_.worker_linger;
  std::optional<net::Clock::time_point> work_seen;
  while (!stopping_ && !executing_) {
    const auto now = net::Clock::now();
    if (!queue_.empty()) {
      if (!work_seen) work_seen = now;
      if (now - *work_seen >= kLeaveToCaller) break;
    } else if (now >= until) {
      break;
    }
    lock.unlock();
    sched_yield();
    lock.lock();
  }
  worker_lingering_ = false;
}

void OpQueue::run_inline_until(QueuedWork& work) {
  std::unique_lock lock(mutex_);
  // A caller that comes for its work at once can be left to run the next ones itself (also when
  // the worker got to this one first).
  auto now = net::Clock::now();
  if (now - work.enqueued_at() < kPromptWait) {
    if (prompt_waits_ < kPromptWaitsForLazyWake) ++prompt_waits_;
  } else {
    prompt_waits_ = 0;
  }
  if (executing_ || work.is_completed()) {
    lock.unlock();
    // Another thread runs it: poll briefly for completion before the caller sleeps, yielding the
    // core, which that very thread may be waiting for (a busy-waiting caller on a host with no
    // idle core held its own worker off for the whole poll: 1 KiB allreduces of 55 µs).
    const auto until = net::Clock::now() + options_.spin;
    while (!work.is_completed() && net::Clock::now() < until) {
      sched_yield();
    }
    return;
  }
  executing_ = true;
  work_left_to_caller_ = false;  // whatever this thread leaves queued is the worker's
  while (!work.is_completed() && !queue_.empty()) {
    std::shared_ptr<QueuedWork> next = pop_front(now);
    lock.unlock();
    bool ok = false;
    now = execute(*next, now, ok);
    const FlightRecorder::Handle flight = next->flight_;
    next.reset();  // callbacks may hold the last references; drop them outside the lock
    lock.lock();
    if (ok) recorder_.record_ended(flight, now, true);
  }
  executing_ = false;
  // Whatever was queued behind this work is the worker's again.
  if (!queue_.empty() || stopping_) cv_.notify_one();
}

void OpQueue::assign_sequence(QueuedWork& work) {
  const std::uint64_t sequence = next_sequence_++;
  work.sequence_ = sequence;
  work.on_sequenced(sequence);
  if (recorder_.enabled()) {
    work.flight_ = recorder_.record_enqueued(work.fingerprint(), FlightChannel::kCollective,
                                             /*peer=*/-1, sequence, work.enqueued_at());
  }
}

bool OpQueue::try_run_now(QueuedWork& work) {
  // One clock read for the queueing, the start and the deadline.
  const auto start = work.enqueued_at();
  {
    std::lock_guard lock(mutex_);
    if (!queue_.empty() || executing_ || worker_lingering_ || stopping_ ||
        poisoned_.load(std::memory_order_acquire)) {
      return false;
    }
    executing_ = true;
    work_left_to_caller_ = false;
    if (prompt_waits_ < kPromptWaitsForLazyWake) ++prompt_waits_;  // it waited at once
    assign_sequence(work);
    recorder_.record_started(work.flight_, start);  // a no-op when the recorder is off
  }
  bool ok = false;
  const auto end = execute(work, start, ok, /*complete_success=*/false);
  {
    std::lock_guard lock(mutex_);
    if (ok) recorder_.record_ended(work.flight_, end, true);
    executing_ = false;
    // Queued meanwhile by another thread: the worker's.
    if (!queue_.empty() || stopping_) cv_.notify_one();
  }
  if (!ok) std::rethrow_exception(work.error());
  return true;
}

std::shared_ptr<QueuedWork> OpQueue::pop_front(net::Clock::time_point now) {
  std::shared_ptr<QueuedWork> next = std::move(queue_.front());
  queue_.pop_front();
  // One that execute() fails at once (the group is poisoned) never started.
  if (!poisoned()) recorder_.record_started(next->flight_, now);
  return next;
}

net::Clock::time_point OpQueue::execute(QueuedWork& work, net::Clock::time_point start, bool& ok,
                                        bool complete_success) {
  ok = false;
  if (poisoned()) {
    {
      std::lock_guard lock(mutex_);
      recorder_.record_cancelled(work.flight_);
    }
    work.complete(poison_error());
    return net::Clock::now();
  }
  try {
    runner_.run(work, net::deadline_after(work.timeout(), start));
  } catch (const CommError&) {
    fail(work, std::current_exception());
    return net::Clock::now();
  } catch (const std::exception& e) {
    const std::string what = work.description();
    fail(work, std::make_exception_ptr(
                   CommError(CommErrorKind::kInternal,
                             fmt::format("rank {}: {} in group '{}' failed: {}", options_.rank,
                                         what, options_.group, e.what()),
                             options_.group, what, work.sequence(), -1)));
    return net::Clock::now();
  } catch (...) {
    const std::string what = work.description();
    fail(work, std::make_exception_ptr(
                   CommError(CommErrorKind::kInternal,
                             fmt::format("rank {}: {} in group '{}' failed with a non-standard "
                                         "exception",
                                         options_.rank, what, options_.group),
                             options_.group, what, work.sequence(), -1)));
    return net::Clock::now();
  }
  // The end, read before complete(): the caller may wait for nothing else.
  const auto end = net::Clock::now();
  ok = true;
  if (complete_success) work.complete();
  return end;
}

// Poisons the queue with the first error: fails `work` and everything queued, then lets the
// backend tell its peers.
// The dump is written before the caller sees the error, and while the operations still queued
// show as queued (they never ran).
void OpQueue::fail(QueuedWork& work, std::exception_ptr error) {
  bool first = false;
  error = keep_first_error(std::move(error), first);
  {
    std::lock_guard lock(mutex_);
    recorder_.record_ended(work.flight_, net::Clock::now(), false);
  }
  if (first) dump_first_error(error);
  work.complete(error);
  fail_queued(error);
}

void OpQueue::poison(std::exception_ptr error) {
  bool first = false;
  error = keep_first_error(std::move(error), first);
  if (first) dump_first_error(error);
  fail_queued(error);
}

void OpQueue::dump_first_error(const std::exception_ptr& error) {
  if (!recorder_.enabled()) return;
  const std::string text = text_of(error);
  recorder_.dump(failure_kind(error), text);
}

std::exception_ptr OpQueue::keep_first_error(std::exception_ptr error, bool& first) {
  {
    std::lock_guard lock(poison_mutex_);
    first = !poison_;
    if (!poison_) poison_ = std::move(error);
    error = poison_;
  }
  poisoned_.store(true, std::memory_order_release);
  return error;
}

void OpQueue::fail_queued(const std::exception_ptr& error) {
  std::deque<std::shared_ptr<QueuedWork>> pending;
  {
    std::lock_guard lock(mutex_);
    pending.swap(queue_);
    for (const auto& w : pending)
      recorder_.record_cancelled(w->flight_);
  }
  for (auto& w : pending)
    w->complete(error);
  runner_.on_poison(text_of(error));
}

}  // namespace ddp::comm
