// The compute of ddp's PowerSGD comm hook on one rank, bucket by bucket, on a model's real
// gradient buckets (issue 28): the hook's call, its allreduce (a world of one: no transfer) and
// its finish step, per bucket and per step (median of --rounds), beside what each pass over the
// compressed matrices costs alone as one ATen call (the products as bmm and as matrix-vector
// products, the error-feedback passes). bench/compare/powersgd_hook_bench.py times PyTorch's
// powerSGD_hook on the same buckets.
//
//   powersgd_hook_bench --model mlp --rank 1 --rounds 7 [--threads 1] [--quick]
//
// Run it with OPENBLAS_NUM_THREADS=1, as ddprun sets for its workers: otherwise OpenBLAS's own
// threads spin beside --threads (measured: sched_yield in the profile, noisier products).
//
// The buckets are those DistributedDataParallel makes for the model (--bucket-cap-mb,
// --first-bucket-cap-mb); each round refills them with the same random gradients (not timed),
// then times every bucket through the hook in launch order, as one backward pass would.
#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include "bench_timing.h"
#include "ddp/runtime/init.h"
#include "ddp/torch/ddp/distributed_data_parallel.h"
#include "ddp/torch/ddp/hooks/powersgd_hook.h"

namespace {

torch::nn::Sequential make_model(const std::string& name) {
  namespace nn = torch::nn;
  if (name == "tiny") {
    return nn::Sequential(nn::Flatten(), nn::Linear(784, 64), nn::ReLU(), nn::Linear(64, 64),
                          nn::ReLU(), nn::Linear(64, 10));
  }
  if (name == "large") {
    return nn::Sequential(nn::Flatten(), nn::Linear(784, 4096), nn::ReLU(), nn::Linear(4096, 4096),
                          nn::ReLU(), nn::Linear(4096, 4096), nn::ReLU(), nn::Linear(4096, 4096),
                          nn::ReLU(), nn::Linear(4096, 10));
  }
  // ddp-train-bench's mlp: 20.1 M parameters, 80 MB of gradients.
  return nn::Sequential(nn::Flatten(), nn::Linear(784, 4096), nn::ReLU(), nn::Linear(4096, 4096),
                        nn::ReLU(), nn::Linear(4096, 10));
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Compute of ddp's PowerSGD comm hook per bucket and step (one rank)"};
  std::string model_name = "mlp";
  int rank = 1;
  int rounds = 7;
  int threads = 1;
  double bucket_cap_mb = 25.0;
  double first_bucket_cap_mb = 1.0;
  bool quick = false;
  app.add_option("--model", model_name, "tiny, mlp or large (as ddp-train-bench)")
      ->check(CLI::IsMember({"tiny", "mlp", "large"}));
  app.add_option("--rank", rank, "matrix_approximation_rank")->check(CLI::PositiveNumber);
  app.add_option("--rounds", rounds, "timed steps; medians are reported")
      ->check(CLI::PositiveNumber);
  app.add_option("--threads", threads, "torch threads")->check(CLI::PositiveNumber);
  app.add_option("--bucket-cap-mb", bucket_cap_mb, "DDP bucket cap")->check(CLI::PositiveNumber);
  app.add_option("--first-bucket-cap-mb", first_bucket_cap_mb, "DDP cap of the first bucket")
      ->check(CLI::PositiveNumber);
  app.add_flag("--quick", quick, "the tiny model, two rounds (a test that the program runs)");
  CLI11_PARSE(app, argc, argv);
  if (quick) {
    model_name = "tiny";
    rounds = 2;
  }
  torch::set_num_threads(threads);
  ::setenv("DDP_QUIET", "1", 0);
  auto group = ddp::init_process_group();  // one process: its allreduce moves nothing

  // The buckets DDP makes for the model, as flat buffers with the gradients as views.
  auto net = make_model(model_name);
  std::vector<torch::Tensor> params = net->parameters();
  std::vector<std::vector<std::size_t>> assignment;
  {
    auto model = ddp::DistributedDataParallel(
        net, group, {.bucket_cap_mb = bucket_cap_mb, .first_bucket_cap_mb = first_bucket_cap_mb});
    assignment = model->reducer().bucket_assignment();
  }
  std::vector<ddp::GradBucket> buckets;
  std::vector<torch::Tensor> sources;  // the gradients each round starts from
  torch::manual_seed(0);
  for (std::size_t b = 0; b < assignment.size(); ++b) {
    std::int64_t numel = 0;
    for (auto p : assignment[b])
      numel += params[p].numel();
    ddp::GradBucket bucket{.index = b, .buffer = torch::empty({numel}), .is_last = false};
    std::int64_t at = 0;
    for (auto p : assignment[b]) {
      bucket.gradients.push_back(
          bucket.buffer.narrow(0, at, params[p].numel()).view(params[p].sizes()));
      at += params[p].numel();
    }
    bucket.is_last = b + 1 == assignment.size();
    sources.push_back(torch::randn({numel}));
    buckets.push_back(std::move(bucket));
  }

  auto state = std::make_shared<ddp::PowerSGDState>(
      ddp::PowerSGDOptions{.matrix_approximation_rank = rank, .start_powersgd_iter = 2});
  const auto hook = ddp::powersgd_hook(state);
  std::vector<std::vector<double>> per_bucket(buckets.size());
  std::vector<double> per_step;
  const int warmup = 3;  // two plain steps, then the first compressed one allocates the memories
  for (int round = 0; round < warmup + rounds; ++round) {
    double step = 0;
    for (std::size_t b = 0; b < buckets.size(); ++b) {
      buckets[b].buffer.copy_(sources[b]);
      const double ms = milliseconds([&] {
        auto reduction = hook(*group, buckets[b]);
        if (reduction.work) reduction.work->wait();
        if (reduction.finish) reduction.finish();
      });
      if (round >= warmup) per_bucket[b].push_back(ms);
      step += ms;
    }
    if (round >= warmup) per_step.push_back(step);
  }

  // What the passes cost: each one alone over every compressed matrix, as single ATen calls on
  // prepared buffers (the profile of issue 28: the three products as PyTorch's hook makes them
  // (bmm) and as matrix-vector products (rank 1), and the error-feedback passes).
  const std::vector<std::string> op_names = {"bmm P=MQ", "bmm Q=M^T P", "bmm M=PQ^T",
                                             "mv P=MQ",  "mv Q=M^T P",  "add_ error",
                                             "copy_",    "sub_ error"};
  std::vector<double> op_ms(op_names.size(), 0.0);
  std::int64_t compressed_numel = 0, total_numel = 0;
  for (std::size_t b = 0; b < buckets.size(); ++b) {
    total_numel += buckets[b].buffer.numel();
    for (const auto& grad : buckets[b].gradients) {
      if (grad.dim() < 2) continue;
      auto matrix = grad.view({1, grad.size(0), -1});
      const auto n = matrix.size(1), m = matrix.size(2);
      const auto r = std::min<std::int64_t>({n, m, rank});
      if (!((n + m) * r * 2 < n * m)) continue;
      compressed_numel += n * m;
      auto p = torch::randn({1, n, r}), q = torch::randn({1, m, r});
      auto pv = torch::randn({n}), qv = torch::randn({m});
      auto error = torch::randn({n * m});
      auto flat = matrix.view({-1});
      auto plain = matrix[0];
      const std::vector<std::function<void()>> ops = {
          [&] { at::bmm_out(p, matrix, q); },
          [&] { at::bmm_out(q, matrix.transpose(1, 2), p); },
          [&] { at::bmm_out(matrix, p, q.transpose(1, 2)); },
          [&] { at::mv_out(pv, plain, qv); },
          [&] { at::mv_out(qv, plain.t(), pv); },
          [&] { flat.add_(error); },
          [&] { error.copy_(flat); },
          [&] { error.sub_(flat); }};
      for (std::size_t o = 0; o < ops.size(); ++o) {
        std::vector<double> times;
        for (int round = 0; round < std::max(3, rounds); ++round)
          times.push_back(milliseconds(ops[o]));
        op_ms[o] += median(times);
      }
    }
  }

  fmt::print("model={} rank={} threads={} rounds={} buckets={} numel={} compressed_numel={}\n",
             model_name, rank, threads, rounds, buckets.size(), total_numel, compressed_numel);
  for (std::size_t b = 0; b < buckets.size(); ++b) {
    fmt::print("bucket {}: numel={} tensors={} hook_ms={:.2f}\n", b, buckets[b].buffer.numel(),
               buckets[b].gradients.size(), median(per_bucket[b]));
  }
  for (std::size_t o = 0; o < op_names.size(); ++o)
    fmt::print("pass {:<13} {:8.2f} ms\n", op_names[o], op_ms[o]);
  fmt::print("hook_step_ms={:.2f}\n", median(per_step));
  return 0;
}
