// CompletionWatcher (completion_watcher.h).
#include "comm/nccl/completion_watcher.h"

#include <cstdio>
#include <cstdlib>
#include <utility>

#include <fmt/format.h>

#include "comm/nccl/poll_pacer.h"

namespace ddp::comm::nccl {

CompletionWatcher::CompletionWatcher(std::function<void(const Failure&)> on_failure)
    : on_failure_(std::move(on_failure)) {}

CompletionWatcher::~CompletionWatcher() {
  stop();
}

void CompletionWatcher::watch(Entry entry) {
  {
    std::lock_guard lock(mutex_);
    if (!stopping_ && !failed_) {
      entries_.push_back(std::move(entry));
      if (!thread_.joinable()) thread_ = std::thread([this] { run(); });
      wake_.notify_one();
      return;
    }
  }
  if (entry.release) entry.release();
}

std::size_t CompletionWatcher::in_flight() const {
  std::lock_guard lock(mutex_);
  return entries_.size();
}

void CompletionWatcher::drain() {
  std::unique_lock lock(mutex_);
  drained_.wait(lock, [this] { return (entries_.empty() && !busy_) || failed_ || stopping_; });
}

void CompletionWatcher::stop() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
    wake_.notify_one();
    drained_.notify_all();
  }
  if (thread_.joinable()) thread_.join();
  std::deque<Entry> left;
  {
    std::lock_guard lock(mutex_);
    left.swap(entries_);
  }
  for (auto& entry : left) {
    if (entry.release) entry.release();
  }
}

void CompletionWatcher::run() {
  std::unique_lock lock(mutex_);
  for (;;) {
    wake_.wait(lock, [this] { return stopping_ || !entries_.empty(); });
    if (stopping_) return;
    // The front entry is only ever popped here, so it stays valid while the lock is released.
    Entry& entry = entries_.front();
    busy_ = true;  // until it is released: drain() waits for that too
    lock.unlock();
    PollPacer pacer;
    Failure failure;
    bool failed = false;
    for (;;) {
      std::string why;
      const Status status = entry.poll(why);
      if (status == Status::kDone) break;
      if (status == Status::kFailed) {
        failure = {entry.description, false, std::move(why)};
        failed = true;
        break;
      }
      if (net::Clock::now() >= entry.deadline) {
        failure = {entry.description, true, {}};
        failed = true;
        break;
      }
      {
        std::lock_guard stop_check(mutex_);
        if (stopping_) break;  // stop() releases it
      }
      pacer.pause();
    }
    if (failed) on_failure_(failure);
    lock.lock();
    if (stopping_) return;
    Entry done = std::move(entries_.front());
    entries_.pop_front();
    std::deque<Entry> unpolled;
    if (failed) {
      failed_ = true;
      unpolled.swap(entries_);
    }
    lock.unlock();
    if (done.release) done.release();
    for (auto& left : unpolled) {
      if (left.release) left.release();
    }
    lock.lock();
    busy_ = false;
    drained_.notify_all();
  }
}

void abort_after_watched_failure(const CompletionWatcher::Failure& failure,
                                 const std::string& group) {
  const std::string what =
      failure.timed_out
          ? std::string(
                "did not complete on the device within its deadline: a peer is stuck, "
                "stopped, or never issued the call")
          : fmt::format("failed on the device: {}", failure.why);
  std::fprintf(stderr,
               "ddp: %s: %s %s. Its Work had completed when it was queued (stream-ordered), so "
               "the program may already use its wrong results: aborting the process\n",
               group.c_str(), failure.description.c_str(), what.c_str());
  std::fflush(stderr);
  std::abort();
}

}  // namespace ddp::comm::nccl
