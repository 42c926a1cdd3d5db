// The in-band fingerprint of the mpi backend's small allreduces (src/comm/mpi/
// mpi_in_band_fingerprint.h): reduced the way MPI reduces them (element by element, in any
// order), the elements equal the expected ones exactly when every rank encoded the same hash.
#include "comm/mpi/mpi_in_band_fingerprint.h"

#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <set>
#include <vector>

#include "comm/reduce_kernels.h"

namespace ddp::comm::mpi {
namespace {

using Bytes = std::vector<std::byte>;

constexpr DType kDTypes[] = {DType::kFloat32, DType::kFloat64, DType::kFloat16, DType::kBFloat16,
                             DType::kInt8,    DType::kUInt8,   DType::kInt32,   DType::kInt64};
constexpr ReduceOp kEncodableOps[] = {ReduceOp::kSum, ReduceOp::kAvg,  ReduceOp::kMin,
                                      ReduceOp::kMax, ReduceOp::kBand, ReduceOp::kBor};
constexpr int kGroupSizes[] = {2, 3, 4, 7, 8, 64};

struct Encoded {
  Bytes mine;
  Bytes expected;
};

Encoded encode(const InBandFingerprint& f, std::uint64_t hash) {
  Encoded e{Bytes(f.bytes()), Bytes(f.bytes())};
  f.encode(hash, e.mine.data(), e.expected.data());
  return e;
}

// What MPI computes from every rank's elements: a left fold, or a tree (the order differs, the
// result must not).
Bytes reduce_all(const std::vector<Bytes>& ranks, const InBandFingerprint& f, DType dtype,
                 ReduceOp op, bool tree) {
  const ReduceOp combine = op == ReduceOp::kAvg ? ReduceOp::kSum : op;
  std::vector<Bytes> level = ranks;
  if (!tree) {
    Bytes acc = level[0];
    for (std::size_t r = 1; r < level.size(); ++r)
      comm::reduce(acc.data(), acc.data(), level[r].data(), f.elements(), dtype, combine);
    return acc;
  }
  while (level.size() > 1) {
    std::vector<Bytes> next;
    for (std::size_t r = 0; r + 1 < level.size(); r += 2) {
      Bytes sum(level[r].size());
      comm::reduce(sum.data(), level[r + 1].data(), level[r].data(), f.elements(), dtype, combine);
      next.push_back(std::move(sum));
    }
    if (level.size() % 2 == 1) next.push_back(level.back());
    level = std::move(next);
  }
  return level[0];
}

// Calls `check(dtype, op, n, encoding)` for every dtype, encodable op and group size with an
// encoding.
template <class Check>
void for_each_encoding(Check check) {
  for (DType dtype : kDTypes) {
    for (ReduceOp op : kEncodableOps) {
      for (int n : kGroupSizes) {
        const InBandFingerprint f(dtype, op, n);
        if (f.usable()) check(dtype, op, n, f);  // the others: WhatCannotBeExactIsNotUsable
      }
    }
  }
}

TEST(InBandFingerprint, EqualHashesReduceToTheExpectedElementsInAnyOrder) {
  std::mt19937_64 random(7);
  for_each_encoding([&](DType dtype, ReduceOp op, int n, const InBandFingerprint& f) {
    // Every digit at its largest (the exactness limit), then random hashes.
    std::vector<std::uint64_t> hashes{~std::uint64_t{0}, 0};
    for (int i = 0; i < 20; ++i)
      hashes.push_back(random());
    for (std::uint64_t hash : hashes) {
      const Encoded e = encode(f, hash);
      const std::vector<Bytes> ranks(static_cast<std::size_t>(n), e.mine);
      for (bool tree : {false, true}) {
        EXPECT_EQ(reduce_all(ranks, f, dtype, op, tree), e.expected)
            << to_string(dtype) << " " << to_string(op) << " n=" << n << " hash=" << hash
            << (tree ? " (tree)" : " (fold)");
      }
    }
  });
}

TEST(InBandFingerprint, ADifferentHashOnAnyRankIsSeenByEveryRank) {
  std::mt19937_64 random(11);
  for_each_encoding([&](DType dtype, ReduceOp op, int n, const InBandFingerprint& f) {
    for (int trial = 0; trial < 40; ++trial) {
      const std::uint64_t hash = random();
      // Half the trials: one bit flipped (one digit off by a power of two); else random.
      const std::uint64_t other =
          trial % 2 == 0 ? hash ^ (std::uint64_t{1} << (trial % 64)) : random();
      if (other == hash) continue;
      const Encoded same = encode(f, hash);
      const Encoded odd = encode(f, other);
      std::vector<Bytes> ranks(static_cast<std::size_t>(n), same.mine);
      const auto odd_rank = static_cast<std::size_t>(trial) % ranks.size();
      ranks[odd_rank] = odd.mine;
      const Bytes result = reduce_all(ranks, f, dtype, op, trial % 4 < 2);
      EXPECT_NE(result, same.expected)
          << to_string(dtype) << " " << to_string(op) << " n=" << n << ": ranks with hash " << hash
          << " did not see rank " << odd_rank << "'s " << other;
      EXPECT_NE(result, odd.expected) << to_string(dtype) << " " << to_string(op) << " n=" << n
                                      << ": rank " << odd_rank << " did not see the others' hash";
    }
  });
}

TEST(InBandFingerprint, WhatCannotBeExactIsNotUsable) {
  for (DType dtype : kDTypes) {
    for (int n : kGroupSizes)
      EXPECT_FALSE(InBandFingerprint(dtype, ReduceOp::kProduct, n).usable()) << to_string(dtype);
  }
  // A bitwise xor of equal digits is 0 or the digit by the parity of n, and unequal ones can
  // cancel: xor has no in-band encoding. band and bor have one for the integer dtypes only.
  for (DType dtype : kDTypes) {
    EXPECT_FALSE(InBandFingerprint(dtype, ReduceOp::kBxor, 4).usable()) << to_string(dtype);
    EXPECT_EQ(InBandFingerprint(dtype, ReduceOp::kBand, 4).usable(), is_integer(dtype))
        << to_string(dtype);
  }
  // bfloat16 holds the integers up to 256 exactly: a sum over 300 ranks has no room for a digit.
  EXPECT_FALSE(InBandFingerprint(DType::kBFloat16, ReduceOp::kSum, 300).usable());
  EXPECT_TRUE(InBandFingerprint(DType::kBFloat16, ReduceOp::kMax, 300).usable());
  // The common case stays small: 12 float32 elements (48 bytes) for a sum over 2 ranks.
  const InBandFingerprint f32(DType::kFloat32, ReduceOp::kSum, 2);
  EXPECT_EQ(f32.digit_bits(), 11);
  EXPECT_EQ(f32.bytes(), 48u);
}

TEST(InBandFingerprint, HashDependsOnEveryFieldOfTheHeader) {
  OpHeader base;
  base.count = 256;
  base.sequence = 41;
  std::set<std::uint64_t> seen{fingerprint_hash(base)};
  const std::vector<void (*)(OpHeader&)> edits{[](OpHeader& h) { h.sequence = 42; },
                                               [](OpHeader& h) { h.count = 255; },
                                               [](OpHeader& h) { h.dtype = 1; },
                                               [](OpHeader& h) { h.reduce_op = 3; },
                                               [](OpHeader& h) { h.kind = Collective::kBroadcast; },
                                               [](OpHeader& h) { h.root = 1; }};
  for (std::size_t i = 0; i < edits.size(); ++i) {
    OpHeader edited = base;
    edits[i](edited);
    EXPECT_TRUE(seen.insert(fingerprint_hash(edited)).second) << "edit " << i;
  }
  OpHeader h;
  // The low digits (what a float32 sum over two ranks carries first) change with the sequence.
  std::set<std::uint64_t> low_digits;
  for (std::uint64_t s = 0; s < 1000; ++s) {
    h = base;
    h.sequence = s;
    low_digits.insert(fingerprint_hash(h) & 0x7ff);
  }
  EXPECT_GT(low_digits.size(), 500u);
}

}  // namespace
}  // namespace ddp::comm::mpi
