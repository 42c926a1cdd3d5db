// Settings: the DDP_* environment variables that ddp reads below its top layer, and the default
// timeout, in one place (internal; layer 0: depends on nothing of ddp but ddp/error.h).
//
// The layers above resolve these once, where an object is made (a group, a rendezvous), and pass
// the results down as options; nothing else in net/store/comm calls getenv. Every reader throws
// ConfigError naming the variable and a valid example for a malformed value. Thread-safe as long
// as nobody modifies the environment concurrently (getenv's own rule).
#pragma once

#include <cstddef>
#include <functional>
#include <optional>
#include <string>

#include "ddp/timeouts.h"

namespace ddp::settings {

// How a variable is looked up: the process environment by default, a map in tests.
using Lookup = std::function<std::optional<std::string>(const std::string& name)>;

// The process environment's value of `name`, or nullopt when it is not set.
std::optional<std::string> environment(const std::string& name);

// DDP_TIMEOUT (seconds, may be fractional) when set, else kDefaultTimeout.
Milliseconds timeout(const Lookup& lookup = environment);

// How long a wait (the rendezvous, or a collective waiting for a peer) goes on before a warning
// names what it waits for; the rendezvous repeats it at this interval until the deadline.
inline constexpr Milliseconds kDefaultWaitWarning{30'000};
// DDP_WAIT_WARN_SECONDS (seconds, may be fractional; 0 = never warn) when set, else
// kDefaultWaitWarning.
Milliseconds wait_warning(const Lookup& lookup = environment);

// The ring backend's variables ("" when unset or empty):
// DDP_TRANSPORT: "auto" or "tcp" (checked by the backend, which names the valid values).
std::string transport(const Lookup& lookup = environment);
// DDP_SHM_SHARED_BUFFERS: "0" makes ProcessGroup::allocate_shared_buffer refuse on this rank
// (every allreduce then copies through the host's segment); "1" or unset: allowed.
bool shm_shared_buffers(const Lookup& lookup = environment);
// DDP_HOST_ID: replaces the detected host identity (which ranks share a host).
std::string host_id(const Lookup& lookup = environment);
// DDP_ADVERTISE_ADDR: the address peers use to reach this rank.
std::string advertise_address(const Lookup& lookup = environment);

// The nccl backend's variable ("" when unset or empty):
// DDP_NCCL_LIBRARY: a path to the libnccl to load instead of libnccl.so.2 (tests name a missing
// one to see the "cannot load libnccl" error).
std::string nccl_library(const Lookup& lookup = environment);

// The flight recorder (docs/observability.md):
// DDP_FLIGHT_RECORDER_ENTRIES: how many operations each group keeps (default 2000; 0 = off).
inline constexpr std::size_t kDefaultFlightRecorderEntries = 2000;
std::size_t flight_recorder_entries(const Lookup& lookup = environment);
// DDP_DUMP_DIR: where dumps go ("" when unset: the working directory).
std::string dump_dir(const Lookup& lookup = environment);
// The timeline (include/ddp/comm/trace.h, docs/observability.md):
// DDP_TRACE: the folder init_process_group writes each rank's trace into ("" when unset: off).
std::string trace_dir(const Lookup& lookup = environment);
// DDP_TRACE_MAX_EVENTS: how many events each rank keeps (default 200000, at least 1).
inline constexpr std::size_t kDefaultTraceMaxEvents = 200'000;
std::size_t trace_max_events(const Lookup& lookup = environment);
// The job's rank and world size as the launcher gave them (RANK/WORLD_SIZE, OMPI_COMM_WORLD_*,
// SLURM_PROCID/SLURM_NTASKS), for the dumps only: -1 where unknown or malformed.
struct JobPlace {
  int rank = -1;
  int world_size = -1;
};
JobPlace job_place(const Lookup& lookup = environment);

}  // namespace ddp::settings
