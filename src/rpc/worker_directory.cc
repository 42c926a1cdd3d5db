#include "rpc/worker_directory.h"

#include <algorithm>
#include <chrono>
#include <map>
#include <sstream>
#include <thread>

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

namespace {

WorkerInfo parse_entry(const std::string& entry, int rank, const WorkerInfo& self, int world_size) {
  std::istringstream in(entry);
  WorkerInfo w;
  std::string port, world;
  auto not_a_worker = [&] {
    return ConfigError(fmt::format("rpc: rank {}'s entry in the store is not a worker's ('{}')",
                                   rank, entry.substr(0, 200)));
  };
  if (!std::getline(in, w.name) || !std::getline(in, w.host) || !std::getline(in, port) ||
      !std::getline(in, world)) {
    throw not_a_worker();
  }
  w.rank = rank;
  int their_world = 0;
  try {
    w.port = static_cast<std::uint16_t>(std::stoul(port));
    their_world = std::stoi(world);
  } catch (const std::logic_error&) {
    throw not_a_worker();
  }
  if (their_world != world_size) {
    throw ConfigError(
        fmt::format("rpc: the workers do not agree on the world: rank {} ('{}') was started for {} "
                    "workers, rank {} ('{}') for {}; start every worker with the same world size",
                    self.rank, self.name, world_size, rank, w.name, their_world));
  }
  check_worker_name(w.name);
  return w;
}

}  // namespace

std::vector<WorkerInfo> exchange_workers(Store& store, const std::string& prefix,
                                         const WorkerInfo& self, int world_size,
                                         Milliseconds timeout) {
  store.set(key_of(prefix, self.rank),
            fmt::format("{}\n{}\n{}\n{}", self.name, self.host, self.port, world_size));

  // Entries are read as they appear, not after all of them: a worker started for another world
  // (or under a taken name) is refused by everyone at once, and the worker waiting for a rank
  // that will never come does not sit out its whole deadline first.
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  std::vector<WorkerInfo> workers(static_cast<std::size_t>(world_size));
  std::vector<bool> read(static_cast<std::size_t>(world_size), false);
  std::map<std::string, int> rank_of_name;
  int missing = world_size;
  auto pause = std::chrono::milliseconds(1);
  while (true) {
    for (int r = 0; r < world_size; ++r) {
      if (read[static_cast<std::size_t>(r)]) continue;
      const std::string key = key_of(prefix, r);
      if (!store.check(std::span<const std::string>(&key, 1))) continue;
      WorkerInfo w = parse_entry(store.get_string(key, timeout), r, self, world_size);
      if (auto [it, fresh] = rank_of_name.emplace(w.name, r); !fresh) {
        throw ConfigError(
            fmt::format("rpc: ranks {} and {} are both named '{}': every worker needs "
                        "a name of its own",
                        std::min(it->second, r), std::max(it->second, r), w.name));
      }
      workers[static_cast<std::size_t>(r)] = std::move(w);
      read[static_cast<std::size_t>(r)] = true;
      --missing;
    }
    if (missing == 0) return workers;
    if (std::chrono::steady_clock::now() >= deadline) {
      std::string absent;
      for (int r = 0; r < world_size; ++r) {
        if (!read[static_cast<std::size_t>(r)])
          absent += (absent.empty() ? "" : ", ") + std::to_string(r);
      }
      throw TimeoutError(fmt::format(
          "rpc: rank {} ('{}') waited {} ms for the workers of a world of {}; rank(s) {} never "
          "joined: start every worker, or give init_rpc a longer timeout",
          self.rank, self.name, timeout.count(), world_size, absent));
    }
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::milliseconds(50));
  }
}

}  // namespace ddp::rpc::transport
