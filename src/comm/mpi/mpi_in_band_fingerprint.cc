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

// Converts the integers `values` (each below 2^63, and exact in T) to elements of type T.
template <class T, class Convert>
void store_all(const std::uint64_t* values, std::size_t n, void* out, Convert convert) {
  T* elements = static_cast<T*>(out);
  for (std::size_t i = 0; i < n; ++i)
    elements[i] = convert(static_cast<std::int64_t>(values[i]));  // signed: one instruction
}

template <class Convert>
void store_all_16bit(const std::uint64_t* values, std::size_t n, void* out, Convert convert) {
  store_all<std::uint16_t>(values, n, out,
                           [&](std::int64_t v) { return convert(static_cast<float>(v)); });
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
  if (op == ReduceOp::kProduct) return;
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
  // The integers first ([this rank's digits | partners | expected digits | partners]), then one
  // conversion loop per dtype.
  constexpr std::size_t kMaxDigits = 64;
  std::uint64_t values[4 * kMaxDigits];
  const auto k = static_cast<std::size_t>(digits_);
  const std::uint64_t mask = (std::uint64_t{1} << digit_bits_) - 1;
  std::uint64_t rest = hash;
  for (std::size_t i = 0; i < k; ++i, rest >>= digit_bits_) {
    const std::uint64_t digit = rest & mask;
    const std::uint64_t partner = is_sum_ ? digit * digit : mask - digit;
    values[i] = digit;
    values[k + i] = partner;
    values[2 * k + i] = is_sum_ ? group_size_ * digit : digit;
    values[3 * k + i] = is_sum_ ? group_size_ * partner : partner;
  }
  const std::uint64_t* const want = values + 2 * k;
  auto both = [&](auto store) {
    store(values, mine);
    store(want, expected);
  };
  const std::size_t n = 2 * k;
  switch (dtype_) {
    case DType::kFloat32:
      return both([n](const std::uint64_t* v, void* out) {
        store_all<float>(v, n, out, [](std::int64_t x) { return static_cast<float>(x); });
      });
    case DType::kFloat64:
      return both([n](const std::uint64_t* v, void* out) {
        store_all<double>(v, n, out, [](std::int64_t x) { return static_cast<double>(x); });
      });
    case DType::kFloat16:
      return both([n](const std::uint64_t* v, void* out) {
        store_all_16bit(v, n, out, [](float x) { return comm::float_to_half(x); });
      });
    case DType::kBFloat16:
      return both([n](const std::uint64_t* v, void* out) {
        store_all_16bit(v, n, out, [](float x) { return comm::float_to_bfloat16(x); });
      });
    case DType::kInt8:
      return both([n](const std::uint64_t* v, void* out) {
        store_all<std::int8_t>(v, n, out,
                               [](std::int64_t x) { return static_cast<std::int8_t>(x); });
      });
    case DType::kUInt8:
      return both([n](const std::uint64_t* v, void* out) {
        store_all<std::uint8_t>(v, n, out,
                                [](std::int64_t x) { return static_cast<std::uint8_t>(x); });
      });
    case DType::kInt32:
      return both([n](const std::uint64_t* v, void* out) {
        store_all<std::int32_t>(v, n, out,
                                [](std::int64_t x) { return static_cast<std::int32_t>(x); });
      });
    case DType::kInt64:
      return both([n](const std::uint64_t* v, void* out) { std::memcpy(out, v, n * 8); });
  }
}

}  // namespace ddp::comm::mpi
