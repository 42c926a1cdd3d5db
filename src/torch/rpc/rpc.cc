// ddp::rpc's calls over the transport (src/rpc/agent.h): one agent per process, the functions
// registered by name, values through rpc_values.h, failures turned into RpcError and
// TimeoutError.
#include "ddp/torch/rpc/rpc.h"

#include <map>
#include <mutex>

#include <fmt/format.h>

#include "ddp/launch/job_secret.h"

#include "rpc/agent.h"
#include "torch/rpc/rpc_internal.h"
#include "torch/rpc/rpc_values.h"

namespace ddp::rpc {
namespace {

namespace transport = ddp::rpc::transport;
using detail::decode_message;
using detail::encode_message;

struct RpcState {
  std::mutex mutex;
  std::map<std::string, Function> functions;
  std::shared_ptr<Store> store;
  std::shared_ptr<transport::Agent> agent;
  Milliseconds timeout = kDefaultRpcTimeout;
};

RpcState& state() {
  static RpcState* s = new RpcState;  // never destroyed: the agent may outlive static teardown
  return *s;
}

}  // namespace

namespace detail {

std::shared_ptr<transport::Agent> running_agent(Milliseconds* timeout) {
  auto& s = state();
  std::lock_guard lock(s.mutex);
  if (timeout != nullptr) *timeout = s.timeout;
  if (!s.agent) {
    throw RpcError(RpcErrorKind::kNotInitialized,
                   "rpc: RPC is not running in this process: call ddp::rpc::init_rpc first");
  }
  return s.agent;
}

RpcErrorKind kind_of(transport::FailureKind kind) {
  switch (kind) {
    case transport::FailureKind::kRemoteException:
      return RpcErrorKind::kRemoteException;
    case transport::FailureKind::kUnknownFunction:
      return RpcErrorKind::kUnknownFunction;
    case transport::FailureKind::kBadArguments:
      return RpcErrorKind::kBadArguments;
    case transport::FailureKind::kWorkerGone:
      return RpcErrorKind::kWorkerGone;
    case transport::FailureKind::kShutdown:
      return RpcErrorKind::kShutdown;
    case transport::FailureKind::kProtocol:
      return RpcErrorKind::kProtocol;
    case transport::FailureKind::kUnknownWorker:
      return RpcErrorKind::kUnknownWorker;
    case transport::FailureKind::kCallerError:
      return RpcErrorKind::kRefused;
    case transport::FailureKind::kTimeout:
      break;
  }
  return RpcErrorKind::kProtocol;
}

std::shared_ptr<transport::Agent> agent_if_running() {
  auto& s = state();
  std::lock_guard lock(s.mutex);
  return s.agent;
}

Function find_function(const std::string& name) {
  {
    auto& s = state();
    std::lock_guard lock(s.mutex);
    auto it = s.functions.find(name);
    if (it != s.functions.end()) return it->second;
  }
  for (auto& [builtin, function] : module_functions()) {
    if (builtin == name) return function;
  }
  for (auto& [builtin, function] : optimizer_functions()) {
    if (builtin == name) return function;
  }
  return {};
}

std::exception_ptr error_of(const transport::Failure& failure) {
  if (failure.kind == transport::FailureKind::kTimeout) {
    return std::make_exception_ptr(TimeoutError(failure.message));
  }
  return std::make_exception_ptr(
      RpcError(kind_of(failure.kind), failure.message, failure.type_name));
}

}  // namespace detail

namespace {

using detail::error_of;

// A reply's value, or its failure (or a result this worker cannot decode) thrown as RpcError.
c10::IValue result_of(transport::Reply reply, const std::string& function, const std::string& to,
                      int from) {
  if (!reply.ok()) std::rethrow_exception(error_of(*reply.failure));
  try {
    return decode_message(std::move(reply.payload),
                          fmt::format("rpc: the result of '{}' from '{}'", function, to), from)
        .value;
  } catch (const std::exception& e) {
    throw RpcError(RpcErrorKind::kProtocol, e.what());
  }
}
using detail::running_agent;

// What runs on the callee: decode, call, encode. A function that throws is reported by the
// agent (its type and text); arguments it cannot decode are the caller's fault, said so.
transport::Handler handler_of(const std::string& name, Function function) {
  return [name, function = std::move(function)](const transport::CallerInfo& caller,
                                                transport::Bytes request,
                                                const transport::CallPromise& reply) {
    detail::Decoded decoded;
    try {
      decoded = decode_message(
          std::move(request),
          fmt::format("rpc: the arguments of '{}' from worker '{}'", name, caller.name),
          caller.rank);
      if (!decoded.value.isTuple()) throw ProtocolError("rpc: the arguments are not a tuple");
    } catch (const std::exception& e) {
      reply.fail(transport::FailureKind::kBadArguments, e.what());
      return;
    }
    // The function and its result's message run in the caller's autograd context, if any: what
    // it sends and returns records its part of the distributed backward.
    detail::AutogradContextScope scope(decoded.autograd_context);
    const auto& elements = decoded.value.toTupleRef().elements();
    c10::IValue result = function(std::vector<c10::IValue>(elements.begin(), elements.end()));
    reply.complete(detail::reply_of(
        encode_message(result, fmt::format("rpc: the result of '{}'", name), caller.rank)));
  };
}

std::string loopback_or_empty(const std::string& master_addr) {
  return master_addr == "127.0.0.1" || master_addr == "localhost" || master_addr == "::1"
             ? "127.0.0.1"
             : "";
}

}  // namespace

void register_function(const std::string& name, Function function) {
  if (!function) throw ConfigError("rpc: register_function('" + name + "') without a function");
  if (name.rfind("__ddp", 0) == 0) {
    throw ConfigError("rpc: register_function('" + name +
                      "'): names starting with __ddp are "
                      "ddp's own (RRefs)");
  }
  auto& s = state();
  std::lock_guard lock(s.mutex);
  s.functions[name] = function;
  if (s.agent) s.agent->register_function(name, handler_of(name, std::move(function)));
}

void init_rpc(const std::string& name, RpcOptions options) {
  auto& s = state();
  std::lock_guard lock(s.mutex);
  if (s.agent) {
    throw ConfigError(
        fmt::format("rpc: init_rpc('{}'): RPC runs already in this process as '{}'; "
                    "call ddp::rpc::shutdown() first",
                    name, s.agent->self().name));
  }
  transport::AgentOptions agent;
  agent.name = name;
  std::string secret;
  std::string master_addr = "127.0.0.1";
  std::shared_ptr<Store> store = options.store;
  if (store) {
    if (!options.rank || !options.world_size) {
      throw ConfigError("rpc: init_rpc with a store needs RpcOptions::rank and world_size too");
    }
    agent.rank = *options.rank;
    agent.world_size = *options.world_size;
    secret = options.secret ? *options.secret : resolve_job_secret(options.init.launch.secret);
  } else {
    World world = rendezvous(options.init);
    store = world.store;
    agent.rank = world.rank();
    agent.world_size = world.size();
    master_addr = world.environment.master_addr;
    secret = options.secret ? *options.secret : world.environment.secret;
  }
  agent.host =
      options.advertise_host.empty() ? loopback_or_empty(master_addr) : options.advertise_host;
  agent.bind_host = options.bind_host;
  agent.secret = secret;
  agent.timeout = options.timeout;
  agent.threads = options.threads;
  agent.spin_before_sleep = options.spin_before_sleep;
  agent.max_message_bytes = options.max_message_bytes;
  agent.shared_memory_bytes = options.shared_memory_bytes;
  for (const auto& [function_name, function] : s.functions) {
    agent.functions.emplace_back(function_name, handler_of(function_name, function));
  }
  for (auto& builtin : detail::rref_functions())
    agent.functions.push_back(std::move(builtin));
  for (auto& builtin : detail::autograd_functions())
    agent.functions.push_back(std::move(builtin));
  for (auto& [builtin, function] : detail::module_functions()) {
    agent.functions.emplace_back(builtin, handler_of(builtin, function));
  }
  for (auto& [builtin, function] : detail::optimizer_functions()) {
    agent.functions.emplace_back(builtin, handler_of(builtin, function));
  }
  s.agent = std::make_shared<transport::Agent>(*store, std::move(agent));
  s.store = std::move(store);
  s.timeout = options.timeout;
}

void shutdown(bool graceful) {
  auto& s = state();
  std::shared_ptr<transport::Agent> agent;
  Milliseconds timeout;
  {
    std::lock_guard lock(s.mutex);
    agent = s.agent;
    timeout = s.timeout;
  }
  if (!agent) {
    throw RpcError(RpcErrorKind::kNotInitialized, "rpc: shutdown() without init_rpc");
  }
  auto forget = [&] {
    {
      std::lock_guard lock(s.mutex);
      s.agent.reset();
      s.store.reset();
    }
    detail::clear_owned_rrefs();
    detail::clear_modules();
    detail::clear_autograd_contexts();
    detail::clear_optimizers();
  };
  try {
    if (graceful) {
      agent->shutdown(timeout);
    } else {
      agent->stop();
    }
  } catch (...) {
    forget();
    throw;
  }
  forget();
}

bool is_initialized() {
  auto& s = state();
  std::lock_guard lock(s.mutex);
  return s.agent != nullptr;
}

WorkerInfo get_worker_info() {
  const auto agent = running_agent();
  return {agent->self().name, agent->self().rank};
}

WorkerInfo get_worker_info(const std::string& name) {
  const auto agent = running_agent();
  const transport::WorkerInfo* w = agent->find_worker(name);
  if (w == nullptr) {
    throw RpcError(RpcErrorKind::kUnknownWorker, fmt::format("rpc: no worker is named '{}'", name));
  }
  return {w->name, w->rank};
}

std::vector<WorkerInfo> get_worker_infos() {
  const auto agent = running_agent();
  std::vector<WorkerInfo> out;
  for (const auto& w : agent->workers())
    out.push_back({w.name, w.rank});
  return out;
}

FuturePtr rpc_async(const std::string& to, const std::string& function,
                    std::vector<c10::IValue> args, std::optional<Milliseconds> timeout) {
  Milliseconds default_timeout{0};
  const auto agent = running_agent(&default_timeout);
  auto future = c10::make_intrusive<c10::ivalue::Future>(c10::AnyType::get());
  const transport::WorkerInfo* worker = agent->find_worker(to);
  if (worker == nullptr) {
    std::string names;
    for (const auto& w : agent->workers())
      names += (names.empty() ? "" : ", ") + w.name;
    future->setError(std::make_exception_ptr(
        RpcError(RpcErrorKind::kUnknownWorker,
                 fmt::format("rpc: '{}' on '{}': no worker is named '{}' (the workers: {})",
                             function, to, to, names))));
    return future;
  }
  transport::Outgoing payload;
  try {
    payload = encode_message(c10::ivalue::Tuple::create(std::move(args)),
                             fmt::format("rpc: the arguments of '{}' for '{}'", function, to),
                             worker->rank);
  } catch (...) {
    future->setError(std::current_exception());
    return future;
  }
  agent
      ->call_attached(worker->rank, function, std::move(payload), timeout.value_or(default_timeout))
      .then_take([future, function, to, from = worker->rank](transport::Reply reply) {
        try {
          future->markCompleted(result_of(std::move(reply), function, to, from));
        } catch (...) {
          future->setError(std::current_exception());
        }
      });
  return future;
}

c10::IValue rpc_sync(const std::string& to, const std::string& function,
                     std::vector<c10::IValue> args, std::optional<Milliseconds> timeout) {
  // The caller waits on the transport's future itself and decodes the reply on its own thread:
  // one hand-over fewer than rpc_async's (the reader thread, an executor, then the caller).
  Milliseconds default_timeout{0};
  const auto agent = running_agent(&default_timeout);
  const transport::WorkerInfo* worker = agent->find_worker(to);
  if (worker == nullptr) {
    FuturePtr future = rpc_async(to, function, std::move(args), timeout);
    future->wait();
    return future->value();  // rethrows the unknown worker's error
  }
  transport::Outgoing payload = encode_message(
      c10::ivalue::Tuple::create(std::move(args)),
      fmt::format("rpc: the arguments of '{}' for '{}'", function, to), worker->rank);
  // This thread waits at once: it reads its reply off the connection itself while it spins.
  return result_of(agent
                       ->call_attached(worker->rank, function, std::move(payload),
                                       timeout.value_or(default_timeout), /*caller_spins=*/true)
                       .take(),
                   function, to, worker->rank);
}

}  // namespace ddp::rpc
