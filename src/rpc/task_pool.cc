#include "rpc/task_pool.h"

#include <chrono>
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

bool TaskPool::post(std::function<void()> task, bool wake) {
  {
    std::lock_guard lock(mutex_);
    if (stopping_) return false;
    queue_.push_back(std::move(task));
    queued_.store(queue_.size(), std::memory_order_release);
  }
  if (wake) cv_.notify_one();
  return true;
}

void TaskPool::expect_task() {
  if (spinning_.load(std::memory_order_acquire) != 0) return;
  {
    std::lock_guard lock(mutex_);
    if (stopping_ || wake_to_look_ > 0 || !queue_.empty()) return;
    ++wake_to_look_;
  }
  cv_.notify_one();
}

void TaskPool::stop() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
    stopping_flag_.store(true, std::memory_order_release);
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
      // A thread that has just run a task looks for the next one for a while before it sleeps:
      // a worker answering a stream of calls then takes each from the queue without being woken
      // (10-20 us a wake-up on this host, issue 51), and sleeps once the stream stops. One thread
      // at a time: more would burn cores a loaded worker needs, and take no task sooner.
      if (spinning_.fetch_add(1, std::memory_order_acq_rel) == 0) {
        SpinHook* hook = spin_hook_.load(std::memory_order_acquire);
        const auto until = std::chrono::steady_clock::now() + spin_before_sleep();
        while (queued_.load(std::memory_order_acquire) == 0 &&
               !stopping_flag_.load(std::memory_order_acquire) &&
               std::chrono::steady_clock::now() < until) {
          if (hook != nullptr) hook->poll();
          std::this_thread::yield();
        }
        if (hook != nullptr) hook->end(queued_.load(std::memory_order_acquire) != 0);
      }
      spinning_.fetch_sub(1, std::memory_order_acq_rel);
      std::unique_lock lock(mutex_);
      cv_.wait(lock, [&] { return stopping_ || !queue_.empty() || wake_to_look_ > 0; });
      if (queue_.empty()) {
        if (stopping_) return;  // and nothing left to run
        --wake_to_look_;        // woken to look for a task that is coming
        continue;
      }
      task = std::move(queue_.front());
      queue_.pop_front();
      queued_.store(queue_.size(), std::memory_order_release);
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
