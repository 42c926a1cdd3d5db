// NCCL's and the CUDA runtime's error codes as ddp's CommError kinds, in one place (internal).
//
// The kind is what programs, the flight recorder and ddprun's blame act on; the message carries
// the library's own text (ncclGetErrorString, ncclGetLastError, cudaGetErrorString) so that
// nothing NCCL said is lost. Pure functions: the texts are passed in, so the table is testable
// without the libraries.
#pragma once

#include <string>

#include "comm/nccl/nccl_headers.h"
#include "ddp/comm/comm_error.h"

namespace ddp::comm::nccl {

// ncclRemoteError (a peer died or its connection broke) -> kPeerGone; ncclSystemError and
// ncclUnhandledCudaError (the network or CUDA under NCCL failed) -> kTransport; NCCL's own
// timeout -> kTimeout; invalid argument or usage, internal errors and anything unknown ->
// kInternal (the front checked the arguments, so these are ddp's or the buffers' fault).
CommErrorKind kind_of(ncclResult_t result);
// No device, an old driver, a device index out of range -> kSetup; everything else (an illegal
// address, out of memory, a launch failure) -> kTransport: the library under the call failed.
CommErrorKind kind_of(cudaError_t error);

// "ncclRemoteError", "ncclInProgress", ... ("ncclResult 42" for a code this table does not know).
std::string nccl_result_name(ncclResult_t result);

// What the message says after the call's name: "failed in NCCL: ncclRemoteError (remote process
// exited or there was a network error; NCCL: <last error>): <advice>". `library_text` is
// ncclGetErrorString's, `last_error` ncclGetLastError's (either may be null or empty).
std::string describe_nccl_failure(ncclResult_t result, const char* library_text,
                                  const char* last_error);
// The same for a CUDA runtime call: "cudaMemcpyAsync failed: cudaErrorInvalidValue (invalid
// argument): <advice>". `name` and `text` are cudaGetErrorName's and cudaGetErrorString's.
std::string describe_cuda_failure(const char* call, cudaError_t error, const char* name,
                                  const char* text);

}  // namespace ddp::comm::nccl
