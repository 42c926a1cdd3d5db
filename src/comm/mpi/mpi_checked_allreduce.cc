// The blocking allreduce and barrier of the mpi backend, fingerprints in band (see mpi_group.h).
#include "comm/mpi/mpi_group.h"

namespace ddp::comm::mpi {

bool MpiProcessGroup::use_checked_allreduce(const Call& op) const {
  // A blocking call cannot return a CommError at its deadline, only end the job (the watchdog);
  // under MPI_THREAD_SERIALIZED it would hold the process-wide MPI lock for its whole duration.
  // A barrier is the checked allreduce of a header alone (that is also what keeps the ranks'
  // exit from it as close together as MPI_Barrier's).
  return (op.kind == Collective::kAllreduce || op.kind == Collective::kBarrier) && size() > 1 &&
         options_.abort_on_failure && MpiRuntime::instance().thread_level() == MPI_THREAD_MULTIPLE;
}

// An allreduce with the call's fingerprint checked. Small ones (small_allreduce_max_bytes) carry it
// in band (mpi_in_band_fingerprint.h: a few elements of the call's own dtype in front of the
// payload, so the check costs no message of its own and every rank's result says whether every rank
// issued the same call) and run as recursive doubling over point-to-point messages
// (mpi_small_allreduce.cc). Larger ones, and products, run as a blocking MPI_Allreduce of the data
// where it lies after a 16-byte one of the fingerprints: copying them in and out would cost more
// than OpenMPI's 1 µs latency. The group's watchdog thread enforces the blocking calls' deadline
// and stall checks, ending the job (abort_on_failure is on) since a blocking call cannot be
// interrupted.
void MpiProcessGroup::run_checked_allreduce(Call& op, Clock::time_point deadline) {
  // A barrier is the fingerprint alone, as bytes combined by their maximum.
  const bool barrier = op.kind == Collective::kBarrier;
  const DType dtype = barrier ? DType::kUInt8 : op.dtype;
  const ReduceOp reduce_op = barrier ? ReduceOp::kMax : op.op;
  const InBandFingerprint& in_band = in_band_fingerprint(dtype, reduce_op);
  const std::size_t bytes = op.count * dtype_size(op.dtype);
  ensure_watchdog();
  if (!in_band.usable() || in_band.bytes() + bytes > small_allreduce_max_bytes_) {
    return run_separately_checked(op, deadline);
  }
  run_small_allreduce(op, in_band, dtype, reduce_op, deadline);
}

void MpiProcessGroup::run_separately_checked(Call& op, Clock::time_point deadline) {
  auto& runtime = MpiRuntime::instance();
  const std::size_t bytes = op.count * dtype_size(op.dtype);
  // The fingerprints (equal everywhere exactly when every rank issued this call) in a 16-byte
  // MPI_Iallreduce that progresses while the blocking data call runs, so that it adds no latency
  // of its own; it completes before the call returns. A mismatched data call cannot overrun a
  // buffer (MPI fails a longer message with MPI_ERR_TRUNCATE), and its result is never returned.
  const std::uint64_t h = fingerprint_hash(op.header);
  check_buffers_->mine[0] = h;
  check_buffers_->mine[1] = ~h;
  MPI_Request check = MPI_REQUEST_NULL;
  int rc = MPI_Iallreduce(check_buffers_->mine, check_buffers_->combined, 2, MPI_UINT64_T, MPI_MAX,
                          check_, &check);
  if (rc != MPI_SUCCESS) {
    throw error(op, CommErrorKind::kTransport,
                fmt::format("could not start its fingerprint check: {}", mpi_error_text(rc)));
  }
  const void* in = op.send;
  if (op.send == op.recv) {
    in = MPI_IN_PLACE;
  } else if (overlaps(op.send, bytes, op.recv, bytes)) {
    scratch_.assign(op.send, op.send + bytes);
    in = scratch_.data();
  }
  watch_.begin(op.header, deadline, op.timeout);
  rc = MPI_Allreduce(in, op.recv, static_cast<int>(op.count), runtime.datatype(op.dtype),
                     runtime.reduce_op(op.dtype, op.op), comm_);
  watch_.end();
  // The fingerprints first, so that a mismatch that MPI reports as an error is named as one.
  MPI_Request data = MPI_REQUEST_NULL;
  wait_for_op(op, deadline, data, check);
  if (rc != MPI_SUCCESS)
    throw error(op, CommErrorKind::kTransport, fmt::format("failed: {}", mpi_error_text(rc)));
  if (op.op == ReduceOp::kAvg) comm::divide(op.recv, op.count, op.dtype, size());
}

const InBandFingerprint& MpiProcessGroup::in_band_fingerprint(DType dtype, ReduceOp op) const {
  static_assert(static_cast<std::size_t>(DType::kInt64) + 1 == kDTypes);
  static_assert(static_cast<std::size_t>(ReduceOp::kBxor) + 1 == kReduceOps);
  return (*in_band_)[static_cast<std::size_t>(dtype) * kReduceOps + static_cast<std::size_t>(op)];
}

}  // namespace ddp::comm::mpi
