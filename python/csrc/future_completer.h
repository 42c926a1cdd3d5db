// FutureCompleter: the threads that complete the c10::ivalue::Futures of a backend's Works.
//
// A future's completion runs its callbacks inline, and Python's DDP comm hooks chain callbacks
// that issue another collective and wait for its future (PowerSGD's do). Run on the engine's
// worker thread, such a callback would wait for an operation that only that thread can run; run
// on a single completer thread, it would wait for a future that only that thread can complete.
// Either way a deadlock until the timeout. So completions run on a pool that starts with one
// thread and adds one whenever every thread is busy (a callback blocked in a wait), up to
// kMaxThreads; threads are kept until the backend goes. Futures nobody asked for are never made
// (ddp_work.h), so plain collectives never touch the pool.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace torch_ddp {

class FutureCompleter {
 public:
  static constexpr std::size_t kMaxThreads = 64;

  FutureCompleter() = default;
  ~FutureCompleter();  // runs what is queued, then joins
  FutureCompleter(const FutureCompleter&) = delete;
  FutureCompleter& operator=(const FutureCompleter&) = delete;

  // Runs `completion` on a pool thread; an idle one takes it, else a new one (below the cap).
  void post(std::function<void()> completion);

 private:
  void run();

  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<std::function<void()>> queue_;
  std::size_t idle_ = 0;
  bool stopping_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace torch_ddp
