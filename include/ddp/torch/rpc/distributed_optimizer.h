// DistributedOptimizer: one optimizer step over parameters on many workers, with the gradients a
// distributed autograd context holds, as PyTorch's torch.distributed.optim.DistributedOptimizer.
//
//   ddp::rpc::DistributedOptimizer optimizer(
//       "sgd", {{"lr", 0.05}}, remote_module.remote_parameters() + local parameters' RRefs);
//   { dist_autograd::Context context; ...; dist_autograd::backward(context.id(), {loss});
//     optimizer.step(context.id()); }
//
// Construction builds, on every worker that owns some of the parameters, a local optimizer of
// `kind` ("sgd", "adam", "adamw") with `options` (lr; sgd: momentum, dampening, weight_decay,
// nesterov; adam/adamw: beta1, beta2, eps, weight_decay, amsgrad) over the parameters it owns
// (RRef::local makes an RRef of one's own). step(context) steps every owner at once, each with
// the gradients that context holds there (a parameter without one is skipped, as with .grad
// undefined); steps on one worker run one at a time. The owners' optimizers are released with
// this object.
// Errors: ConfigError (an unknown kind or option, before anything is built), the RPC errors of
// the owners (a missing context there is RpcError kRemoteException naming it).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "ddp/torch/rpc/rref.h"

// Exported by ddp's shared libraries, which hide the rest (src/CMakeLists.txt).
#pragma GCC visibility push(default)
namespace ddp::rpc {

class DistributedOptimizer {
 public:
  DistributedOptimizer(const std::string& kind, const std::map<std::string, double>& options,
                       const std::vector<RRef>& parameters);
  ~DistributedOptimizer();
  DistributedOptimizer(const DistributedOptimizer&) = delete;
  DistributedOptimizer& operator=(const DistributedOptimizer&) = delete;

  void step(std::int64_t context_id);

 private:
  std::vector<std::pair<std::string, std::int64_t>> owners_;  // (worker, its optimizer's id)
};

}  // namespace ddp::rpc
#pragma GCC visibility pop
