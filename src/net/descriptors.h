// File descriptors as a resource the process can run out of: naming exhaustion where it happens,
// the limit, and how many are open. The comm engine opens descriptors per peer (sockets,
// eventfds, pidfds, memfds); when the limit is too low, every such call fails with EMFILE, and an
// error that only said "Too many open files" deep inside a connection attempt (or nothing, where a
// loop retried) sent users to check secrets, versions and addresses instead of `ulimit -n`.
//
// Thread-safe (reads and sets process-wide limits); no state of its own.
#pragma once

#include <cstddef>
#include <string>

#include "ddp/error.h"

namespace ddp::net {

// A descriptor could not be made because the process (EMFILE) or the system (ENFILE) has no more.
// Its message is out_of_descriptors_text() with what was being done in front.
class OutOfDescriptorsError : public Error {
 public:
  using Error::Error;
};

// EMFILE or ENFILE.
bool is_out_of_descriptors(int err);

// "out of file descriptors (EMFILE: Too many open files): this process may open 32 (ulimit -n);
// ..." with what to do; for ENFILE, that the system's table is full. `err` is EMFILE or ENFILE.
std::string out_of_descriptors_text(int err);

// strerror(err), except that EMFILE and ENFILE get out_of_descriptors_text(err): for the
// messages of calls that make descriptors (eventfd, memfd_create, open, pidfd_open, epoll).
std::string system_error_text(int err);

// Throws OutOfDescriptorsError("<what>: <out_of_descriptors_text(err)>") when `err` is EMFILE or
// ENFILE; returns otherwise.
void throw_if_out_of_descriptors(int err, const std::string& what);

// The soft RLIMIT_NOFILE in force (at most 1 << 20 for "unlimited").
std::size_t open_files_limit();

// Raises the soft RLIMIT_NOFILE to the hard limit (as the Go runtime does at start) and returns
// the soft limit in force afterwards. Failing to raise it is not an error: the old limit is
// returned.
std::size_t raise_open_files_limit();

// Makes sure this process may open `needed` descriptors in all, raising the soft RLIMIT_NOFILE to
// the hard limit when it is lower (only then: a soft limit above 1024 breaks programs that still
// use select()). Returns the soft limit in force afterwards, less than `needed` when even the hard
// limit is.
std::size_t ensure_open_files_limit(std::size_t needed);

// The hard RLIMIT_NOFILE (at most 1 << 20 for "unlimited").
std::size_t hard_open_files_limit();

// How many descriptors this process has open now (/proc/self/fd, not counting the one used to
// read it), or 0 when that cannot be read.
std::size_t open_descriptor_count();

}  // namespace ddp::net
