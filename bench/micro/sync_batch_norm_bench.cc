// sync_batch_norm_bench: cost of one ddp::SyncBatchNorm layer against torch::nn::BatchNorm on the
// same per-rank batch, forward + backward (input gradient included), at a given world size.
//
//   build/bin/sync_batch_norm_bench --world 2 --repeats 50
//
// Ranks are forked from this process and join a ring group over 127.0.0.1 (one torch thread
// each). For every shape, each rank times `repeats` iterations of each layer after `warmup`; the
// table shows the median of the slowest rank. With one rank SyncBatchNorm runs plain batch_norm
// (as PyTorch does), so world 1 shows the cost of the wrapper alone.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <torch/torch.h>
#include <CLI/CLI.hpp>

#include "bench_timing.h"
#include "ddp/runtime/init.h"
#include "ddp/store/tcp_store.h"
#include "ddp/torch/core/tensor_collectives.h"
#include "ddp/torch/ddp/sync_batch_norm.h"
#include "forked_ranks.h"

namespace {

// Median milliseconds of forward + backward of `layer` on `x` with upstream gradient `dy`.
template <typename Layer>
double time_layer(Layer& layer, const torch::Tensor& x, const torch::Tensor& dy, int warmup,
                  int repeats, ddp::ProcessGroup& group) {
  std::vector<double> times;
  for (int i = 0; i < warmup + repeats; ++i) {
    group.barrier()->wait();  // start together, so a slow rank does not show up as comm time
    const auto start = std::chrono::steady_clock::now();
    auto input = x.detach().requires_grad_(true);
    layer->zero_grad();
    layer(input).backward(dy);
    const std::chrono::duration<double, std::milli> elapsed =
        std::chrono::steady_clock::now() - start;
    if (i >= warmup) times.push_back(elapsed.count());
  }
  // The slowest rank's median is the cost of the layer for the group.
  auto result = torch::tensor({median(times)}, torch::kDouble);
  ddp::allreduce_tensor(group, result, ddp::ReduceOp::kMax)->wait();
  return result.item<double>();
}

int run_rank(int rank, int world, int port, int warmup, int repeats) {
  torch::set_num_threads(1);
  auto pg = ddp::init_process_group(
      {.launch = {
           .rank = rank, .world_size = world, .master_addr = "127.0.0.1", .master_port = port}});
  const std::vector<std::vector<int64_t>> shapes = {
      {64, 32, 28, 28}, {64, 32, 14, 14}, {64, 64, 7, 7}, {64, 256, 4, 4}, {64, 512}};
  if (rank == 0) {
    fmt::print("world {}, {} repeats (median of the slowest rank), forward + backward per layer\n",
               world, repeats);
    fmt::print("{:<18} {:>12} {:>16} {:>14} {:>8}\n", "input (N,C,...)", "BatchNorm ms",
               "SyncBatchNorm ms", "overhead ms", "ratio");
  }
  for (const auto& shape : shapes) {
    torch::manual_seed(1);
    const auto x = torch::randn(shape);
    const auto dy = torch::randn(shape);
    const int64_t channels = shape[1];
    torch::nn::BatchNorm2d bn2d(channels);
    torch::nn::BatchNorm1d bn1d(channels);
    ddp::SyncBatchNorm sync(ddp::SyncBatchNormOptions(channels).process_group(pg));
    const double plain = shape.size() == 4 ? time_layer(bn2d, x, dy, warmup, repeats, *pg)
                                           : time_layer(bn1d, x, dy, warmup, repeats, *pg);
    const double synced = time_layer(sync, x, dy, warmup, repeats, *pg);
    if (rank == 0) {
      fmt::print("{:<18} {:>12.3f} {:>16.3f} {:>14.3f} {:>8.2f}\n",
                 fmt::format("{}", fmt::join(shape, "x")), plain, synced, synced - plain,
                 synced / plain);
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Cost per layer of ddp::SyncBatchNorm against torch::nn::BatchNorm"};
  int world = 2;
  int warmup = 5;
  int repeats = 50;
  app.add_option("--world", world, "ranks forked on this machine")->check(CLI::Range(1, 64));
  app.add_option("--warmup", warmup, "untimed iterations first")->check(CLI::NonNegativeNumber);
  app.add_option("--repeats", repeats, "timed iterations")->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);
  const int port = ddp::pick_free_port();
  return run_forked_ranks(world,
                          [&](int rank) { return run_rank(rank, world, port, warmup, repeats); });
}
