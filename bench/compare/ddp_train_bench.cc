// ddp-train-bench: median training-step time of DistributedDataParallel, the peer of
// bench/compare/pytorch_ddp_bench.py (PyTorch DDP on gloo). Same models, batch and synthetic data.
//
//   ddprun --standalone --nproc-per-node 2 ddp-train-bench --model mlp --steps 30
//
// A step is zero_grad + forward + cross-entropy + backward (gradients averaged over the ranks
// when it returns) + optimizer step (`--optimizer sgd|adam`; `--sharding zero1` shards its state
// with ddp::ZeroRedundancyOptimizer; `zero2` and `fsdp` wrap the model in
// ddp::FullyShardedDataParallel, SHARD_GRAD_OP and FULL_SHARD, with units of at least
// `--min-num-params` parameters; docs/sharding.md). Each rank takes the median of its step
// times; the slowest rank's median is reported. Rank 0's last line:
// `step_ms=<median> samples_per_s=<world*batch/median> peak_mem_mb=<x> state_mem_mb=<s>
// bytes_per_step=<B>`, where x is the largest rank's peak resident memory (VmHWM) minus its
// resident memory before the model was built (libtorch warmed up first on a tiny model, so that
// its code and thread pools are in that baseline, not charged to the model), s the largest rank's
// resident memory right after the last optimizer step (parameters, gradients and optimizer state
// all live; malloc_trim first, so freed temporaries do not count) minus the same baseline, and B
// the payload one rank handed to collectives for the gradients in a step
// (BackwardTimeline::bytes_sent; 0 with one process). --comm-hook powersgd|batched-powersgd
// (--powersgd-rank r, compression from iteration --powersgd-start-iter, default 2, so within
// the warm-up) and int8 compress it.
// --model-file PATH trains a TorchScript archive instead (torch.jit.script or torch.jit.trace
// exported; its forward takes one [batch, 1, 28, 28] float tensor and returns [batch, 10] logits)
// under ddp::ScriptDistributedDataParallel; tests/torch/ddp/export_torchscript_model.py --model
// bench_cnn exports the cnn, for comparing the two wrappers
// (bench/probes/torchscript_vs_module.py). With one process the model is trained without
// DistributedDataParallel, as the Python peer does, unless --always-ddp (DDP's own cost at world
// 1, e.g. over DDP_BACKEND=nccl).
//
// --device cuda puts the model and the batch on cuda:(LOCAL_RANK % device count), so that two
// ranks share one GPU on a one-GPU machine (through the torch layer's staged path: host twins on
// the ring engine), and synchronises the device before each step's clock is read. Needs a libtorch
// with CUDA and a device; a CUDA tensor the torch layer does not take yet is its named error.
// peak_mem_mb and state_mem_mb are host memory (VmHWM, VmRSS) on either device, and --phases
// times the host's side of each phase there (only the whole step waits for the device).
// With zero2/fsdp a line before the last, `fsdp_buffers place=host|device peak_mb=<p>
// formula_mb=<f> ...`: the most bytes FSDP's unsharded buffers (gathered parameters, full flat
// gradients) held at once in the timed steps (ddp/torch/fsdp/fsdp_memory.h, the largest rank's; on
// the device with --device cuda, where --cpu-offload leaves only shard-sized transients beside
// them), beside docs/sharding.md's formula.
//
// Every flag is range-checked before the job starts: a refusal names the flag, its value and what
// would be valid, and exits 1 (as any other error).
#include <malloc.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <torch/cuda.h>
#include <torch/torch.h>
#include <CLI/CLI.hpp>

#include "bench_timing.h"
#include "common/program_options.h"
#include "ddp/error.h"
#include "ddp/runtime/init.h"
#include "ddp/torch/api/distributed.h"
#include "ddp/torch/core/tensor_collectives.h"
#include "ddp/torch/ddp/distributed_data_parallel.h"
#include "ddp/torch/ddp/hooks/comm_hook_by_name.h"
#include "ddp/torch/ddp/script_distributed_data_parallel.h"
#include "ddp/torch/ddp/sync_batch_norm.h"
#include "ddp/torch/fsdp/fsdp_memory.h"
#include "ddp/torch/fsdp/fully_sharded_data_parallel.h"
#include "ddp/torch/zero/chunked_adam.h"
#include "ddp/torch/zero/zero_redundancy_optimizer.h"

namespace {

// The largest bucket cap: 1 TiB, far above any model here (a cap above the model's size makes one
// bucket), and low enough to count in bytes (1e300 MiB reached DDP as a cap of 0 bytes).
constexpr double kMaxBucketCapMb = 1 << 20;
// --warmup + --steps must stay an int.
constexpr int kMaxSteps = 1'000'000'000;

// Floats per sample, beyond its 784 input pixels, of the built-in model's widest activation: the
// cnn's first convolution (32 x 28 x 28), the MLPs' 4096-wide layers.
double widest_activation(const std::string& model) {
  return model == "cnn" ? 32 * 28 * 28 : 4096;
}

// The TorchScript archive of --model-file, refused by name where it is none or does not map a
// [batch, 1, 28, 28] float batch to [batch, 10] logits (libtorch's own errors named no flag).
torch::jit::Module load_model_file(const std::string& path, const torch::Device& device) {
  // libtorch's message without its backtrace, first line only.
  const auto first_line = [](const c10::Error& e) {
    const std::string text = e.what_without_backtrace();
    return text.substr(0, text.find('\n'));
  };
  auto script = [&] {
    try {
      return torch::jit::load(path, device);
    } catch (const c10::Error& e) {
      throw ddp::ConfigError(
          fmt::format("--model-file '{}' is not a TorchScript archive (torch::jit::load: {}); "
                      "export one with torch.jit.script or torch.jit.trace and .save()",
                      path, first_line(e)));
    } catch (const std::exception& e) {
      throw ddp::ConfigError(fmt::format(
          "--model-file '{}' is not a TorchScript archive (torch::jit::load: {})", path, e.what()));
    }
  }();
  // One forward of two samples in eval mode (no batch-norm statistics change), before anything is
  // timed.
  script.eval();
  try {
    torch::NoGradGuard no_grad;
    const auto logits = script.forward({torch::zeros({2, 1, 28, 28}).to(device)});
    if (!logits.isTensor() || logits.toTensor().sizes() != c10::IntArrayRef{2, 10}) {
      throw ddp::ConfigError(fmt::format(
          "--model-file '{}': its forward of a [2, 1, 28, 28] float batch returned {}, not [2, 10] "
          "logits",
          path,
          logits.isTensor() ? "a tensor of shape " + c10::str(logits.toTensor().sizes())
                            : fmt::format("a {}", logits.tagKind())));
    }
  } catch (const c10::Error& e) {
    throw ddp::ConfigError(
        fmt::format("--model-file '{}': its forward of a [2, 1, 28, 28] float batch failed: {}",
                    path, first_line(e)));
  }
  script.train();
  return script;
}

torch::nn::Sequential make_model(const std::string& name) {
  namespace nn = torch::nn;
  if (name == "large") {  // 53.6 M parameters
    return nn::Sequential(nn::Flatten(), nn::Linear(784, 4096), nn::ReLU(), nn::Linear(4096, 4096),
                          nn::ReLU(), nn::Linear(4096, 4096), nn::ReLU(), nn::Linear(4096, 4096),
                          nn::ReLU(), nn::Linear(4096, 10));
  }
  if (name == "mlp") {
    return nn::Sequential(nn::Flatten(), nn::Linear(784, 4096), nn::ReLU(), nn::Linear(4096, 4096),
                          nn::ReLU(), nn::Linear(4096, 10));
  }
  return nn::Sequential(nn::Conv2d(nn::Conv2dOptions(1, 32, 3).padding(1)), nn::BatchNorm2d(32),
                        nn::ReLU(), nn::MaxPool2d(2),
                        nn::Conv2d(nn::Conv2dOptions(32, 64, 3).padding(1)), nn::BatchNorm2d(64),
                        nn::ReLU(), nn::MaxPool2d(2), nn::Flatten(), nn::Linear(3136, 128),
                        nn::ReLU(), nn::Linear(128, 10));
}

// A field of /proc/self/status in MiB (VmRSS: resident now, VmHWM: peak resident), 0 if absent.
// The largest of every rank's `value`, through the tensor API: a group over device memory (nccl)
// reads no host buffer, so the value travels on `device` there.
double max_over_ranks(ddp::ProcessGroup& group, double value, const torch::Device& device) {
  const bool on_device = group.memory_space() == ddp::MemorySpace::kCuda;
  auto tensor = torch::full(
      {1}, value, torch::TensorOptions(torch::kFloat64).device(on_device ? device : torch::kCPU));
  ddp::all_reduce(tensor, ddp::ReduceOp::kMax, group);
  return tensor.item<double>();
}

double status_mib(const std::string& field) {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);) {
    if (line.rfind(field + ":", 0) == 0) return std::stod(line.substr(field.size() + 1)) / 1024.0;
  }
  return 0.0;
}

// Runs one training step of a tiny model with the optimizer the benchmark uses, so that the pages
// of libtorch's code and its lazily created state that any model touches are resident before the
// baseline is read; then gives freed memory back.
void warm_up_libtorch(const std::string& optimizer_name, int batch_size) {
  namespace nn = torch::nn;
  nn::Sequential tiny(nn::Flatten(), nn::Linear(784, 16), nn::ReLU(), nn::Linear(16, 10));
  std::unique_ptr<torch::optim::Optimizer> opt;
  if (optimizer_name == "adam") {
    opt = std::make_unique<torch::optim::Adam>(tiny->parameters(), torch::optim::AdamOptions(1e-3));
  } else if (optimizer_name == "chunked-adam") {
    opt = std::make_unique<ddp::ChunkedAdam>(tiny->parameters(), torch::optim::AdamOptions(1e-3));
  } else {
    opt = std::make_unique<torch::optim::SGD>(tiny->parameters(),
                                              torch::optim::SGDOptions(0.01).momentum(0.9));
  }
  const auto x = torch::randn({batch_size, 1, 28, 28});
  const auto y = torch::randint(0, 10, {batch_size});
  for (int i = 0; i < 2; ++i) {
    opt->zero_grad();
    torch::nn::functional::cross_entropy(tiny->forward(x), y).backward();
    opt->step();
  }
  malloc_trim(0);
}

// The device of --device for this process: cpu, or cuda:(LOCAL_RANK % device count), chosen
// before the process group exists (as a PyTorch script calls torch.cuda.set_device first).
torch::Device pick_device(const std::string& name) {
  if (name == "cpu") return torch::kCPU;
  if (!torch::cuda::is_available()) {
    throw std::runtime_error(
        "--device cuda, but this libtorch sees no CUDA device (torch::cuda::is_available() is "
        "false: a libtorch without CUDA, no GPU, or no driver). Run on a GPU machine with a "
        "CUDA-enabled libtorch (scripts/gpu-check.sh, docs/gpu.md), or use --device cpu");
  }
  const auto count = static_cast<int>(torch::cuda::device_count());
  int local_rank = 0;
  if (const char* text = std::getenv("LOCAL_RANK"); text != nullptr && *text != '\0') {
    try {
      local_rank = std::stoi(text);
    } catch (const std::exception&) {
      throw std::runtime_error(fmt::format("LOCAL_RANK is '{}', not a number", text));
    }
  }
  if (local_rank < 0) throw std::runtime_error(fmt::format("LOCAL_RANK is {}", local_rank));
  return {torch::kCUDA, static_cast<c10::DeviceIndex>(local_rank % count)};
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "Median DistributedDataParallel training-step time (peer: "
      "bench/compare/pytorch_ddp_bench.py)"};
  std::string model_name = "mlp";
  int steps = 30;
  int warmup = 5;
  int batch_size = 64;
  int threads = 1;
  double bucket_cap_mb = 25.0;
  double first_bucket_cap_mb = 1.0;
  bool as_view = false;
  std::string hook = "none";
  bool phases = false;
  bool broadcast_buffers = true;
  std::optional<std::int64_t> divergence_check_every;  // unset: the library's default
  bool check_costs = false;
  bool sync_bn = false;
  std::string device_name = "cpu";
  bool always_ddp = false;
  auto* model_option =
      app.add_option("--model", model_name, "cnn, mlp or large (an mlp of 53.6 M parameters)")
          ->check(CLI::IsMember({"cnn", "mlp", "large"}));
  std::string model_file;
  app.add_option("--model-file", model_file,
                 "a TorchScript archive to train instead (forward: [batch, 1, 28, 28] float -> "
                 "[batch, 10] logits), under ddp::ScriptDistributedDataParallel")
      ->check(ddp_programs::kReadableFile)
      ->excludes(model_option);
  std::string optimizer_name = "sgd";
  app.add_option("--optimizer", optimizer_name,
                 "sgd (momentum 0.9), adam (libtorch's, also as ZeRO's local optimizer) or "
                 "chunked-adam (ddp::ChunkedAdam: the same state and results without "
                 "parameter-sized temporaries; ZeRO's default for AdamOptions)")
      ->check(CLI::IsMember({"sgd", "adam", "chunked-adam"}));
  std::string sharding = "ddp";
  app.add_option("--sharding", sharding,
                 "ddp (every rank holds the optimizer state), zero1 (ZeroRedundancyOptimizer), "
                 "zero1-overlap (its step in DDP's comm hook: overlap_with_ddp), zero2 "
                 "(FullyShardedDataParallel SHARD_GRAD_OP) or fsdp (FULL_SHARD)")
      ->check(CLI::IsMember({"ddp", "zero1", "zero1-overlap", "zero2", "fsdp"}));
  std::int64_t min_num_params = 1'000'000;
  app.add_option("--min-num-params", min_num_params,
                 "zero2/fsdp: a unit closes once it holds this many parameters")
      ->check(CLI::Range(std::int64_t{1}, std::int64_t{1} << 40));
  std::string param_dtype_name = "float32";
  app.add_option("--param-dtype", param_dtype_name,
                 "float32, or bfloat16: forward and backward in bf16 from fp32 master weights "
                 "(DDP's param_dtype; zero2/fsdp: FsdpMixedPrecision::param_dtype, reduced in "
                 "bf16); buffers in bf16 too (buffer_dtype); the logits are upcast for the loss")
      ->check(CLI::IsMember({"float32", "bfloat16"}));
  bool keep_free_heap = false;
  app.add_flag("--keep-free-heap", keep_free_heap,
               "zero2/fsdp: FsdpOptions::release_free_heap = false (malloc keeps freed memory)");
  bool cpu_offload = false;
  app.add_flag(
      "--cpu-offload", cpu_offload,
      "zero2/fsdp: FsdpOptions::cpu_offload.offload_params (with --device cuda the shards, "
      "their gradients and the optimizer step on the host; on the CPU a no-op)");
  app.add_option("--device", device_name,
                 "cpu, or cuda: cuda:(LOCAL_RANK % device count); two ranks may share a GPU")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  app.add_flag("--always-ddp", always_ddp,
               "wrap the model in DistributedDataParallel also with one process (DDP's own cost)");
  app.add_option("--steps", steps, "timed steps")->check(CLI::Range(1, kMaxSteps));
  app.add_option("--warmup", warmup, "untimed steps first")->check(CLI::Range(0, kMaxSteps));
  app.add_option("--batch-size", batch_size, "samples per rank and step")
      ->check(CLI::Range(1, std::numeric_limits<int>::max()));
  app.add_option("--threads", threads, "torch threads per rank")->check(ddp_programs::kThreads);
  app.add_option("--bucket-cap-mb", bucket_cap_mb, "DDP bucket cap (MiB)")
      ->check(ddp_programs::positive_at_most(kMaxBucketCapMb, "MiB"));
  app.add_option("--first-bucket-cap-mb", first_bucket_cap_mb, "DDP cap of the first bucket (MiB)")
      ->check(ddp_programs::positive_at_most(kMaxBucketCapMb, "MiB"));
  app.add_flag("--gradient-as-bucket-view", as_view, "gradients are views of the buckets");
  int powersgd_rank = 1;
  std::int64_t powersgd_start = 2;
  app.add_option(
         "--comm-hook", hook,
         "none, fp16, bf16, powersgd, batched-powersgd, int8 or noop (no communication: the bound)")
      ->check(CLI::IsMember(ddp::comm_hook_names()));
  app.add_option("--powersgd-rank", powersgd_rank, "PowerSGD's matrix_approximation_rank")
      ->check(CLI::Range(1, std::numeric_limits<int>::max()));
  app.add_option("--powersgd-start-iter", powersgd_start,
                 "PowerSGD's start_powersgd_iter (>= 2; keep it <= --warmup to time compression)")
      ->check(CLI::Range(std::int64_t{2}, std::int64_t{1} << 40));
  app.add_flag(
      "!--no-broadcast-buffers", broadcast_buffers,
      "DDP option broadcast_buffers = false (rank 0's buffers are not broadcast in forward)");
  app.add_option("--divergence-check-every", divergence_check_every,
                 "DDP option divergence_check_every (0 = off; default: the library's, "
                 "DDP_DIVERGENCE_CHECK_EVERY or ddp::kDefaultDivergenceCheckEvery)")
      ->check(CLI::Range(std::int64_t{0}, std::numeric_limits<std::int64_t>::max()));
  app.add_flag("--check-costs", check_costs,
               "also time DDP's per-forward parameter check and one divergence check (rank 0)");
  app.add_flag("--sync-bn", sync_bn, "the cnn's BatchNorms become ddp::SyncBatchNorm");
  app.add_flag("--phases", phases,
               "also print each rank's median time per phase of a step (zero_grad, forward, "
               "backward until autograd finished, waiting for the last bucket, optimizer step)");
  if (const auto code = ddp_programs::parse_command_line(app, argc, argv, "ddp-train-bench")) {
    return *code;
  }
  const bool fully_sharded = sharding == "zero2" || sharding == "fsdp";
  if (!model_file.empty() && (sync_bn || fully_sharded)) {
    fmt::print(stderr,
               "ddp-train-bench: --model-file trains a TorchScript module under "
               "ScriptDistributedDataParallel; --sync-bn and --sharding zero2/fsdp need the "
               "built-in models (libtorch modules)\n");
    return 1;
  }
  if (cpu_offload && !fully_sharded) {
    fmt::print(stderr, "ddp-train-bench: --cpu-offload is FSDP's: add --sharding zero2 or fsdp\n");
    return 1;
  }
  if (!model_file.empty()) model_name = "file:" + model_file;
  std::optional<torch::ScalarType> param_dtype;
  if (param_dtype_name == "bfloat16") param_dtype = torch::kBFloat16;

  std::string where;  // the device, in error messages of CUDA runs
  try {
    // The batch (made on the host, whatever the device) and, on the CPU, the built-in model's
    // widest activation of it: a lower bound of what a rank holds.
    const bool widest_counted = device_name == "cpu" && model_file.empty();
    ddp_programs::check_fits_in_memory(
        4.0 * (784.0 + (widest_counted ? widest_activation(model_name) : 0.0)) * batch_size,
        fmt::format("--batch-size {}{} ({})", batch_size,
                    model_file.empty() ? fmt::format(" of --model {}", model_name) : "",
                    widest_counted ? "the input batch and the model's widest activation on it"
                                   : "the input batch"));
    torch::set_num_threads(threads);
    const torch::Device device = pick_device(device_name);
    if (device.is_cuda()) where = fmt::format(" (--device cuda: {})", device.str());
    // Step times must include the device's work, which runs asynchronously to the host.
    auto sync_device = [&] {
      if (device.is_cuda()) torch::cuda::synchronize(device.index());
    };
    auto group = ddp::init_process_group();
    const int rank = group->rank();
    const int world = group->size();
    warm_up_libtorch(optimizer_name, batch_size);
    torch::manual_seed(1234);
    const double rss_before_model_mib = status_mib("VmRSS");
    // The model: a built-in nn::Sequential (net) or a TorchScript module (script).
    torch::nn::Sequential net{nullptr};
    std::optional<torch::jit::Module> script;
    std::vector<torch::Tensor> model_params;
    if (model_file.empty()) {
      net = make_model(model_name);
      net->to(device);
      if (sync_bn) ddp::convert_sync_batchnorm(net.ptr(), group);
      model_params = net->parameters();
    } else {
      script = load_model_file(model_file, device);
      for (const auto& p : script->parameters())
        model_params.push_back(p);
    }
    // DDP's wrapper of either kind (the type-independent part is all the loop needs), and the
    // forward of whatever trains.
    std::shared_ptr<ddp::DistributedDataParallelBase> ddp_model;
    std::function<torch::Tensor(const torch::Tensor&)> forward;
    std::shared_ptr<ddp::FullyShardedDataParallelImpl> fsdp_model;
    const ddp::DdpOptions ddp_options{.bucket_cap_mb = bucket_cap_mb,
                                      .first_bucket_cap_mb = first_bucket_cap_mb,
                                      .broadcast_buffers = broadcast_buffers,
                                      .gradient_as_bucket_view = as_view,
                                      .divergence_check_every = divergence_check_every,
                                      .param_dtype = param_dtype,
                                      .buffer_dtype = param_dtype};
    if (fully_sharded) {
      fsdp_model =
          ddp::FullyShardedDataParallel(
              net, group,
              ddp::FsdpOptions{
                  .sharding_strategy = sharding == "fsdp" ? ddp::ShardingStrategy::kFullShard
                                                          : ddp::ShardingStrategy::kShardGradOp,
                  .min_num_params = min_num_params,
                  .mixed_precision = {.param_dtype = param_dtype, .buffer_dtype = param_dtype},
                  .cpu_offload = {.offload_params = cpu_offload},
                  .release_free_heap = !keep_free_heap})
              .ptr();
      forward = [&](const torch::Tensor& x) { return fsdp_model->forward(x); };
    } else if ((world > 1 || always_ddp) && script) {
      auto wrapped = ddp::ScriptDistributedDataParallel(*script, group, ddp_options).ptr();
      forward = [wrapped](const torch::Tensor& x) { return wrapped->forward(x); };
      ddp_model = wrapped;
    } else if (world > 1 || always_ddp) {
      auto wrapped = ddp::DistributedDataParallel(net, group, ddp_options).ptr();
      forward = [wrapped](const torch::Tensor& x) { return wrapped->forward(x); };
      ddp_model = wrapped;
    } else if (script) {
      forward = [&](const torch::Tensor& x) { return script->forward({x}).toTensor(); };
    } else {
      forward = [&](const torch::Tensor& x) { return net->forward(x); };
    }
    std::optional<ddp::CommHook> chosen_hook;
    if (ddp_model) {
      auto chosen = ddp::comm_hook_from_name(
          hook, {.powersgd_rank = powersgd_rank, .powersgd_start_iter = powersgd_start});
      chosen_hook = chosen.hook;
      if (chosen.hook) ddp_model->register_comm_hook(*chosen.hook, hook);
    }
    const auto sgd = torch::optim::SGDOptions(0.01).momentum(0.9);
    const auto adam = torch::optim::AdamOptions(1e-3);
    std::unique_ptr<torch::optim::Optimizer> optimizer;
    // FullyShardedDataParallel: the optimizer steps on the shards.
    const auto params = fsdp_model ? fsdp_model->parameters() : model_params;
    if (sharding == "zero1" || sharding == "zero1-overlap") {
      const ddp::ZeroOptions zero_options{.overlap_with_ddp = sharding == "zero1-overlap"};
      auto zero = optimizer_name == "adam"
                      ? std::make_unique<ddp::ZeroRedundancyOptimizer>(
                            model_params, ddp::optimizer_factory<torch::optim::Adam>(adam), group,
                            zero_options)
                  : optimizer_name == "chunked-adam"
                      ? std::make_unique<ddp::ZeroRedundancyOptimizer>(model_params, adam, group,
                                                                       zero_options)
                      : std::make_unique<ddp::ZeroRedundancyOptimizer>(model_params, sgd, group,
                                                                       zero_options);
      if (zero_options.overlap_with_ddp) {
        if (!ddp_model) {
          throw ddp::ConfigError(
              "--sharding zero1-overlap steps in DDP's comm hook: run at world >= 2 (or with "
              "--always-ddp)");
        }
        ddp_model->register_comm_hook(
            ddp::hook_with_zero_step(chosen_hook.value_or(ddp::allreduce_hook()), *zero),
            "zero:" + hook);
      }
      optimizer = std::move(zero);
    } else if (optimizer_name == "adam") {
      optimizer = std::make_unique<torch::optim::Adam>(params, adam);
    } else if (optimizer_name == "chunked-adam") {
      optimizer = std::make_unique<ddp::ChunkedAdam>(params, adam);
    } else {
      optimizer = std::make_unique<torch::optim::SGD>(params, sgd);
    }
    auto& opt = *optimizer;
    torch::manual_seed(100 + rank);
    const auto x = torch::randn({batch_size, 1, 28, 28}).to(device);
    const auto y = torch::randint(0, 10, {batch_size}).to(device);
    sync_device();

    using Clock = std::chrono::steady_clock;
    auto ms = [](Clock::duration d) {
      return std::chrono::duration<double, std::milli>(d).count();
    };
    std::vector<double> step_seconds;
    std::vector<double> step_bytes;
    // zero_grad, forward, backward compute, waiting for the reductions, optimizer step (ms).
    std::vector<std::vector<double>> phase_ms(5);
    double state_mem_mb = 0.0;
    for (int step = 0; step < warmup + steps; ++step) {
      if (step == warmup) ddp::reset_fsdp_buffer_peak();  // the timed steps' peak
      const auto start = Clock::now();
      opt.zero_grad();
      const auto zeroed = Clock::now();
      auto logits = forward(x);
      const auto forwarded = Clock::now();
      torch::nn::functional::cross_entropy(logits.to(torch::kFloat), y).backward();
      const auto backward_returned = Clock::now();
      opt.step();
      sync_device();
      const auto stop = Clock::now();
      const std::chrono::duration<double> elapsed = stop - start;
      if (step + 1 == warmup + steps) {
        // Parameters, gradients and optimizer state are all live here; temporaries are freed.
        malloc_trim(0);
        state_mem_mb = status_mib("VmRSS") - rss_before_model_mib;
      }
      if (step < warmup) continue;
      step_seconds.push_back(elapsed.count());
      step_bytes.push_back(
          ddp_model ? static_cast<double>(ddp_model->reducer().last_timeline().bytes_sent) : 0.0);
      const auto computed =
          ddp_model ? ddp_model->reducer().last_timeline().backward_finished : backward_returned;
      phase_ms[0].push_back(ms(zeroed - start));
      phase_ms[1].push_back(ms(forwarded - zeroed));
      phase_ms[2].push_back(ms(computed - forwarded));
      phase_ms[3].push_back(ms(backward_returned - computed));
      phase_ms[4].push_back(ms(stop - backward_returned));
    }
    if (phases) {
      fmt::print(
          "rank {} phases_ms zero_grad={:.2f} forward={:.2f} backward={:.2f} sync_wait={:.2f} "
          "step={:.2f} total={:.2f}\n",
          rank, median(phase_ms[0]), median(phase_ms[1]), median(phase_ms[2]), median(phase_ms[3]),
          median(phase_ms[4]), 1e3 * median(step_seconds));
      std::fflush(stdout);
    }
    if (check_costs && ddp_model) {
      // The local check that runs before every forward, and one divergence check (collective).
      std::vector<double> check_us;
      for (int i = 0; i < 1000; ++i) {
        const auto start = Clock::now();
        ddp_model->check_parameters();
        check_us.push_back(1e3 * ms(Clock::now() - start));
      }
      std::vector<double> divergence_ms;
      for (int i = 0; i < 20; ++i) {
        const auto start = Clock::now();
        ddp_model->check_divergence();
        divergence_ms.push_back(ms(Clock::now() - start));
      }
      // The divergence guard's per-forward flag: one 4-byte allgather.
      std::vector<double> flag_us;
      std::vector<std::int32_t> flags(static_cast<std::size_t>(world));
      for (int i = 0; i < 1000; ++i) {
        const std::int32_t mine = 0;
        const auto start = Clock::now();
        group->allgather(&mine, flags.data(), 1, ddp::DType::kInt32)->wait();
        flag_us.push_back(1e3 * ms(Clock::now() - start));
      }
      if (rank == 0) {
        const double every =
            static_cast<double>(ddp_model->options().divergence_check_every.value_or(0));
        const double guard_ms =
            every > 0 ? 1e-3 * median(flag_us) + median(divergence_ms) / every : 0.0;
        fmt::print(
            "check_parameters_us={:.2f} check_divergence_ms={:.3f} guard_flag_us={:.2f} "
            "guard_every={} guard_ms_per_step={:.4f} guard_share_of_step={:.4f} step_ms={:.3f}\n",
            median(check_us), median(divergence_ms), median(flag_us), every, guard_ms,
            guard_ms / (1e3 * median(step_seconds)), 1e3 * median(step_seconds));
        std::fflush(stdout);
      }
    }
    const double step_s = max_over_ranks(*group, median(step_seconds), device);
    const double peak_mem_mb =
        max_over_ranks(*group, status_mib("VmHWM") - rss_before_model_mib, device);
    state_mem_mb = max_over_ranks(*group, state_mem_mb, device);
    const auto place =
        device.is_cuda() ? ddp::FsdpMemoryPlace::kDevice : ddp::FsdpMemoryPlace::kHost;
    const double fsdp_peak_mb = max_over_ranks(
        *group, static_cast<double>(ddp::fsdp_buffer_bytes(place).peak) / (1 << 20), device);
    group->barrier()->wait();
    if (rank == 0) {
      // Ψ, and the largest FSDP unit's parameter count: what the memory formulas need.
      std::int64_t params = 0;
      for (const auto& p : model_params)
        params += p.numel();
      std::int64_t largest_unit = 0;
      for (std::size_t u = 0; fsdp_model && u < fsdp_model->unit_count(); ++u) {
        largest_unit = std::max(largest_unit, fsdp_model->unit_info(u).numel);
      }
      fmt::print(
          "model={} world_size={} batch_size={} threads={} steps={} backend={} optimizer={} "
          "sharding={} params={} largest_unit_params={} param_dtype={} device={} ddp={}\n",
          model_name, world, batch_size, threads, steps, group->backend(), optimizer_name, sharding,
          params, largest_unit, param_dtype_name, device_name,
          (ddp_model || fsdp_model) ? "on" : "off");
      if (fsdp_model) {
        // docs/sharding.md's formula for FSDP's unsharded buffers (U: the largest unit's padded
        // size, b: bytes per element of param_dtype): FULL_SHARD two gathered units and two units'
        // full flat gradients, b·(2U + 2U); SHARD_GRAD_OP every unit gathered instead of two.
        std::int64_t unit = 0, all_units = 0;
        for (std::size_t u = 0; u < fsdp_model->unit_count(); ++u) {
          unit = std::max(unit, fsdp_model->unit_info(u).padded_numel);
          all_units += fsdp_model->unit_info(u).padded_numel;
        }
        const double b = param_dtype ? 2.0 : 4.0;
        const double gathered = static_cast<double>(sharding == "fsdp" ? 2 * unit : all_units);
        const double formula_mb = b * (gathered + 2.0 * static_cast<double>(unit)) / (1 << 20);
        fmt::print(
            "fsdp_buffers place={} peak_mb={:.1f} formula_mb={:.1f} peak_over_formula={:.3f} "
            "cpu_offload={}\n",
            device.is_cuda() ? "device" : "host", fsdp_peak_mb, formula_mb,
            fsdp_peak_mb / formula_mb, cpu_offload ? "on" : "off");
      }
      fmt::print(
          "step_ms={:.3f} samples_per_s={:.1f} peak_mem_mb={:.1f} state_mem_mb={:.1f} "
          "bytes_per_step={:.0f}\n",
          step_s * 1e3, world * batch_size / step_s, peak_mem_mb, state_mem_mb, median(step_bytes));
    }
    return 0;
  } catch (const ddp::Error& e) {
    fmt::print(stderr, "ddp-train-bench{}: {}\n", where, e.what());
    return 1;
  } catch (const c10::Error& e) {
    // libtorch's errors, e.g. an allocation over a memory limit (docs/sharding.md): a named exit,
    // not std::terminate, so the launcher reports the rank's failure and its reason (without
    // libtorch's 30-frame backtrace).
    fmt::print(stderr, "ddp-train-bench{}: error: {}\n", where, e.what_without_backtrace());
    return 1;
  } catch (const std::exception& e) {
    fmt::print(stderr, "ddp-train-bench{}: error: {}\n", where, e.what());
    return 1;
  }
}
