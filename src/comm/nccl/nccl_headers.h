// The NCCL and CUDA runtime headers, for their types and constants only (internal): nothing of
// ddp links libnccl or libcudart; their functions are called through NcclLibrary's table
// (nccl_library.h). Included as system headers by CMake (ddp_nccl_headers), so their own warnings
// are not ours.
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>
