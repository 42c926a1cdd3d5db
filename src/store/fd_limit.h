// How many connections the store server may hold without starving the process that hosts it of
// file descriptors (rank 0 still has to open checkpoints, datasets and its ring sockets).
// Thread-safe (reads and sets process-wide limits).
#pragma once

#include <cstddef>

namespace ddp::store {

// Raises the soft RLIMIT_NOFILE to the hard limit (as the Go runtime does at start) and returns
// the soft limit in force afterwards. Failing to raise it is not an error: the old limit is
// returned. (net::raise_open_files_limit, net/descriptors.h.)
std::size_t raise_open_files_limit();

// The automatic TcpStoreLimits::max_connections for a process allowed `open_files` descriptors:
// half of them (the other half stays with the process), at most kMaxAutomaticConnections and at
// least 1.
inline constexpr std::size_t kMaxAutomaticConnections = 16384;
std::size_t automatic_max_connections(std::size_t open_files);

}  // namespace ddp::store
