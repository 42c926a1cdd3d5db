// The reference values of the collective tests (tests/comm and the conformance suite): a
// deterministic input per rank and element for every dtype, and the exact expected reduction.
//
// Inputs are small integers (-2..2, or 0..4 for uint8), so sums and products over up to 8 ranks
// are exact in every float type and the reference does not depend on reduction order; an average
// is one division of the exact sum, rounded once, as the engine does. Integer products may wrap
// (int8, uint8), and the reference wraps them the same way.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "comm/reduce_kernels.h"
#include "ddp/comm/types.h"

namespace ddp::test {

// Element i of `who`'s input (who is a rank, or a (rank, block) pair folded into one number).
inline long long input_value(DType dtype, int who, std::size_t i, int salt) {
  const long long v = static_cast<long long>((static_cast<std::size_t>(who) * 7 + i * 3 +
                                              static_cast<std::size_t>(salt) * 11 + 1) %
                                             5) -
                      2;
  return dtype == DType::kUInt8 ? v + 2 : v;
}

inline bool is_float(DType d) {
  return d == DType::kFloat32 || d == DType::kFloat64 || d == DType::kFloat16 ||
         d == DType::kBFloat16;
}

inline void store_value(DType dtype, std::byte* p, double value) {
  auto put = [p](auto v) { std::memcpy(p, &v, sizeof v); };
  switch (dtype) {
    case DType::kFloat32:
      return put(static_cast<float>(value));
    case DType::kFloat64:
      return put(value);
    case DType::kFloat16:
      return put(comm::float_to_half(static_cast<float>(value)));
    case DType::kBFloat16:
      return put(comm::float_to_bfloat16(static_cast<float>(value)));
    // Integers wrap, as the engine's sums and products do.
    case DType::kInt8:
      return put(static_cast<std::int8_t>(static_cast<long long>(value)));
    case DType::kUInt8:
      return put(static_cast<std::uint8_t>(static_cast<long long>(value)));
    case DType::kInt32:
      return put(static_cast<std::int32_t>(static_cast<long long>(value)));
    case DType::kInt64:
      return put(static_cast<std::int64_t>(value));
  }
}

inline double load_value(DType dtype, const std::byte* p) {
  auto get = [p]<typename T>(T) {
    T v;
    std::memcpy(&v, p, sizeof v);
    return v;
  };
  switch (dtype) {
    case DType::kFloat32:
      return get(float{});
    case DType::kFloat64:
      return get(double{});
    case DType::kFloat16:
      return comm::half_to_float(get(std::uint16_t{}));
    case DType::kBFloat16:
      return comm::bfloat16_to_float(get(std::uint16_t{}));
    case DType::kInt8:
      return get(std::int8_t{});
    case DType::kUInt8:
      return get(std::uint8_t{});
    case DType::kInt32:
      return get(std::int32_t{});
    case DType::kInt64:
      return static_cast<double>(get(std::int64_t{}));
  }
  return 0;
}

// `acc` op `v` (an average accumulates the sum; the caller divides).
template <class A>
A combine(ReduceOp op, A acc, A v) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg:
      return acc + v;
    case ReduceOp::kMin:
      return std::min(acc, v);
    case ReduceOp::kMax:
      return std::max(acc, v);
    case ReduceOp::kProduct:
      return acc * v;
    // Bitwise on the two's complement of the (integral) values, as the integer dtypes hold them.
    case ReduceOp::kBand:
      return static_cast<A>(static_cast<long long>(acc) & static_cast<long long>(v));
    case ReduceOp::kBor:
      return static_cast<A>(static_cast<long long>(acc) | static_cast<long long>(v));
    case ReduceOp::kBxor:
      return static_cast<A>(static_cast<long long>(acc) ^ static_cast<long long>(v));
  }
  return acc;
}

// Whether a collective reduces `dtype` with `op` (the bitwise ops take integers only; the other
// combinations are refused, which the bad-input tests check).
inline bool reduces(DType dtype, ReduceOp op) {
  return !is_bitwise(op) || is_integer(dtype);
}

inline std::vector<std::byte> make_input(DType dtype, std::size_t count, int who, int salt) {
  const std::size_t esz = dtype_size(dtype);
  std::vector<std::byte> buf(count * esz);
  for (std::size_t i = 0; i < count; ++i) {
    store_value(dtype, buf.data() + i * esz, static_cast<double>(input_value(dtype, who, i, salt)));
  }
  return buf;
}

// Element-wise op over ranks 0..size-1 of make_input(dtype, count, rank, salt).
inline std::vector<std::byte> expected_reduction(DType dtype, ReduceOp op, std::size_t count,
                                                 int size, int salt) {
  const std::size_t esz = dtype_size(dtype);
  std::vector<std::byte> out(count * esz);
  for (std::size_t i = 0; i < count; ++i) {
    // In double (exact for these inputs, and keeps -0 from -2 * 0) and in int64.
    long long acc = input_value(dtype, 0, i, salt);
    double facc = static_cast<double>(acc);
    for (int r = 1; r < size; ++r) {
      const long long v = input_value(dtype, r, i, salt);
      const auto fv = static_cast<double>(v);
      acc = combine(op, acc, v);
      facc = combine(op, facc, fv);
    }
    std::byte* p = out.data() + i * esz;
    if (!is_float(dtype)) {
      // Wrap to the type first (sums here never wrap; products of int8/uint8 may), then truncate.
      std::vector<std::byte> wrapped(esz);
      store_value(dtype, wrapped.data(), static_cast<double>(acc));
      long long w = 0;
      switch (dtype) {
        case DType::kInt8:
          w = static_cast<std::int8_t>(wrapped[0]);
          break;
        case DType::kUInt8:
          w = static_cast<std::uint8_t>(wrapped[0]);
          break;
        default:
          w = acc;
          break;
      }
      store_value(dtype, p, static_cast<double>(op == ReduceOp::kAvg ? w / size : w));
    } else if (op != ReduceOp::kAvg) {
      store_value(dtype, p, facc);
    } else if (dtype == DType::kFloat64) {
      store_value(dtype, p, facc / size);
    } else {
      store_value(dtype, p,
                  static_cast<double>(static_cast<float>(facc) / static_cast<float>(size)));
    }
  }
  return out;
}

}  // namespace ddp::test
