// Who the workers of an RPC instance are (internal; agent.h): each publishes its name, rank,
// address and world size in the store, then reads everyone's as they appear and checks that they
// agree. Every worker reads the same entries, so each one that sees a duplicate name or a world
// that does not agree throws ConfigError at once, and none goes on alone.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "ddp/store/store.h"
#include "ddp/timeouts.h"

namespace ddp::rpc::transport {

struct WorkerInfo {
  std::string name;
  int rank = 0;
  std::string host;
  std::uint16_t port = 0;
};

inline constexpr std::size_t kMaxWorkerNameBytes = 128;

// Throws ConfigError unless `name` is 1 to 128 characters of [A-Za-z0-9_.:-] (PyTorch's rule,
// plus '.'), saying which character is not.
void check_worker_name(std::string_view name);

// Publishes `self` under `prefix`, then waits (up to `timeout`) for the world's entries and
// returns them by rank. Throws ConfigError naming the ranks of a duplicate name or of a world
// size that differs from `world_size`; TimeoutError naming the ranks that never published.
std::vector<WorkerInfo> exchange_workers(Store& store, const std::string& prefix,
                                         const WorkerInfo& self, int world_size,
                                         Milliseconds timeout);

}  // namespace ddp::rpc::transport
