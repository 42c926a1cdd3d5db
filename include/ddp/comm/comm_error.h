// CommError: a collective or point-to-point operation failed.
//
// Thrown (from Work::wait, or rethrown by every later call on a poisoned group) when a peer closed
// its connection, a deadline passed, or ranks issued different collectives. The message says what
// happened in words; the accessors give the context for programs that want to react to it.
//
//   try { pg->allreduce(buf, n, ddp::DType::kFloat32, ddp::ReduceOp::kSum)->wait(); }
//   catch (const ddp::CommError& e) {
//     if (e.kind() == ddp::CommErrorKind::kTimeout) log(e.group(), e.op(), e.sequence(), e.peer());
//   }
#pragma once

#include <cstdint>
#include <string>

#include "ddp/error.h"

// Exported by ddp's shared libraries, which hide the rest (src/CMakeLists.txt).
#pragma GCC visibility push(default)
namespace ddp {

// What went wrong, for programs, watchdogs and the flight recorder to act on without reading the
// message (whose wording may change).
enum class CommErrorKind : std::uint8_t {
  kTimeout,    // a deadline passed: a peer is stuck, stopped, or never issued the call
  kMismatch,   // ranks issued different calls (kind, count, dtype, op, root or algorithm)
  kPeerGone,   // a peer closed its connection, died or left the group without saying why
  kAborted,    // the group was aborted: a peer (or a parent group) failed first and said so
  kSetup,      // the group could not be set up (connections, handshake, shared memory)
  kTransport,  // the transport or library failed (a socket or MPI error)
  kInternal,   // anything else that went wrong inside an operation
};

// "timeout", "mismatch", "peer gone", "aborted", "setup", "transport", "internal".
const char* to_string(CommErrorKind kind);

class CommError : public Error {
 public:
  // `message` is the full text returned by what(); the other fields repeat its context.
  CommError(CommErrorKind kind, const std::string& message, std::string group, std::string op,
            std::uint64_t sequence, int peer)
      : Error(message),
        kind_(kind),
        group_(std::move(group)),
        op_(std::move(op)),
        sequence_(sequence),
        peer_(peer) {}

  CommErrorKind kind() const { return kind_; }
  // Name of the process group ("default", "default/sub0", ...).
  const std::string& group() const { return group_; }
  // The operation that failed, as called: "allreduce(float32 x 1024, sum)".
  const std::string& op() const { return op_; }
  // Its sequence number in the group (collectives count from 0 in issue order).
  std::uint64_t sequence() const { return sequence_; }
  // The rank (in the group) that caused or reported the failure; -1 when none is known.
  int peer() const { return peer_; }

 private:
  CommErrorKind kind_;
  std::string group_;
  std::string op_;
  std::uint64_t sequence_ = 0;
  int peer_ = -1;
};

}  // namespace ddp
#pragma GCC visibility pop
