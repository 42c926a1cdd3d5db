// The in-band checked allreduce of small buffers (see mpi_group.h): [fingerprint | payload] in one
// buffer, combined by recursive doubling over point-to-point messages on the group's data
// communicator, polled with MPI_Test, up to OpenMPI's eager limit; by MPI_Allreduce above.
//
// Why not MPI_Allreduce for the smallest: ddp runs MPI at MPI_THREAD_MULTIPLE (its watchdog and
// point-to-point calls use MPI beside the collectives), and there OpenMPI 4.1's blocking calls
// wait through its multi-threaded synchronisation objects (a mutex and a condition variable set up
// and torn down per wait, a process-wide list of waiters): about 0.14 µs of a 1 KiB allreduce
// that takes 1.04 µs at MPI_THREAD_SINGLE. Requests polled with MPI_Test skip them, and for one
// step (world 2) the exchange is what tuned's recursive doubling does, less its copies
// (docs/benchmarks.md, "mpi backend").
//
// Every rank combines the same partial results, only in the other order (a op b against b op a),
// and every ReduceOp is commutative element by element, so every rank ends with the same bits.
// A world that is not a power of two folds first: rank 2i+1 (i < world - 2^k) hands its buffer to
// rank 2i and gets the result back at the end.
#include "comm/mpi/mpi_group.h"

namespace ddp::comm::mpi {
namespace {

// Up to this many bytes (fingerprint and payload) the exchange is point to point: OpenMPI sends
// them eagerly (btl_vader_eager_limit is 4 KiB with its own header). A longer message takes a
// rendezvous in which the receiver reads the sender's buffer (CMA), and since that buffer was just
// written, that read costs more than MPI_Allreduce's own exchange (3.6 against 3.4 µs at 4 KiB).
constexpr std::size_t kPointToPointMaxBytes = 4096 - 64;
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

void MpiProcessGroup::run_small_allreduce(MpiOp& op, const InBandFingerprint& in_band, DType dtype,
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

  if (total > kPointToPointMaxBytes) {
    // Past the eager limit: MPI's own allreduce, in place (sparing OpenMPI a copy of the input).
    auto& runtime = MpiRuntime::instance();
    watch_.begin(op.header, deadline, op.timeout);
    const int rc =
        MPI_Allreduce(MPI_IN_PLACE, mine, static_cast<int>(elements), runtime.datatype(dtype),
                      runtime.reduce_op(dtype, reduce_op), comm_);
    watch_.end();
    if (rc != MPI_SUCCESS) {
      // Calls of different sizes may fail as a truncated message on one rank: a mismatch.
      const CommError failed = error(op, fmt::format("failed: {}", mpi_error_text(rc)));
      fail_mismatch(op, deadline, &failed);
    }
  } else {
    recursive_doubling(op, mine, theirs, total, elements, dtype,
                       reduce_op == ReduceOp::kAvg ? ReduceOp::kSum : reduce_op, deadline);
  }
  if (std::memcmp(mine, expected, fingerprint_bytes) != 0) fail_mismatch(op, deadline);
  if (bytes > 0) std::memcpy(op.recv, mine + fingerprint_bytes, bytes);
  if (op.op == ReduceOp::kAvg) comm::divide(op.recv, op.count, op.dtype, size());
}

void MpiProcessGroup::recursive_doubling(MpiOp& op, std::byte* mine, std::byte* theirs,
                                         std::size_t bytes, std::size_t elements, DType dtype,
                                         ReduceOp combine, Clock::time_point deadline) {
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
    return;
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
    comm::reduce(mine, mine, theirs, elements, dtype, combine);
  }
  if (me < 2 * folded) exchange_step(op, me + 1, mine, nullptr, bytes, stall, deadline);
}

void MpiProcessGroup::exchange_step(MpiOp& op, int peer, const std::byte* from, std::byte* into,
                                    std::size_t bytes, StallCheck& stall,
                                    Clock::time_point deadline) {
  MPI_Request requests[2] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};
  const int count = static_cast<int>(bytes);
  int rc = MPI_SUCCESS;
  if (into != nullptr) {
    rc = MPI_Irecv(into, count, MPI_BYTE, peer, kSmallAllreduceTag, comm_, &requests[0]);
  }
  if (rc == MPI_SUCCESS && from != nullptr) {
    rc = MPI_Isend(from, count, MPI_BYTE, peer, kSmallAllreduceTag, comm_, &requests[1]);
  }
  if (rc != MPI_SUCCESS) {
    throw error(
        op, fmt::format("could not post its exchange with rank {}: {}", peer, mpi_error_text(rc)));
  }
  MPI_Status statuses[2];
  for (int polls = 1;; ++polls) {
    int done = 0;
    rc = MPI_Testall(2, requests, &done, statuses);
    if (rc != MPI_SUCCESS || done) break;
    if (polls % kPollsPerCheck == 0) {
      stall.check();
      back_off(polls / kPollsPerIdleRound);
    }
  }
  // A message of another size (MPI_ERR_TRUNCATE for a longer one) means that the peer issued a
  // call of another size, or another call: named as a mismatch when the headers differ.
  int received = count;
  if (rc == MPI_SUCCESS && into != nullptr) MPI_Get_count(&statuses[0], MPI_BYTE, &received);
  if (rc != MPI_SUCCESS || received != count) {
    const CommError failed = error(
        op, rc != MPI_SUCCESS
                ? fmt::format("failed in its exchange with rank {}: {}", peer, mpi_error_text(rc))
                : fmt::format("received {} bytes from rank {} where {} were due", received, peer,
                              count));
    fail_mismatch(op, deadline, &failed);
  }
}

}  // namespace ddp::comm::mpi
