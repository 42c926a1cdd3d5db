// DistributedDataParallel with DdpOptions::param_dtype (PyTorch's DDP mixed_precision
// .param_dtype), in real processes: forward and backward run on bfloat16 copies of the
// parameters, and the averaged float32 gradients, and the float32 weights an optimizer steps with
// them, equal what each rank computes on its own bfloat16 copy, upcast and averaged; also under
// no_sync; a forward without gradients leaves the parameters in float32; bad dtypes are refused.
#include <gtest/gtest.h>

#include "ddp/error.h"
#include "ddp/torch/ddp/distributed_data_parallel.h"
#include "support/multiprocess.h"
#include "support/torch/ddp_test_util.h"
#include "support/unity_namespace.h"

namespace ddp {
namespace {
namespace DDP_UNITY_ID {

using test::join_group;
using test::run_ranks;

torch::nn::Sequential make_net() {
  torch::manual_seed(3);
  return torch::nn::Sequential(torch::nn::Linear(6, 5), torch::nn::ReLU(), torch::nn::Linear(5, 2));
}

torch::Tensor batch_of(int rank, int step) {
  torch::manual_seed(100 + 10 * rank + step);
  return torch::randn({4, 6});
}

// This rank's gradients of `net` (float32) computed the way param_dtype computes them: on a
// bfloat16 copy, upcast to float32, accumulated over `inputs`.
std::vector<torch::Tensor> local_bf16_gradients(const torch::nn::Sequential& net,
                                                const std::vector<torch::Tensor>& inputs) {
  auto copy = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(net->clone());
  copy->to(torch::kBFloat16);
  std::vector<torch::Tensor> sums;
  for (const auto& p : net->parameters())
    sums.push_back(torch::zeros_like(p));
  for (const auto& x : inputs) {
    copy->zero_grad();
    copy->forward(x.to(torch::kBFloat16)).pow(2).sum().backward();
    const auto params = copy->parameters();
    for (std::size_t i = 0; i < params.size(); ++i)
      sums[i] += params[i].grad().to(torch::kFloat32);
  }
  return sums;
}

void expect_float32(const torch::nn::Sequential& net, const std::string& when) {
  for (const auto& p : net->parameters()) {
    if (p.scalar_type() != torch::kFloat32 ||
        (p.grad().defined() && p.grad().scalar_type() != torch::kFloat32)) {
      throw std::runtime_error("a parameter or gradient is not float32 " + when);
    }
  }
}

TEST(DdpMixedPrecision, AveragesTheBf16GradientsIntoFloat32MasterWeights) {
  const int size = 2;
  const int port = test::free_port();
  const auto results = run_ranks(size, [&](int rank) {
    auto pg = join_group(rank, size, port);
    auto net = make_net();
    auto reference = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(net->clone());
    DistributedDataParallel model(net.ptr(), pg, DdpOptions{.param_dtype = torch::kBFloat16});
    torch::optim::SGD opt(model->parameters(), 0.1);
    for (int step = 0; step < 3; ++step) {
      const auto x = batch_of(rank, step);
      const auto want = test::averaged_over_ranks(
          *pg, local_bf16_gradients(torch::nn::Sequential(reference), {x}));
      opt.zero_grad();
      const auto out = model->forward(x);
      if (out.scalar_type() != torch::kBFloat16) {
        throw std::runtime_error("forward did not run in bfloat16");
      }
      out.pow(2).sum().backward();
      expect_float32(net, "after backward");
      const auto params = net->parameters();
      for (std::size_t i = 0; i < params.size(); ++i) {
        test::expect_close(params[i].grad(), want[i], fmt::format("gradient {} step {}", i, step),
                           1e-6, 1e-7);
      }
      opt.step();
      {
        torch::NoGradGuard no_grad;
        const auto ref_params = reference->parameters();
        for (std::size_t i = 0; i < ref_params.size(); ++i)
          ref_params[i].sub_(0.1 * want[i]);
      }
      for (std::size_t i = 0; i < params.size(); ++i) {
        test::expect_close(params[i], reference->parameters()[i],
                           fmt::format("float32 weight {} after step {}", i, step), 1e-6, 1e-7);
      }
    }
    // A forward without gradients (evaluation) leaves the parameters in float32 at once.
    {
      torch::NoGradGuard no_grad;
      model->forward(batch_of(rank, 9));
    }
    expect_float32(net, "after a forward without gradients");
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(DdpMixedPrecision, AccumulatesUnderNoSyncInFloat32) {
  const int size = 2;
  const int port = test::free_port();
  const auto results = run_ranks(size, [&](int rank) {
    auto pg = join_group(rank, size, port);
    auto net = make_net();
    auto reference =
        torch::nn::Sequential(std::dynamic_pointer_cast<torch::nn::SequentialImpl>(net->clone()));
    DistributedDataParallel model(net.ptr(), pg, DdpOptions{.param_dtype = torch::kBFloat16});
    const std::vector<torch::Tensor> inputs = {batch_of(rank, 0), batch_of(rank, 1),
                                               batch_of(rank, 2)};
    model->zero_grad();
    {
      auto guard = model->no_sync();
      for (int i = 0; i < 2; ++i) {
        model->forward(inputs[i]).pow(2).sum().backward();
        expect_float32(net, "after a backward under no_sync");
      }
    }
    model->forward(inputs[2]).pow(2).sum().backward();
    const auto want = test::averaged_over_ranks(*pg, local_bf16_gradients(reference, inputs));
    const auto params = net->parameters();
    for (std::size_t i = 0; i < params.size(); ++i) {
      test::expect_close(params[i].grad(), want[i], fmt::format("accumulated gradient {}", i), 1e-5,
                         1e-6);
    }
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(DdpMixedPrecision, BufferDtypeCastsTheBuffersForGoodAndBatchNormTrainsInBf16) {
  const int size = 2;
  const int port = test::free_port();
  const auto results = run_ranks(size, [&](int rank) {
    auto pg = join_group(rank, size, port);
    torch::manual_seed(4);
    torch::nn::Sequential net(torch::nn::Linear(6, 4), torch::nn::BatchNorm1d(4),
                              torch::nn::Linear(4, 2));
    DistributedDataParallel model(
        net.ptr(), pg,
        DdpOptions{.param_dtype = torch::kBFloat16, .buffer_dtype = torch::kBFloat16});
    for (const auto& b : net->named_buffers()) {
      const auto want = b.value().is_floating_point() ? torch::kBFloat16 : torch::kLong;
      if (b.value().scalar_type() != want) throw std::runtime_error(b.key() + " was not cast");
    }
    torch::optim::SGD opt(model->parameters(), 0.1);
    const auto first_weight = net[0]->as<torch::nn::Linear>()->weight.detach().clone();
    const auto first_bias = net[0]->as<torch::nn::Linear>()->bias.detach().clone();
    const auto x = batch_of(rank, 0);
    model->forward(x).pow(2).sum().backward();
    opt.step();
    expect_float32(net, "after the step");
    // This rank's statistics moved with its own batch (0.1 of the first layer's batch mean).
    const auto mean = net[1]->as<torch::nn::BatchNorm1d>()->running_mean;
    if (mean.scalar_type() != torch::kBFloat16) throw std::runtime_error("running_mean dtype");
    const auto want = 0.1 * torch::addmm(first_bias, x, first_weight.t()).mean(0);
    test::expect_close(mean.to(torch::kFloat), want, "running_mean", 2e-2, 2e-3);
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(DdpMixedPrecision, AnIntegerParamOrBufferDtypeIsRefused) {
  const int port = test::free_port();
  const auto results = run_ranks(1, [&](int rank) {
    auto pg = join_group(rank, 1, port);
    test::expect_throws<ConfigError>(
        [&] {
          DistributedDataParallel model(make_net().ptr(), pg,
                                        DdpOptions{.param_dtype = torch::kInt32});
        },
        "param_dtype is Int", "param_dtype int32");
    test::expect_throws<ConfigError>(
        [&] {
          DistributedDataParallel model(make_net().ptr(), pg,
                                        DdpOptions{.buffer_dtype = torch::kInt64});
        },
        "buffer_dtype is Long", "buffer_dtype int64");
  });
  EXPECT_ALL_RANKS_OK(results);
}

}  // namespace DDP_UNITY_ID
}  // namespace
}  // namespace ddp
