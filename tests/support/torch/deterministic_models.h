// The models and batches the DDP + Join, ZeRO and FSDP suites train, built from formulas rather
// than a random generator, so that every process, every libtorch and the PyTorch reference
// scripts (pytorch_join_reference.py, pytorch_zero_reference.py) start from the same numbers.
#pragma once

#include <torch/torch.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace ddp::test {

// Sets the j-th value of the k-th parameter of `model` to 0.3 sin(0.37 (j + 1) + k), computed in
// float64 and stored in the parameter's dtype.
inline void fill_deterministic(torch::nn::Module& model) {
  torch::NoGradGuard no_grad;
  int k = 0;
  for (auto& p : model.parameters()) {
    std::vector<double> values(static_cast<std::size_t>(p.numel()));
    for (std::size_t j = 0; j < values.size(); ++j)
      values[j] = 0.3 * std::sin(0.37 * static_cast<double>(j + 1) + k);
    p.copy_(torch::tensor(values, torch::kFloat64).view(p.sizes()).to(p.scalar_type()));
    ++k;
  }
}

// The sharding suites' (ZeRO, FSDP) model and data: kShardedIn features, a global batch of
// kShardedGlobalBatch samples split evenly over the ranks, two outputs.
inline constexpr int kShardedIn = 6, kShardedGlobalBatch = 12;

// Children: Linear(6, 9), Tanh, Linear(9, 4 + variant), Tanh, Linear(4 + variant, 2); a variant
// other than 0 is a model that differs from the others in one shape.
inline torch::nn::Sequential sharded_suite_model(int variant = 0) {
  torch::nn::Sequential model(torch::nn::Linear(kShardedIn, 9), torch::nn::Tanh(),
                              torch::nn::Linear(9, 4 + variant), torch::nn::Tanh(),
                              torch::nn::Linear(4 + variant, 2));
  fill_deterministic(*model);
  return model;
}

// Rank `rank`'s slice (of `world`) of the global batch of `step`: inputs and targets.
inline std::pair<torch::Tensor, torch::Tensor> sharded_suite_batch(int rank, int world, int step) {
  std::vector<double> x, y;
  for (int s = 0; s < kShardedGlobalBatch; ++s) {
    for (int f = 0; f < kShardedIn; ++f)
      x.push_back(std::sin(0.011 * (step * 100 + s * kShardedIn + f) + 0.5 * f));
    for (int o = 0; o < 2; ++o)
      y.push_back(std::cos(0.017 * (step * 100 + s * 2 + o)));
  }
  const int per = kShardedGlobalBatch / world;
  auto xs =
      torch::tensor(x, torch::kFloat64).view({kShardedGlobalBatch, kShardedIn}).to(torch::kFloat32);
  auto ys = torch::tensor(y, torch::kFloat64).view({kShardedGlobalBatch, 2}).to(torch::kFloat32);
  return {xs.narrow(0, rank * per, per), ys.narrow(0, rank * per, per)};
}

// The tiny GPTs' batches (tensor_parallel_test.cc, fsdp_tensor_parallel_test.cc): token ids
// [batch, sequence] below `vocab` of `step` from a fixed stream, and each id's next id as targets.
inline std::pair<torch::Tensor, torch::Tensor> token_batch(int step, std::int64_t batch,
                                                           std::int64_t sequence,
                                                           std::int64_t vocab) {
  const auto n = batch * (sequence + 1);
  const auto stream = (torch::arange(n, torch::kInt64) * 7 + step * 5 +
                       torch::arange(n, torch::kInt64).div(3, "floor")) %
                      vocab;
  const auto rows = stream.reshape({batch, sequence + 1});
  return {rows.narrow(1, 0, sequence).contiguous(), rows.narrow(1, 1, sequence).contiguous()};
}

}  // namespace ddp::test
