// What ddp::rpc's calls (rpc.cc) share with its RRefs (rref.cc); internal.
#pragma once

#include <exception>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "ddp/torch/rpc/rpc.h"
#include "rpc/agent.h"

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
std::pair<std::string, std::string> describe_current_exception();

// The built-in functions of RRefs (rref.cc), installed by init_rpc beside the user's; their names
// start with "__ddp", which register_function refuses.
std::vector<std::pair<std::string, transport::Handler>> rref_functions();
// Forgets every value this worker owns (after the agent stopped).
void clear_owned_rrefs();

// The built-in functions of RemoteModule (remote_module.cc), installed like the user's but under
// names starting with "__ddp"; and forgetting the modules built here (at shutdown).
std::vector<std::pair<std::string, Function>> module_functions();
void clear_modules();

// Encodes a value for a message to another worker, turning every RRef in it into a fork for that
// worker (told to the owner before this returns), and decodes one, turning the forks back into
// RRefs held by this worker.
transport::Bytes encode_message(const c10::IValue& value, const std::string& context);
c10::IValue decode_message(std::span<const std::uint8_t> bytes, const std::string& source);

}  // namespace ddp::rpc::detail
