// The in-band fingerprint of a blocking allreduce (see mpi_in_band_fingerprint.h).
#include "comm/mpi/mpi_in_band_fingerprint.h"

#include <cstring>

#include "comm/reduce_kernels.h"

namespace ddp::comm::mpi {
namespace {

// The widest digits: a sum's squares stay below 2^32, so n d^2 fits 64 bits for any group.
constexpr int kMaxDigitBits = 16;

// The largest L such that the dtype holds every integer 0..L exactly (and, for the integer types,
// without wrapping around): float16 and bfloat16 are reduced in float32 and rounded back, which
// keeps such integers exact.
std::uint64_t exact_integers_up_to(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return std::uint64_t{1} << 24;
    case DType::kFloat64:
      return std::uint64_t{1} << 53;
    case DType::kFloat16:
      return std::uint64_t{1} << 11;
    case DType::kBFloat16:
      return std::uint64_t{1} << 8;
    case DType::kInt8:
      return 127;
    case DType::kUInt8:
      return 255;
    case DType::kInt32:
      return 0x7fffffffu;
    case DType::kInt64:
      return 0x7fffffffffffffffu;
  }
  return 0;
}

// This rank's elements and the expected ones, as elements of type T; `convert` turns an exact
// integer (below 2^63: converted as signed, one instruction) into one. The dtype is switched on
// once per call, not per element.
template <class T, class Convert>
void encode_as(std::uint64_t hash, int digit_bits, std::size_t digits, bool is_sum,
               std::uint64_t group_size, void* mine, void* expected, Convert convert) {
  const std::uint64_t mask = (std::uint64_t{1} << digit_bits) - 1;
  T* out = static_cast<T*>(mine);
  T* want = static_cast<T*>(expected);
  for (std::size_t i = 0; i < digits; ++i, hash >>= digit_bits) {
    const std::uint64_t digit = hash & mask;
    const std::uint64_t partner = is_sum ? digit * digit : mask - digit;
    out[i] = convert(static_cast<std::int64_t>(digit));
    out[digits + i] = convert(static_cast<std::int64_t>(partner));
    if (is_sum) {
      want[i] = convert(static_cast<std::int64_t>(group_size * digit));
      want[digits + i] = convert(static_cast<std::int64_t>(group_size * partner));
    }
  }
  // A max or min of equal digits is the digits themselves.
  if (!is_sum) std::memcpy(want, out, 2 * digits * sizeof(T));
}

}  // namespace

std::uint64_t fingerprint_hash(const OpHeader& header) {
  std::uint64_t words[sizeof header / sizeof(std::uint64_t)];
  std::memcpy(words, &header, sizeof words);
  // Each word times its own odd constant (independent multiplications), then splitmix64's
  // finaliser, so that every digit of the result depends on every bit of the header. FNV-1a over
  // the 32 bytes took 32 multiplications in a chain.
  std::uint64_t h = words[0] * 0x9e3779b97f4a7c15u ^ words[1] * 0xc2b2ae3d27d4eb4fu ^
                    words[2] * 0x165667b19e3779f9u ^ words[3] * 0xff51afd7ed558ccdu;
  h ^= h >> 30;
  h *= 0xbf58476d1ce4e5b9u;
  h ^= h >> 27;
  h *= 0x94d049bb133111ebu;
  h ^= h >> 31;
  return h;
}

InBandFingerprint::InBandFingerprint(DType dtype, ReduceOp op, int group_size)
    : dtype_(dtype),
      is_sum_(op == ReduceOp::kSum || op == ReduceOp::kAvg),
      group_size_(static_cast<std::uint64_t>(group_size > 0 ? group_size : 1)) {
  if (op == ReduceOp::kProduct || op == ReduceOp::kBxor) return;
  // A bitwise and or or of the pairs (d, M - d) is (d, M - d) exactly when every rank sent d
  // (and(d_r) = d puts d's bits in every d_r, and(M - d_r) = M - d keeps every d_r within d's
  // bits; or is the mirror image): the encoding of max and min.
  if (is_bitwise(op) && !is_integer(dtype)) return;  // refused before any call is made
  const std::uint64_t limit = exact_integers_up_to(dtype);
  for (int bits = kMaxDigitBits; bits >= 1; --bits) {
    const std::uint64_t largest = (std::uint64_t{1} << bits) - 1;
    // A sum's partial results are at most n M^2, a max's or min's at most M.
    const unsigned __int128 reach =
        is_sum_ ? static_cast<unsigned __int128>(group_size_) * largest * largest : largest;
    if (reach <= limit) {
      digit_bits_ = bits;
      digits_ = (64 + bits - 1) / bits;
      return;
    }
  }
}

void InBandFingerprint::encode(std::uint64_t hash, void* mine, void* expected) const {
  const auto k = static_cast<std::size_t>(digits_);
  auto as = [&]<class T>(T, auto convert) {
    encode_as<T>(hash, digit_bits_, k, is_sum_, group_size_, mine, expected, convert);
  };
  switch (dtype_) {
    case DType::kFloat32:
      return as(float{}, [](std::int64_t v) { return static_cast<float>(v); });
    case DType::kFloat64:
      return as(double{}, [](std::int64_t v) { return static_cast<double>(v); });
    case DType::kFloat16:
      return as(std::uint16_t{},
                [](std::int64_t v) { return comm::float_to_half(static_cast<float>(v)); });
    case DType::kBFloat16:
      return as(std::uint16_t{},
                [](std::int64_t v) { return comm::float_to_bfloat16(static_cast<float>(v)); });
    case DType::kInt8:
      return as(std::int8_t{}, [](std::int64_t v) { return static_cast<std::int8_t>(v); });
    case DType::kUInt8:
      return as(std::uint8_t{}, [](std::int64_t v) { return static_cast<std::uint8_t>(v); });
    case DType::kInt32:
      return as(std::int32_t{}, [](std::int64_t v) { return static_cast<std::int32_t>(v); });
    case DType::kInt64:
      return as(std::int64_t{}, [](std::int64_t v) { return v; });
  }
}

}  // namespace ddp::comm::mpi
