// RemoteModule: an nn::Module built on a named worker from a registered factory, whose forward
// runs there by RPC, as PyTorch's torch.distributed.nn.RemoteModule (docs/rpc.md).
//
//   // on every worker, before init_rpc:
//   ddp::rpc::register_module("bag", [](const std::vector<c10::IValue>& args) {
//     return std::make_shared<torch::nn::EmbeddingBagImpl>(
//         torch::nn::EmbeddingBagOptions(args[0].toInt(), args[1].toInt()).mode(torch::kSum));
//   }, [](torch::nn::Module& m, const std::vector<c10::IValue>& args) {
//     return c10::IValue(m.as<torch::nn::EmbeddingBagImpl>()->forward(
//         args[0].toTensor(), args[1].toTensor()));
//   });
//   // on a trainer:
//   ddp::rpc::RemoteModule bag("ps", "bag", {100, 16});
//   torch::Tensor out = bag.forward({indices, offsets}).toTensor();
//   std::vector<ddp::rpc::RRef> params = bag.remote_parameters();   // owned by "ps"
//
// The module lives on its worker until RPC shuts down there; its parameters' RRefs hold the
// parameter tensors themselves (an optimizer stepping them on the owner steps the module).
// Errors: as rpc_sync's (an unknown module name is RpcError kRemoteException naming it).
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <torch/nn/module.h>

#include "ddp/torch/rpc/rpc.h"
#include "ddp/torch/rpc/rref.h"

// Exported by ddp's shared libraries, which hide the rest (src/CMakeLists.txt).
#pragma GCC visibility push(default)
namespace ddp::rpc {

using ModuleFactory =
    std::function<std::shared_ptr<torch::nn::Module>(const std::vector<c10::IValue>& args)>;
using ModuleForward =
    std::function<c10::IValue(torch::nn::Module& module, const std::vector<c10::IValue>& args)>;

// Registers (or replaces) module kind `name` in this process, for RemoteModules built here.
void register_module(const std::string& name, ModuleFactory factory, ModuleForward forward);

class RemoteModule {
 public:
  // Builds module kind `module` on worker `on` with `args` (one round trip).
  RemoteModule(const std::string& on, const std::string& module,
               std::vector<c10::IValue> args = {});

  // A handle to a module built already (by another RemoteModule, e.g. on another worker; id()
  // names it), so that several workers share one module, as PyTorch's passing a RemoteModule.
  static RemoteModule existing(const std::string& on, std::int64_t id);
  std::int64_t id() const { return id_; }

  c10::IValue forward(std::vector<c10::IValue> args) const;
  FuturePtr forward_async(std::vector<c10::IValue> args) const;
  // An RRef per parameter, in the module's parameters() order, owned by the module's worker.
  std::vector<RRef> remote_parameters() const;
  const std::string& owner() const { return owner_; }

 private:
  RemoteModule() = default;
  std::string owner_;
  std::int64_t id_ = 0;
};

}  // namespace ddp::rpc
#pragma GCC visibility pop
