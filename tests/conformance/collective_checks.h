// Backend-independent conformance checks for ddp::ProcessGroup.
//
// Each check runs one family of operations on a group, with every dtype (and every reduce op where
// there is one), counts 0, 1, a prime, fewer elements than ranks, not divisible by the group size,
// every root, in place and out of place, and compares the results with a reference computed
// locally. Inputs are small integers derived from (rank, index, salt), so that sums and products
// over up to 8 ranks are exact in every float type and the reference does not depend on the
// reduction order; an average is the exact sum divided once (float32 for float32/16/bfloat16,
// rounded once to the storage type; truncating for integers), as the types.h contract says.
//
//   auto pg = ddp::make_mpi_process_group();
//   ddp::conformance::run_all_checks(*pg);            // throws std::runtime_error on a mismatch
//
// Every rank of the group must run the same checks in the same order (they issue collectives).
// A mismatch throws std::runtime_error naming the check, dtype, op, count, first wrong index and
// the rank; errors of the group itself (ConfigError, CommError, TimeoutError) pass through. After
// a failure on one rank the others block in their next collective until the group's timeout: give
// the group a short timeout in tests. Call from one thread per rank.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "ddp/comm/process_group.h"

namespace ddp::conformance {

void check_allreduce(ProcessGroup& pg);
// allreduce_segments, mixed with plain allreduce of the same count on odd ranks.
void check_allreduce_segments(ProcessGroup& pg);
void check_broadcast(ProcessGroup& pg);
void check_reduce(ProcessGroup& pg);
void check_allgather(ProcessGroup& pg);
void check_gather(ProcessGroup& pg);
void check_scatter(ProcessGroup& pg);
void check_reduce_scatter(ProcessGroup& pg);
void check_alltoall(ProcessGroup& pg);
// Uneven sizes: allgather_v, alltoall_v, reduce_scatter_v with zero, different, equal and one
// large count; counts that differ across ranks are a ConfigError on every rank.
void check_allgather_v(ProcessGroup& pg);
void check_alltoall_v(ProcessGroup& pg);
void check_reduce_scatter_v(ProcessGroup& pg);
void check_uneven_mismatch(ProcessGroup& pg);
void check_barrier(ProcessGroup& pg);
// CallOptions::blocking: every collective returns a completed Work with the right result, also
// behind queued operations and mixed with ranks that queue the same call; rounded float sums end
// bitwise equal on every rank; set_result on the shared Work throws ConfigError.
void check_blocking_calls(ProcessGroup& pg);
// send/recv: a root talking to every rank, an even/odd ring exchange, several tagged messages in
// flight to one peer, empty messages. Does nothing on a group of one.
void check_send_recv(ProcessGroup& pg);
// 64+ operations issued before any is waited for; Work::then callbacks; then() after completion.
void check_many_in_flight(ProcessGroup& pg);
// new_group: a subgroup without rank 0, one of the first and last ranks, one of everybody; each
// runs collectives (the non-members check they got nullptr), interleaved with the parent group.
void check_subgroups(ProcessGroup& pg);
// ConfigError at call time for bad roots, peers, null buffers, rank lists, dtype values and
// timeouts. Purely local: issues no operation.
void check_argument_errors(ProcessGroup& pg);

// Failures by kind, for backends whose failures do not end the job (the mpi backend with
// abort_on_failure off): in a subgroup of ranks 0 and 1, rank 0 calls allreduce and rank 1
// broadcast; each fails with a CommError of kind mismatch (or aborted, when it learns of it from
// the peer that saw it first, with that peer's reason), at least one of them mismatch; the
// subgroup is poisoned (its next call fails with the same kind), the parent group is not. Does
// nothing on a group of one.
void check_mismatch_kinds(ProcessGroup& pg);

struct NamedCheck {
  std::string name;
  std::function<void(ProcessGroup&)> run;
};

// Every check above, in the order run_all_checks runs them.
const std::vector<NamedCheck>& all_checks();

// The checks that fail a subgroup on purpose (check_mismatch_kinds).
const std::vector<NamedCheck>& failure_checks();
// Runs every check in order; rethrows the first failure as std::runtime_error prefixed with
// "check <name> failed on rank R of N: ".
void run_all_checks(ProcessGroup& pg);

}  // namespace ddp::conformance
