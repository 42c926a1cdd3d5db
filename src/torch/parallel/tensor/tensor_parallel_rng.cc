// TensorParallelRng (tensor_parallel.h): Megatron's model-parallel RNG tracker on CPU generators.
#include <ATen/CPUGeneratorImpl.h>

#include <fmt/format.h>

#include "ddp/error.h"
#include "ddp/torch/parallel/tensor/tensor_parallel.h"
#include "torch/core/recomputation.h"

namespace ddp {

TensorParallelRng::TensorParallelRng(std::uint64_t seed, int tp_rank)
    : seed_(seed),
      tp_rank_(tp_rank),
      replicated_(at::detail::createCPUGenerator(seed)),
      split_(at::detail::createCPUGenerator(seed + kSplitSeedOffset +
                                            static_cast<std::uint64_t>(tp_rank))) {
  if (tp_rank < 0) {
    throw ConfigError(
        fmt::format("TensorParallelRng: tp_rank is {}; pass this rank's rank in its "
                    "tp group (DeviceMesh::coordinate(\"tp\"))",
                    tp_rank));
  }
}

torch::Generator& TensorParallelRng::generator(Region region) {
  return region == Region::kReplicated ? replicated_ : split_;
}

torch::Tensor TensorParallelRng::dropout(const torch::Tensor& input, double p, bool training,
                                         Region region) {
  if (p < 0.0 || p > 1.0) {
    throw ConfigError(
        fmt::format("TensorParallelRng::dropout: p is {}; pass a probability in [0, 1]", p));
  }
  if (!training || p == 0.0) return input;
  if (p == 1.0) return input * 0.0;
  // The mask is drawn without autograd; the product carries the gradient (mask / (1 - p)).
  torch::Tensor keep;
  {
    torch::NoGradGuard no_grad;
    // A checkpointed function's recomputation replays this generator (ddp::checkpoint).
    detail::note_generator_draw(generator(region));
    keep = torch::empty_like(input).bernoulli_(1.0 - p, generator(region)).div_(1.0 - p);
  }
  return input * keep;
}

}  // namespace ddp
