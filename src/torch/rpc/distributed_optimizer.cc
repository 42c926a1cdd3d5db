// DistributedOptimizer (include/ddp/torch/rpc/distributed_optimizer.h): the caller's side, and
// the owners' local optimizers with the built-in functions that build, step and release them.
#include "ddp/torch/rpc/distributed_optimizer.h"

#include <mutex>
#include <set>

#include <fmt/format.h>
#include <torch/optim.h>

#include "ddp/torch/rpc/dist_autograd.h"
#include "torch/rpc/rpc_internal.h"

namespace ddp::rpc {
namespace detail {
namespace {

constexpr const char* kCreateOptimizer = "__ddp_optim.create";
constexpr const char* kStepOptimizer = "__ddp_optim.step";
constexpr const char* kReleaseOptimizer = "__ddp_optim.release";

const std::map<std::string, std::set<std::string>>& known_options() {
  static const std::map<std::string, std::set<std::string>> known = {
      {"sgd", {"lr", "momentum", "dampening", "weight_decay", "nesterov"}},
      {"adam", {"lr", "beta1", "beta2", "eps", "weight_decay", "amsgrad"}},
      {"adamw", {"lr", "beta1", "beta2", "eps", "weight_decay", "amsgrad"}},
  };
  return known;
}

void check_options(const std::string& kind, const std::map<std::string, double>& options) {
  auto it = known_options().find(kind);
  if (it == known_options().end()) {
    throw ConfigError(
        fmt::format("DistributedOptimizer: unknown kind '{}' (sgd, adam, adamw)", kind));
  }
  if (!options.contains("lr")) throw ConfigError("DistributedOptimizer: options need an lr");
  for (const auto& [name, value] : options) {
    if (!it->second.contains(name)) {
      throw ConfigError(fmt::format("DistributedOptimizer: '{}' has no option '{}'", kind, name));
    }
    if (!std::isfinite(value)) {
      throw ConfigError(fmt::format("DistributedOptimizer: option '{}' is {}", name, value));
    }
  }
}

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const std::string& kind,
                                                        const std::map<std::string, double>& o,
                                                        const std::vector<at::Tensor>& params) {
  auto get = [&](const char* name, double fallback) {
    auto it = o.find(name);
    return it == o.end() ? fallback : it->second;
  };
  if (kind == "sgd") {
    return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(get("lr", 0))
                                                           .momentum(get("momentum", 0))
                                                           .dampening(get("dampening", 0))
                                                           .weight_decay(get("weight_decay", 0))
                                                           .nesterov(get("nesterov", 0) != 0));
  }
  if (kind == "adam") {
    return std::make_unique<torch::optim::Adam>(params,
                                                torch::optim::AdamOptions(get("lr", 0))
                                                    .betas({get("beta1", 0.9), get("beta2", 0.999)})
                                                    .eps(get("eps", 1e-8))
                                                    .weight_decay(get("weight_decay", 0))
                                                    .amsgrad(get("amsgrad", 0) != 0));
  }
  return std::make_unique<torch::optim::AdamW>(params,
                                               torch::optim::AdamWOptions(get("lr", 0))
                                                   .betas({get("beta1", 0.9), get("beta2", 0.999)})
                                                   .eps(get("eps", 1e-8))
                                                   .weight_decay(get("weight_decay", 0.01))
                                                   .amsgrad(get("amsgrad", 0) != 0));
}

struct LocalOptimizer {
  std::vector<at::Tensor> parameters;
  std::unique_ptr<torch::optim::Optimizer> optimizer;
};

struct Optimizers {
  std::mutex mutex;       // the map
  std::mutex step_mutex;  // one step at a time on this worker
  std::map<std::int64_t, std::shared_ptr<LocalOptimizer>> by_id;
  std::int64_t next_id = 1;
};

Optimizers& optimizers() {
  static Optimizers* o = new Optimizers;  // never destroyed: RPC's threads may outlive teardown
  return *o;
}

}  // namespace

std::vector<std::pair<std::string, Function>> optimizer_functions() {
  std::vector<std::pair<std::string, Function>> out;
  out.emplace_back(kCreateOptimizer, [](const std::vector<c10::IValue>& args) {
    const std::string kind = args.at(0).toStringRef();
    std::map<std::string, double> options;
    for (const auto& entry : args.at(1).toGenericDict()) {
      options[entry.key().toStringRef()] = entry.value().toDouble();
    }
    check_options(kind, options);
    auto local = std::make_shared<LocalOptimizer>();
    for (const auto& value : args.at(2).toListRef()) {
      RRef rref = RRef::from(value);
      if (!rref.is_owner()) {
        throw Error(
            fmt::format("DistributedOptimizer: a parameter owned by '{}' was sent to "
                        "worker '{}'",
                        rref.owner().name, running_agent()->self().name));
      }
      local->parameters.push_back(rref.local_value().toTensor());
    }
    local->optimizer = make_optimizer(kind, options, local->parameters);
    auto& o = optimizers();
    std::lock_guard lock(o.mutex);
    const std::int64_t id = o.next_id++;
    o.by_id[id] = std::move(local);
    return c10::IValue(id);
  });
  out.emplace_back(kStepOptimizer, [](const std::vector<c10::IValue>& args) {
    std::shared_ptr<LocalOptimizer> local;
    auto& o = optimizers();
    {
      std::lock_guard lock(o.mutex);
      auto it = o.by_id.find(args.at(0).toInt());
      if (it == o.by_id.end()) throw Error("DistributedOptimizer: no such optimizer here");
      local = it->second;
    }
    std::map<const c10::TensorImpl*, at::Tensor> grads;
    for (auto& [tensor, grad] : dist_autograd::get_gradients(args.at(1).toInt())) {
      grads[tensor.unsafeGetTensorImpl()] = grad;
    }
    std::lock_guard step(o.step_mutex);
    auto borrowed = lock_leaf_gradients();
    for (auto& p : local->parameters) {
      auto it = grads.find(p.unsafeGetTensorImpl());
      p.mutable_grad() = it == grads.end() ? at::Tensor() : it->second;
    }
    try {
      local->optimizer->step();
    } catch (...) {
      for (auto& p : local->parameters)
        p.mutable_grad().reset();
      throw;
    }
    for (auto& p : local->parameters)
      p.mutable_grad().reset();
    return c10::IValue();
  });
  out.emplace_back(kReleaseOptimizer, [](const std::vector<c10::IValue>& args) {
    auto& o = optimizers();
    std::lock_guard lock(o.mutex);
    o.by_id.erase(args.at(0).toInt());
    return c10::IValue();
  });
  return out;
}

void clear_optimizers() {
  auto& o = optimizers();
  std::lock_guard lock(o.mutex);
  o.by_id.clear();
}

}  // namespace detail

DistributedOptimizer::DistributedOptimizer(const std::string& kind,
                                           const std::map<std::string, double>& options,
                                           const std::vector<RRef>& parameters) {
  detail::check_options(kind, options);
  std::map<std::string, c10::impl::GenericList> by_owner;
  for (const auto& p : parameters) {
    auto [it, fresh] = by_owner.try_emplace(p.owner().name, c10::AnyType::get());
    it->second.push_back(p.ivalue());
  }
  c10::impl::GenericDict dict(c10::StringType::get(), c10::FloatType::get());
  for (const auto& [name, value] : options)
    dict.insert(name, value);
  for (auto& [owner, list] : by_owner) {
    owners_.emplace_back(owner,
                         rpc_sync(owner, detail::kCreateOptimizer, {kind, dict, list}).toInt());
  }
}

DistributedOptimizer::~DistributedOptimizer() {
  if (!is_initialized()) return;
  for (const auto& [owner, id] : owners_) {
    try {
      rpc_async(owner, detail::kReleaseOptimizer, {id});
    } catch (...) {
      // RPC going down: the optimizers go with it.
    }
  }
}

void DistributedOptimizer::step(std::int64_t context_id) {
  std::vector<FuturePtr> steps;
  for (const auto& [owner, id] : owners_) {
    steps.push_back(rpc_async(owner, detail::kStepOptimizer, {id, context_id}));
  }
  for (auto& s : steps)
    s->wait();
  for (auto& s : steps)
    s->value();  // rethrows the first owner's failure
}

}  // namespace ddp::rpc
