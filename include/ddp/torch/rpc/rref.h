// RRef: a reference to a value that lives on one worker (its owner), as PyTorch's
// torch.distributed.rpc.RRef, and remote(), which creates one by running a registered function
// there (docs/rpc.md).
//
//   ddp::rpc::RRef table = ddp::rpc::remote("ps", "make_table", {100, 16});  // returns at once
//   torch::Tensor copy = table.to_here().toTensor();     // fetched from the owner
//   ddp::rpc::rpc_sync("trainer2", "use", {table.ivalue()});  // passed on: a fork for trainer2
//   // in a registered function: auto table = ddp::rpc::RRef::from(args[0]);
//   //                           table.local_value() on the owner
//
// Reference counting follows PyTorch's protocol: every RRef handle, on any worker, holds one
// fork of the owner's value; the owner learns of a fork before it can be released (remote()'s
// call creates the first; passing an RRef in a call's arguments or result first tells the owner
// of the receiver's), and frees the value when the last fork is released. Releasing one is a
// message to the owner, sent when the last copy of a handle is destroyed (after remote() was
// confirmed); graceful shutdown() waits for those messages.
//
// Errors: to_here() throws what the function threw on the owner (RpcError kRemoteException), the
// failure of remote()'s call (RpcError: unknown function, worker gone), TimeoutError, or RpcError
// kWorkerGone when the owner died; local_value() off the owner is RpcError kRefused.
// Threads: handles may be copied, used and destroyed on any thread.
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/ivalue.h>

#include "ddp/torch/rpc/rpc.h"

// Exported by ddp's shared libraries, which hide the rest (src/CMakeLists.txt).
#pragma GCC visibility push(default)
namespace ddp::rpc {

namespace detail {
class RRefImpl;
}

class RRef {
 public:
  // The RRef an IValue holds (a registered function's argument); RpcError kRefused otherwise.
  static RRef from(const c10::IValue& value);
  // An RRef of `value` owned by this worker (PyTorch's RRef(value)), e.g. a local parameter for a
  // DistributedOptimizer.
  static RRef local(c10::IValue value);

  WorkerInfo owner() const;
  bool is_owner() const;
  // Whether the owner has confirmed this handle's fork (always true on the owner).
  bool confirmed_by_owner() const;
  // The value, fetched from the owner (waiting for remote()'s function to finish there).
  c10::IValue to_here(std::optional<Milliseconds> timeout = std::nullopt) const;
  // The value, on the owner only.
  c10::IValue local_value() const;
  // This RRef as an IValue, to pass in a call's arguments or return from a function.
  c10::IValue ivalue() const;

 private:
  friend RRef remote(const std::string&, const std::string&, std::vector<c10::IValue>,
                     std::optional<Milliseconds>);
  explicit RRef(c10::intrusive_ptr<c10::RRefInterface> impl) : impl_(std::move(impl)) {}
  detail::RRefImpl& impl() const;
  // Always a detail::RRefImpl (held as its interface, a complete type, so RRef copies anywhere).
  c10::intrusive_ptr<c10::RRefInterface> impl_;
};

// Values this worker owns with at least one fork alive somewhere (for tests and leak checks).
std::size_t owned_rref_count();

// Runs `function` on worker `to` with `args` and returns at once an RRef to its result there.
RRef remote(const std::string& to, const std::string& function, std::vector<c10::IValue> args = {},
            std::optional<Milliseconds> timeout = std::nullopt);

}  // namespace ddp::rpc
#pragma GCC visibility pop
