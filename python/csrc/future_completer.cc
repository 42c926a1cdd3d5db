#include "future_completer.h"

#include <cstdio>
#include <exception>

namespace torch_ddp {

FutureCompleter::~FutureCompleter() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  for (auto& thread : threads_)
    thread.join();
}

void FutureCompleter::post(std::function<void()> completion) {
  {
    std::lock_guard lock(mutex_);
    queue_.push_back(std::move(completion));
    // Every thread busy (or none yet): one more, so a callback that waits for this completion
    // cannot wait for itself.
    if (idle_ < queue_.size() && threads_.size() < kMaxThreads) {
      threads_.emplace_back([this] { run(); });
      ++idle_;
    }
  }
  wake_.notify_one();
}

void FutureCompleter::run() {
  std::unique_lock lock(mutex_);
  for (;;) {
    wake_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stopping, and nothing left to complete
    auto completion = std::move(queue_.front());
    queue_.pop_front();
    --idle_;
    lock.unlock();
    try {
      completion();
    } catch (const std::exception& e) {
      // A future's callbacks report their errors through the futures they return; what escapes
      // here has nowhere to go but the log.
      std::fprintf(stderr, "torch_ddp: a future's completion threw: %s\n", e.what());
    }
    lock.lock();
    ++idle_;
  }
}

}  // namespace torch_ddp
