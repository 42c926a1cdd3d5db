// Small models and data for the DistributedDataParallel tests (shared by several suites).
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <vector>

namespace ddp::test {

struct MlpImpl : torch::nn::Module {
  explicit MlpImpl(int hidden = 32) {
    fc1 = register_module("fc1", torch::nn::Linear(20, hidden));
    fc2 = register_module("fc2", torch::nn::Linear(hidden, 16));
    fc3 = register_module("fc3", torch::nn::Linear(16, 4));
  }
  torch::Tensor forward(torch::Tensor x) { return fc3(torch::relu(fc2(torch::relu(fc1(x))))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, fc3{nullptr};
};
TORCH_MODULE(Mlp);

// The cnn without BatchNorm, scaled down to 12x12 inputs.
struct SmallCnnImpl : torch::nn::Module {
  SmallCnnImpl() {
    conv1 =
        register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 4, 3).padding(1)));
    conv2 =
        register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(4, 8, 3).padding(1)));
    fc1 = register_module("fc1", torch::nn::Linear(8 * 3 * 3, 16));
    fc2 = register_module("fc2", torch::nn::Linear(16, 4));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = torch::max_pool2d(torch::relu(conv1(x)), 2);
    x = torch::max_pool2d(torch::relu(conv2(x)), 2);
    return fc2(torch::relu(fc1(x.flatten(1))));
  }
  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr};
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(SmallCnn);

struct Batches {
  torch::Tensor inputs;   // [steps, world * batch, ...]
  torch::Tensor targets;  // [steps, world * batch]
};

inline Batches make_batches(int steps, int total_batch, std::vector<std::int64_t> sample_shape) {
  torch::manual_seed(7);
  std::vector<std::int64_t> shape{steps, total_batch};
  shape.insert(shape.end(), sample_shape.begin(), sample_shape.end());
  return {torch::randn(shape), torch::randint(0, 4, {steps, total_batch})};
}

inline torch::optim::SGD make_sgd(std::vector<torch::Tensor> params) {
  return torch::optim::SGD(std::move(params), torch::optim::SGDOptions(0.1).momentum(0.9));
}

}  // namespace ddp::test
