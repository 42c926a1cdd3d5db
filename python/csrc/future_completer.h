// FutureCompleter: one thread per backend that completes the c10::ivalue::Futures of its Works.
//
// A future's completion runs its callbacks inline, and Python's DDP comm hooks chain callbacks
// that issue another collective and wait for it (PowerSGD's does). Run on the engine's worker
// thread, such a callback would wait for an operation that only that thread can run: a deadlock
// until the timeout. The completer thread takes them instead, in the order the operations
// completed, while the worker goes on. Futures nobody asked for are never created (ddp_work.h).
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

namespace torch_ddp {

class FutureCompleter {
 public:
  FutureCompleter();
  ~FutureCompleter();  // runs what is queued, then joins
  FutureCompleter(const FutureCompleter&) = delete;
  FutureCompleter& operator=(const FutureCompleter&) = delete;

  // Runs `completion` on the completer thread, after those posted before it.
  void post(std::function<void()> completion);

 private:
  void run();

  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<std::function<void()>> queue_;
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace torch_ddp
