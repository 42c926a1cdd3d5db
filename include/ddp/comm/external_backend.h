// ExternalBackend: a ProcessGroup backend that lives outside ddp::comm, behind the same front as
// ring, mpi and nccl.
//
// The front (argument checks, the call record and its fingerprint, sequence numbers, the
// operation queue with its worker thread, blocking and async calls, the flight recorder,
// poisoning after the first failure, the uneven collectives and allreduce_segments) is internal
// to ddp::comm. A backend built in a layer above it (ddp::torch's adapter over a libtorch c10d
// group, ddp/torch/c10d_process_group.h) implements this interface instead and gets the same
// front through make_external_backend_group():
//
//   auto pg = ddp::make_external_backend_group(std::make_unique<MyBackend>(...), rank, size,
//                                              {.name = "mine", .timeout = 30s});
//   pg->allreduce(buf, n, ddp::DType::kFloat32, ddp::ReduceOp::kSum)->wait();
//
// Threads: check() runs on the caller's thread before a call is queued; run() on one thread at a
// time, in issue order (the group's worker, or a caller waiting for it); send()/recv() on the
// caller's thread; new_group() on the caller's thread.
// Errors: ConfigError from check() is thrown by the call itself (nothing is queued). run() throws
// CommError of the right kind (kTimeout once `deadline` has passed, kTransport when the library
// failed); any other exception becomes a CommError of kind kInternal. Either poisons the group.
#pragma once

#include <chrono>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "ddp/comm/process_group.h"
#include "ddp/comm/types.h"
#include "ddp/comm/work.h"

// Exported by ddp's shared libraries, which hide the rest (src/CMakeLists.txt).
#pragma GCC visibility push(default)
namespace ddp {

// One collective, checked by the front. Buffers as in ProcessGroup's call of the same kind: for
// the block collectives `count` is per rank; `recv` (gather, reduce) or `send` (scatter) may be
// null away from the root; barrier names no buffer.
struct BackendCall {
  Collective kind = Collective::kAllreduce;
  const void* send = nullptr;
  void* recv = nullptr;
  std::size_t count = 0;
  DType dtype = DType::kFloat32;
  ReduceOp op = ReduceOp::kSum;  // the reductions only
  int root = -1;                 // broadcast, reduce, gather, scatter only
  std::uint64_t sequence = 0;    // in the group, from 0 in issue order (0 in check())
  std::string description;       // "allreduce #7 (256 x float32, sum)", for messages
};

class ExternalBackend {
 public:
  virtual ~ExternalBackend() = default;

  // The backend's name as ProcessGroup::backend() returns it ("c10d:gloo").
  virtual std::string_view name() const = 0;
  // Throws ConfigError for a call this backend cannot run (a dtype or an operation it lacks),
  // naming the operation and the backend. Default: accepts everything.
  virtual void check(const BackendCall& call) const { static_cast<void>(call); }
  // Runs `call` to completion by `deadline`. See the file comment for errors.
  virtual void run(const BackendCall& call, std::chrono::steady_clock::time_point deadline) = 0;
  // The group failed (error text `reason`): stop what can be stopped. Must not throw.
  virtual void on_poison(const std::string& reason) noexcept { static_cast<void>(reason); }
  // Point to point, arguments checked (peer, tag, buffer); the Work completes on its own (not
  // only when waited for) and fails with a CommError of kind kTimeout after `timeout`.
  virtual std::shared_ptr<Work> send(const void* buf, std::size_t count, DType dtype, int dst,
                                     int tag, std::chrono::milliseconds timeout) = 0;
  virtual std::shared_ptr<Work> recv(void* buf, std::size_t count, DType dtype, int src, int tag,
                                     std::chrono::milliseconds timeout) = 0;
  // ProcessGroup::new_group after the front checked `ranks`: the subgroup for a member, nullptr
  // for the others; throws ConfigError when the backend cannot make one.
  virtual std::shared_ptr<ProcessGroup> new_group(const std::vector<int>& ranks) = 0;
  // Tags send/recv may use.
  virtual int min_tag() const { return INT_MIN; }
  virtual int max_tag() const { return INT_MAX; }
};

struct ExternalGroupOptions {
  std::string name = "default";          // the group's name in messages and the flight recorder
  std::chrono::milliseconds timeout{0};  // a call's deadline; 0: ddp's default (timeouts.h)
};

// The group over `backend`, ranks as the backend counts them. Throws ConfigError for a null
// backend, a rank outside 0..size-1 or a negative timeout.
std::shared_ptr<ProcessGroup> make_external_backend_group(std::unique_ptr<ExternalBackend> backend,
                                                          int rank, int size,
                                                          ExternalGroupOptions options = {});

}  // namespace ddp
#pragma GCC visibility pop
