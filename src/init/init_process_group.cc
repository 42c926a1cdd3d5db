#include "ddp/init.h"

#include <algorithm>
#include <mutex>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "ddp/error.h"
#include "ddp/mpi_process_group.h"
#include "ddp/prefix_store.h"
#include "ddp/ring_process_group.h"

namespace ddp {
namespace {

std::mutex default_group_mutex;
std::shared_ptr<ProcessGroup> default_group;

struct BackendChoice {
  std::string name;
  std::string source;  // where the name came from, for error messages
};

BackendChoice choose_backend(const InitOptions& options) {
  if (!options.backend.empty()) return {options.backend, "InitOptions::backend"};
  if (const auto from_env = process_environment("DDP_BACKEND"); from_env && !from_env->empty()) {
    return {*from_env, "DDP_BACKEND"};
  }
  // Launched by mpirun (and not by a torchrun-style launcher inside it): MPI knows the world.
  const bool under_mpirun =
      process_environment("OMPI_COMM_WORLD_SIZE").has_value() && !process_environment("RANK");
  if (under_mpirun && mpi_backend_available()) return {"mpi", "mpirun's environment"};
  return {"ring", "the default"};
}

}  // namespace

std::vector<std::string> available_backends() {
  std::vector<std::string> names{"ring"};
  if (mpi_backend_available()) names.push_back("mpi");
  return names;
}

std::shared_ptr<ProcessGroup> init_process_group(const InitOptions& options) {
  const BackendChoice backend = choose_backend(options);
  std::shared_ptr<ProcessGroup> group;
  if (backend.name == "ring") {
    World world = rendezvous(options);
    group = make_ring_process_group(
        std::make_shared<PrefixStore>("ddp/pg", world.store), world.rank(), world.size(),
        {.timeout = world.timeout, .group_name = "default", .secret = world.environment.secret});
  } else if (backend.name == "mpi" && mpi_backend_available()) {
    // MPI has its own rendezvous; the launcher's variables are only checked against it.
    group = make_mpi_process_group({.timeout = resolve_timeout(options.timeout)});
    if (options.launch.rank && *options.launch.rank != group->rank()) {
      throw ConfigError(fmt::format("options.rank={} but MPI says this process is rank {}",
                                    *options.launch.rank, group->rank()));
    }
    if (options.launch.world_size && *options.launch.world_size != group->size()) {
      throw ConfigError(fmt::format("options.world_size={} but MPI's world has {} processes",
                                    *options.launch.world_size, group->size()));
    }
  } else {
    throw ConfigError(fmt::format("unknown backend '{}' (from {}); this build of ddp has: {}",
                                  backend.name, backend.source,
                                  fmt::join(available_backends(), ", ")));
  }
  std::lock_guard lock(default_group_mutex);
  default_group = group;
  return group;
}

std::shared_ptr<ProcessGroup> default_process_group() {
  std::lock_guard lock(default_group_mutex);
  return default_group;
}

void destroy_process_group() {
  std::lock_guard lock(default_group_mutex);
  default_group.reset();
}

}  // namespace ddp
