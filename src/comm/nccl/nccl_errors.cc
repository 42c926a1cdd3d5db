// The error table of the nccl backend (see nccl_errors.h).
#include "comm/nccl/nccl_errors.h"

#include <fmt/format.h>

namespace ddp::comm::nccl {
namespace {

// ncclTimeout (8) is newer than some nccl.h this file may be built with: matched by number.
constexpr int kNcclTimeout = 8;

const char* advice_for(ncclResult_t result) {
  switch (static_cast<int>(result)) {
    case ncclRemoteError:
      return "a peer process died or its connection broke; look at the other ranks' logs";
    case ncclSystemError:
      return "a system call or the network under NCCL failed; NCCL_DEBUG=WARN tells more";
    case ncclUnhandledCudaError:
      return "a CUDA call inside NCCL failed; NCCL_DEBUG=WARN tells more";
    case ncclInvalidArgument:
      return "check that every buffer is device memory on this rank's CUDA device";
    case ncclInvalidUsage:
      return "NCCL refused how it was used (two ranks on one GPU, say); NCCL_DEBUG=WARN tells "
             "more";
    case kNcclTimeout:
      return "NCCL's own timeout passed; a peer is stuck or gone";
    default:
      return "NCCL_DEBUG=WARN tells more";
  }
}

}  // namespace

CommErrorKind kind_of(ncclResult_t result) {
  switch (static_cast<int>(result)) {
    case ncclRemoteError:
      return CommErrorKind::kPeerGone;
    case ncclSystemError:
    case ncclUnhandledCudaError:
      return CommErrorKind::kTransport;
    case kNcclTimeout:
      return CommErrorKind::kTimeout;
    default:  // ncclInternalError, ncclInvalidArgument, ncclInvalidUsage, unknown codes
      return CommErrorKind::kInternal;
  }
}

CommErrorKind kind_of(cudaError_t error) {
  switch (error) {
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorInvalidDevice:
      return CommErrorKind::kSetup;
    default:
      return CommErrorKind::kTransport;
  }
}

std::string nccl_result_name(ncclResult_t result) {
  switch (static_cast<int>(result)) {
    case ncclSuccess:
      return "ncclSuccess";
    case ncclUnhandledCudaError:
      return "ncclUnhandledCudaError";
    case ncclSystemError:
      return "ncclSystemError";
    case ncclInternalError:
      return "ncclInternalError";
    case ncclInvalidArgument:
      return "ncclInvalidArgument";
    case ncclInvalidUsage:
      return "ncclInvalidUsage";
    case ncclRemoteError:
      return "ncclRemoteError";
    case ncclInProgress:
      return "ncclInProgress";
    case kNcclTimeout:
      return "ncclTimeout";
    default:
      return fmt::format("ncclResult {}", static_cast<int>(result));
  }
}

std::string describe_nccl_failure(ncclResult_t result, const char* library_text,
                                  const char* last_error) {
  std::string said;
  if (library_text != nullptr && *library_text != '\0') said = library_text;
  if (last_error != nullptr && *last_error != '\0') {
    said += fmt::format("{}NCCL: {}", said.empty() ? "" : "; ", last_error);
  }
  return fmt::format("failed in NCCL: {}{}: {}", nccl_result_name(result),
                     said.empty() ? std::string() : fmt::format(" ({})", said), advice_for(result));
}

std::string describe_cuda_failure(const char* call, cudaError_t error, const char* name,
                                  const char* text) {
  const char* advice = kind_of(error) == CommErrorKind::kSetup
                           ? "check the driver and CUDA_VISIBLE_DEVICES"
                           : "check that the buffers are device memory of this rank's device "
                             "and large enough for the call";
  return fmt::format("{} failed: {} ({}): {}", call,
                     name != nullptr ? name : fmt::format("cudaError {}", static_cast<int>(error)),
                     text != nullptr ? text : "no text", advice);
}

}  // namespace ddp::comm::nccl
