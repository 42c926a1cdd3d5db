#include "ddp/work.h"

#include <cstdio>
#include <thread>

#include <fmt/format.h>

#include "ddp/error.h"

namespace ddp {
namespace {

void run_callback(const std::function<void(Work&)>& callback, Work& work) {
  try {
    callback(work);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ddp: a Work::then callback of %s threw: %s\n", work.description().c_str(),
                 e.what());
  } catch (...) {
    std::fprintf(stderr, "ddp: a Work::then callback of %s threw a non-exception\n",
                 work.description().c_str());
  }
}

}  // namespace

Work::Work(std::string description, std::chrono::milliseconds timeout)
    : description_(std::move(description)), timeout_(timeout) {}

void Work::complete(std::exception_ptr error) {
  std::vector<std::function<void(Work&)>> callbacks;
  {
    std::lock_guard lock(mutex_);
    error_ = std::move(error);
    completing_thread_ = std::this_thread::get_id();
    completed_.store(true, std::memory_order_release);
    callbacks.swap(callbacks_);
    // Without callbacks the operation is finished at once (one lock instead of two: this is on the
    // path of every small collective).
    if (callbacks.empty()) finished_.store(true, std::memory_order_release);
  }
  if (!callbacks.empty()) {
    for (const auto& callback : callbacks)
      run_callback(callback, *this);
    // Waiters wake only now, so that wait() returning means the callbacks have run.
    std::lock_guard lock(mutex_);
    finished_.store(true, std::memory_order_release);
  }
  done_cv_.notify_all();
}

std::exception_ptr Work::error() const {
  if (!is_completed()) return nullptr;
  // error_ is written once, before completed_ is released, and never again.
  return error_;
}

void Work::then(std::function<void(Work&)> callback) {
  {
    std::lock_guard lock(mutex_);
    if (!completed_.load(std::memory_order_relaxed)) {
      callbacks_.push_back(std::move(callback));
      return;
    }
  }
  run_callback(callback, *this);
}

bool Work::finished_or_own_callback() const {
  if (finished_.load(std::memory_order_acquire)) return true;
  if (!is_completed()) return false;
  // A callback waiting for its own Work must not wait for the callbacks to finish.
  std::lock_guard lock(mutex_);
  return completing_thread_ == std::this_thread::get_id();
}

bool Work::wait_until(std::chrono::steady_clock::time_point deadline) {
  if (finished_or_own_callback()) return true;
  std::unique_lock lock(mutex_);
  return done_cv_.wait_until(lock, deadline,
                             [&] { return finished_.load(std::memory_order_relaxed); });
}

void Work::wait() {
  if (!is_completed()) help_until_completed();
  if (!finished_or_own_callback()) {
    // A safety net only: the group enforces the operation's own deadline from when it starts,
    // which normally fires first; this one also covers time spent queued behind other operations.
    const auto limit = 2 * timeout_ + std::chrono::seconds(1);
    const auto deadline = timeout_.count() > 0 && timeout_ < std::chrono::hours(24 * 365)
                              ? std::chrono::steady_clock::now() + limit
                              : std::chrono::steady_clock::time_point::max();
    if (!wait_until(deadline)) {
      throw TimeoutError(
          fmt::format("timed out after {} ms waiting for {} (still queued or running)",
                      limit.count(), description()));
    }
  }
  if (auto e = error()) std::rethrow_exception(e);
}

bool Work::wait_for(std::chrono::milliseconds timeout) {
  // No help: running the operation here could outlast `timeout`.
  return wait_until(std::chrono::steady_clock::now() + timeout);
}

}  // namespace ddp
