// Compiled with -O3 (see CMakeLists.txt): the loops below are written for GCC's vectoriser —
// restrict pointers, no calls, branches as selects.
#include "comm/reduce_kernels.h"

#include <cpuid.h>
#include <immintrin.h>

#include <bit>
#include <cstring>
#include <type_traits>

namespace ddp::comm {
namespace {

// Branch-free IEEE half <-> float (after F. Giesen, "half_to_float_fast5" and
// "float_to_half_fast3_rtne"), so that the loops vectorise without F16C.
// Selects are written as masks so that GCC if-converts and vectorises the loops.
inline std::uint32_t mask_if(bool condition) {
  return 0u - static_cast<std::uint32_t>(condition);
}

inline float half_to_float_inline(std::uint16_t h) {
  const std::uint32_t shifted_exp = 0x7c00u << 13;
  std::uint32_t o = (static_cast<std::uint32_t>(h) & 0x7fffu) << 13;
  const std::uint32_t exp = shifted_exp & o;
  o += (127u - 15u) << 23;
  const std::uint32_t inf_nan = o + ((128u - 16u) << 23);
  const std::uint32_t denorm = std::bit_cast<std::uint32_t>(std::bit_cast<float>(o + (1u << 23)) -
                                                            std::bit_cast<float>(113u << 23));
  const std::uint32_t is_inf_nan = mask_if(exp == shifted_exp);
  const std::uint32_t is_denorm = mask_if(exp == 0);
  std::uint32_t bits = (inf_nan & is_inf_nan) | (o & ~is_inf_nan);
  bits = (denorm & is_denorm) | (bits & ~is_denorm);
  bits |= (static_cast<std::uint32_t>(h) & 0x8000u) << 16;
  return std::bit_cast<float>(bits);
}

inline std::uint16_t float_to_half_inline(float value) {
  const std::uint32_t f32_infinity = 255u << 23;
  const std::uint32_t f16_max = (127u + 16u) << 23;
  const std::uint32_t denorm_magic = ((127u - 15u) + (23u - 10u) + 1u) << 23;
  std::uint32_t f = std::bit_cast<std::uint32_t>(value);
  const std::uint32_t sign = f & 0x80000000u;
  f ^= sign;
  const std::uint32_t inf_nan = 0x7c00u | (static_cast<std::uint32_t>(f > f32_infinity) << 9);
  const std::uint32_t subnormal =
      std::bit_cast<std::uint32_t>(std::bit_cast<float>(f) + std::bit_cast<float>(denorm_magic)) -
      denorm_magic;
  const std::uint32_t mant_odd = (f >> 13) & 1u;
  const std::uint32_t normal = (f + ((15u - 127u) << 23) + 0xfffu + mant_odd) >> 13;
  const std::uint32_t is_big = mask_if(f >= f16_max);
  const std::uint32_t is_small = mask_if(f < (113u << 23));
  std::uint32_t o = (subnormal & is_small) | (normal & ~is_small);
  o = (inf_nan & is_big) | (o & ~is_big);
  o |= sign >> 16;
  return static_cast<std::uint16_t>(o);
}

inline float bfloat16_to_float_inline(std::uint16_t h) {
  return std::bit_cast<float>(static_cast<std::uint32_t>(h) << 16);
}

inline std::uint16_t float_to_bfloat16_inline(float value) {
  const std::uint32_t f = std::bit_cast<std::uint32_t>(value);
  const std::uint32_t rounded = (f + 0x7fffu + ((f >> 16) & 1u)) >> 16;
  // NaN: keep it a (quiet) NaN instead of letting rounding carry it into infinity.
  const std::uint32_t is_nan = mask_if((f & 0x7fffffffu) > 0x7f800000u);
  return static_cast<std::uint16_t>((((f >> 16) | 0x40u) & is_nan) | (rounded & ~is_nan));
}

// Storage type and accumulation type of each DType.
template <class T>
struct Plain {
  using Storage = T;
  using Acc = T;
  static Acc load(Storage v) { return v; }
  static Storage store(Acc v) { return v; }
};
struct Half {
  using Storage = std::uint16_t;
  using Acc = float;
  static Acc load(Storage v) { return half_to_float_inline(v); }
  static Storage store(Acc v) { return float_to_half_inline(v); }
};
struct BFloat {
  using Storage = std::uint16_t;
  using Acc = float;
  static Acc load(Storage v) { return bfloat16_to_float_inline(v); }
  static Storage store(Acc v) { return float_to_bfloat16_inline(v); }
};

// Integer sums and products wrap (computed in the unsigned type: signed overflow would be UB).
template <class T>
T wrapping_add(T x, T y) {
  if constexpr (std::is_integral_v<T>) {
    using U = std::make_unsigned_t<T>;
    return static_cast<T>(static_cast<U>(static_cast<U>(x) + static_cast<U>(y)));
  } else {
    return x + y;
  }
}
template <class T>
T wrapping_mul(T x, T y) {
  if constexpr (std::is_integral_v<T>) {
    // Promote small types to unsigned int so that the multiply cannot overflow a signed int.
    using U = std::conditional_t<(sizeof(T) < sizeof(unsigned)), unsigned, std::make_unsigned_t<T>>;
    return static_cast<T>(static_cast<U>(static_cast<U>(x) * static_cast<U>(y)));
  } else {
    return x * y;
  }
}

struct SumOp {
  template <class T>
  static T apply(T x, T y, T) {
    return wrapping_add(x, y);
  }
};
struct ProductOp {
  template <class T>
  static T apply(T x, T y, T) {
    return wrapping_mul(x, y);
  }
};
struct MinOp {
  template <class T>
  static T apply(T x, T y, T) {
    return y < x ? y : x;
  }
};
struct MaxOp {
  template <class T>
  static T apply(T x, T y, T) {
    return x < y ? y : x;
  }
};
// Bitwise: instantiated for the integer types only (run_op).
struct BandOp {
  template <class T>
  static T apply(T x, T y, T) {
    return static_cast<T>(x & y);
  }
};
struct BorOp {
  template <class T>
  static T apply(T x, T y, T) {
    return static_cast<T>(x | y);
  }
};
struct BxorOp {
  template <class T>
  static T apply(T x, T y, T) {
    return static_cast<T>(x ^ y);
  }
};
struct SumDivideOp {
  template <class T>
  static T apply(T x, T y, T divisor) {
    return wrapping_add(x, y) / divisor;
  }
};

template <class Traits, class Op>
void reduce_out_of_place(typename Traits::Storage* __restrict dst,
                         const typename Traits::Storage* __restrict a,
                         const typename Traits::Storage* __restrict b, std::size_t count,
                         typename Traits::Acc divisor) {
  for (std::size_t i = 0; i < count; ++i) {
    dst[i] = Traits::store(Op::apply(Traits::load(a[i]), Traits::load(b[i]), divisor));
  }
}

template <class Traits, class Op>
void reduce_in_place(typename Traits::Storage* __restrict dst,
                     const typename Traits::Storage* __restrict b, std::size_t count,
                     typename Traits::Acc divisor) {
  for (std::size_t i = 0; i < count; ++i) {
    dst[i] = Traits::store(Op::apply(Traits::load(dst[i]), Traits::load(b[i]), divisor));
  }
}

// The same loops compiled for AVX2 (twice the lanes), used when the CPU has it.
#if defined(__x86_64__)
template <class Traits, class Op>
__attribute__((target("avx2"))) void reduce_out_of_place_avx2(
    typename Traits::Storage* __restrict dst, const typename Traits::Storage* __restrict a,
    const typename Traits::Storage* __restrict b, std::size_t count, typename Traits::Acc divisor) {
  for (std::size_t i = 0; i < count; ++i) {
    dst[i] = Traits::store(Op::apply(Traits::load(a[i]), Traits::load(b[i]), divisor));
  }
}

template <class Traits, class Op>
__attribute__((target("avx2"))) void reduce_in_place_avx2(
    typename Traits::Storage* __restrict dst, const typename Traits::Storage* __restrict b,
    std::size_t count, typename Traits::Acc divisor) {
  for (std::size_t i = 0; i < count; ++i) {
    dst[i] = Traits::store(Op::apply(Traits::load(dst[i]), Traits::load(b[i]), divisor));
  }
}

bool has_avx2() {
  static const bool supported = __builtin_cpu_supports("avx2");
  return supported;
}
#endif

template <class Traits, class Op>
void run(void* dst, const void* a, const void* b, std::size_t count, int divisor) {
  using S = typename Traits::Storage;
  using Acc = typename Traits::Acc;
  const Acc d = static_cast<Acc>(divisor);
#if defined(__x86_64__)
  if constexpr (std::is_same_v<Traits, Plain<Acc>>) {
    if (has_avx2()) {
      if (dst == a) {
        return reduce_in_place_avx2<Traits, Op>(static_cast<S*>(dst), static_cast<const S*>(b),
                                                count, d);
      }
      return reduce_out_of_place_avx2<Traits, Op>(static_cast<S*>(dst), static_cast<const S*>(a),
                                                  static_cast<const S*>(b), count, d);
    }
  }
#endif
  if (dst == a) {
    reduce_in_place<Traits, Op>(static_cast<S*>(dst), static_cast<const S*>(b), count, d);
  } else {
    reduce_out_of_place<Traits, Op>(static_cast<S*>(dst), static_cast<const S*>(a),
                                    static_cast<const S*>(b), count, d);
  }
}

// float16 and bfloat16 with AVX2 (+F16C): 8 lanes widened to float32, combined, and narrowed
// with the same rounding (nearest even) as the portable loops, which stay the fallback (checked
// at run time) and handle the tails.
#if defined(__x86_64__)
struct HalfAvx2 {
  using Scalar = Half;
  __attribute__((target("avx2,f16c"))) static __m256 load(const std::uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  __attribute__((target("avx2,f16c"))) static void store(std::uint16_t* p, __m256 v) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                     _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
};
struct BFloatAvx2 {
  using Scalar = BFloat;
  __attribute__((target("avx2,f16c"))) static __m256 load(const std::uint16_t* p) {
    const __m256i wide =
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
  __attribute__((target("avx2,f16c"))) static void store(std::uint16_t* p, __m256 v) {
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_srli_epi32(
        _mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7fff)), odd), 16);
    // NaN stays a quiet NaN (as float_to_bfloat16_inline).
    const __m256i magnitude = _mm256_and_si256(bits, _mm256_set1_epi32(0x7fffffff));
    const __m256i is_nan = _mm256_cmpgt_epi32(magnitude, _mm256_set1_epi32(0x7f800000));
    const __m256i nan = _mm256_or_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(0x40));
    const __m256i narrowed = _mm256_blendv_epi8(rounded, nan, is_nan);
    // Pack 8 x 32 -> 8 x 16 bits (packus works per 128-bit lane; gather the two halves).
    const __m256i packed =
        _mm256_permute4x64_epi64(_mm256_packus_epi32(narrowed, narrowed), 0b1000);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
  }
};

template <class Lanes, class Op>
__attribute__((target("avx2,f16c"))) void reduce_16bit_avx2(std::uint16_t* dst,
                                                            const std::uint16_t* a,
                                                            const std::uint16_t* b,
                                                            std::size_t count, float divisor) {
  std::size_t i = 0;
  const __m256 d = _mm256_set1_ps(divisor);
  for (; i + 8 <= count; i += 8) {
    const __m256 x = Lanes::load(a + i);
    const __m256 y = Lanes::load(b + i);
    __m256 r;
    if constexpr (std::is_same_v<Op, SumOp>) {
      r = _mm256_add_ps(x, y);
    } else if constexpr (std::is_same_v<Op, ProductOp>) {
      r = _mm256_mul_ps(x, y);
    } else if constexpr (std::is_same_v<Op, MinOp>) {
      r = _mm256_min_ps(y, x);  // y < x ? y : x, as MinOp
    } else if constexpr (std::is_same_v<Op, MaxOp>) {
      r = _mm256_max_ps(y, x);  // y > x ? y : x, as MaxOp
    } else {
      r = _mm256_div_ps(_mm256_add_ps(x, y), d);
    }
    Lanes::store(dst + i, r);  // dst may equal a: this block was loaded first
  }
  using S = typename Lanes::Scalar;
  for (; i < count; ++i)
    dst[i] = S::store(Op::apply(S::load(a[i]), S::load(b[i]), divisor));
}

bool has_avx2_f16c() {
  // F16C from CPUID leaf 1 (ECX bit 29): clang's __builtin_cpu_supports does not know "f16c".
  static const bool supported = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    return __builtin_cpu_supports("avx2") && __get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 &&
           (ecx & bit_F16C) != 0;
  }();
  return supported;
}
#endif

template <class Traits, class Op>
void run_16bit(void* dst, const void* a, const void* b, std::size_t count, int divisor) {
#if defined(__x86_64__)
  if (has_avx2_f16c()) {
    using Lanes = std::conditional_t<std::is_same_v<Traits, Half>, HalfAvx2, BFloatAvx2>;
    return reduce_16bit_avx2<Lanes, Op>(
        static_cast<std::uint16_t*>(dst), static_cast<const std::uint16_t*>(a),
        static_cast<const std::uint16_t*>(b), count, static_cast<float>(divisor));
  }
#endif
  run<Traits, Op>(dst, a, b, count, divisor);
}

template <class Traits>
void run_op_16bit(void* dst, const void* a, const void* b, std::size_t count, ReduceOp op,
                  int avg_divisor) {
  switch (op) {
    case ReduceOp::kSum:
      return run_16bit<Traits, SumOp>(dst, a, b, count, 1);
    case ReduceOp::kAvg:
      if (avg_divisor > 0) return run_16bit<Traits, SumDivideOp>(dst, a, b, count, avg_divisor);
      return run_16bit<Traits, SumOp>(dst, a, b, count, 1);
    case ReduceOp::kMin:
      return run_16bit<Traits, MinOp>(dst, a, b, count, 1);
    case ReduceOp::kMax:
      return run_16bit<Traits, MaxOp>(dst, a, b, count, 1);
    case ReduceOp::kProduct:
      return run_16bit<Traits, ProductOp>(dst, a, b, count, 1);
    case ReduceOp::kBand:
    case ReduceOp::kBor:
    case ReduceOp::kBxor:
      return;  // integers only: refused before any kernel runs (argument_checks.cc)
  }
}

template <class Traits>
void run_op(void* dst, const void* a, const void* b, std::size_t count, ReduceOp op,
            int avg_divisor) {
  switch (op) {
    case ReduceOp::kSum:
      return run<Traits, SumOp>(dst, a, b, count, 1);
    case ReduceOp::kAvg:
      if (avg_divisor > 0) return run<Traits, SumDivideOp>(dst, a, b, count, avg_divisor);
      return run<Traits, SumOp>(dst, a, b, count, 1);
    case ReduceOp::kMin:
      return run<Traits, MinOp>(dst, a, b, count, 1);
    case ReduceOp::kMax:
      return run<Traits, MaxOp>(dst, a, b, count, 1);
    case ReduceOp::kProduct:
      return run<Traits, ProductOp>(dst, a, b, count, 1);
    case ReduceOp::kBand:
    case ReduceOp::kBor:
    case ReduceOp::kBxor:
      // Integers only: a floating-point dtype is refused before any kernel runs
      // (argument_checks.cc).
      if constexpr (std::is_integral_v<typename Traits::Storage>) {
        if (op == ReduceOp::kBand) return run<Traits, BandOp>(dst, a, b, count, 1);
        if (op == ReduceOp::kBor) return run<Traits, BorOp>(dst, a, b, count, 1);
        return run<Traits, BxorOp>(dst, a, b, count, 1);
      }
      return;
  }
}

template <class Traits>
void divide_as(void* buf, std::size_t count, int divisor) {
  using S = typename Traits::Storage;
  using Acc = typename Traits::Acc;
  auto* __restrict p = static_cast<S*>(buf);
  const Acc d = static_cast<Acc>(divisor);
  for (std::size_t i = 0; i < count; ++i)
    p[i] = Traits::store(Traits::load(p[i]) / d);
}

}  // namespace

void reduce(void* dst, const void* a, const void* b, std::size_t count, DType dtype, ReduceOp op,
            int avg_divisor) {
  if (count == 0) return;
  switch (dtype) {
    case DType::kFloat32:
      return run_op<Plain<float>>(dst, a, b, count, op, avg_divisor);
    case DType::kFloat64:
      return run_op<Plain<double>>(dst, a, b, count, op, avg_divisor);
    case DType::kFloat16:
      return run_op_16bit<Half>(dst, a, b, count, op, avg_divisor);
    case DType::kBFloat16:
      return run_op_16bit<BFloat>(dst, a, b, count, op, avg_divisor);
    case DType::kInt8:
      return run_op<Plain<std::int8_t>>(dst, a, b, count, op, avg_divisor);
    case DType::kUInt8:
      return run_op<Plain<std::uint8_t>>(dst, a, b, count, op, avg_divisor);
    case DType::kInt32:
      return run_op<Plain<std::int32_t>>(dst, a, b, count, op, avg_divisor);
    case DType::kInt64:
      return run_op<Plain<std::int64_t>>(dst, a, b, count, op, avg_divisor);
  }
}

void divide(void* buf, std::size_t count, DType dtype, int divisor) {
  if (count == 0 || divisor == 1) return;
  switch (dtype) {
    case DType::kFloat32:
      return divide_as<Plain<float>>(buf, count, divisor);
    case DType::kFloat64:
      return divide_as<Plain<double>>(buf, count, divisor);
    case DType::kFloat16:
      return divide_as<Half>(buf, count, divisor);
    case DType::kBFloat16:
      return divide_as<BFloat>(buf, count, divisor);
    case DType::kInt8:
      return divide_as<Plain<std::int8_t>>(buf, count, divisor);
    case DType::kUInt8:
      return divide_as<Plain<std::uint8_t>>(buf, count, divisor);
    case DType::kInt32:
      return divide_as<Plain<std::int32_t>>(buf, count, divisor);
    case DType::kInt64:
      return divide_as<Plain<std::int64_t>>(buf, count, divisor);
  }
}

float half_to_float(std::uint16_t h) {
  return half_to_float_inline(h);
}
std::uint16_t float_to_half(float f) {
  return float_to_half_inline(f);
}
float bfloat16_to_float(std::uint16_t h) {
  return bfloat16_to_float_inline(h);
}
std::uint16_t float_to_bfloat16(float f) {
  return float_to_bfloat16_inline(f);
}

}  // namespace ddp::comm
