// torchrun's agent store: PyTorch 2.x's torchrun (c10d rendezvous, --standalone, the default)
// runs a c10d TCPStore in its agent and tells the workers to use it instead of hosting their own:
// TORCHELASTIC_USE_AGENT_STORE=True, MASTER_ADDR/MASTER_PORT = that store. ddp then joins through
// it with the c10d client (store/c10d_store_client.h), every rank a client.
#pragma once

#include <optional>
#include <string>

#include "ddp/launch/launch_environment.h"

namespace ddp::init {

// The key prefix ddp uses in torchrun's store, or nullopt when the job does not use it
// (TORCHELASTIC_USE_AGENT_STORE is not "True", or options.master_addr/master_port point
// elsewhere, as PyTorch's own _agent_store_serves() requires). torchrun's store outlives worker
// restarts, so the prefix holds the restart count and the world size:
// "ddp/torchrun/attempt_<TORCHELASTIC_RESTART_COUNT>/world_<WORLD_SIZE>". torchrun's own keys
// ("torch.rendezvous.*", "torchelastic/*") and Python workers' never start with "ddp/".
std::optional<std::string> torchrun_agent_store_prefix(const LaunchOptions& options,
                                                       const LaunchEnvironment& env,
                                                       const EnvironmentLookup& lookup);

}  // namespace ddp::init
