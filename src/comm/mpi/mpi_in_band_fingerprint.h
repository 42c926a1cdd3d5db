// The fingerprint of a blocking allreduce carried in band (internal; docs/mpi.md, "Mismatches").
//
// A call's 64-bit fingerprint hash travels as a few extra elements of the call's own dtype in
// front of its payload, reduced by the call's own MPI operation. So the check costs no message of
// its own, no user-defined operation and no derived datatype: OpenMPI keeps its fast paths (a
// contiguous predefined type, its vectorised predefined operations), and 64 bytes more do not
// change which protocol a message takes.
//
// The hash is cut into K digits of c bits; each digit d travels with a partner element chosen so
// that the reduced pair has a value every rank can predict, and has it exactly when every rank
// sent the same digit:
//   sum, avg:  (d, d^2)    reduce to (n d, n d^2); then sum_r (d_r - d)^2 = 0, so every d_r = d
//   max, min:  (d, M - d)  reduce to (d, M - d) (M = 2^c - 1): the largest and the smallest d_r
//                          are both d
//   band, bor: (d, M - d)  as max and min: the and (or) of the d_r and of the M - d_r are d and
//                          M - d only when every d_r = d
// The digit width is the widest for which every partial result is an integer the dtype holds
// exactly (no rounding, no wrap-around) for this group size, whatever order MPI reduces in.
// A product, a bitwise xor, or a group too large for a narrow dtype's exact integers, has no such
// encoding: those calls exchange their fingerprints in a separate allreduce instead.
#pragma once

#include <cstddef>
#include <cstdint>

#include "comm/wire.h"
#include "ddp/comm/types.h"

namespace ddp::comm::mpi {

// The hash compared across ranks (in band, in the separate check, and in stall notices).
std::uint64_t fingerprint_hash(const OpHeader& header);

class InBandFingerprint {
 public:
  InBandFingerprint() = default;
  // The encoding for calls of this dtype and reduce operation on a group of `group_size` ranks.
  InBandFingerprint(DType dtype, ReduceOp op, int group_size);

  // Whether this combination has an in-band encoding.
  bool usable() const { return digits_ > 0; }
  // Elements of the call's dtype in front of the payload, and their bytes.
  std::size_t elements() const { return 2 * static_cast<std::size_t>(digits_); }
  std::size_t bytes() const { return elements() * dtype_size(dtype_); }
  int digit_bits() const { return digit_bits_; }

  // Writes this rank's elements for `hash` into `mine`, and into `expected` the reduced elements
  // every rank gets exactly when every rank wrote the same hash (compare them bytewise).
  void encode(std::uint64_t hash, void* mine, void* expected) const;

 private:
  DType dtype_ = DType::kFloat32;
  bool is_sum_ = false;
  std::uint64_t group_size_ = 0;
  int digit_bits_ = 0;
  int digits_ = 0;
};

}  // namespace ddp::comm::mpi
