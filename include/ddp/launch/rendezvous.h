// Rendezvous: how the processes of a job find each other before any collective runs.
//
//   ddp::World world = ddp::rendezvous();           // reads ddprun/torchrun/mpirun/srun variables
//   world.store->set("hello/" + std::to_string(world.rank()), "hi");
//
// Rank 0 starts the rendezvous store's server on MASTER_ADDR:MASTER_PORT (that interface only;
// DDP_STORE_LISTEN_ADDR or LaunchOptions::store_listen_addr choose another, e.g. 0.0.0.0; a job
// spanning hosts whose MASTER_ADDR resolves to a loopback address on rank 0 listens on every
// interface); every rank connects to MASTER_ADDR:MASTER_PORT as a client, retrying until the
// deadline (rank 0 may start last). With a job secret (DDP_SECRET / DDP_SECRET_FILE, job_secret.h)
// the store admits only processes that prove they know it (docs/security.md).
// Each rank then claims its rank number and the world size in the store, and all ranks wait until
// the whole world has arrived. rendezvous() returns only when every rank is there.
//
// Deadline: InitOptions::timeout, else the environment variable DDP_TIMEOUT (seconds), else
// 300 s. It bounds connecting, and waiting for the other ranks.
// While it waits longer than InitOptions::wait_warning (else DDP_WAIT_WARN_SECONDS, else 30 s),
// local rank 0 of each node warns, and again at every such interval until the deadline, naming
// what it waits for: rank 0's store, or which ranks (and nodes) have not arrived, how many of
// how many.
//
// Errors (nothing waits past the deadline):
//   ConfigError   bad launch variables (see launch_environment.h), MASTER_PORT already in use on
//                 rank 0, two processes claiming the same rank, ranks that disagree on the world
//                 size, a malformed DDP_TIMEOUT;
//   TimeoutError  the master cannot be reached, or not every rank arrived (names the missing
//   ranks);
//   StoreError    the store refused this process (another secret, or a secret on one side only).
// Keep the returned World (and so rank 0's store server) alive until every rank is done with the
// store: destroy it after a final barrier.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "ddp/launch/launch_environment.h"
#include "ddp/store/store.h"

// Exported by ddp's shared libraries, which hide the rest (src/CMakeLists.txt).
#pragma GCC visibility push(default)
namespace ddp {

struct InitOptions {
  LaunchOptions launch;                 // overrides of the launcher's variables
  std::string backend;                  // "" = DDP_BACKEND, else chosen from the launcher
  std::optional<Milliseconds> timeout;  // "" = DDP_TIMEOUT, else kDefaultTimeout
  std::shared_ptr<Store> store;         // use this store instead of connecting to the master
  // Interval of the waiting warnings: unset = DDP_WAIT_WARN_SECONDS, else 30 s; zero = none.
  std::optional<Milliseconds> wait_warning;
  // Receives each warning line; default: the line on stderr.
  std::function<void(const std::string& line)> warn;
  // Backend "mpi" only (MpiOptions::abort_on_failure): on the group's first failure end the whole
  // job with MPI_Abort (true), or throw the CommError to this rank only (false).
  bool mpi_abort_on_failure = true;
};

struct World {
  std::shared_ptr<Store> store;  // the job's store (all ranks share one key space)
  LaunchEnvironment environment;
  Milliseconds timeout{kDefaultTimeout};

  int rank() const { return environment.rank; }
  int size() const { return environment.world_size; }
  int local_rank() const { return environment.local_rank; }
  int local_size() const { return environment.local_world_size; }
};

World rendezvous(const InitOptions& options = {});

// The deadline rendezvous() uses: options.timeout, else DDP_TIMEOUT (seconds, may be
// fractional), else kDefaultTimeout. Throws ConfigError for a malformed or non-positive value.
Milliseconds resolve_timeout(std::optional<Milliseconds> explicit_timeout,
                             const EnvironmentLookup& lookup = process_environment);

}  // namespace ddp
#pragma GCC visibility pop
