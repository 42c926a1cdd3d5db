// DdpWork: the c10d::Work of one c10d call, made of the engine's operations for it.
//
// A c10d call can become several engine operations (a coalesced call, one per tensor) and may
// need a last step once they have all succeeded (copying a gathered buffer into the caller's
// tensors, writing back a contiguous copy): `finish`, run on the thread that completed the last
// operation, before the Work counts as completed. wait() waits for the operations (on the calling
// thread where the engine can run them there) and rethrows a failure as c10::DistBackendError
// (Python: torch.distributed.DistBackendError, a RuntimeError). getFuture() gives a future
// completed with result() (PyTorch's DDP comm hooks chain on it) on the backend's completer
// thread (future_completer.h says why); it is made only when asked for.
#pragma once

#include <torch/extension.h>

#include <chrono>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/Work.hpp>
#include "ddp/comm/work.h"
#include "future_completer.h"

namespace torch_ddp {

// The error `error` (a ddp or c10 exception) as a c10::DistBackendError naming `call`.
std::exception_ptr as_backend_error(std::exception_ptr error, const std::string& call);

class DdpWork : public c10d::Work {
 public:
  struct Spec {
    int rank = -1;
    c10d::OpType type = c10d::OpType::UNKNOWN;
    std::string call;  // names the call in messages, e.g. "allreduce"
    std::vector<std::shared_ptr<ddp::Work>> parts;
    std::vector<at::Tensor> outputs;     // result(), and kept alive until completion
    std::vector<at::Tensor> keep_alive;  // inputs and scratch the operations read or write
    std::function<void()> finish;        // may be empty
    std::shared_ptr<FutureCompleter> completer;
    std::chrono::milliseconds timeout{0};
    // A receive from any source: where the engine writes the sender's rank (sourceRank()).
    std::shared_ptr<int> source;
  };
  // Registers the completion callbacks: a Work whose parts have completed completes at once.
  static c10::intrusive_ptr<DdpWork> start(Spec spec);

  bool isCompleted() override;
  bool isSuccess() const override;
  std::exception_ptr exception() const override;
  std::vector<at::Tensor> result() override;
  void synchronize() override {}
  bool wait(std::chrono::milliseconds timeout = ::kNoTimeout) override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;
  std::chrono::milliseconds getTimeout() const override { return timeout_; }
  // The sender of a receive from any source, once it completed (c10d's error otherwise).
  int sourceRank() const override;

  explicit DdpWork(Spec spec);

 private:
  // What the engine's callbacks touch: kept apart from the Work so that a Work dropped before its
  // operations complete is freed, and the callbacks hold no cycle through the parts.
  struct State {
    std::mutex mutex;
    std::size_t remaining = 0;
    bool completed = false;
    std::exception_ptr error;
    std::vector<at::Tensor> outputs;
    std::vector<at::Tensor> keep_alive;
    std::function<void()> finish;
    std::string call;
    c10::intrusive_ptr<c10::ivalue::Future> future;
    std::shared_ptr<FutureCompleter> completer;
  };
  static void part_done(const std::shared_ptr<State>& state, ddp::Work& part);
  static void complete(const std::shared_ptr<State>& state);  // after the last part
  static void complete_future(const std::shared_ptr<State>& state);

  std::vector<std::shared_ptr<ddp::Work>> parts_;
  std::shared_ptr<State> state_;
  std::chrono::milliseconds timeout_;
  std::shared_ptr<int> source_;
};

}  // namespace torch_ddp
