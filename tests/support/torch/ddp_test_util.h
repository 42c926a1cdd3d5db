// Helpers for DistributedDataParallel tests: each test forks real rank processes (run_ranks);
// each rank joins a fresh ring group on a free port and uses libtorch with one thread. The parent
// process never touches libtorch, so forking it is safe.
#pragma once

#include <torch/torch.h>

#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "ddp/comm/process_group.h"
#include "ddp/runtime/init.h"
#include "ddp/torch/core/tensor_collectives.h"

namespace ddp::test {

inline std::shared_ptr<ProcessGroup> join_group(
    int rank, int size, int port, std::chrono::milliseconds timeout = std::chrono::seconds(30)) {
  torch::set_num_threads(1);
  return init_process_group({.launch = {.rank = rank,
                                        .world_size = size,
                                        .master_addr = "127.0.0.1",
                                        .master_port = port},
                             .timeout = timeout});
}

// Throws unless `actual` and `expected` agree to `rel` relative (plus a tiny absolute) tolerance.
inline void expect_close(const torch::Tensor& actual, const torch::Tensor& expected,
                         const std::string& what, double rel = 1e-5, double abs = 1e-6) {
  if (actual.sizes() != expected.sizes()) {
    throw std::runtime_error(what + ": shapes differ");
  }
  if (!torch::allclose(actual, expected, rel, abs)) {
    const auto diff = (actual - expected).abs().max().item<double>();
    throw std::runtime_error(
        fmt::format("{}: max abs difference {:g} exceeds rtol {:g}", what, diff, rel));
  }
}

// The average over the group's ranks of each tensor (an fp32/fp64 sum, then divided once): the
// reference for gradients a wrapper averages.
inline std::vector<torch::Tensor> averaged_over_ranks(ProcessGroup& group,
                                                      std::vector<torch::Tensor> tensors) {
  for (auto& t : tensors) {
    allreduce_tensor(group, t, ReduceOp::kSum)->wait();
    t.div_(group.size());
  }
  return tensors;
}

// Runs `call`, which must throw an E whose message contains `needle`; otherwise throws
// std::runtime_error saying what happened (`what` names the case).
template <class E, class F>
void expect_throws(F&& call, const std::string& needle, const std::string& what) {
  try {
    call();
  } catch (const E& e) {
    if (std::string(e.what()).find(needle) != std::string::npos) return;
    throw std::runtime_error(
        fmt::format("{}: the error '{}' does not mention '{}'", what, e.what(), needle));
  } catch (const std::exception& e) {
    throw std::runtime_error(fmt::format("{}: threw the wrong kind of error: {}", what, e.what()));
  }
  throw std::runtime_error(what + ": did not throw");
}

// Throws unless every rank holds bit-identical values of every tensor.
inline void expect_identical_across_ranks(ProcessGroup& group,
                                          const std::vector<torch::Tensor>& tensors,
                                          const std::string& what) {
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    auto mine = tensors[i].detach().contiguous().clone();
    auto high = mine.clone();
    auto low = mine.clone();
    allreduce_tensor(group, high, ReduceOp::kMax)->wait();
    allreduce_tensor(group, low, ReduceOp::kMin)->wait();
    if (!torch::equal(high, mine) || !torch::equal(low, mine)) {
      throw std::runtime_error(
          fmt::format("{}: tensor {} differs across ranks (rank {})", what, i, group.rank()));
    }
  }
}

}  // namespace ddp::test
