// The job's shared secret: one value that turns on authentication of the rendezvous store and of
// every data-plane connection of the ring backend (docs/security.md).
//
//   // DDP_SECRET=...  or  DDP_SECRET_FILE=/run/secrets/job  (ddprun --secret-file sets the latter)
//   std::string secret = ddp::resolve_job_secret(std::nullopt);   // "" = no secret
//
// Sources, first that applies: the explicit value (LaunchOptions::secret, i.e.
// InitOptions::launch.secret); DDP_SECRET (the secret itself); DDP_SECRET_FILE (a file holding
// it; trailing newlines are dropped). DDP_SECRET and DDP_SECRET_FILE may both be set only when
// they hold the same secret. No source: "" (no authentication; trusted network only).
//
// Errors: ConfigError naming the variable or file and the fix: an empty secret (an empty
// DDP_SECRET, an empty file), a file that cannot be read, is larger than kMaxSecretBytes, that
// its group or other users may access (chmod 600 it), or that is no regular file (a FIFO or a
// device; never waited on), and DDP_SECRET and DDP_SECRET_FILE disagreeing.
// Pure functions over their arguments and the file system: any thread may call them.
#pragma once

#include <cstddef>
#include <optional>
#include <string>

#include "ddp/launch/launch_environment.h"

// Exported by ddp's shared libraries, which hide the rest (src/CMakeLists.txt).
#pragma GCC visibility push(default)
namespace ddp {

inline constexpr std::size_t kMaxSecretBytes = 64 * 1024;

// Reads a secret file: its bytes without trailing '\n'/'\r'. `what` names where the path came
// from in error messages ("DDP_SECRET_FILE", "--secret-file").
std::string read_secret_file(const std::string& path, const std::string& what);

std::string resolve_job_secret(const std::optional<std::string>& explicit_secret,
                               const EnvironmentLookup& lookup = process_environment);

}  // namespace ddp
#pragma GCC visibility pop
