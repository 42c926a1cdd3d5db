// Helpers for the comm hook tests: a GradBucket over a flat buffer (as the reducer builds it) and
// one reduction through a hook, waited for and finished as the reducer does.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <vector>

#include <fmt/format.h>

#include "ddp/comm/process_group.h"
#include "ddp/torch/ddp/distributed_data_parallel.h"
#include "ddp/torch/ddp/hooks/comm_hooks.h"
#include "support/torch/ddp_test_util.h"

namespace ddp::test {

using Shapes = std::vector<std::vector<std::int64_t>>;

inline std::int64_t total_numel(const Shapes& shapes) {
  std::int64_t total = 0;
  for (const auto& shape : shapes) {
    std::int64_t n = 1;
    for (const auto d : shape)
      n *= d;
    total += n;
  }
  return total;
}

// A bucket whose gradients are views of `buffer` with `shapes`, in order.
inline GradBucket make_bucket(torch::Tensor buffer, const Shapes& shapes, std::size_t index = 0,
                              bool is_last = true) {
  GradBucket bucket{.index = index, .buffer = buffer, .is_last = is_last};
  std::int64_t at = 0;
  for (const auto& shape : shapes) {
    const auto n = total_numel({shape});
    bucket.gradients.push_back(buffer.narrow(0, at, n).view(shape));
    bucket.parameter_names.push_back("p" + std::to_string(bucket.gradients.size() - 1));
    at += n;
  }
  return bucket;
}

// Runs `hook` on a copy of `gradients` (flat) and returns the averaged bucket; adds the
// reduction's bytes to *bytes when given.
inline torch::Tensor reduce_with(const CommHook& hook, ProcessGroup& group,
                                 const torch::Tensor& gradients, const Shapes& shapes,
                                 std::size_t* bytes = nullptr) {
  auto buffer = gradients.clone();
  auto bucket = make_bucket(buffer, shapes);
  auto reduction = hook(group, bucket);
  if (reduction.work) reduction.work->wait();
  if (reduction.finish) reduction.finish();
  if (bytes) *bytes += reduction.bytes_sent.value_or(0);
  return buffer;
}

// Every rank's flat tensor, gathered: [world, numel].
inline torch::Tensor gather_all(ProcessGroup& group, const torch::Tensor& mine) {
  auto flat = mine.contiguous();
  auto all = torch::empty({group.size(), flat.numel()}, flat.options());
  group.allgather(flat.data_ptr(), all.data_ptr(), flat.numel(), DType::kFloat32)->wait();
  return all;
}

// Trains a 32->16 linear regression (the same target on every rank, per-rank data) under DDP with
// `hook` for `steps` SGD steps; throws unless the parameters stay identical across ranks and the
// loss falls below 1e-3 of the first step's. Returns the model, for checks of its timeline.
inline DistributedDataParallel<torch::nn::LinearImpl> train_regression_with_hook(
    std::shared_ptr<ProcessGroup> group, CommHook hook, int steps = 300) {
  torch::manual_seed(5);
  const auto truth = torch::randn({32, 16});
  torch::nn::Linear net(torch::nn::LinearOptions(32, 16).bias(false));
  DistributedDataParallel model(net.ptr(), group);
  model->register_comm_hook(std::move(hook));
  torch::optim::SGD opt(model->parameters(), 0.1);
  torch::manual_seed(50 + group->rank());
  double first = 0, last = 0;
  for (int step = 0; step < steps; ++step) {
    const auto x = torch::randn({16, 32});
    const auto loss = torch::mse_loss(model->forward(x), torch::matmul(x, truth));
    opt.zero_grad();
    loss.backward();
    opt.step();
    if (step == 0) first = loss.item<double>();
    last = loss.item<double>();
  }
  expect_identical_across_ranks(*group, model->parameters(), "after training");
  if (!(last < first * 1e-3)) {
    throw std::runtime_error(fmt::format("loss {:g} -> {:g}: did not converge", first, last));
  }
  return model;
}

}  // namespace ddp::test
