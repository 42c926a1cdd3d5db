// The operation header both backends fingerprint their calls with (internal): the ring backend's
// wire format, and the fingerprint the mpi backend checks in-band or on a stall.
//
// Every message of a ring operation starts with a 32-byte OpHeader: the operation's fingerprint
// (kind, dtype, reduce op, algorithm, count, root or tag) and its sequence number. The receiver
// compares it with the header it expects (four 64-bit compares), so ranks that issue different
// operations fail with both calls named instead of exchanging wrong bytes or hanging.
// Both ends of a connection are assumed to share byte order (checked by the handshake magic).
#pragma once

#include <cstdint>
#include <cstring>
#include <string>

#include "ddp/comm/types.h"

namespace ddp::comm {

inline constexpr std::uint32_t kHeaderMagic = 0x48504444;     // "DDPH"
inline constexpr std::uint32_t kHandshakeMagic = 0x52504444;  // "DDPR"
inline constexpr std::uint32_t kProtocolVersion = 1;

// ddp::to_string(Collective/DType/ReduceOp) beside to_string(Algorithm) below.
using ddp::to_string;

enum class Algorithm : std::uint8_t {
  kNone,
  kRing,               // pipelined ring (reduce-scatter + allgather for allreduce)
  kRecursiveDoubling,  // log-step exchange with partners rank ^ 2^k
  kChain,              // pipelined chain (broadcast, reduce)
  kBinomialTree,       // binomial tree (broadcast)
  kDirect,             // every rank talks to its peers directly (gather, scatter, alltoall, p2p)
  kSharedMemory,       // through the host's shared-memory segment (src/comm/shm)
  kHierarchical,       // inside each host over shared memory, across hosts over TCP
};

inline constexpr std::uint8_t kNoReduceOp = 0xff;

struct OpHeader {
  std::uint32_t magic = kHeaderMagic;
  Collective kind = Collective::kAllreduce;
  std::uint8_t dtype = 0;
  std::uint8_t reduce_op = kNoReduceOp;
  Algorithm algorithm = Algorithm::kNone;
  std::uint64_t sequence = 0;  // collectives: the group's counter; p2p: per (sender, receiver)
  std::uint64_t count = 0;     // elements (per rank for allgather/gather/scatter/...)
  std::int32_t root = -1;      // root rank, or the tag of a send
  std::int32_t reserved = 0;

  bool operator==(const OpHeader& other) const {
    return std::memcmp(this, &other, sizeof *this) == 0;
  }
};
static_assert(sizeof(OpHeader) == 32);

std::string_view to_string(Algorithm algorithm);

// "allreduce(float32 x 1024, sum) #7", "broadcast(float32 x 1024, root 0) #7", ...
// `peer` is the other end of a send/recv (for "send(...) to rank 1"), -1 otherwise.
std::string describe(const OpHeader& header, int peer = -1, bool as_receiver = false);

}  // namespace ddp::comm
