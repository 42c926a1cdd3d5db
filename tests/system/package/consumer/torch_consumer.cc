#include <ddp/torch/core/version.h>
#include <torch/torch.h>

#include <iostream>

int main() {
  const auto sum = torch::ones({2, 2}).sum().item<float>();
  std::cout << "libtorch " << ddp::libtorch_version() << " sum " << sum << "\n";
  return sum == 4.0f ? 0 : 1;
}
