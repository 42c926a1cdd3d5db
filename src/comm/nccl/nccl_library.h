// NcclLibrary: libnccl and the CUDA runtime, loaded with dlopen into a table of functions
// (internal).
//
// Why dlopen: libddp must not depend on libnccl or libcudart at link time, so that a CPU-only
// user never needs them, and a process that already loaded them (PyTorch loads its wheel's
// libnccl.so.2 and libcudart) gets that copy back from dlopen by soname: one NCCL per process.
//
// Search: NCCL from `library` when non-empty (a path; DDP_NCCL_LIBRARY), else libnccl.so.2 by the
// loader's rules, then in the folders beside the headers this build used (DDP_NCCL_FALLBACK_DIRS).
// The CUDA runtime: libcudart.so.13, .12, then libcudart.so, the same way.
//
// load() is thread-safe; the first successful load is kept for the life of the process (never
// dlclosed: NCCL's threads may outlive any group), and a later `library` is then ignored. A failed
// load is not remembered, so the next call tries again. Errors are ConfigError naming what is
// missing (the library and the loader's reason, or the function) and what to do.
#pragma once

#include <string>
#include <string_view>

#include "comm/nccl/nccl_headers.h"

namespace ddp::comm::nccl {

struct NcclLibrary {
  // Where they came from, for messages.
  std::string nccl_path;
  std::string cudart_path;
  int nccl_version = 0;  // ncclGetVersion: 23007 for 2.30.7

  // libnccl
  ncclResult_t (*GetVersion)(int*);
  ncclResult_t (*GetUniqueId)(ncclUniqueId*);
  ncclResult_t (*CommInitRankConfig)(ncclComm_t*, int, ncclUniqueId, int, ncclConfig_t*);
  ncclResult_t (*CommSplit)(ncclComm_t, int, int, ncclComm_t*, ncclConfig_t*);
  ncclResult_t (*CommAbort)(ncclComm_t);
  ncclResult_t (*CommFinalize)(ncclComm_t);
  ncclResult_t (*CommDestroy)(ncclComm_t);
  ncclResult_t (*CommGetAsyncError)(ncclComm_t, ncclResult_t*);
  const char* (*GetErrorString)(ncclResult_t);
  const char* (*GetLastError)(ncclComm_t);
  ncclResult_t (*GroupStart)();
  ncclResult_t (*GroupEnd)();
  ncclResult_t (*AllReduce)(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t,
                            cudaStream_t);
  ncclResult_t (*Broadcast)(const void*, void*, size_t, ncclDataType_t, int, ncclComm_t,
                            cudaStream_t);
  ncclResult_t (*Reduce)(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t, int, ncclComm_t,
                         cudaStream_t);
  ncclResult_t (*AllGather)(const void*, void*, size_t, ncclDataType_t, ncclComm_t, cudaStream_t);
  ncclResult_t (*ReduceScatter)(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t,
                                cudaStream_t);
  ncclResult_t (*Send)(const void*, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t);
  ncclResult_t (*Recv)(void*, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t);

  // libcudart
  cudaError_t (*GetDeviceCount)(int*);
  cudaError_t (*GetDevice)(int*);
  cudaError_t (*SetDevice)(int);
  const char* (*GetErrorName)(cudaError_t);
  const char* (*GetErrorStringCuda)(cudaError_t);
  cudaError_t (*StreamCreateWithFlags)(cudaStream_t*, unsigned int);
  cudaError_t (*StreamDestroy)(cudaStream_t);
  cudaError_t (*StreamWaitEvent)(cudaStream_t, cudaEvent_t, unsigned int);
  cudaError_t (*EventCreateWithFlags)(cudaEvent_t*, unsigned int);
  cudaError_t (*EventDestroy)(cudaEvent_t);
  cudaError_t (*EventRecord)(cudaEvent_t, cudaStream_t);
  cudaError_t (*EventQuery)(cudaEvent_t);
  cudaError_t (*Malloc)(void**, size_t);
  cudaError_t (*Free)(void*);
  cudaError_t (*MallocHost)(void**, size_t);
  cudaError_t (*FreeHost)(void*);
  cudaError_t (*MemcpyAsync)(void*, const void*, size_t, cudaMemcpyKind, cudaStream_t);
  cudaError_t (*Memcpy)(void*, const void*, size_t, cudaMemcpyKind);
  cudaError_t (*MemsetAsync)(void*, int, size_t, cudaStream_t);
  cudaError_t (*StreamSynchronize)(cudaStream_t);
  cudaError_t (*DeviceSynchronize)();
  cudaError_t (*PointerGetAttributes)(cudaPointerAttributes*, const void*);
  cudaError_t (*GetLastErrorCuda)();

  // Loads both libraries (or returns the table loaded before). `library`: see the file comment.
  // (A string_view: a string literal makes no temporary for GCC 13 to warn a reference outlives.)
  static const NcclLibrary& load(std::string_view library);

  // Makes `device` current on the calling thread after checking that this process sees a CUDA
  // device and that `device` is one of them (-1: the current one, returned). ConfigError names
  // the problem: no device (with the runtime's reason), or how many devices there are.
  int select_device(int device) const;
};

// The text of a CUDA runtime error: "cudaErrorNoDevice: no CUDA-capable device is detected".
std::string cuda_error_text(const NcclLibrary& lib, cudaError_t error);

}  // namespace ddp::comm::nccl
