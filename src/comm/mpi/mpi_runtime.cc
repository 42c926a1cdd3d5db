#include "comm/mpi/mpi_runtime.h"

#include <cstdlib>

#include <fmt/format.h>

#include "comm/reduce_kernels.h"
#include "ddp/error.h"

namespace ddp::comm::mpi {
namespace {

// MPI has no float16/bfloat16 in OpenMPI 4.1: they travel as 2-byte opaque elements and reduce
// through these, which widen to float32 and round back to nearest even (the engine's kernels).
// MPI asks for inoutvec = invec op inoutvec; every ReduceOp here is commutative.
template <DType kDType, ReduceOp kOp>
void reduce_16bit(void* invec, void* inoutvec, int* len, MPI_Datatype*) {
  comm::reduce(inoutvec, inoutvec, invec, static_cast<std::size_t>(*len), kDType, kOp);
}

int op_index(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg:
      return 0;
    case ReduceOp::kMin:
      return 1;
    case ReduceOp::kMax:
      return 2;
    case ReduceOp::kProduct:
      return 3;
  }
  return 0;
}

void finalize_at_exit() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Finalize();
}

void check(int rc, const char* what) {
  if (rc != MPI_SUCCESS) {
    throw ConfigError(fmt::format("mpi backend: {} failed: {}", what, mpi_error_text(rc)));
  }
}

}  // namespace

std::string mpi_error_text(int code) {
  char text[MPI_MAX_ERROR_STRING] = {};
  int length = 0;
  if (MPI_Error_string(code, text, &length) != MPI_SUCCESS) {
    return fmt::format("MPI error code {}", code);
  }
  return fmt::format("{} (MPI error code {})", std::string(text, static_cast<std::size_t>(length)),
                     code);
}

MpiRuntime& MpiRuntime::instance() {
  // Never destroyed: groups may outlive static destructors, and MPI_Finalize runs from atexit.
  static MpiRuntime* runtime = new MpiRuntime();
  return *runtime;
}

MpiRuntime::MpiRuntime() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) {
    throw ConfigError(
        "mpi backend: MPI was already finalised in this process; create the group "
        "before MPI_Finalize");
  }
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (initialized) {
    MPI_Query_thread(&thread_level_);
    if (thread_level_ < MPI_THREAD_SERIALIZED) {
      throw ConfigError(fmt::format(
          "mpi backend: the program initialised MPI with thread level {} but ddp calls MPI from "
          "its worker threads; initialise it with MPI_Init_thread(..., MPI_THREAD_MULTIPLE, ...) "
          "(or MPI_THREAD_SERIALIZED), or let ddp initialise it",
          thread_level_));
    }
  } else {
    check(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &thread_level_),
          "MPI_Init_thread");
    // We initialised it, so we finalise it; registered after MPI_Init so that it runs first.
    std::atexit(finalize_at_exit);
    if (thread_level_ < MPI_THREAD_SERIALIZED) {
      throw ConfigError(fmt::format(
          "mpi backend: this MPI library offers thread level {} only; ddp needs "
          "MPI_THREAD_SERIALIZED or MPI_THREAD_MULTIPLE (rebuild MPI with thread support)",
          thread_level_));
    }
  }
  serialize_ = thread_level_ < MPI_THREAD_MULTIPLE;

  void* tag_ub = nullptr;
  int found = 0;
  if (MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &tag_ub, &found) == MPI_SUCCESS && found) {
    max_tag_ = *static_cast<int*>(tag_ub);
  }

  check(MPI_Type_contiguous(2, MPI_BYTE, &half_), "MPI_Type_contiguous (float16)");
  check(MPI_Type_commit(&half_), "MPI_Type_commit (float16)");
  check(MPI_Type_contiguous(2, MPI_BYTE, &bfloat16_), "MPI_Type_contiguous (bfloat16)");
  check(MPI_Type_commit(&bfloat16_), "MPI_Type_commit (bfloat16)");
  constexpr int kCommutes = 1;
  check(MPI_Op_create(reduce_16bit<DType::kFloat16, ReduceOp::kSum>, kCommutes, &half_ops_[0]),
        "MPI_Op_create");
  check(MPI_Op_create(reduce_16bit<DType::kFloat16, ReduceOp::kMin>, kCommutes, &half_ops_[1]),
        "MPI_Op_create");
  check(MPI_Op_create(reduce_16bit<DType::kFloat16, ReduceOp::kMax>, kCommutes, &half_ops_[2]),
        "MPI_Op_create");
  check(MPI_Op_create(reduce_16bit<DType::kFloat16, ReduceOp::kProduct>, kCommutes, &half_ops_[3]),
        "MPI_Op_create");
  check(MPI_Op_create(reduce_16bit<DType::kBFloat16, ReduceOp::kSum>, kCommutes, &bfloat16_ops_[0]),
        "MPI_Op_create");
  check(MPI_Op_create(reduce_16bit<DType::kBFloat16, ReduceOp::kMin>, kCommutes, &bfloat16_ops_[1]),
        "MPI_Op_create");
  check(MPI_Op_create(reduce_16bit<DType::kBFloat16, ReduceOp::kMax>, kCommutes, &bfloat16_ops_[2]),
        "MPI_Op_create");
  check(MPI_Op_create(reduce_16bit<DType::kBFloat16, ReduceOp::kProduct>, kCommutes,
                      &bfloat16_ops_[3]),
        "MPI_Op_create");
}

std::unique_lock<std::mutex> MpiRuntime::lock() {
  return serialize_ ? std::unique_lock<std::mutex>(mutex_) : std::unique_lock<std::mutex>();
}

MPI_Datatype MpiRuntime::datatype(DType dtype) const {
  switch (dtype) {
    case DType::kFloat32:
      return MPI_FLOAT;
    case DType::kFloat64:
      return MPI_DOUBLE;
    case DType::kFloat16:
      return half_;
    case DType::kBFloat16:
      return bfloat16_;
    case DType::kInt8:
      return MPI_INT8_T;
    case DType::kUInt8:
      return MPI_UINT8_T;
    case DType::kInt32:
      return MPI_INT32_T;
    case DType::kInt64:
      return MPI_INT64_T;
  }
  return MPI_DATATYPE_NULL;
}

MPI_Op MpiRuntime::reduce_op(DType dtype, ReduceOp op) const {
  if (dtype == DType::kFloat16) return half_ops_[op_index(op)];
  if (dtype == DType::kBFloat16) return bfloat16_ops_[op_index(op)];
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg:
      return MPI_SUM;
    case ReduceOp::kMin:
      return MPI_MIN;
    case ReduceOp::kMax:
      return MPI_MAX;
    case ReduceOp::kProduct:
      return MPI_PROD;
  }
  return MPI_OP_NULL;
}

}  // namespace ddp::comm::mpi
