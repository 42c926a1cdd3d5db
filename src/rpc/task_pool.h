// A fixed set of threads running queued tasks in order of arrival (internal; agent.h): where the
// agent runs handlers and the callbacks of completed calls, so the threads reading connections
// never run user code. stop() lets the queued tasks finish, then joins. A thread that ran a task
// looks for the next for spin_before_sleep() (call_future.h) before it sleeps.
//
// A task that blocks holds its thread: handlers that wait on calls of their own should be few or
// return at once and complete their reply from a callback (docs/rpc.md).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "rpc/call_future.h"  // spin_before_sleep

namespace ddp::rpc::transport {

class TaskPool {
 public:
  explicit TaskPool(int threads);
  ~TaskPool();
  TaskPool(const TaskPool&) = delete;
  TaskPool& operator=(const TaskPool&) = delete;

  // Queues a task; false (and the task is dropped) after stop(). `wake` false: no sleeping thread
  // is woken for it (the thread posting is the pool's spinning one, which takes it next).
  bool post(std::function<void()> task, bool wake = true);
  // What the spinning thread does between looks (SpinHook, call_future.h); it must outlive stop().
  void set_spin_hook(SpinHook* hook) { spin_hook_.store(hook, std::memory_order_release); }
  // A task is coming soon (a large request is being read): wakes a sleeping thread now, to look
  // for it as a thread that has just run a task does, so that the task does not wait for the
  // wake-up after it is posted. Nothing when a thread is looking already.
  void expect_task();
  // Runs what is queued, then joins every thread. Idempotent; not from a pool thread.
  void stop();
  // Tasks queued or running.
  std::size_t busy() const;

 private:
  void run();

  mutable std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  std::size_t running_ = 0;
  bool stopping_ = false;
  // queue_.size() and stopping_, for a thread that looks for work without the mutex.
  std::atomic<std::size_t> queued_{0};
  std::atomic<bool> stopping_flag_{false};
  std::atomic<int> spinning_{0};  // threads in (or about to decide on) the look before sleeping
  int wake_to_look_ = 0;          // expect_task()'s wake-ups not yet taken, under mutex_
  std::atomic<SpinHook*> spin_hook_{nullptr};
  std::vector<std::thread> threads_;
};

}  // namespace ddp::rpc::transport
