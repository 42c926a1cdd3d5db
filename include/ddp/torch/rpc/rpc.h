// Remote calls between named workers, as PyTorch's torch.distributed.rpc, on ddp's own transport
// (docs/rpc.md). Functions are registered by name on every process; no code crosses the wire.
//
//   ddp::rpc::register_function("add", [](const std::vector<c10::IValue>& args) {
//     return c10::IValue(args[0].toTensor() + args[1].toTensor());
//   });
//   ddp::rpc::init_rpc(rank == 0 ? "ps" : "trainer" + std::to_string(rank));  // ddprun's env
//   torch::Tensor sum = ddp::rpc::rpc_sync("ps", "add", {a, b}).toTensor();
//   auto future = ddp::rpc::rpc_async("ps", "add", {a, b});          // c10::ivalue::Future
//   future->wait();  future->value();                                 // value() rethrows
//   ddp::rpc::shutdown();                                             // every worker, together
//
// Values (arguments and results): None, bool, int, double, string, tuples, lists, dicts (string
// or int keys) and dense CPU tensors (a CUDA tensor is copied to the CPU), sent as libtorch's
// pickle with the tensors' bytes beside it and read back through ddp's allowlist unpickler.
//
// init_rpc is collective: every worker of the world calls it with a name of its own (letters,
// digits, _ - . :). Register functions before it, so that a peer's first call finds them. A
// function runs on a pool of `threads` threads of the callee; what it throws comes back to the
// caller as RpcError(kRemoteException) with the exception's type and text.
//
// Errors: rpc_sync throws, and an rpc_async future completes with, ddp::TimeoutError (the
// deadline passed) or RpcError (rpc_error.h: kinds for an unknown worker or function, arguments
// the callee cannot decode, a worker that died, a remote exception). init_rpc: ConfigError (a
// duplicate name, a world that does not agree, a bad name, RPC running already), TimeoutError
// (a worker that never came), ProtocolError (a worker without the job's secret).
// Threads: every function may be called from any thread, but not init_rpc and shutdown at once.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/ivalue.h>

#include "ddp/launch/rendezvous.h"
#include "ddp/store/store.h"
#include "ddp/timeouts.h"
#include "ddp/torch/rpc/rpc_error.h"

// Exported by ddp's shared libraries, which hide the rest (src/CMakeLists.txt).
#pragma GCC visibility push(default)
namespace ddp::rpc {

// PyTorch's default rpc_timeout.
inline constexpr Milliseconds kDefaultRpcTimeout{60'000};

struct RpcOptions {
  // The job's store and this worker's place in the world. Without a store, init_rpc runs
  // ddp::rendezvous(init) (the launcher's environment: ddprun, torchrun, mpirun, srun).
  std::shared_ptr<Store> store;
  std::optional<int> rank;
  std::optional<int> world_size;
  InitOptions init;
  // The default deadline of a call, and the bound of start-up and shut-down.
  Milliseconds timeout = kDefaultRpcTimeout;
  // Authenticates every RPC connection; unset: the job's (DDP_SECRET, DDP_SECRET_FILE).
  std::optional<std::string> secret;
  // The address the other workers reach this one at ("" = DDP_ADVERTISE_ADDR, else this host's
  // name) and the one it listens on ("" = every address).
  std::string advertise_host;
  std::string bind_host;
  int threads = 16;
  std::uint64_t max_message_bytes = std::uint64_t{1} << 30;
  // Between workers of one host, each side of a connection copies its messages of 16 KiB and more
  // through a shared-memory ring of this many bytes (a multiple of 4096 from 64 KiB to 1 GiB),
  // made with the first such message; a message larger than the room left goes by TCP. 0: every
  // byte goes by TCP (docs/rpc.md, "Shared memory between workers of one host").
  std::size_t shared_memory_bytes = std::size_t{4} << 20;
  // How long a thread waiting for a reply (rpc_sync, wait()), or a callee's pool thread that has
  // just run a call, yields its core in a loop before it sleeps, 0 to 10,000 us: on one host a
  // round trip is tens of microseconds and each wake-up from sleep adds 10-20 (docs/rpc.md). 0
  // saves that CPU where cores are scarcer than latency matters.
  std::chrono::microseconds spin_before_sleep{100};
};

struct WorkerInfo {
  std::string name;
  int id = 0;  // the worker's rank in the RPC world
};

using Function = std::function<c10::IValue(const std::vector<c10::IValue>& args)>;
using FuturePtr = c10::intrusive_ptr<c10::ivalue::Future>;

// Registers (or replaces) `name` in this process, now and for every later init_rpc.
void register_function(const std::string& name, Function function);

void init_rpc(const std::string& name, RpcOptions options = {});
// graceful: wait for every worker's outstanding calls (collective); otherwise stop at once,
// failing what is outstanding here. Throws RpcError(kNotInitialized) without init_rpc.
void shutdown(bool graceful = true);
bool is_initialized();

WorkerInfo get_worker_info();  // this worker
WorkerInfo get_worker_info(const std::string& name);
std::vector<WorkerInfo> get_worker_infos();

c10::IValue rpc_sync(const std::string& to, const std::string& function,
                     std::vector<c10::IValue> args = {},
                     std::optional<Milliseconds> timeout = std::nullopt);
FuturePtr rpc_async(const std::string& to, const std::string& function,
                    std::vector<c10::IValue> args = {},
                    std::optional<Milliseconds> timeout = std::nullopt);

}  // namespace ddp::rpc
#pragma GCC visibility pop
