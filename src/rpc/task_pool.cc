#include "rpc/task_pool.h"

#include <cstdio>
#include <exception>

namespace ddp::rpc::transport {

TaskPool::TaskPool(int threads) {
  threads_.reserve(static_cast<std::size_t>(threads));
  for (int i = 0; i < threads; ++i)
    threads_.emplace_back([this] { run(); });
}

TaskPool::~TaskPool() {
  stop();
}

bool TaskPool::post(std::function<void()> task) {
  {
    std::lock_guard lock(mutex_);
    if (stopping_) return false;
    queue_.push_back(std::move(task));
  }
  cv_.notify_one();
  return true;
}

void TaskPool::stop() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  cv_.notify_all();
  for (auto& thread : threads_) {
    if (thread.joinable()) thread.join();
  }
}

std::size_t TaskPool::busy() const {
  std::lock_guard lock(mutex_);
  return queue_.size() + running_;
}

void TaskPool::run() {
  for (;;) {
    std::function<void()> task;
    {
      std::unique_lock lock(mutex_);
      cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, and nothing left to run
      task = std::move(queue_.front());
      queue_.pop_front();
      ++running_;
    }
    try {
      task();
    } catch (const std::exception& e) {
      // Tasks complete their own promises; one that throws past that is a bug to report, not a
      // reason to lose the thread.
      std::fprintf(stderr, "ddp rpc: a task threw: %s\n", e.what());
    }
    std::lock_guard lock(mutex_);
    --running_;
  }
}

}  // namespace ddp::rpc::transport
