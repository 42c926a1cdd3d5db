// C10dBackend: ddp's ExternalBackend (ddp/comm/external_backend.h) over a libtorch c10d group
// (internal; the public entry is ddp/torch/c10d/c10d_process_group.h).
//
// Each collective becomes the c10d call of the same kind on tensors that alias the caller's
// buffers (torch::from_blob); the worker thread waits for c10d's Work until the call's deadline,
// which is also c10d's own timeout for the operation. Point-to-point operations (c10d_p2p.cc)
// complete on a thread of their own that waits for c10d's Works in posting order.
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "ddp/comm/external_backend.h"
#include "ddp/torch/c10d/c10d_process_group.h"
#include "torch/c10d/libtorch_compat_c10d.h"

namespace ddp::torch_c10d {

using libtorch_compat::C10dCollectives;

// The tensor type of a DType.
c10::ScalarType scalar_type(DType dtype);
// A 1-D tensor of `count` elements aliasing `data` (no copy; the caller keeps it alive).
at::Tensor alias(const void* data, std::size_t count, DType dtype);

// Completes ddp Works for c10d point-to-point Works: one thread that waits for each in posting
// order, within its deadline. A later Work that finished first is completed once the earlier ones
// are done (or timed out): p2p in ddp's uses waits for them in that order anyway.
class P2pCompleter {
 public:
  P2pCompleter(std::string group, std::string backend);
  ~P2pCompleter();  // waits for the Works still pending (each bounded by its deadline)
  P2pCompleter(const P2pCompleter&) = delete;
  P2pCompleter& operator=(const P2pCompleter&) = delete;

  // `c10d_work` was posted for `description` with the tensor `keep` (aliasing the buffer).
  std::shared_ptr<Work> track(c10::intrusive_ptr<c10d::Work> c10d_work, at::Tensor keep,
                              std::string description, std::chrono::milliseconds timeout, int peer);

 private:
  struct Pending;
  void loop();
  void finish(Pending& pending);

  const std::string group_;
  const std::string backend_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Pending>> pending_;
  bool stopping_ = false;
  std::thread thread_;
};

class C10dBackend final : public ExternalBackend {
 public:
  C10dBackend(c10::intrusive_ptr<C10dCollectives> collectives, C10dWrapOptions options);

  std::string_view name() const override { return name_; }
  void check(const BackendCall& call) const override;
  void run(const BackendCall& call, std::chrono::steady_clock::time_point deadline) override;
  std::shared_ptr<Work> send(const void* buf, std::size_t count, DType dtype, int dst, int tag,
                             std::chrono::milliseconds timeout) override;
  std::shared_ptr<Work> recv(void* buf, std::size_t count, DType dtype, int src, int tag,
                             std::chrono::milliseconds timeout) override;
  std::shared_ptr<ProcessGroup> new_group(const std::vector<int>& ranks) override;
  // c10d's gloo takes non-negative tags (they become part of its slot numbers).
  int min_tag() const override { return 0; }

 private:
  // Issues the c10d operation for `call` with `timeout` as its own timeout (on the worker).
  c10::intrusive_ptr<c10d::Work> issue(const BackendCall& call, std::chrono::milliseconds timeout,
                                       std::vector<at::Tensor>& keep);
  c10::intrusive_ptr<c10d::Work> issue_reduce_scatter(const BackendCall& call,
                                                      std::chrono::milliseconds timeout,
                                                      std::vector<at::Tensor>& keep);
  // Waits for `work` until `deadline`; throws CommError (kTimeout or kTransport).
  void wait(c10d::Work& work, const BackendCall& call,
            std::chrono::steady_clock::time_point deadline) const;
  [[noreturn]] void fail(CommErrorKind kind, const BackendCall& call,
                         const std::string& what) const;

  c10::intrusive_ptr<C10dCollectives> collectives_;
  C10dWrapOptions options_;
  const std::string c10d_name_;  // "gloo"
  const std::string name_;       // "c10d:gloo"
  const int rank_;
  const int size_;
  // Set once the c10d backend refused reduce_scatter; later calls go to the fallback directly.
  bool reduce_scatter_refused_ = false;  // worker thread only
  P2pCompleter p2p_;
};

}  // namespace ddp::torch_c10d
