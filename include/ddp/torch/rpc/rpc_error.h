// The errors of ddp's RPC (rpc.h): what failed, by kind, with a text that names the function and
// the worker. A deadline that passes is a ddp::TimeoutError instead, as everywhere in ddp.
#pragma once

#include <string>

#include "ddp/error.h"

// Exported by ddp's shared libraries, which hide the rest (src/CMakeLists.txt).
#pragma GCC visibility push(default)
namespace ddp::rpc {

enum class RpcErrorKind {
  kRemoteException,  // the function threw on the callee: remote_type() is its exception's type
  kUnknownFunction,  // the callee has no function of that name
  kBadArguments,     // the callee could not decode the arguments
  kWorkerGone,       // the worker's connection closed or failed (it died, or stopped)
  kUnknownWorker,    // no worker of that name
  kShutdown,         // RPC was shut down (here) before the call completed
  kProtocol,         // a peer broke the wire protocol
  kRefused,          // refused before anything was sent (arguments over the size limit)
  kNotInitialized,   // init_rpc has not run in this process
};

class RpcError : public Error {
 public:
  RpcError(RpcErrorKind kind, const std::string& message, std::string remote_type = {})
      : Error(message), kind_(kind), remote_type_(std::move(remote_type)) {}
  RpcErrorKind kind() const { return kind_; }
  // kRemoteException: the callee's exception type, demangled ("std::out_of_range").
  const std::string& remote_type() const { return remote_type_; }

 private:
  RpcErrorKind kind_;
  std::string remote_type_;
};

}  // namespace ddp::rpc
#pragma GCC visibility pop
