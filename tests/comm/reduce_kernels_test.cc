// Reduction kernels against a scalar reference: every dtype x op, in place and out of place,
// lengths that exercise the vector loops' tails, and the float16/bfloat16 rounding.
#include "comm/reduce_kernels.h"

#include <gtest/gtest.h>
#ifndef __FLT16_MAX__
#include <immintrin.h>
#endif

#include <bit>
#include <cmath>
#include <cstring>
#include <random>
#include <tuple>
#include <type_traits>
#include <vector>
#include "support/unity_namespace.h"

namespace ddp::comm {
namespace {
namespace DDP_UNITY_ID {

const DType kAllDTypes[] = {DType::kFloat32, DType::kFloat64, DType::kFloat16, DType::kBFloat16,
                            DType::kInt8,    DType::kUInt8,   DType::kInt32,   DType::kInt64};
const ReduceOp kAllOps[] = {ReduceOp::kSum,     ReduceOp::kAvg,  ReduceOp::kMin, ReduceOp::kMax,
                            ReduceOp::kProduct, ReduceOp::kBand, ReduceOp::kBor, ReduceOp::kBxor};

// Reference bfloat16 rounding, written the slow obvious way: keep the upper 16 bits, and round up
// when the dropped part is more than half, or exactly half and the kept part is odd.
std::uint16_t reference_bfloat16(float f) {
  const std::uint32_t bits = std::bit_cast<std::uint32_t>(f);
  if (std::isnan(f)) return static_cast<std::uint16_t>((bits >> 16) | 0x40);
  std::uint32_t upper = bits >> 16;
  const std::uint32_t lower = bits & 0xffff;
  if (lower > 0x8000 || (lower == 0x8000 && (upper & 1))) ++upper;
  return static_cast<std::uint16_t>(upper);
}

// Reference float16 conversions, by the compiler's IEEE half type where it has one (GCC), else
// by the CPU's F16C instructions (clang before 15 has no _Float16 on x86; the sanitizer stages
// build with clang): both round to nearest even, and neither is the library's code.
#ifdef __FLT16_MAX__
std::uint16_t reference_half(float f) {
  return std::bit_cast<std::uint16_t>(static_cast<_Float16>(f));
}
float reference_half_to_float(std::uint16_t h) {
  return static_cast<float>(std::bit_cast<_Float16>(h));
}
#else
__attribute__((target("f16c"))) std::uint16_t reference_half(float f) {
  return static_cast<std::uint16_t>(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT));
}
__attribute__((target("f16c"))) float reference_half_to_float(std::uint16_t h) {
  return _cvtsh_ss(h);
}
#endif

TEST(Float16, EveryHalfConvertsToFloatExactlyAndBack) {
  for (std::uint32_t h = 0; h < 65536; ++h) {
    const auto half = static_cast<std::uint16_t>(h);
    const float expected = reference_half_to_float(half);
    const float got = half_to_float(half);
    if (std::isnan(expected)) {
      EXPECT_TRUE(std::isnan(got)) << std::hex << h;
      continue;
    }
    ASSERT_EQ(std::bit_cast<std::uint32_t>(got), std::bit_cast<std::uint32_t>(expected))
        << std::hex << h;
    ASSERT_EQ(float_to_half(got), half) << std::hex << h;
  }
}

TEST(Float16, FloatToHalfRoundsToNearestEven) {
  std::mt19937 rng(1);
  std::uniform_int_distribution<std::uint32_t> bits;
  for (int i = 0; i < 2'000'000; ++i) {
    const float f = std::bit_cast<float>(bits(rng));
    if (std::isnan(f)) continue;
    ASSERT_EQ(float_to_half(f), reference_half(f)) << f;
  }
  // Halfway cases: 1 + 2^-11 is exactly between 1 and the next half; ties go to even (1.0).
  EXPECT_EQ(float_to_half(1.0f + 0x1p-11f), 0x3c00);
  EXPECT_EQ(float_to_half(1.0f + 3 * 0x1p-11f), 0x3c02);
  EXPECT_EQ(float_to_half(65520.0f), 0x7c00);  // rounds to infinity
  EXPECT_EQ(float_to_half(0x1p-25f), 0x0000);  // tie between 0 and the smallest subnormal
  EXPECT_EQ(float_to_half(0x1p-24f), 0x0001);
}

TEST(BFloat16, RoundsToNearestEven) {
  std::mt19937 rng(2);
  std::uniform_int_distribution<std::uint32_t> bits;
  for (int i = 0; i < 2'000'000; ++i) {
    const float f = std::bit_cast<float>(bits(rng));
    if (std::isnan(f)) continue;
    ASSERT_EQ(float_to_bfloat16(f), reference_bfloat16(f)) << f;
    ASSERT_EQ(std::bit_cast<std::uint32_t>(bfloat16_to_float(reference_bfloat16(f))),
              static_cast<std::uint32_t>(reference_bfloat16(f)) << 16);
  }
  EXPECT_EQ(float_to_bfloat16(std::bit_cast<float>(0x3f808000u)), 0x3f80);  // tie, even stays
  EXPECT_EQ(float_to_bfloat16(std::bit_cast<float>(0x3f818000u)), 0x3f82);  // tie, odd rounds up
  EXPECT_TRUE(std::isnan(bfloat16_to_float(float_to_bfloat16(NAN))));
}

// Scalar reference over doubles/int64 with the documented semantics.
template <class T>
T combine(T x, T y, ReduceOp op, int divisor) {
  switch (op) {
    case ReduceOp::kSum:
      return x + y;
    case ReduceOp::kAvg:
      return divisor > 0 ? (x + y) / static_cast<T>(divisor) : x + y;
    case ReduceOp::kMin:
      return std::min(x, y);
    case ReduceOp::kMax:
      return std::max(x, y);
    case ReduceOp::kProduct:
      return x * y;
    case ReduceOp::kBand:
    case ReduceOp::kBor:
    case ReduceOp::kBxor:
      if constexpr (std::is_integral_v<T> || std::is_same_v<T, __int128>) {
        if (op == ReduceOp::kBand) return x & y;
        if (op == ReduceOp::kBor) return x | y;
        return x ^ y;
      }
      return x;  // never asked: bitwise ops take integer dtypes only
  }
  return x;
}

// Random operands, small enough that integer results stay in range, and floats that are not
// all integers (so that rounding is exercised).
struct Operands {
  std::vector<std::byte> a, b;
};

Operands make_operands(DType dtype, std::size_t count, std::mt19937& rng) {
  const std::size_t esz = dtype_size(dtype);
  Operands o{std::vector<std::byte>(count * esz), std::vector<std::byte>(count * esz)};
  std::uniform_real_distribution<float> real(-8.0f, 8.0f);
  std::uniform_int_distribution<int> small(-9, 9);
  std::uniform_int_distribution<int> positive(0, 15);
  for (auto* buf : {&o.a, &o.b}) {
    for (std::size_t i = 0; i < count; ++i) {
      std::byte* p = buf->data() + i * esz;
      switch (dtype) {
        case DType::kFloat32: {
          const float v = real(rng);
          std::memcpy(p, &v, 4);
          break;
        }
        case DType::kFloat64: {
          const double v = static_cast<double>(real(rng)) / 3.0;
          std::memcpy(p, &v, 8);
          break;
        }
        case DType::kFloat16: {
          const std::uint16_t v = reference_half(real(rng));
          std::memcpy(p, &v, 2);
          break;
        }
        case DType::kBFloat16: {
          const std::uint16_t v = reference_bfloat16(real(rng));
          std::memcpy(p, &v, 2);
          break;
        }
        case DType::kInt8: {
          const auto v = static_cast<std::int8_t>(small(rng));
          std::memcpy(p, &v, 1);
          break;
        }
        case DType::kUInt8: {
          const auto v = static_cast<std::uint8_t>(positive(rng));
          std::memcpy(p, &v, 1);
          break;
        }
        case DType::kInt32: {
          const std::int32_t v = small(rng) * 1000;
          std::memcpy(p, &v, 4);
          break;
        }
        case DType::kInt64: {
          const std::int64_t v = static_cast<std::int64_t>(small(rng)) * 100'000'000'000LL;
          std::memcpy(p, &v, 8);
          break;
        }
      }
    }
  }
  return o;
}

// The expected element i of a op b, as the bytes the kernel must produce.
void expected_element(DType dtype, const std::byte* a, const std::byte* b, std::byte* out,
                      ReduceOp op, int divisor) {
  switch (dtype) {
    case DType::kFloat32: {
      float x, y;
      std::memcpy(&x, a, 4);
      std::memcpy(&y, b, 4);
      const float r = combine<float>(x, y, op, divisor);
      std::memcpy(out, &r, 4);
      return;
    }
    case DType::kFloat64: {
      double x, y;
      std::memcpy(&x, a, 8);
      std::memcpy(&y, b, 8);
      const double r = combine<double>(x, y, op, divisor);
      std::memcpy(out, &r, 8);
      return;
    }
    case DType::kFloat16:
    case DType::kBFloat16: {
      std::uint16_t x, y;
      std::memcpy(&x, a, 2);
      std::memcpy(&y, b, 2);
      const bool half = dtype == DType::kFloat16;
      const float fx = half ? reference_half_to_float(x)
                            : std::bit_cast<float>(static_cast<std::uint32_t>(x) << 16);
      const float fy = half ? reference_half_to_float(y)
                            : std::bit_cast<float>(static_cast<std::uint32_t>(y) << 16);
      const float r = combine<float>(fx, fy, op, divisor);
      const std::uint16_t stored = half ? reference_half(r) : reference_bfloat16(r);
      std::memcpy(out, &stored, 2);
      return;
    }
    case DType::kInt8: {
      std::int8_t x, y;
      std::memcpy(&x, a, 1);
      std::memcpy(&y, b, 1);
      const auto r = static_cast<std::int8_t>(combine<int>(x, y, op, divisor));
      std::memcpy(out, &r, 1);
      return;
    }
    case DType::kUInt8: {
      std::uint8_t x, y;
      std::memcpy(&x, a, 1);
      std::memcpy(&y, b, 1);
      const auto r = static_cast<std::uint8_t>(combine<int>(x, y, op, divisor));
      std::memcpy(out, &r, 1);
      return;
    }
    case DType::kInt32: {
      std::int32_t x, y;
      std::memcpy(&x, a, 4);
      std::memcpy(&y, b, 4);
      const auto r = static_cast<std::int32_t>(combine<std::int64_t>(x, y, op, divisor));
      std::memcpy(out, &r, 4);
      return;
    }
    case DType::kInt64: {
      std::int64_t x, y;
      std::memcpy(&x, a, 8);
      std::memcpy(&y, b, 8);
      const auto r = static_cast<std::int64_t>(
          combine<__int128>(x, y, op, divisor));  // no overflow in the reference itself
      std::memcpy(out, &r, 8);
      return;
    }
  }
}

class KernelTest : public ::testing::TestWithParam<std::tuple<DType, ReduceOp>> {};

TEST_P(KernelTest, MatchesScalarReferenceInAndOutOfPlace) {
  const auto [dtype, op] = GetParam();
  const std::size_t esz = dtype_size(dtype);
  std::mt19937 rng(static_cast<unsigned>(dtype) * 31 + static_cast<unsigned>(op));
  for (std::size_t count : {0u, 1u, 7u, 16u, 33u, 1000u, 4099u}) {
    for (int divisor : {0, 3}) {
      const Operands o = make_operands(dtype, count, rng);
      std::vector<std::byte> expected(count * esz);
      for (std::size_t i = 0; i < count; ++i) {
        expected_element(dtype, o.a.data() + i * esz, o.b.data() + i * esz,
                         expected.data() + i * esz, op, divisor);
      }
      std::vector<std::byte> out(count * esz + 1, std::byte{0x5a});  // +1: detects overruns
      reduce(out.data(), o.a.data(), o.b.data(), count, dtype, op, divisor);
      // count 0: expected.data() may be null, and memcmp with a null pointer is UB even for 0.
      EXPECT_EQ(count == 0 ? 0 : std::memcmp(out.data(), expected.data(), count * esz), 0)
          << to_string(dtype) << " " << to_string(op) << " count " << count;
      EXPECT_EQ(out[count * esz], std::byte{0x5a}) << "wrote past the end";
      std::vector<std::byte> in_place = o.a;
      reduce(in_place.data(), in_place.data(), o.b.data(), count, dtype, op, divisor);
      EXPECT_EQ(in_place, expected)
          << "in place: " << to_string(dtype) << " " << to_string(op) << " count " << count;
    }
  }
}

// Every dtype with every op it can be reduced with (the bitwise ops take integers only).
std::vector<std::tuple<DType, ReduceOp>> valid_combinations() {
  std::vector<std::tuple<DType, ReduceOp>> result;
  for (DType dtype : kAllDTypes) {
    for (ReduceOp op : kAllOps) {
      if (!is_bitwise(op) || is_integer(dtype)) result.emplace_back(dtype, op);
    }
  }
  return result;
}

INSTANTIATE_TEST_SUITE_P(AllTypesAndOps, KernelTest, ::testing::ValuesIn(valid_combinations()),
                         [](const auto& info) {
                           return std::string(to_string(std::get<0>(info.param))) + "_" +
                                  std::string(to_string(std::get<1>(info.param)));
                         });

TEST(Kernels, IntegerSumsWrapAndAverageTruncates) {
  const std::int32_t a[2] = {INT32_MAX, -7};
  const std::int32_t b[2] = {1, 0};
  std::int32_t out[2];
  reduce(out, a, b, 2, DType::kInt32, ReduceOp::kSum);
  EXPECT_EQ(out[0], INT32_MIN);
  const std::int32_t c[1] = {-7};
  const std::int32_t d[1] = {0};
  reduce(out, c, d, 1, DType::kInt32, ReduceOp::kAvg, 2);
  EXPECT_EQ(out[0], -3);  // truncation toward zero
}

TEST(Kernels, DivideHandlesEveryType) {
  for (DType dtype : kAllDTypes) {
    std::mt19937 rng(7);
    const Operands o = make_operands(dtype, 100, rng);
    std::vector<std::byte> zero(o.a.size());
    // a / 2 computed as (a + 0) / 2 by the reference.
    std::vector<std::byte> expected(o.a.size());
    const std::size_t esz = dtype_size(dtype);
    for (std::size_t i = 0; i < 100; ++i) {
      expected_element(dtype, o.a.data() + i * esz, zero.data() + i * esz,
                       expected.data() + i * esz, ReduceOp::kAvg, 2);
    }
    std::vector<std::byte> buf = o.a;
    divide(buf.data(), 100, dtype, 2);
    EXPECT_EQ(buf, expected) << to_string(dtype);
  }
}

}  // namespace DDP_UNITY_ID
}  // namespace
}  // namespace ddp::comm
