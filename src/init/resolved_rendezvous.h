// The rendezvous of rendezvous.h for a launch environment the caller resolved already: the
// composition root (src/runtime) resolves it once, looks at it (the local rank's GPU) and hands
// it down, instead of each step parsing the launcher's variables again.
#pragma once

#include "ddp/launch/launch_environment.h"
#include "ddp/launch/rendezvous.h"

namespace ddp {

// rendezvous(options) with `environment` = resolve_launch_environment(options.launch).
World rendezvous(const InitOptions& options, LaunchEnvironment environment);

}  // namespace ddp
