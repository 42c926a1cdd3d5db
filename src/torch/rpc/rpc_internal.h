// What ddp::rpc's calls (rpc.cc) share with its RRefs (rref.cc); internal.
#pragma once

#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "ddp/torch/rpc/rpc.h"
#include "rpc/agent.h"
#include "rpc/current_exception.h"

namespace ddp::rpc::detail {

namespace transport = ddp::rpc::transport;

// The running agent (RpcError kNotInitialized without one); `timeout` gets the default deadline.
std::shared_ptr<transport::Agent> running_agent(Milliseconds* timeout = nullptr);
// The agent, or null when RPC is not running (for work that may be skipped then: releasing an
// RRef after the shut-down).
std::shared_ptr<transport::Agent> agent_if_running();
// A registered function, or an empty one.
Function find_function(const std::string& name);
// The error a failed call completes its future with.
std::exception_ptr error_of(const transport::Failure& failure);
// The type (demangled) and text of the exception being handled.
using transport::describe_current_exception;

// The built-in functions of RRefs (rref.cc), installed by init_rpc beside the user's; their names
// start with "__ddp", which register_function refuses.
std::vector<std::pair<std::string, transport::Handler>> rref_functions();
// Forgets every value this worker owns (after the agent stopped).
void clear_owned_rrefs();

// The built-in functions of RemoteModule (remote_module.cc), installed like the user's but under
// names starting with "__ddp"; and forgetting the modules built here (at shutdown).
std::vector<std::pair<std::string, Function>> module_functions();
void clear_modules();
// The same for DistributedOptimizer (distributed_optimizer.cc).
std::vector<std::pair<std::string, Function>> optimizer_functions();
void clear_optimizers();

// The RRef hooks of a message's value (rref.cc): an RRef leaving becomes a fork for the receiver
// (told to its owner first), a marker arriving becomes a handle holding that fork.
c10::IValue fork_for_message(const c10::intrusive_ptr<c10::RRefInterface>& rref);
c10::IValue rref_from_marker(const c10::ivalue::Tuple& marker);

// A call's or a reply's value as a message (message.cc): (autograd record, value), where the
// record (None outside a distributed autograd context, or when no tensor requires grad) names
// the context, the message and which tensors require grad; RRefs go through the hooks above.
// Large tensors travel as attachments, from their own memory (rpc_values.h).
transport::Outgoing encode_message(const c10::IValue& value, const std::string& context,
                                   int to_rank);
inline transport::Reply reply_of(transport::Outgoing message) {
  return transport::Reply{std::move(message.bytes), std::nullopt, std::move(message.attachments)};
}
struct Decoded {
  c10::IValue value;
  std::int64_t autograd_context = 0;  // the sender's context, 0 for none
};
// Takes the message: its large tensors stay in the memory it was received into (rpc_values.h).
Decoded decode_message(transport::Bytes&& bytes, const std::string& source, int from_rank);

// Distributed autograd (dist_autograd.cc): the context current on this thread (0: none), a scope
// that makes one current, what a message records, and the built-in functions.
std::int64_t current_autograd_context();
class AutogradContextScope {
 public:
  explicit AutogradContextScope(std::int64_t id);
  ~AutogradContextScope();
  AutogradContextScope(const AutogradContextScope&) = delete;
  AutogradContextScope& operator=(const AutogradContextScope&) = delete;

 private:
  std::int64_t previous_;
};
// Sending `value` to `to_rank` under the current context: records its tensors that require grad
// as a send and returns the record (None when there is nothing to record).
c10::IValue record_send(const c10::IValue& value, int to_rank);
// Receiving: marks the recorded tensors of `value` as requiring grad, remembers where their
// gradients go; returns the context's id.
std::int64_t record_receive(const c10::IValue& record, const c10::IValue& value, int from_rank);
std::vector<std::pair<std::string, transport::Handler>> autograd_functions();
// Held by whatever borrows parameters' .grad on this worker (a local backward pass, an optimizer
// step of a DistributedOptimizer), so that two never borrow it at once.
std::unique_lock<std::mutex> lock_leaf_gradients();
void clear_autograd_contexts();

}  // namespace ddp::rpc::detail
