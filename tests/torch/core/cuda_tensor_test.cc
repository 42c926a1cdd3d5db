// What ddp does with a CUDA tensor, checked with either libtorch and without a GPU: the tensor
// wraps a host address that it declares to be on cuda:0 (at::for_blob with an explicit target
// device asks no CUDA driver), so only its device says CUDA, which is all the checks may read.
// The helpers accept it and ZeroRedundancyOptimizer names parameters on two devices;
// tests/torch/api/cuda_group_test.cc runs the CUDA-group paths on the CPU, and
// tests/torch/gpu/gpu_test.cc moves real CUDA tensors where there is a GPU.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <array>
#include <string>

#include <torch/torch.h>

#include "ddp/error.h"
#include "ddp/torch/api/distributed.h"
#include "ddp/torch/core/tensor_collectives.h"
#include "ddp/torch/zero/zero_redundancy_optimizer.h"
#include "support/multiprocess.h"
#include "support/torch/ddp_test_util.h"
#include "support/unity_namespace.h"

namespace ddp {
namespace {
namespace DDP_UNITY_ID {

using ::testing::HasSubstr;

torch::Tensor tensor_declared_on_cuda(float* host_memory, std::int64_t n) {
  const c10::Device cuda(c10::DeviceType::CUDA, 0);
  return at::for_blob(host_memory, {n})
      .target_device(cuda)
      .options(torch::TensorOptions().dtype(torch::kFloat32).device(cuda))
      .make_tensor();
}

// The tensor, or a skip where this libtorch cannot describe one without a GPU.
#define DECLARE_CUDA_TENSOR(tensor, memory)                                       \
  torch::Tensor tensor;                                                           \
  try {                                                                           \
    tensor = tensor_declared_on_cuda(memory.data(), memory.size());               \
  } catch (const c10::Error& e) {                                                 \
    GTEST_SKIP() << "this libtorch cannot describe a CUDA tensor without a GPU (" \
                 << e.what_without_backtrace() << ")";                            \
  }                                                                               \
  ASSERT_TRUE(tensor.is_cuda())

TEST(CudaTensor, IsAcceptedByTheHelpersThatStageIt) {
  std::array<float, 4> memory{};
  DECLARE_CUDA_TENSOR(tensor, memory);
  EXPECT_NO_THROW(check_collective_tensor(tensor, "the gradient of 'fc.weight'"));
}

// ZeroRedundancyOptimizer takes parameters on one device, CPU or CUDA (CUDA ones on a host group
// through staged broadcasts, on a CUDA group directly); parameters on two devices are named.
TEST(CudaTensor, ZeroRefusesParametersOnTwoDevicesByName) {
  std::array<float, 4> memory{};
  DECLARE_CUDA_TENSOR(on_cuda, memory);
  auto ring = test::join_group(0, 1, test::free_port());
  const auto adam = torch::optim::AdamOptions(0.1);
  try {
    ZeroRedundancyOptimizer zero({torch::zeros({4}), on_cuda}, adam, ring);
    FAIL() << "parameters on two devices were accepted";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("parameter 1 (group 0) is on cuda:0 but parameter 0 is on "
                                    "cpu; the parameters must be on one device"));
  }
}

TEST(CudaTensor, AMetaTensorIsRefusedNamingTheDevicesDdpMoves) {
  const auto tensor = torch::empty({4}, torch::TensorOptions().device(torch::kMeta));
  try {
    check_collective_tensor(tensor, "the allreduce tensor");
    FAIL() << "a meta tensor was accepted";
  } catch (const ConfigError& e) {
    EXPECT_THAT(e.what(),
                HasSubstr("the allreduce tensor is on meta; ddp moves CPU and CUDA tensors only"));
  }
}

#undef DECLARE_CUDA_TENSOR  // not into the next source of a unity batch

}  // namespace DDP_UNITY_ID
}  // namespace
}  // namespace ddp
