// CommError: a collective or point-to-point operation failed.
//
// Thrown (from Work::wait, or rethrown by every later call on a poisoned group) when a peer closed
// its connection, a deadline passed, or ranks issued different collectives. The message says what
// happened in words; the accessors give the context for programs that want to react to it.
//
//   try { pg->allreduce(buf, n, ddp::DType::kFloat32, ddp::ReduceOp::kSum)->wait(); }
//   catch (const ddp::CommError& e) { log(e.group(), e.op(), e.sequence(), e.peer()); }
#pragma once

#include <cstdint>
#include <string>

#include "ddp/error.h"

// Exported by ddp's shared libraries, which hide the rest (src/CMakeLists.txt).
#pragma GCC visibility push(default)
namespace ddp {

class CommError : public Error {
 public:
  // `message` is the full text returned by what(); the other fields repeat its context.
  CommError(const std::string& message, std::string group, std::string op, std::uint64_t sequence,
            int peer)
      : Error(message),
        group_(std::move(group)),
        op_(std::move(op)),
        sequence_(sequence),
        peer_(peer) {}

  // Name of the process group ("default", "default/sub0", ...).
  const std::string& group() const { return group_; }
  // The operation that failed, as called: "allreduce(float32 x 1024, sum)".
  const std::string& op() const { return op_; }
  // Its sequence number in the group (collectives count from 0 in issue order).
  std::uint64_t sequence() const { return sequence_; }
  // The rank (in the group) that caused or reported the failure; -1 when none is known.
  int peer() const { return peer_; }

 private:
  std::string group_;
  std::string op_;
  std::uint64_t sequence_ = 0;
  int peer_ = -1;
};

}  // namespace ddp
#pragma GCC visibility pop
