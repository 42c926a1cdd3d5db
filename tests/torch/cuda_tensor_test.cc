// A CUDA tensor handed to ddp gets ddp's clear error (ddp moves CPU tensors only; docs/
// architecture.md plans CUDA), with either libtorch and on a machine without a GPU: the tensor
// wraps a host address that it declares to be on cuda:0 (at::for_blob with an explicit target
// device asks no CUDA driver), so only its device says CUDA, which is all the check may read.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <array>
#include <string>

#include <torch/torch.h>

#include "ddp/error.h"
#include "ddp/torch/tensor_collectives.h"

namespace ddp {
namespace {

using ::testing::HasSubstr;

torch::Tensor tensor_declared_on_cuda(float* host_memory, std::int64_t n) {
  const c10::Device cuda(c10::DeviceType::CUDA, 0);
  return at::for_blob(host_memory, {n})
      .target_device(cuda)
      .options(torch::TensorOptions().dtype(torch::kFloat32).device(cuda))
      .make_tensor();
}

TEST(CudaTensor, IsRefusedNamingItsDeviceAndWhatDdpMoves) {
  std::array<float, 4> memory{};
  torch::Tensor tensor;
  try {
    tensor = tensor_declared_on_cuda(memory.data(), memory.size());
  } catch (const c10::Error& e) {
    GTEST_SKIP() << "this libtorch cannot describe a CUDA tensor without a GPU ("
                 << e.what_without_backtrace() << "); check_collective_tensor's device test "
                 << "is then covered by the non-CPU case only";
  }
  ASSERT_TRUE(tensor.is_cuda());
  try {
    check_collective_tensor(tensor, "the gradient of 'fc.weight'");
    FAIL() << "a CUDA tensor was accepted";
  } catch (const ConfigError& e) {
    EXPECT_THAT(e.what(), HasSubstr("the gradient of 'fc.weight' is on cuda:0"));
    EXPECT_THAT(e.what(), HasSubstr("ddp moves CPU tensors only"));
  }
}

TEST(CudaTensor, AMetaTensorIsRefusedTheSameWay) {
  const auto tensor = torch::empty({4}, torch::TensorOptions().device(torch::kMeta));
  try {
    check_collective_tensor(tensor, "the allreduce tensor");
    FAIL() << "a meta tensor was accepted";
  } catch (const ConfigError& e) {
    EXPECT_THAT(e.what(), HasSubstr("the allreduce tensor is on meta; ddp moves CPU tensors only"));
  }
}

}  // namespace
}  // namespace ddp
