// CompletionWatcher: the nccl backend's watchdog for calls made stream-ordered
// (CallOptions::cuda_done_event): their Work completed once they were queued on the device, so
// nobody waits for them on the host. One thread polls each such call's completion, oldest first
// (they run in that order on the group's stream), until it finished, failed, or passed its
// deadline; the first failure is reported once (the nccl group then ends the process:
// abort_after_watched_failure below), and the calls still watched are released unpolled. Knows
// nothing of CUDA: each entry brings its own poll.
//
//   CompletionWatcher watcher([&](const Failure& f) { abort_after_watched_failure(f, who); });
//   watcher.watch({.poll = query_event, .deadline = d, .description = "allreduce #7"});
//   watcher.drain();  // every call watched so far done, or the failure reported
//   watcher.stop();   // before what the polls use goes away (the destructor stops too)
#pragma once

#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

#include "net/socket.h"

namespace ddp::comm::nccl {

class CompletionWatcher {
 public:
  enum class Status { kPending, kDone, kFailed };
  struct Entry {
    // One look at the call: kFailed sets `why`. Called on the watcher's thread only.
    std::function<Status(std::string& why)> poll;
    net::Deadline deadline;
    std::string description;  // names the call in the failure
    // Runs exactly once when the entry leaves the watcher (done, failed, released or stopped).
    std::function<void()> release;
  };
  struct Failure {
    std::string description;
    bool timed_out = false;  // else failed: `why` says how
    std::string why;
  };

  explicit CompletionWatcher(std::function<void(const Failure&)> on_failure);
  CompletionWatcher(const CompletionWatcher&) = delete;
  CompletionWatcher& operator=(const CompletionWatcher&) = delete;
  ~CompletionWatcher();

  // Watches `entry` after those given before; starts the thread on first use. After stop(), or
  // after a failure was reported, the entry is released at once.
  void watch(Entry entry);
  // Calls watched and not yet done.
  std::size_t in_flight() const;
  // Blocks until every call watched so far is done or a failure was reported (each call has a
  // deadline, so this ends), or stop() was called.
  void drain();
  // Joins the thread; entries left are released unpolled. Idempotent.
  void stop();

 private:
  void run();

  const std::function<void(const Failure&)> on_failure_;
  mutable std::mutex mutex_;
  std::condition_variable wake_;
  std::condition_variable drained_;  // an entry left, a failure, or stop
  std::deque<Entry> entries_;        // under mutex_
  bool stopping_ = false;            // under mutex_
  bool failed_ = false;              // under mutex_
  bool busy_ = false;                // under mutex_: an entry taken, not yet released
  std::thread thread_;
};

// The nccl backend's answer to a failure the watcher found: the message (naming `group`, e.g.
// "rank 0 of group 'default' (nccl backend, CUDA device 0)", and the call) on stderr, then
// std::abort(). The call's Work already told the program it was done, so its results are in use
// and wrong; a process that went on could save them and exit 0. PyTorch's NCCL watchdog tears the
// process down the same way; a launcher (ddprun) sees the failed rank.
[[noreturn]] void abort_after_watched_failure(const CompletionWatcher::Failure& failure,
                                              const std::string& group);

}  // namespace ddp::comm::nccl
