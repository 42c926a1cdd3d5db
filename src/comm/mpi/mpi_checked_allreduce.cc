// The blocking allreduce and barrier of the mpi backend, fingerprints in band (see mpi_group.h).
#include "comm/mpi/mpi_group.h"

namespace ddp::comm::mpi {

bool MpiProcessGroup::use_checked_allreduce(const MpiOp& op) const {
  // A blocking call cannot return a CommError at its deadline, only end the job (the watchdog);
  // under MPI_THREAD_SERIALIZED it would hold the process-wide MPI lock for its whole duration.
  // A barrier is the checked allreduce of a header alone (that is also what keeps the ranks'
  // exit from it as close together as MPI_Barrier's).
  return (op.kind == Collective::kAllreduce || op.kind == Collective::kBarrier) && size() > 1 &&
         options_.abort_on_failure && MpiRuntime::instance().thread_level() == MPI_THREAD_MULTIPLE;
}

// A small allreduce as one blocking MPI_Allreduce of [OpHeader | payload] with the runtime's
// checked operation: the fingerprints travel with the data, so the check costs no message of its
// own, and every rank's result says whether every rank issued the same call (a count mismatch
// included: the header says how many bytes to expect). The group's watchdog thread enforces the
// deadline and the stall checks, ending the job (abort_on_failure is on) since a blocking call
// cannot be interrupted.
void MpiProcessGroup::run_checked_allreduce(MpiOp& op, Clock::time_point deadline) {
  auto& runtime = MpiRuntime::instance();
  constexpr std::size_t kHeader = sizeof(comm::OpHeader);
  const std::size_t bytes = op.count * dtype_size(op.dtype);
  ensure_watchdog();
  if (kHeader + bytes > kInBandMaxBytes) {
    // The fingerprints first (equal everywhere exactly when every rank issued this call), then
    // the data where it lies.
    const std::uint64_t h = hash_bytes(&op.header, sizeof op.header);
    check_buffers_->mine[0] = h;
    check_buffers_->mine[1] = ~h;
    watch_.begin(op.header, deadline, op.timeout);
    int rc = MPI_Allreduce(check_buffers_->mine, check_buffers_->combined, 2, MPI_UINT64_T, MPI_MAX,
                           check_);
    if (rc == MPI_SUCCESS && (check_buffers_->combined[0] != check_buffers_->mine[0] ||
                              check_buffers_->combined[1] != check_buffers_->mine[1])) {
      watch_.end();
      fail_mismatch(op, deadline);
    }
    if (rc == MPI_SUCCESS) {
      const void* in = op.send;
      if (op.send == op.recv) {
        in = MPI_IN_PLACE;
      } else if (overlaps(op.send, bytes, op.recv, bytes)) {
        scratch_.assign(op.send, op.send + bytes);
        in = scratch_.data();
      }
      rc = MPI_Allreduce(in, op.recv, static_cast<int>(op.count), runtime.datatype(op.dtype),
                         runtime.reduce_op(op.dtype, op.op), comm_);
    }
    watch_.end();
    if (rc != MPI_SUCCESS) throw error(op, fmt::format("failed: {}", mpi_error_text(rc)));
    if (op.op == ReduceOp::kAvg) comm::divide(op.recv, op.count, op.dtype, size());
    return;
  }
  if (packed_.size() < 2 * (kHeader + bytes)) packed_.resize(2 * (kHeader + bytes));
  std::byte* in = packed_.data();
  std::byte* out = in + kHeader + bytes;
  std::memcpy(in, &op.header, kHeader);
  if (bytes > 0) std::memcpy(in + kHeader, op.send, bytes);
  const MPI_Datatype packed_type = packed_type_for(bytes);
  watch_.begin(op.header, deadline, op.timeout);
  const int rc = MPI_Allreduce(in, out, 1, packed_type, runtime.checked_op(), comm_);
  watch_.end();
  if (rc != MPI_SUCCESS) {
    const CommError failed = error(op, fmt::format("failed: {}", mpi_error_text(rc)));
    fail_mismatch(op, deadline, &failed);
  }
  comm::OpHeader result;
  std::memcpy(&result, out, kHeader);
  if (result.reserved != 0) fail_mismatch(op, deadline);
  if (bytes > 0) std::memcpy(op.recv, out + kHeader, bytes);
  if (op.op == ReduceOp::kAvg) comm::divide(op.recv, op.count, op.dtype, size());
}

MPI_Datatype MpiProcessGroup::packed_type_for(std::size_t payload_bytes) {
  for (const auto& entry : packed_types_) {
    if (entry.bytes == payload_bytes) return entry.type;
  }
  auto& entry = packed_types_[packed_next_];
  packed_next_ = (packed_next_ + 1) % packed_types_.size();
  entry = {payload_bytes, MpiRuntime::instance().packed_type(payload_bytes)};
  return entry.type;
}

}  // namespace ddp::comm::mpi
