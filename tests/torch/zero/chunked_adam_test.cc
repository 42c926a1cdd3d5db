// ChunkedAdam and ChunkedAdamW against libtorch's Adam and AdamW: the same parameters and state
// bit for bit with one intra-op thread, for parameters below, at and across the chunk size, a
// non-contiguous one, with and without weight decay and amsgrad; states interchangeable through
// save/load; and the step's peak memory without the parameter-sized temporaries libtorch's makes.
#include <gtest/gtest.h>

#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <torch/torch.h>

#include "ddp/torch/zero/chunked_adam.h"
#include "support/resident_memory.h"
#include "support/unity_namespace.h"

namespace ddp {
namespace {
namespace DDP_UNITY_ID {

using test::peak_added_mib;
using test::status_mib;

// One intra-op thread for the scope (the bit-for-bit contract's condition).
class OneThread {
 public:
  OneThread() : before_(torch::get_num_threads()) { torch::set_num_threads(1); }
  ~OneThread() { torch::set_num_threads(before_); }
  OneThread(const OneThread&) = delete;
  OneThread& operator=(const OneThread&) = delete;

 private:
  int before_;
};

// Parameters of every shape that matters to the chunking.
std::vector<torch::Tensor> make_parameters() {
  torch::manual_seed(7);
  std::vector<torch::Tensor> params{
      torch::randn({7}),                              // below a chunk
      torch::randn({kChunkedAdamElements}),           // exactly one
      torch::randn({3 * kChunkedAdamElements + 37}),  // chunks and a tail
      torch::randn({300, 700}),                       // 2-D, several chunks
      torch::randn({700, 300}).t(),                   // not contiguous: stepped whole
  };
  for (auto& p : params)
    p.requires_grad_(true);
  return params;
}

std::vector<torch::Tensor> copies(const std::vector<torch::Tensor>& params) {
  std::vector<torch::Tensor> out;
  for (const auto& p : params) {
    // clone() keeps a transposed layout (preserve format), so the copy is not contiguous either.
    out.push_back(p.detach().clone().requires_grad_(true));
  }
  return out;
}

// `steps` steps of both optimizers over equal parameters with equal random gradients; every
// parameter and state tensor must be equal.
void expect_same_steps(torch::optim::Optimizer& mine, std::vector<torch::Tensor>& mine_params,
                       torch::optim::Optimizer& theirs, std::vector<torch::Tensor>& their_params,
                       int steps, const std::string& what) {
  for (int step = 0; step < steps; ++step) {
    for (std::size_t i = 0; i < mine_params.size(); ++i) {
      const auto grad = torch::randn_like(mine_params[i]) * (step + 1);
      mine_params[i].mutable_grad() = grad.clone();
      their_params[i].mutable_grad() = grad.clone();
    }
    mine.step();
    theirs.step();
    for (std::size_t i = 0; i < mine_params.size(); ++i) {
      ASSERT_TRUE(torch::equal(mine_params[i], their_params[i]))
          << what << ": parameter " << i << " differs after step " << step + 1 << " (max "
          << (mine_params[i] - their_params[i]).abs().max().item<double>() << ")";
    }
  }
  ASSERT_EQ(mine.state().size(), theirs.state().size()) << what;
}

// Mine against Theirs (libtorch's class) for each of `each_options`, four steps apiece.
template <class Mine, class Theirs, class Options>
void expect_equal_to_libtorch(const std::vector<Options>& each_options, const char* name) {
  OneThread one_thread;
  for (const auto& options : each_options) {
    auto mine_params = make_parameters();
    auto their_params = copies(mine_params);
    Mine mine(mine_params, options);
    Theirs theirs(their_params, options);
    expect_same_steps(
        mine, mine_params, theirs, their_params, 4,
        fmt::format("{} wd {} amsgrad {}", name, options.weight_decay(), options.amsgrad()));
  }
}

TEST(ChunkedAdam, EqualsLibtorchsAdamBitForBit) {
  using torch::optim::AdamOptions;
  expect_equal_to_libtorch<ChunkedAdam, torch::optim::Adam>(
      std::vector<AdamOptions>{AdamOptions(1e-2), AdamOptions(1e-2).weight_decay(0.1),
                               AdamOptions(1e-2).amsgrad(true),
                               AdamOptions(3e-3).weight_decay(0.05).amsgrad(true).eps(1e-6)},
      "Adam");
}

TEST(ChunkedAdam, AdamWEqualsLibtorchsAdamWBitForBit) {
  using torch::optim::AdamWOptions;
  expect_equal_to_libtorch<ChunkedAdamW, torch::optim::AdamW>(
      std::vector<AdamWOptions>{AdamWOptions(1e-2), AdamWOptions(1e-2).weight_decay(0),
                                AdamWOptions(1e-2).weight_decay(0.1).amsgrad(true)},
      "AdamW");
}

// The state is libtorch's: saved from one class, it loads into the other, which steps on as the
// first would have.
TEST(ChunkedAdam, StateSavedByEitherClassLoadsIntoTheOther) {
  OneThread one_thread;
  const auto options = torch::optim::AdamOptions(1e-2).amsgrad(true);
  auto mine_params = make_parameters();
  auto their_params = copies(mine_params);
  ChunkedAdam mine(mine_params, options);
  torch::optim::Adam theirs(their_params, options);
  expect_same_steps(mine, mine_params, theirs, their_params, 2, "before saving");

  std::ostringstream saved_mine;
  torch::save(mine, saved_mine);
  auto loaded_params = copies(mine_params);
  torch::optim::Adam from_mine(loaded_params, options);
  std::istringstream in_mine(saved_mine.str());
  torch::load(from_mine, in_mine);
  expect_same_steps(mine, mine_params, from_mine, loaded_params, 2, "ChunkedAdam -> Adam");

  std::ostringstream saved_theirs;
  torch::save(theirs, saved_theirs);
  auto other_params = copies(their_params);
  ChunkedAdam from_theirs(other_params, options);
  std::istringstream in_theirs(saved_theirs.str());
  torch::load(from_theirs, in_theirs);
  expect_same_steps(from_theirs, other_params, theirs, their_params, 2, "Adam -> ChunkedAdam");
}

TEST(ChunkedAdam, SparseGradientsAreRefusedAsLibtorchRefusesThem) {
  auto p = torch::zeros({4, 3}).requires_grad_(true);
  p.mutable_grad() = torch::eye(4).narrow(1, 0, 3).to_sparse();
  ChunkedAdam optimizer(std::vector<torch::Tensor>{p}, torch::optim::AdamOptions(1e-3));
  try {
    optimizer.step();
    FAIL() << "a sparse gradient was accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("does not support sparse gradients"), std::string::npos)
        << e.what();
  }
}

// A 64 MiB weight: libtorch's step peaks at two weight-sized temporaries above what it holds, the
// chunked one at a few chunks (both measured on their second step, the state made).
TEST(ChunkedAdam, StepMakesNoParameterSizedTemporaries) {
  if (status_mib("VmHWM") < 0) GTEST_SKIP() << "no VmHWM in /proc/self/status";
  const std::int64_t elements = 16 << 20;
  const double weight_mib = elements * 4.0 / (1 << 20);
  auto run = [&](auto make_optimizer) {
    auto p = torch::randn({elements}).requires_grad_(true);
    p.mutable_grad() = torch::randn({elements});
    auto optimizer = make_optimizer(std::vector<torch::Tensor>{p});
    optimizer.step();  // makes the state
    return peak_added_mib([&] { optimizer.step(); });
  };
  const double libtorch = run([](std::vector<torch::Tensor> params) {
    return torch::optim::Adam(std::move(params), torch::optim::AdamOptions(1e-3));
  });
  const double chunked = run([](std::vector<torch::Tensor> params) {
    return ChunkedAdam(std::move(params), torch::optim::AdamOptions(1e-3));
  });
  const double chunked_w = run([](std::vector<torch::Tensor> params) {
    return ChunkedAdamW(std::move(params), torch::optim::AdamWOptions(1e-3).amsgrad(true));
  });
  // The measure sees libtorch's temporaries (at least one weight's worth) ...
  EXPECT_GT(libtorch, weight_mib) << "libtorch's Adam added " << libtorch << " MiB";
  // ... and the chunked steps add at most a few chunks (1 MiB each per stream).
  EXPECT_LT(chunked, 8.0) << "ChunkedAdam added " << chunked << " MiB";
  EXPECT_LT(chunked_w, 8.0) << "ChunkedAdamW added " << chunked_w << " MiB";
}

}  // namespace DDP_UNITY_ID
}  // namespace
}  // namespace ddp
