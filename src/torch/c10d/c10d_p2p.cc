// Point to point over a c10d group: c10d's send/recv, and the thread that completes ddp's Works
// for them (c10d_backend.h).
#include <fmt/format.h>

#include "ddp/error.h"
#include "torch/c10d/c10d_backend.h"

namespace ddp::torch_c10d {

struct P2pCompleter::Pending {
  c10::intrusive_ptr<c10d::Work> c10d_work;
  at::Tensor keep;  // aliases the caller's buffer; c10d holds it too
  std::shared_ptr<Work> work;
  std::string description;
  std::chrono::steady_clock::time_point deadline;
  int peer = -1;
};

P2pCompleter::P2pCompleter(std::string group, std::string backend)
    : group_(std::move(group)), backend_(std::move(backend)), thread_([this] { loop(); }) {}

P2pCompleter::~P2pCompleter() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

std::shared_ptr<Work> P2pCompleter::track(c10::intrusive_ptr<c10d::Work> c10d_work, at::Tensor keep,
                                          std::string description,
                                          std::chrono::milliseconds timeout, int peer) {
  auto pending = std::make_shared<Pending>();
  pending->c10d_work = std::move(c10d_work);
  pending->keep = std::move(keep);
  pending->work = std::make_shared<Work>(description, timeout);
  pending->description = std::move(description);
  pending->deadline = std::chrono::steady_clock::now() + timeout;
  pending->peer = peer;
  auto work = pending->work;
  {
    std::lock_guard lock(mutex_);
    pending_.push_back(std::move(pending));
  }
  cv_.notify_one();
  return work;
}

void P2pCompleter::loop() {
  for (;;) {
    std::shared_ptr<Pending> next;
    {
      std::unique_lock lock(mutex_);
      cv_.wait(lock, [&] { return stopping_ || !pending_.empty(); });
      if (pending_.empty()) return;  // stopping, nothing left
      next = std::move(pending_.front());
      pending_.pop_front();
    }
    finish(*next);
  }
}

void P2pCompleter::finish(Pending& pending) {
  using std::chrono::milliseconds;
  const auto now = std::chrono::steady_clock::now();
  const auto remaining = std::chrono::ceil<milliseconds>(pending.deadline - now);
  std::exception_ptr error;
  const auto failure = [&](CommErrorKind kind, const std::string& what) {
    return std::make_exception_ptr(
        CommError(kind,
                  fmt::format("{} in group '{}' ({}) failed: {}", pending.description, group_,
                              backend_, what),
                  group_, pending.description, 0, pending.peer));
  };
  try {
    // c10d reads a zero timeout as "no timeout": wait at least 1 ms.
    if (!pending.c10d_work->wait(std::max(remaining, milliseconds(1)))) {
      error = failure(CommErrorKind::kAborted, "c10d aborted the operation");
    }
  } catch (const std::exception& e) {
    const std::string what = e.what();
    const auto line = what.substr(0, what.find('\n'));  // c10::Error appends a backtrace
    error = std::chrono::steady_clock::now() >= pending.deadline
                ? failure(CommErrorKind::kTimeout,
                          fmt::format("not done within its deadline (c10d: {})", line))
                : failure(CommErrorKind::kTransport, fmt::format("c10d: {}", line));
  }
  pending.work->complete(error);
}

std::shared_ptr<Work> C10dBackend::send(const void* buf, std::size_t count, DType dtype, int dst,
                                        int tag, std::chrono::milliseconds timeout) {
  std::vector<at::Tensor> tensors = {alias(buf, count, dtype)};
  auto description =
      fmt::format("send to rank {} (tag {}, {} x {})", dst, tag, count, to_string(dtype));
  try {
    auto work = collectives_->send(tensors, dst, tag);
    return p2p_.track(std::move(work), tensors.front(), std::move(description), timeout, dst);
  } catch (const c10::Error& e) {
    throw ConfigError(fmt::format("{} on {}: c10d refused it: {}", description, name_,
                                  e.what_without_backtrace()));
  }
}

std::shared_ptr<Work> C10dBackend::recv(void* buf, std::size_t count, DType dtype, int src, int tag,
                                        std::chrono::milliseconds timeout) {
  std::vector<at::Tensor> tensors = {alias(buf, count, dtype)};
  auto description =
      fmt::format("recv from rank {} (tag {}, {} x {})", src, tag, count, to_string(dtype));
  try {
    auto work = collectives_->recv(tensors, src, tag);
    return p2p_.track(std::move(work), tensors.front(), std::move(description), timeout, src);
  } catch (const c10::Error& e) {
    throw ConfigError(fmt::format("{} on {}: c10d refused it: {}", description, name_,
                                  e.what_without_backtrace()));
  }
}

}  // namespace ddp::torch_c10d
