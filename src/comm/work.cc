#include "ddp/comm/work.h"

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

// The Work of and_then(): completes when the stage started by the continuation does. Holds the
// current stage so that wait() can help run it on the waiting thread (lazy wake-up, see
// ring_process_group.cc) instead of sleeping until the worker gets to it.
class ChainedWork final : public Work {
 public:
  ChainedWork(std::string description, std::chrono::milliseconds timeout,
              std::shared_ptr<Work> stage)
      : Work(std::move(description), timeout), stage_(std::move(stage)) {}

  void set_stage(std::shared_ptr<Work> stage) {
    std::lock_guard lock(stage_mutex_);
    stage_ = std::move(stage);
  }

  // Completes the chain with `from`'s error and result; drops the stage (it holds callbacks that
  // hold this Work).
  void finish(Work* from, std::exception_ptr error) {
    if (from != nullptr) {
      std::any value = from->result();
      if (value.has_value()) set_result(std::move(value));
    }
    set_stage(nullptr);
    complete(std::move(error));
  }

 protected:
  void help_until_completed() override {
    // Each pass helps the current stage; completing it may start the next stage on this thread.
    for (;;) {
      std::shared_ptr<Work> stage;
      {
        std::lock_guard lock(stage_mutex_);
        stage = stage_;
      }
      if (!stage || is_completed()) return;
      if (!stage->is_completed()) stage->help_until_completed();
      std::lock_guard lock(stage_mutex_);
      if (stage_ == stage) return;  // not advanced: block in wait() like any Work
    }
  }

 private:
  std::mutex stage_mutex_;
  std::shared_ptr<Work> stage_;
};

namespace {

// Attaches the continuation to `stage`: on success calls `next`, which may start another stage.
void continue_chain(const std::shared_ptr<ChainedWork>& chain, Work& stage,
                    std::function<std::shared_ptr<Work>(Work&)> next) {
  stage.then([chain, next = std::move(next)](Work& done) {
    if (auto error = done.error()) {
      chain->finish(nullptr, error);
      return;
    }
    std::shared_ptr<Work> following;
    try {
      following = next ? next(done) : nullptr;
    } catch (...) {
      chain->finish(nullptr, std::current_exception());
      return;
    }
    if (!following) {
      chain->finish(&done, nullptr);
      return;
    }
    chain->set_stage(following);
    following->then([chain](Work& last) { chain->finish(&last, last.error()); });
  });
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
    // A callback may hold the last reference to this Work (it is released below).
    const auto keep_alive = weak_from_this().lock();
    for (const auto& callback : callbacks)
      run_callback(callback, *this);
    // What the callbacks hold (a collective's input tensor kept alive, for one) is released
    // before waiters wake: wait() returning means the callbacks have run and that memory is free
    // again (FSDP's memory count, fsdp_memory.h, reads it right after a step).
    callbacks.clear();
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

std::shared_ptr<Work> Work::and_then(std::function<std::shared_ptr<Work>(Work&)> next) {
  // The chain does not own this Work: whoever runs it (the group's queue) keeps it alive until it
  // completes, and its callback keeps the chain alive until then.
  auto chain = std::make_shared<ChainedWork>(description() + " and then more", timeout_, nullptr);
  // For helping in wait(); a Work not owned by a shared_ptr is simply not helped.
  chain->set_stage(weak_from_this().lock());
  continue_chain(chain, *this, std::move(next));
  return chain;
}

const std::shared_ptr<Work>& Work::completed_blocking_call() {
  // Immortal (callers may hold it past static destruction; both objects stay reachable from these
  // statics, so leak checkers do not count them), and handed out as a shared_ptr that shares no
  // ownership (the aliasing constructor with an empty owner): copying and dropping it, once per
  // blocking call, then touches no reference count that every thread would contend on.
  static const std::shared_ptr<Work>* const owner = [] {
    auto* work = new std::shared_ptr<Work>(std::make_shared<Work>(
        "a blocking call (completed when it returned)", std::chrono::milliseconds(0)));
    (*work)->takes_no_result_ = true;
    (*work)->complete();
    return work;
  }();
  static const std::shared_ptr<Work>* const handed_out =
      new std::shared_ptr<Work>(std::shared_ptr<Work>(), owner->get());
  return *handed_out;
}

void Work::set_result(std::any value) {
  if (takes_no_result_) {
    throw ConfigError(
        "set_result on the Work of a blocking call (CallOptions::blocking), which every such call "
        "shares: make the call without `blocking` to attach a result");
  }
  std::lock_guard lock(mutex_);
  result_ = std::move(value);
}

std::any Work::result() const {
  std::lock_guard lock(mutex_);
  return result_;
}

void Work::throw_bad_result(const char* held_type) const {
  throw ConfigError(held_type == nullptr
                        ? fmt::format("{} has no result", description())
                        : fmt::format("the result of {} is a {}, not the type asked for",
                                      description(), held_type));
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
