#include "rpc/worker_directory.h"

#include <map>
#include <sstream>

#include <fmt/format.h>

#include "ddp/error.h"

namespace ddp::rpc::transport {
namespace {

bool allowed(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' ||
         c == '-' || c == '.' || c == ':';
}

std::string key_of(const std::string& prefix, int rank) {
  return fmt::format("{}/worker/{}", prefix, rank);
}

}  // namespace

void check_worker_name(std::string_view name) {
  if (name.empty() || name.size() > kMaxWorkerNameBytes) {
    throw ConfigError(fmt::format("rpc: a worker name must have 1 to {} characters; '{}' has {}",
                                  kMaxWorkerNameBytes, name.substr(0, 200), name.size()));
  }
  for (std::size_t i = 0; i < name.size(); ++i) {
    if (!allowed(name[i])) {
      throw ConfigError(
          fmt::format("rpc: the worker name '{}' holds the character {:#04x} at {}: "
                      "names are letters, digits and _ - . :",
                      name, static_cast<unsigned char>(name[i]), i));
    }
  }
}

std::vector<WorkerInfo> exchange_workers(Store& store, const std::string& prefix,
                                         const WorkerInfo& self, int world_size,
                                         Milliseconds timeout) {
  store.set(key_of(prefix, self.rank),
            fmt::format("{}\n{}\n{}\n{}", self.name, self.host, self.port, world_size));
  std::vector<std::string> keys;
  for (int r = 0; r < world_size; ++r)
    keys.push_back(key_of(prefix, r));
  store.wait(keys, timeout);

  std::vector<WorkerInfo> workers(static_cast<std::size_t>(world_size));
  std::map<std::string, int> rank_of_name;
  for (int r = 0; r < world_size; ++r) {
    const std::string entry = store.get_string(keys[static_cast<std::size_t>(r)], timeout);
    std::istringstream in(entry);
    WorkerInfo& w = workers[static_cast<std::size_t>(r)];
    std::string port, world;
    if (!std::getline(in, w.name) || !std::getline(in, w.host) || !std::getline(in, port) ||
        !std::getline(in, world)) {
      throw ConfigError(fmt::format("rpc: rank {}'s entry in the store is not a worker's ('{}')", r,
                                    entry.substr(0, 200)));
    }
    w.rank = r;
    try {
      w.port = static_cast<std::uint16_t>(std::stoul(port));
      if (std::stoi(world) != world_size) {
        throw ConfigError(fmt::format(
            "rpc: the workers do not agree on the world: rank {} ('{}') was started for {} "
            "workers, rank {} ('{}') for {}; start every worker with the same world size",
            self.rank, self.name, world_size, r, w.name, world));
      }
    } catch (const std::logic_error&) {
      throw ConfigError(fmt::format("rpc: rank {}'s entry in the store is not a worker's ('{}')", r,
                                    entry.substr(0, 200)));
    }
    check_worker_name(w.name);
    if (auto [it, fresh] = rank_of_name.emplace(w.name, r); !fresh) {
      throw ConfigError(
          fmt::format("rpc: ranks {} and {} are both named '{}': every worker needs "
                      "a name of its own",
                      it->second, r, w.name));
    }
  }
  return workers;
}

}  // namespace ddp::rpc::transport
