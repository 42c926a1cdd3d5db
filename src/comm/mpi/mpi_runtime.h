// The process-wide MPI state of the mpi backend (internal): initialisation and finalisation, the
// thread-level contract, and the MPI datatypes and operations of each DType and ReduceOp.
//
// MpiRuntime::instance() initialises MPI on first use (MPI_Init_thread asking for
// MPI_THREAD_MULTIPLE) unless the program already did, and then finalises it at process exit.
// Any thread may call it; it throws ConfigError when MPI was finalised already or was initialised
// by the program with less than MPI_THREAD_SERIALIZED. Every MPI call of the backend holds lock():
// a no-op under MPI_THREAD_MULTIPLE, one process-wide mutex under MPI_THREAD_SERIALIZED.
#pragma once

// The C API only: OpenMPI's (deprecated) C++ bindings would need libmpi_cxx at link time.
#ifndef OMPI_SKIP_MPICXX
#define OMPI_SKIP_MPICXX 1
#endif
#ifndef MPICH_SKIP_MPICXX
#define MPICH_SKIP_MPICXX 1
#endif
#include <mpi.h>

#include <mutex>
#include <string>

#include "ddp/types.h"

namespace ddp::comm::mpi {

class MpiRuntime {
 public:
  static MpiRuntime& instance();

  // Hold while calling MPI (see the top of this file).
  std::unique_lock<std::mutex> lock();

  MPI_Datatype datatype(DType dtype) const;
  // kAvg maps to the sum: the caller divides afterwards.
  MPI_Op reduce_op(DType dtype, ReduceOp op) const;
  // The largest tag MPI accepts (MPI_TAG_UB, at least 32767).
  int max_tag() const { return max_tag_; }
  int thread_level() const { return thread_level_; }

 private:
  MpiRuntime();

  bool serialize_ = false;
  int thread_level_ = MPI_THREAD_SINGLE;
  int max_tag_ = 32767;
  std::mutex mutex_;
  MPI_Datatype half_ = MPI_DATATYPE_NULL;
  MPI_Datatype bfloat16_ = MPI_DATATYPE_NULL;
  // User operations for float16/bfloat16, indexed by [sum, min, max, product].
  MPI_Op half_ops_[4] = {MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL};
  MPI_Op bfloat16_ops_[4] = {MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL};
};

// The text of an MPI error code ("MPI_ERR_TRUNCATE: message truncated").
std::string mpi_error_text(int code);

}  // namespace ddp::comm::mpi
