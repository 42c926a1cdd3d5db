// StagingThread: runs a Reducer's staged bucket launches one after another, in the order they
// were submitted (bucket order, so every rank issues its collectives in the same order), off the
// autograd thread: a job waits for its bucket's device-to-host copy, which the autograd thread
// must not wait for (device_staging.h).
//
// Jobs must not throw (they record their errors where their submitter reads them). The thread
// starts with the first job. Destruction lets the running job finish and drops the others.
#pragma once

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

namespace ddp::detail {

class StagingThread {
 public:
  StagingThread() = default;
  StagingThread(const StagingThread&) = delete;
  StagingThread& operator=(const StagingThread&) = delete;
  ~StagingThread();

  void submit(std::function<void()> job);
  // Returns once every job submitted so far has run (true) or at `deadline` (false).
  bool drain(std::chrono::steady_clock::time_point deadline);

 private:
  void run();

  std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<std::function<void()>> jobs_;
  bool running_job_ = false;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace ddp::detail
