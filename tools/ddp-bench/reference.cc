#include "ddp-bench/reference.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <type_traits>

namespace ddp::bench {
namespace {

// 16-bit floating-point storage; converted through float with round-to-nearest-even.
struct Float16 {
  std::uint16_t bits;
};
struct BFloat16 {
  std::uint16_t bits;
};

std::uint16_t float_to_half_bits(float value) {
  const auto x = std::bit_cast<std::uint32_t>(value);
  const std::uint32_t sign = (x >> 16) & 0x8000u;
  const std::uint32_t exponent = (x >> 23) & 0xffu;
  std::uint32_t mantissa = x & 0x7fffffu;
  if (exponent == 0xffu)
    return static_cast<std::uint16_t>(sign | 0x7c00u | (mantissa ? 0x200u : 0));
  const int half_exponent = static_cast<int>(exponent) - 127 + 15;
  if (half_exponent >= 0x1f) return static_cast<std::uint16_t>(sign | 0x7c00u);
  if (half_exponent <= 0) {  // subnormal half (or zero): units of 2^-24
    if (half_exponent < -10) return static_cast<std::uint16_t>(sign);
    mantissa |= 0x800000u;
    const int shift = 14 - half_exponent;
    std::uint32_t half_mantissa = mantissa >> shift;
    const std::uint32_t rest = mantissa & ((1u << shift) - 1);
    const std::uint32_t halfway = 1u << (shift - 1);
    if (rest > halfway || (rest == halfway && (half_mantissa & 1u))) ++half_mantissa;
    return static_cast<std::uint16_t>(sign | half_mantissa);
  }
  std::uint32_t half = sign | (static_cast<std::uint32_t>(half_exponent) << 10) | (mantissa >> 13);
  const std::uint32_t rest = mantissa & 0x1fffu;
  // A carry out of the mantissa correctly bumps the exponent (up to infinity).
  if (rest > 0x1000u || (rest == 0x1000u && (half & 1u))) ++half;
  return static_cast<std::uint16_t>(half);
}

float half_bits_to_float(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t exponent = (h >> 10) & 0x1fu;
  const std::uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0) {
    const float v = std::ldexp(static_cast<float>(mantissa), -24);
    return sign ? -v : v;
  }
  if (exponent == 0x1f) return std::bit_cast<float>(sign | 0x7f800000u | (mantissa << 13));
  return std::bit_cast<float>(sign | ((exponent + 112) << 23) | (mantissa << 13));
}

std::uint16_t float_to_bfloat16_bits(float value) {
  const auto x = std::bit_cast<std::uint32_t>(value);
  if (std::isnan(value)) return static_cast<std::uint16_t>((x >> 16) | 0x40u);
  return static_cast<std::uint16_t>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

template <class T>
double to_double(T value) {
  if constexpr (std::is_same_v<T, Float16>) {
    return half_bits_to_float(value.bits);
  } else if constexpr (std::is_same_v<T, BFloat16>) {
    return std::bit_cast<float>(static_cast<std::uint32_t>(value.bits) << 16);
  } else {
    return static_cast<double>(value);
  }
}

template <class T>
T from_double(double value) {
  if constexpr (std::is_same_v<T, Float16>) {
    return Float16{float_to_half_bits(static_cast<float>(value))};
  } else if constexpr (std::is_same_v<T, BFloat16>) {
    return BFloat16{float_to_bfloat16_bits(static_cast<float>(value))};
  } else if constexpr (std::is_floating_point_v<T>) {
    return static_cast<T>(value);
  } else {
    // Whole numbers wrap like the dtype (conversion to an unsigned or narrower type is modular).
    return static_cast<T>(static_cast<std::int64_t>(value));
  }
}

template <class T>
constexpr bool kIsFloat =
    std::is_floating_point_v<T> || std::is_same_v<T, Float16> || std::is_same_v<T, BFloat16>;

template <class T>
struct TypeTag {
  using type = T;
};

template <class F>
decltype(auto) with_element_type(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kFloat32:
      return f(TypeTag<float>{});
    case DType::kFloat64:
      return f(TypeTag<double>{});
    case DType::kFloat16:
      return f(TypeTag<Float16>{});
    case DType::kBFloat16:
      return f(TypeTag<BFloat16>{});
    case DType::kInt8:
      return f(TypeTag<std::int8_t>{});
    case DType::kUInt8:
      return f(TypeTag<std::uint8_t>{});
    case DType::kInt32:
      return f(TypeTag<std::int32_t>{});
    case DType::kInt64:
      return f(TypeTag<std::int64_t>{});
  }
  throw std::invalid_argument("ddp-bench: unknown dtype");
}

bool is_reduction(Collective c) {
  return c == Collective::kAllreduce || c == Collective::kReduce || c == Collective::kReduceScatter;
}

bool is_blocked(Collective c) {
  return c == Collective::kAllgather || c == Collective::kGather || c == Collective::kScatter ||
         c == Collective::kReduceScatter || c == Collective::kAlltoall;
}

// Input element `i` of rank `rank`. See the header for why these values.
double input_value(const CheckSpec& spec, int rank, std::size_t i) {
  const auto r = static_cast<std::size_t>(rank);
  if (!is_reduction(spec.collective)) return static_cast<double>((r * 31 + (i % 97) * 7) % 97);
  if (spec.reduce_op == ReduceOp::kProduct) return (i + r) % 4 == 0 ? 2.0 : 1.0;
  return static_cast<double>(((i % 8) * 5 + r * 3) % 8);
}

// The reduction over ranks of input element `i`, as dtype T computes it.
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
    case ReduceOp::kBand:
    case ReduceOp::kBor:
    case ReduceOp::kBxor:
      if constexpr (std::is_integral_v<A>) {
        if (op == ReduceOp::kBand) return acc & v;
        if (op == ReduceOp::kBor) return acc | v;
        return acc ^ v;
      }
      return acc;  // bitwise ops take integer dtypes only (bench_options.cc)
  }
  return acc;
}

template <class T>
double reduced_value(const CheckSpec& spec, std::size_t i) {
  const int n = spec.world_size;
  if constexpr (kIsFloat<T>) {
    double acc = input_value(spec, 0, i);
    for (int r = 1; r < n; ++r)
      acc = combine(spec.reduce_op, acc, input_value(spec, r, i));
    if (spec.reduce_op == ReduceOp::kAvg) acc /= n;
    return acc;
  } else {
    auto acc = static_cast<std::int64_t>(input_value(spec, 0, i));
    for (int r = 1; r < n; ++r)
      acc = combine(spec.reduce_op, acc, static_cast<std::int64_t>(input_value(spec, r, i)));
    // The sum wraps in the dtype first, then is divided once (truncating), as types.h says.
    auto wrapped = static_cast<T>(acc);
    if (spec.reduce_op == ReduceOp::kAvg) wrapped = static_cast<T>(wrapped / n);
    return static_cast<double>(wrapped);
  }
}

template <class T>
double expected_typed(const CheckSpec& spec, int rank, const Layout& layout, std::size_t j) {
  const std::size_t block = layout.block_count;
  const auto r = static_cast<std::size_t>(rank);
  switch (spec.collective) {
    case Collective::kAllreduce:
    case Collective::kReduce:
      return reduced_value<T>(spec, j);
    case Collective::kReduceScatter:
      return reduced_value<T>(spec, r * block + j);
    case Collective::kBroadcast:
      return input_value(spec, spec.root, j);
    case Collective::kAllgather:
    case Collective::kGather:
      return input_value(spec, static_cast<int>(j / block), j % block);
    case Collective::kScatter:
      return input_value(spec, spec.root, r * block + j);
    case Collective::kAlltoall:
      return input_value(spec, static_cast<int>(j / block), r * block + j % block);
    case Collective::kSend:
      return input_value(spec, (rank + spec.world_size - 1) % spec.world_size, j);
    case Collective::kBarrier:
      return 0;
  }
  throw std::invalid_argument("ddp-bench: unknown collective");
}

// Relative tolerance of a floating-point reduction result (see the header).
template <class T>
double tolerance(const CheckSpec& spec) {
  if (!is_reduction(spec.collective)) return 0;
  if constexpr (std::is_same_v<T, double>) {
    return 1e-12;
  } else if constexpr (std::is_same_v<T, float>) {
    return 1e-6;
  } else if constexpr (std::is_same_v<T, Float16>) {
    return std::ldexp(1.0, -10) * spec.world_size;
  } else if constexpr (std::is_same_v<T, BFloat16>) {
    return std::ldexp(1.0, -7) * spec.world_size;
  } else {
    return 0;
  }
}

bool receives(const CheckSpec& spec, int rank) {
  switch (spec.collective) {
    case Collective::kReduce:
    case Collective::kGather:
      return rank == spec.root;
    case Collective::kBarrier:
      return false;
    default:
      return true;
  }
}

}  // namespace

Layout layout_for(Collective collective, std::size_t requested_bytes, DType dtype, int world_size) {
  Layout layout;
  if (collective == Collective::kBarrier) return layout;
  const std::size_t element = dtype_size(dtype);
  const auto n = static_cast<std::size_t>(world_size);
  std::size_t elements = requested_bytes / element;
  if (is_blocked(collective)) {
    layout.block_count = std::max<std::size_t>(1, elements / n);
    layout.total_count = layout.block_count * n;
  } else {
    layout.total_count = std::max<std::size_t>(1, elements);
    layout.block_count = layout.total_count;
  }
  switch (collective) {
    case Collective::kAllgather:
    case Collective::kGather:
      layout.send_count = layout.block_count;
      layout.recv_count = layout.total_count;
      break;
    case Collective::kScatter:
    case Collective::kReduceScatter:
      layout.send_count = layout.total_count;
      layout.recv_count = layout.block_count;
      break;
    default:
      layout.send_count = layout.total_count;
      layout.recv_count = layout.total_count;
  }
  layout.bytes = layout.total_count * element;
  return layout;
}

double bus_bandwidth_factor(Collective collective, int world_size) {
  const double n = world_size;
  switch (collective) {
    case Collective::kAllreduce:
      return 2.0 * (n - 1) / n;
    case Collective::kReduceScatter:
    case Collective::kAllgather:
    case Collective::kGather:
    case Collective::kScatter:
    case Collective::kAlltoall:
      return (n - 1) / n;
    case Collective::kBroadcast:
    case Collective::kReduce:
    case Collective::kSend:
      return 1.0;
    case Collective::kBarrier:
      return 0.0;
  }
  throw std::invalid_argument("ddp-bench: unknown collective");
}

void fill_input(const CheckSpec& spec, int rank, void* send, std::size_t count) {
  with_element_type(spec.dtype, [&]<class Tag>(Tag) {
    using T = typename Tag::type;
    auto* out = static_cast<T*>(send);
    for (std::size_t i = 0; i < count; ++i)
      out[i] = from_double<T>(input_value(spec, rank, i));
  });
}

void poison(DType dtype, void* buf, std::size_t count) {
  with_element_type(dtype, [&]<class Tag>(Tag) {
    using T = typename Tag::type;
    const T value = from_double<T>(kIsFloat<T> ? std::numeric_limits<double>::quiet_NaN() : -1.0);
    std::fill_n(static_cast<T*>(buf), count, value);
  });
}

double expected_value(const CheckSpec& spec, int rank, const Layout& layout, std::size_t index) {
  return with_element_type(spec.dtype, [&]<class Tag>(Tag) {
    using T = typename Tag::type;
    // Round through the dtype, so the expectation is a value the dtype can hold.
    return to_double(from_double<T>(expected_typed<T>(spec, rank, layout, index)));
  });
}

std::uint64_t count_wrong(const CheckSpec& spec, int rank, const void* recv, const Layout& layout) {
  if (!receives(spec, rank)) return 0;
  return with_element_type(spec.dtype, [&]<class Tag>(Tag) {
    using T = typename Tag::type;
    const auto* got = static_cast<const T*>(recv);
    const double tol = tolerance<T>(spec);
    std::uint64_t wrong = 0;
    for (std::size_t j = 0; j < layout.recv_count; ++j) {
      const double expect = to_double(from_double<T>(expected_typed<T>(spec, rank, layout, j)));
      const double value = to_double(got[j]);
      if (tol == 0) {
        if (value != expect) ++wrong;  // NaN (the poison) never compares equal
      } else if (!(std::abs(value - expect) <= tol * std::max(1.0, std::abs(expect)))) {
        ++wrong;
      }
    }
    return wrong;
  });
}

double load_value(DType dtype, const void* buf, std::size_t index) {
  return with_element_type(dtype, [&]<class Tag>(Tag) {
    using T = typename Tag::type;
    return to_double(static_cast<const T*>(buf)[index]);
  });
}

void store_value(DType dtype, void* buf, std::size_t index, double value) {
  with_element_type(dtype, [&]<class Tag>(Tag) {
    using T = typename Tag::type;
    static_cast<T*>(buf)[index] = from_double<T>(value);
  });
}

}  // namespace ddp::bench
