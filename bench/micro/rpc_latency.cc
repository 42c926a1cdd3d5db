// rpc-latency: ddp::rpc's round trips between two workers, under ddprun (bench/compare/
// compare_rpc.py runs it beside PyTorch's TensorPipe RPC, bench/compare/pytorch_rpc_bench.py).
//
//   ddprun --standalone --nproc-per-node 2 rpc-latency [--calls N] [--echo-calls M]
//          [--echo-bytes B] [--warmup W]
//
// Worker 0 ("caller") times N rpc_sync calls of a function that takes and returns nothing, then
// M rpc_sync calls of one that returns its argument, a float32 tensor of B bytes, each call
// timed alone; worker 1 ("callee") serves. Worker 0 prints one line per measurement:
//   rpc-latency empty_us median=.. p10=.. p90=.. calls=N
//   rpc-latency echo_us bytes=B median=.. p10=.. p90=.. calls=M
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <torch/torch.h>
#include <CLI/CLI.hpp>

#include "ddp/launch/launch_environment.h"
#include "ddp/torch/rpc/rpc.h"

namespace {

struct Summary {
  double median, p10, p90;
};

Summary summarise(std::vector<double> micros) {
  std::sort(micros.begin(), micros.end());
  auto at = [&](double q) {
    return micros[static_cast<std::size_t>(q * static_cast<double>(micros.size() - 1))];
  };
  return {at(0.5), at(0.1), at(0.9)};
}

template <typename Call>
std::vector<double> time_calls(int warmup, int calls, const Call& call) {
  for (int i = 0; i < warmup; ++i)
    call();
  std::vector<double> micros;
  micros.reserve(static_cast<std::size_t>(calls));
  for (int i = 0; i < calls; ++i) {
    const auto start = std::chrono::steady_clock::now();
    call();
    micros.push_back(
        std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start)
            .count());
  }
  return micros;
}

}  // namespace

int main(int argc, char** argv) {
  int calls = 2000, echo_calls = 200, warmup = 100;
  std::int64_t echo_bytes = 1 << 20;
  CLI::App app{"rpc-latency: ddp::rpc round trips between two workers (run under ddprun)"};
  app.add_option("--calls", calls, "timed empty calls")->check(CLI::PositiveNumber);
  app.add_option("--echo-calls", echo_calls, "timed tensor echoes")->check(CLI::PositiveNumber);
  app.add_option("--echo-bytes", echo_bytes, "bytes of the echoed float32 tensor")
      ->check(CLI::Range(std::int64_t{4}, std::int64_t{1} << 30));
  app.add_option("--warmup", warmup, "untimed calls first")->check(CLI::NonNegativeNumber);
  CLI11_PARSE(app, argc, argv);
  try {
    ddp::rpc::register_function("noop",
                                [](const std::vector<c10::IValue>&) { return c10::IValue(); });
    ddp::rpc::register_function("echo",
                                [](const std::vector<c10::IValue>& args) { return args.at(0); });
    // The name depends on the rank, which the launcher's environment gives.
    const int rank = ddp::resolve_launch_environment().rank;
    ddp::rpc::init_rpc(rank == 0 ? "caller" : "callee");
    if (ddp::rpc::get_worker_info().id == 0) {
      const auto empty =
          summarise(time_calls(warmup, calls, [] { ddp::rpc::rpc_sync("callee", "noop"); }));
      std::printf("rpc-latency empty_us median=%.1f p10=%.1f p90=%.1f calls=%d\n", empty.median,
                  empty.p10, empty.p90, calls);
      const auto tensor = torch::rand({echo_bytes / 4});
      const auto echo = summarise(time_calls(std::min(warmup, 20), echo_calls, [&] {
        ddp::rpc::rpc_sync("callee", "echo", {tensor});
      }));
      std::printf("rpc-latency echo_us bytes=%lld median=%.1f p10=%.1f p90=%.1f calls=%d\n",
                  static_cast<long long>(echo_bytes), echo.median, echo.p10, echo.p90, echo_calls);
      std::fflush(stdout);
    }
    ddp::rpc::shutdown();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rpc-latency: %s\n", e.what());
    return 1;
  }
  return 0;
}
