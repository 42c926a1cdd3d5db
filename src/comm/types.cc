#include "ddp/comm/types.h"

#include <stdexcept>
#include <string>

namespace ddp {

void throw_unknown_dtype(DType dtype) {
  throw std::invalid_argument("unknown DType " + std::to_string(static_cast<int>(dtype)));
}

std::string_view to_string(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return "float32";
    case DType::kFloat64:
      return "float64";
    case DType::kFloat16:
      return "float16";
    case DType::kBFloat16:
      return "bfloat16";
    case DType::kInt8:
      return "int8";
    case DType::kUInt8:
      return "uint8";
    case DType::kInt32:
      return "int32";
    case DType::kInt64:
      return "int64";
  }
  throw std::invalid_argument("unknown DType " + std::to_string(static_cast<int>(dtype)));
}

std::string_view to_string(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return "sum";
    case ReduceOp::kAvg:
      return "avg";
    case ReduceOp::kMin:
      return "min";
    case ReduceOp::kMax:
      return "max";
    case ReduceOp::kProduct:
      return "product";
    case ReduceOp::kBand:
      return "band";
    case ReduceOp::kBor:
      return "bor";
    case ReduceOp::kBxor:
      return "bxor";
  }
  throw std::invalid_argument("unknown ReduceOp " + std::to_string(static_cast<int>(op)));
}

std::string_view to_string(Collective kind) {
  switch (kind) {
    case Collective::kAllreduce:
      return "allreduce";
    case Collective::kBroadcast:
      return "broadcast";
    case Collective::kReduce:
      return "reduce";
    case Collective::kAllgather:
      return "allgather";
    case Collective::kGather:
      return "gather";
    case Collective::kScatter:
      return "scatter";
    case Collective::kReduceScatter:
      return "reduce_scatter";
    case Collective::kAlltoall:
      return "alltoall";
    case Collective::kBarrier:
      return "barrier";
    case Collective::kSend:
      return "send";
  }
  return "unknown-op";
}

}  // namespace ddp
