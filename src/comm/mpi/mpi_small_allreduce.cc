// The in-band checked allreduce of small buffers (see mpi_group.h): [fingerprint | payload] in one
// buffer, combined by recursive doubling over point-to-point messages on the group's data
// communicator, each within OpenMPI's eager limit, polled with MPI_Test.
//
// Why not MPI_Allreduce: ddp runs MPI at MPI_THREAD_MULTIPLE (its watchdog and point-to-point
// calls use MPI beside the collectives), and there OpenMPI 4.1's blocking calls wait through its
// multi-threaded synchronisation objects (a mutex and a condition variable set up and torn down
// per wait, a process-wide list of waiters): about 0.14 µs of a 1 KiB allreduce that takes
// 1.04 µs at MPI_THREAD_SINGLE. Requests polled with MPI_Test skip them. And past 4 KiB,
// OpenMPI's allreduce sends one message by rendezvous, where eager pieces posted together cost
// half as much (docs/benchmarks.md, "mpi backend").
//
// Every rank combines the same partial results, only in the other order (a op b against b op a),
// and every ReduceOp is commutative element by element, so every rank ends with the same bits.
// A world that is not a power of two folds first: rank 2i+1 (i < world - 2^k) hands its buffer to
// rank 2i and gets the result back at the end.
#include <algorithm>

#include "comm/mpi/mpi_group.h"

namespace ddp::comm::mpi {
namespace {

// Each exchange moves its buffer in pieces of up to kPieceBytes, each within OpenMPI's
// shared-memory eager limit (btl_vader_eager_limit, 4 KiB with OpenMPI's own header), all posted
// at once. A longer message would take a rendezvous in which the receiver reads the sender's
// buffer (CMA), and since that buffer was just written, the read costs more than the data: a
// 4 KiB exchange took 3.6 µs as one message, 1.9 in two pieces, against 3.0 for OpenMPI's own
// MPI_Allreduce.
constexpr std::size_t kPieceBytes = 4096 - 64;
constexpr std::size_t kMaxPieces = 9;
// Bytes that one rank sends in all the steps of a small allreduce, at most. Recursive doubling
// sends the whole buffer at each of its log2(world) steps: at world 2 the copies in and out and
// the step itself stay cheaper than MPI_Allreduce up to about 32 KiB (0.55x OpenMPI's time at
// 8 KiB, 0.96x at 32 KiB, 1.09x at 48 KiB; docs/benchmarks.md).
constexpr std::size_t kSmallAllreduceMaxBytesSent = kPieceBytes * kMaxPieces;
// The tag of these messages on `comm_`: MPI delivers the messages between two ranks with one tag
// in order, and OpenMPI's own collectives on `comm_` use tags of their own.
constexpr int kSmallAllreduceTag = 1;
// Polls between two looks at the clock (deadline and stall checks) and at back_off: a clock read
// costs about as much as a poll, and a small exchange completes within a few polls.
constexpr int kPollsPerCheck = 64;
// back_off counts these polls as one idle round, so that the spinning lasts about as long as in
// wait_for_op, whose rounds read the clock (4096 polls here, about 40 µs): an exchange that takes
// a rendezvous (past OpenMPI's 4 KiB eager limit) must not be put to sleep.
constexpr int kPollsPerIdleRound = 16;

}  // namespace

std::size_t MpiProcessGroup::small_allreduce_max_bytes(int world) {
  int steps = 0;  // of recursive doubling, and one more for a folded world's hand-back
  for (int reach = 1; reach < world; reach *= 2)
    ++steps;
  return kSmallAllreduceMaxBytesSent / static_cast<std::size_t>(std::max(steps, 1));
}

void MpiProcessGroup::run_small_allreduce(Call& op, const InBandFingerprint& in_band, DType dtype,
                                          ReduceOp reduce_op, Clock::time_point deadline) {
  const std::size_t fingerprint_bytes = in_band.bytes();
  const std::size_t bytes = op.count * dtype_size(op.dtype);
  const std::size_t total = fingerprint_bytes + bytes;
  const std::size_t elements = in_band.elements() + op.count;
  // [this rank's fingerprint | payload], what a peer sent, the fingerprint expected.
  if (packed_.size() < 2 * total + fingerprint_bytes) packed_.resize(2 * total + fingerprint_bytes);
  std::byte* mine = packed_.data();
  std::byte* theirs = mine + total;
  std::byte* expected = theirs + total;
  in_band.encode(fingerprint_hash(op.header), mine, expected);
  if (bytes > 0) std::memcpy(mine + fingerprint_bytes, op.send, bytes);

  const ReduceOp combine = reduce_op == ReduceOp::kAvg ? ReduceOp::kSum : reduce_op;
  const bool last_step_left = recursive_doubling(op, mine, theirs, total, elements, dtype, combine,
                                                 /*leave_last_step=*/bytes > 0, deadline);
  if (last_step_left) {
    // The last step's fingerprints first; then the payloads straight into the output (one copy
    // fewer). Every rank of a power-of-two world takes this path, so all end with the same bits.
    comm::reduce(mine, mine, theirs, in_band.elements(), dtype, combine);
    if (std::memcmp(mine, expected, fingerprint_bytes) != 0) fail_mismatch(op, deadline);
    comm::reduce(op.recv, mine + fingerprint_bytes, theirs + fingerprint_bytes, op.count, dtype,
                 combine);
  } else {
    if (std::memcmp(mine, expected, fingerprint_bytes) != 0) fail_mismatch(op, deadline);
    if (bytes > 0) std::memcpy(op.recv, mine + fingerprint_bytes, bytes);
  }
  if (op.op == ReduceOp::kAvg) comm::divide(op.recv, op.count, op.dtype, size());
}

bool MpiProcessGroup::recursive_doubling(Call& op, std::byte* mine, std::byte* theirs,
                                         std::size_t bytes, std::size_t elements, DType dtype,
                                         ReduceOp combine, bool leave_last_step,
                                         Clock::time_point deadline) {
  StallCheck stall(*this, op, deadline);
  const int world = size();
  const int me = rank();
  int active = 1;  // the largest power of two up to the world size
  while (active * 2 <= world)
    active *= 2;
  const int folded = world - active;  // ranks 2i+1 < 2 * folded hand their data to rank 2i
  if (me < 2 * folded && me % 2 == 1) {
    exchange_step(op, me - 1, mine, nullptr, bytes, stall, deadline);
    exchange_step(op, me - 1, nullptr, mine, bytes, stall, deadline);
    return false;
  }
  if (me < 2 * folded) {
    exchange_step(op, me + 1, nullptr, theirs, bytes, stall, deadline);
    comm::reduce(mine, mine, theirs, elements, dtype, combine);
  }
  const int virtual_rank = me < 2 * folded ? me / 2 : me - folded;
  for (int mask = 1; mask < active; mask <<= 1) {
    const int virtual_peer = virtual_rank ^ mask;
    const int peer = virtual_peer < folded ? 2 * virtual_peer : virtual_peer + folded;
    exchange_step(op, peer, mine, theirs, bytes, stall, deadline);
    // Left to the caller only where every rank can leave it: no rank folds.
    if (leave_last_step && folded == 0 && mask * 2 >= active) return true;
    comm::reduce(mine, mine, theirs, elements, dtype, combine);
  }
  if (me < 2 * folded) exchange_step(op, me + 1, mine, nullptr, bytes, stall, deadline);
  return false;
}

void MpiProcessGroup::exchange_step(Call& op, int peer, const std::byte* from, std::byte* into,
                                    std::size_t bytes, StallCheck& stall,
                                    Clock::time_point deadline) {
  // Each piece fits the eager limit: receives first, then sends, packed so that every poll tests
  // only live requests.
  const std::size_t pieces = (bytes + kPieceBytes - 1) / kPieceBytes;
  MPI_Request requests[2 * kMaxPieces];
  int posted = 0;
  int rc = MPI_SUCCESS;
  for (std::size_t i = 0; i < pieces && rc == MPI_SUCCESS && into != nullptr; ++i) {
    const std::size_t at = i * kPieceBytes;
    const int count = static_cast<int>(std::min(kPieceBytes, bytes - at));
    rc =
        MPI_Irecv(into + at, count, MPI_BYTE, peer, kSmallAllreduceTag, comm_, &requests[posted++]);
  }
  const int receives = posted;
  for (std::size_t i = 0; i < pieces && rc == MPI_SUCCESS && from != nullptr; ++i) {
    const std::size_t at = i * kPieceBytes;
    const int count = static_cast<int>(std::min(kPieceBytes, bytes - at));
    rc =
        MPI_Isend(from + at, count, MPI_BYTE, peer, kSmallAllreduceTag, comm_, &requests[posted++]);
  }
  if (rc != MPI_SUCCESS) {
    throw error(op, CommErrorKind::kTransport,
                fmt::format("could not post its exchange with rank {}: {}", peer,
                            mpi_error_text(rc)));
  }
  MPI_Status statuses[2 * kMaxPieces];
  for (int polls = 1;; ++polls) {
    int done = 0;
    rc = MPI_Testall(posted, requests, &done, statuses);
    if (rc != MPI_SUCCESS || done) break;
    if (polls % kPollsPerCheck == 0) {
      stall.check();
      back_off(polls / kPollsPerIdleRound);
    }
  }
  // A message of another size (MPI_ERR_TRUNCATE for a longer one) means that the peer issued a
  // call of another size, or another call: named as a mismatch when the headers differ. (A peer
  // that sends fewer pieces leaves a receive waiting: the stall checks name that.)
  std::size_t received = bytes;
  if (rc == MPI_SUCCESS && into != nullptr) {
    received = 0;
    for (int i = 0; i < receives; ++i) {
      int count = 0;
      MPI_Get_count(&statuses[i], MPI_BYTE, &count);
      received += static_cast<std::size_t>(count);
    }
  }
  if (rc != MPI_SUCCESS || received != bytes) {
    const CommError failed =
        error(op, rc != MPI_SUCCESS ? CommErrorKind::kTransport : CommErrorKind::kMismatch,
              rc != MPI_SUCCESS
                  ? fmt::format("failed in its exchange with rank {}: {}", peer, mpi_error_text(rc))
                  : fmt::format("received {} bytes from rank {} where {} were due", received, peer,
                                bytes));
    // Tell the peers which call this rank made: one left waiting for a piece that this rank will
    // not send names both calls at its next stall check instead of at its deadline.
    bool announced = false;
    if (auto problem = stall_problem(op, announced)) throw *problem;
    fail_mismatch(op, deadline, &failed);
  }
}

}  // namespace ddp::comm::mpi
