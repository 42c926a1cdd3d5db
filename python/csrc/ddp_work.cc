#include "ddp_work.h"

#include <fmt/format.h>

#include <c10/util/Exception.h>

#include "ddp/error.h"

namespace torch_ddp {

std::exception_ptr as_backend_error(std::exception_ptr error, const std::string& call) {
  try {
    std::rethrow_exception(error);
  } catch (const c10::DistBackendError&) {
    return std::current_exception();
  } catch (const std::exception& e) {
    // A deadline that passed says so in the words c10d's callers match on (gloo's "Timed out").
    const std::string what = e.what();
    const bool deadline = dynamic_cast<const ddp::TimeoutError*>(&e) != nullptr ||
                          what.find("timed out") != std::string::npos;
    try {
      C10_THROW_ERROR(DistBackendError,
                      deadline ? fmt::format("ddp backend: {} failed: Timed out (its deadline "
                                             "passed): {}",
                                             call, what)
                               : fmt::format("ddp backend: {} failed: {}", call, what));
    } catch (...) {
      return std::current_exception();
    }
  }
}

DdpWork::DdpWork(Spec spec)
    : c10d::Work(spec.rank, spec.type),
      parts_(std::move(spec.parts)),
      state_(std::make_shared<State>()),
      timeout_(spec.timeout),
      source_(std::move(spec.source)) {
  state_->remaining = parts_.size();
  state_->outputs = std::move(spec.outputs);
  state_->keep_alive = std::move(spec.keep_alive);
  state_->finish = std::move(spec.finish);
  state_->call = std::move(spec.call);
  state_->completer = std::move(spec.completer);
}

c10::intrusive_ptr<DdpWork> DdpWork::start(Spec spec) {
  auto work = c10::make_intrusive<DdpWork>(std::move(spec));
  auto state = work->state_;
  if (work->parts_.empty()) {
    complete(state);  // nothing to send (an empty list); `finish` may still copy
    return work;
  }
  for (auto& part : work->parts_) {
    part->then([state](ddp::Work& done) { part_done(state, done); });
  }
  return work;
}

void DdpWork::part_done(const std::shared_ptr<State>& state, ddp::Work& part) {
  {
    std::lock_guard lock(state->mutex);
    if (auto error = part.error(); error && !state->error) {
      state->error = as_backend_error(error, state->call);
    }
    if (--state->remaining > 0) return;
  }
  complete(state);
}

void DdpWork::complete(const std::shared_ptr<State>& state) {
  std::function<void()> finish;
  {
    std::lock_guard lock(state->mutex);
    if (!state->error) finish = std::move(state->finish);
  }
  if (finish) {
    try {
      finish();
    } catch (...) {
      std::lock_guard lock(state->mutex);
      state->error = as_backend_error(std::current_exception(), state->call);
    }
  }
  bool has_future = false;
  {
    std::lock_guard lock(state->mutex);
    state->completed = true;
    state->keep_alive.clear();
    has_future = static_cast<bool>(state->future);
  }
  if (has_future) state->completer->post([state] { complete_future(state); });
}

void DdpWork::complete_future(const std::shared_ptr<State>& state) {
  std::exception_ptr error;
  std::vector<at::Tensor> outputs;
  {
    std::lock_guard lock(state->mutex);
    error = state->error;
    outputs = state->outputs;
  }
  if (error) {
    state->future->setError(error);
  } else {
    state->future->markCompleted(c10::IValue(outputs));
  }
}

bool DdpWork::isCompleted() {
  std::lock_guard lock(state_->mutex);
  return state_->completed;
}

bool DdpWork::isSuccess() const {
  std::lock_guard lock(state_->mutex);
  return state_->completed && !state_->error;
}

std::exception_ptr DdpWork::exception() const {
  std::lock_guard lock(state_->mutex);
  return state_->error;
}

std::vector<at::Tensor> DdpWork::result() {
  std::lock_guard lock(state_->mutex);
  return state_->outputs;
}

bool DdpWork::wait(std::chrono::milliseconds timeout) {
  const bool bounded = timeout > std::chrono::milliseconds(0);
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (auto& part : parts_) {
    if (bounded) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - std::chrono::steady_clock::now());
      if (!part->wait_for(std::max(left, std::chrono::milliseconds(0)))) {
        C10_THROW_ERROR(DistBackendError,
                        fmt::format("ddp backend: {} did not complete within the {} ms that "
                                    "wait() allowed (the operation goes on; its own deadline is "
                                    "the group's timeout)",
                                    state_->call, timeout.count()));
      }
    } else {
      try {
        part->wait();
      } catch (...) {
        // The callbacks have recorded it too; the first error of the call is what wait() throws.
      }
    }
  }
  // ddp's wait() returns after the callbacks registered before completion have run, so the last
  // part's callback (and `finish`) has run by now.
  std::lock_guard lock(state_->mutex);
  if (!state_->completed) {
    C10_THROW_ERROR(
        DistBackendError,
        fmt::format("ddp backend: {} has not completed within twice its deadline", state_->call));
  }
  if (state_->error) std::rethrow_exception(state_->error);
  return true;
}

c10::intrusive_ptr<c10::ivalue::Future> DdpWork::getFuture() {
  bool complete_now = false;
  c10::intrusive_ptr<c10::ivalue::Future> future;
  {
    std::lock_guard lock(state_->mutex);
    if (!state_->future) {
      state_->future =
          c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()));
      complete_now = state_->completed;
    }
    future = state_->future;
  }
  // Already complete: the caller's thread completes it (its callbacks added later run inline).
  if (complete_now) complete_future(state_);
  return future;
}

int DdpWork::sourceRank() const {
  if (!source_) return c10d::Work::sourceRank();
  std::lock_guard lock(state_->mutex);
  TORCH_CHECK(state_->completed && !state_->error,
              "ddp backend: the source rank of a recv from any source is known once it completed "
              "without error; wait() for it first");
  return *source_;
}

}  // namespace torch_ddp
