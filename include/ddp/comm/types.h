// Element types, reduction operations and the kinds of collectives.
//
// A collective moves raw buffers described by (pointer, element count, DType); reductions combine
// elements with a ReduceOp. These are plain values: any thread may use them. Nothing here throws
// except to_string/dtype_size on a value outside the enum (std::invalid_argument).
//
//   ddp::dtype_size(ddp::DType::kBFloat16)   // 2
//   ddp::to_string(ddp::ReduceOp::kAvg)       // "avg"
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

// Exported by ddp's shared libraries, which hide the rest (src/CMakeLists.txt).
#pragma GCC visibility push(default)
namespace ddp {

enum class DType : std::uint8_t {
  kFloat32,   // IEEE binary32
  kFloat64,   // IEEE binary64
  kFloat16,   // IEEE binary16; reduced in float32, rounded back to nearest even
  kBFloat16,  // bfloat16; reduced in float32, rounded back to nearest even
  kInt8,      // two's complement; sums and products wrap
  kUInt8,     // sums and products wrap
  kInt32,     // two's complement; sums and products wrap
  kInt64,     // two's complement; sums and products wrap
};

enum class ReduceOp : std::uint8_t {
  kSum,
  kAvg,  // sum over ranks, then divided once by the group size (integers: truncating division)
  kMin,
  kMax,
  kProduct,
  // Bitwise, integer dtypes only (a floating-point dtype is a ConfigError on every rank). The
  // nccl backend has no bitwise reductions (NCCL has none) and refuses them.
  kBand,
  kBor,
  kBxor,
};

// Whether `op` is one of the bitwise reductions (kBand, kBor, kBxor).
constexpr bool is_bitwise(ReduceOp op) {
  return op == ReduceOp::kBand || op == ReduceOp::kBor || op == ReduceOp::kBxor;
}
// Whether `dtype` is an integer type (what the bitwise reductions accept).
constexpr bool is_integer(DType dtype) {
  return dtype == DType::kInt8 || dtype == DType::kUInt8 || dtype == DType::kInt32 ||
         dtype == DType::kInt64;
}

// Throws std::invalid_argument naming a DType value outside the enum.
[[noreturn]] void throw_unknown_dtype(DType dtype);

// Bytes per element. Inline: it is on the path of every call.
inline std::size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
    case DType::kInt32:
      return 4;
    case DType::kFloat64:
    case DType::kInt64:
      return 8;
    case DType::kFloat16:
    case DType::kBFloat16:
      return 2;
    case DType::kInt8:
    case DType::kUInt8:
      return 1;
  }
  throw_unknown_dtype(dtype);
}
// "float32", "bfloat16", "int64", ...
std::string_view to_string(DType dtype);
// "sum", "avg", "min", "max", "product".
std::string_view to_string(ReduceOp op);

// The operations of a ProcessGroup, for messages, benchmarks and traces. The values are part of
// the ring backend's wire format (the kind of each message header): append, never reorder.
enum class Collective : std::uint8_t {
  kAllreduce,
  kBroadcast,
  kReduce,
  kAllgather,
  kGather,
  kScatter,
  kReduceScatter,
  kAlltoall,
  kBarrier,
  kSend,  // point to point (a send, or the matching recv)
};

// "allreduce", "reduce_scatter", ..., "send".
std::string_view to_string(Collective collective);

}  // namespace ddp
#pragma GCC visibility pop
