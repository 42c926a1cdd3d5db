#include "rpc/call_future.h"

#include <cstdio>
#include <cstring>
#include <exception>
#include <thread>

namespace ddp::rpc::transport {

std::string to_string(FailureKind kind) {
  switch (kind) {
    case FailureKind::kRemoteException:
      return "remote exception";
    case FailureKind::kUnknownFunction:
      return "unknown function";
    case FailureKind::kWorkerGone:
      return "worker gone";
    case FailureKind::kTimeout:
      return "timeout";
    case FailureKind::kShutdown:
      return "shut down";
    case FailureKind::kProtocol:
      return "protocol error";
    case FailureKind::kUnknownWorker:
      return "unknown worker";
    case FailureKind::kCallerError:
      return "refused by the caller";
    case FailureKind::kBadArguments:
      return "bad arguments";
  }
  return "failure " + std::to_string(static_cast<int>(kind));
}

std::size_t Outgoing::size() const {
  std::size_t total = bytes.size();
  for (const auto& a : attachments)
    total += a.size;
  return total;
}

Bytes Outgoing::flatten() && {
  const std::size_t total = size();
  Bytes out = std::move(bytes);
  if (attachments.empty()) return out;
  std::size_t at = out.size();
  out.resize(total);
  for (const auto& a : attachments) {
    if (a.size > 0) std::memcpy(out.data() + at, a.data, a.size);
    at += a.size;
  }
  attachments.clear();
  return out;
}

bool CallFuture::done() const {
  std::lock_guard lock(state_->mutex);
  return state_->done;
}

namespace {
std::atomic<std::int64_t> spin_micros{kDefaultSpinBeforeSleep.count()};
}  // namespace

void set_spin_before_sleep(std::chrono::microseconds spin) {
  spin_micros.store(spin.count(), std::memory_order_relaxed);
}

std::chrono::microseconds spin_before_sleep() {
  return std::chrono::microseconds(spin_micros.load(std::memory_order_relaxed));
}

// Until the call is complete or spin_before_sleep() passed, giving the core to any thread that
// wants it (the reader that completes the call may be one of them) between looks.
void CallFuture::spin_until_ready() const {
  std::shared_ptr<SpinHook> hook;
  {
    std::lock_guard lock(state_->mutex);
    hook = std::move(state_->spin_hook);
  }
  const auto spin = spin_before_sleep();
  const auto until = std::chrono::steady_clock::now() + spin;
  while (!state_->ready.load(std::memory_order_acquire) &&
         std::chrono::steady_clock::now() < until) {
    if (hook) hook->poll();
    std::this_thread::yield();
  }
  if (hook) hook->end(state_->ready.load(std::memory_order_acquire));
}

void CallFuture::sleep_until_done(std::unique_lock<std::mutex>& lock) const {
  while (!state_->done) {
    state_->cv.wait(lock);
    if (!state_->done && state_->woken_early) {
      state_->woken_early = false;
      lock.unlock();
      spin_until_ready();
      lock.lock();
    }
  }
}

const Reply& CallFuture::wait() const& {
  spin_until_ready();
  std::unique_lock lock(state_->mutex);
  sleep_until_done(lock);
  return state_->reply;
}

void CallFuture::then(std::function<void(const Reply&)> callback) const {
  {
    std::lock_guard lock(state_->mutex);
    if (!state_->done) {
      state_->callbacks.push_back(std::move(callback));
      return;
    }
  }
  callback(state_->reply);  // the reply no longer changes once done
}

Reply CallFuture::take() const {
  spin_until_ready();
  std::unique_lock lock(state_->mutex);
  sleep_until_done(lock);
  return std::move(state_->reply);
}

void CallFuture::then_take(std::function<void(Reply)> callback) const {
  then([state = state_, callback = std::move(callback)](const Reply&) {
    callback(std::move(state->reply));
  });
}

CallPromise::CallPromise(Executor executor) : state_(std::make_shared<CallFuture::State>()) {
  state_->executor = std::move(executor);
}

bool CallPromise::complete(Reply reply) const {
  std::vector<std::function<void(const Reply&)>> callbacks;
  {
    std::lock_guard lock(state_->mutex);
    if (state_->done) return false;
    state_->reply = std::move(reply);
    state_->done = true;
    state_->ready.store(true, std::memory_order_release);
    callbacks.swap(state_->callbacks);
  }
  state_->cv.notify_all();
  if (callbacks.empty()) return true;
  auto state = state_;
  auto run = [state, callbacks = std::move(callbacks)] {
    for (const auto& callback : callbacks) {
      // A callback that throws has nobody to tell but the log: the future it was added to is
      // complete, and the others must still run.
      try {
        callback(state->reply);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "ddp rpc: a callback on a call's future threw: %s\n", e.what());
      }
    }
  };
  if (state_->executor) {
    state_->executor(std::move(run));
  } else {
    run();
  }
  return true;
}

void CallPromise::set_spin_hook(std::shared_ptr<SpinHook> hook) const {
  std::lock_guard lock(state_->mutex);
  state_->spin_hook = std::move(hook);
}

void CallPromise::expect_completion() const {
  {
    std::lock_guard lock(state_->mutex);
    if (state_->done) return;
    state_->woken_early = true;
  }
  state_->cv.notify_all();
}

bool CallPromise::fail(FailureKind kind, std::string message, std::string type_name) const {
  return complete(Reply{{}, Failure{kind, std::move(type_name), std::move(message)}});
}

}  // namespace ddp::rpc::transport
