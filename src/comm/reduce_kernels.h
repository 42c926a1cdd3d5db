// Reduction kernels: element-wise dst = a op b over raw buffers, for every DType and ReduceOp.
//
// Type-erased on purpose (one function, a switch to a template instance), so that algorithms stay
// free of templates. The instances are simple loops over __restrict pointers compiled with -O3,
// which GCC vectorises; bench/micro/reduce_kernels_bench.cc measures them. float16 and bfloat16 are
// widened to float32, combined, and rounded back to nearest even, one rounding per call.
// Pure functions: any thread; they do not throw (dtype/op are validated by the callers; a bitwise
// op on a floating-point dtype leaves dst untouched).
#pragma once

#include <cstddef>
#include <cstdint>

#include "ddp/comm/types.h"

namespace ddp::comm {

// dst[i] = a[i] op b[i] for i < count. `dst` may be exactly `a` (in place); `b` must not overlap
// `dst`. For ReduceOp::kAvg the elements are summed; when `avg_divisor` > 0 the sum is then
// divided by it (the last step of an average: floats divide in the accumulation type, integers
// truncate toward zero).
void reduce(void* dst, const void* a, const void* b, std::size_t count, DType dtype, ReduceOp op,
            int avg_divisor = 0);

// buf[i] /= divisor (an average over a group of one rank is a no-op, but kept general).
void divide(void* buf, std::size_t count, DType dtype, int divisor);

// Conversions used by the kernels (exposed for tests): round to nearest even, NaN stays NaN.
float half_to_float(std::uint16_t h);
std::uint16_t float_to_half(float f);
float bfloat16_to_float(std::uint16_t h);
std::uint16_t float_to_bfloat16(float f);

}  // namespace ddp::comm
