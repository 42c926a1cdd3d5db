// The nccl backend's error table: every NCCL result and the CUDA errors that matter map to the
// CommError kind the rest of ddp acts on, and the messages keep the library's own words.
#include "comm/nccl/nccl_errors.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include "support/unity_namespace.h"

namespace ddp::comm::nccl {
namespace {
namespace DDP_UNITY_ID {

using ::testing::HasSubstr;

TEST(NcclErrors, EveryNcclResultHasItsKindAndName) {
  struct Row {
    int code;
    CommErrorKind kind;
    const char* name;
  };
  const Row table[] = {
      {ncclUnhandledCudaError, CommErrorKind::kTransport, "ncclUnhandledCudaError"},
      {ncclSystemError, CommErrorKind::kTransport, "ncclSystemError"},
      {ncclInternalError, CommErrorKind::kInternal, "ncclInternalError"},
      {ncclInvalidArgument, CommErrorKind::kInternal, "ncclInvalidArgument"},
      {ncclInvalidUsage, CommErrorKind::kInternal, "ncclInvalidUsage"},
      {ncclRemoteError, CommErrorKind::kPeerGone, "ncclRemoteError"},
      {ncclInProgress, CommErrorKind::kInternal, "ncclInProgress"},
      {8, CommErrorKind::kTimeout, "ncclTimeout"},  // newer than some nccl.h
      // A code no nccl.h has, within the enum's range (0 to 15: a value outside it is undefined
      // behaviour, which clang's UBSan refuses).
      {13, CommErrorKind::kInternal, "ncclResult 13"},
  };
  for (const Row& row : table) {
    const auto result = static_cast<ncclResult_t>(row.code);
    EXPECT_EQ(kind_of(result), row.kind) << row.name;
    EXPECT_EQ(nccl_result_name(result), row.name);
  }
}

TEST(NcclErrors, CudaErrorsOfTheSetUpAreSetUpTheRestTransport) {
  EXPECT_EQ(kind_of(cudaErrorNoDevice), CommErrorKind::kSetup);
  EXPECT_EQ(kind_of(cudaErrorInsufficientDriver), CommErrorKind::kSetup);
  EXPECT_EQ(kind_of(cudaErrorInvalidDevice), CommErrorKind::kSetup);
  EXPECT_EQ(kind_of(cudaErrorIllegalAddress), CommErrorKind::kTransport);
  EXPECT_EQ(kind_of(cudaErrorMemoryAllocation), CommErrorKind::kTransport);
  EXPECT_EQ(kind_of(cudaErrorInvalidValue), CommErrorKind::kTransport);
}

TEST(NcclErrors, MessagesKeepTheLibrarysWordsAndSayWhatToDo) {
  const std::string remote =
      describe_nccl_failure(ncclRemoteError, "remote process exited or there was a network error",
                            "socket closed by peer 10.0.0.2");
  EXPECT_THAT(remote, HasSubstr("ncclRemoteError"));
  EXPECT_THAT(remote, HasSubstr("remote process exited or there was a network error"));
  EXPECT_THAT(remote, HasSubstr("NCCL: socket closed by peer 10.0.0.2"));
  EXPECT_THAT(remote, HasSubstr("other ranks' logs"));
  // Without the library's texts the code and the advice are still there.
  const std::string bare = describe_nccl_failure(ncclInvalidArgument, nullptr, "");
  EXPECT_THAT(bare, HasSubstr("ncclInvalidArgument"));
  EXPECT_THAT(bare, HasSubstr("device memory"));
  const std::string cuda = describe_cuda_failure("cudaMemcpyAsync", cudaErrorInvalidValue,
                                                 "cudaErrorInvalidValue", "invalid argument");
  EXPECT_THAT(cuda, HasSubstr("cudaMemcpyAsync failed: cudaErrorInvalidValue (invalid argument)"));
  EXPECT_THAT(describe_cuda_failure("cudaSetDevice", cudaErrorNoDevice, nullptr, nullptr),
              HasSubstr("CUDA_VISIBLE_DEVICES"));
}

}  // namespace DDP_UNITY_ID
}  // namespace
}  // namespace ddp::comm::nccl
