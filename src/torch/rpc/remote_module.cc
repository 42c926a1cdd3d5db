// RemoteModule (include/ddp/torch/rpc/remote_module.h): the module kinds registered here, the
// modules built here for other workers, and the built-in functions that build, run and expose
// them.
#include "ddp/torch/rpc/remote_module.h"

#include <map>
#include <mutex>

#include <fmt/format.h>

#include "torch/rpc/rpc_internal.h"

namespace ddp::rpc {
namespace detail {
namespace {

constexpr const char* kCreate = "__ddp_module.create";
constexpr const char* kForward = "__ddp_module.forward";
constexpr const char* kParameterCount = "__ddp_module.parameter_count";
constexpr const char* kParameter = "__ddp_module.parameter";

struct Kind {
  ModuleFactory factory;
  ModuleForward forward;
};

struct Built {
  std::shared_ptr<torch::nn::Module> module;
  ModuleForward forward;
};

struct Modules {
  std::mutex mutex;
  std::map<std::string, Kind> kinds;
  std::map<std::int64_t, Built> built;
  std::int64_t next_id = 1;
};

Modules& modules() {
  static Modules* m = new Modules;  // never destroyed: RPC's threads may outlive static teardown
  return *m;
}

Built built_module(const c10::IValue& id) {
  auto& m = modules();
  std::lock_guard lock(m.mutex);
  auto it = id.isInt() ? m.built.find(id.toInt()) : m.built.end();
  if (it == m.built.end()) {
    throw Error(fmt::format("rpc: no RemoteModule {} lives on worker '{}' (shut down since?)",
                            id.isInt() ? id.toInt() : -1, running_agent()->self().name));
  }
  return it->second;
}

std::vector<c10::IValue> rest(const std::vector<c10::IValue>& args) {
  return {args.begin() + 1, args.end()};
}

}  // namespace

std::vector<std::pair<std::string, Function>> module_functions() {
  std::vector<std::pair<std::string, Function>> out;
  out.emplace_back(kCreate, [](const std::vector<c10::IValue>& args) {
    if (args.empty() || !args[0].isString()) throw Error("rpc: RemoteModule without a kind");
    const std::string& name = args[0].toStringRef();
    Kind kind;
    {
      auto& m = modules();
      std::lock_guard lock(m.mutex);
      auto it = m.kinds.find(name);
      if (it == m.kinds.end()) {
        throw Error(
            fmt::format("rpc: worker '{}' has no module kind '{}' registered "
                        "(ddp::rpc::register_module)",
                        running_agent()->self().name, name));
      }
      kind = it->second;
    }
    auto module = kind.factory(rest(args));
    if (!module) throw Error("rpc: the factory of module kind '" + name + "' returned nothing");
    auto& m = modules();
    std::lock_guard lock(m.mutex);
    const std::int64_t id = m.next_id++;
    m.built[id] = {std::move(module), kind.forward};
    return c10::IValue(id);
  });
  out.emplace_back(kForward, [](const std::vector<c10::IValue>& args) {
    Built built = built_module(args.at(0));
    return built.forward(*built.module, rest(args));
  });
  out.emplace_back(kParameterCount, [](const std::vector<c10::IValue>& args) {
    return c10::IValue(
        static_cast<std::int64_t>(built_module(args.at(0)).module->parameters().size()));
  });
  out.emplace_back(kParameter, [](const std::vector<c10::IValue>& args) {
    const auto parameters = built_module(args.at(0)).module->parameters();
    const auto index = args.at(1).toInt();
    if (index < 0 || index >= static_cast<std::int64_t>(parameters.size())) {
      throw Error(
          fmt::format("rpc: the module has {} parameters, not {}", parameters.size(), index + 1));
    }
    return c10::IValue(parameters[static_cast<std::size_t>(index)]);
  });
  return out;
}

void clear_modules() {
  auto& m = modules();
  std::lock_guard lock(m.mutex);
  m.built.clear();
}

}  // namespace detail

void register_module(const std::string& name, ModuleFactory factory, ModuleForward forward) {
  if (!factory || !forward) {
    throw ConfigError("rpc: register_module('" + name + "') needs a factory and a forward");
  }
  auto& m = detail::modules();
  std::lock_guard lock(m.mutex);
  m.kinds[name] = {std::move(factory), std::move(forward)};
}

RemoteModule::RemoteModule(const std::string& on, const std::string& module,
                           std::vector<c10::IValue> args)
    : owner_(on) {
  args.insert(args.begin(), module);
  id_ = rpc_sync(on, detail::kCreate, std::move(args)).toInt();
}

RemoteModule RemoteModule::existing(const std::string& on, std::int64_t id) {
  RemoteModule module;
  module.owner_ = on;
  module.id_ = id;
  return module;
}

FuturePtr RemoteModule::forward_async(std::vector<c10::IValue> args) const {
  args.insert(args.begin(), id_);
  return rpc_async(owner_, detail::kForward, std::move(args));
}

c10::IValue RemoteModule::forward(std::vector<c10::IValue> args) const {
  auto future = forward_async(std::move(args));
  future->wait();
  return future->value();
}

std::vector<RRef> RemoteModule::remote_parameters() const {
  const auto count = rpc_sync(owner_, detail::kParameterCount, {id_}).toInt();
  std::vector<RRef> out;
  for (std::int64_t i = 0; i < count; ++i) {
    out.push_back(remote(owner_, detail::kParameter, {id_, i}));
  }
  return out;
}

}  // namespace ddp::rpc
