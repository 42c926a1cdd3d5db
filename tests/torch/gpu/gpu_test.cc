// ddp on CUDA tensors (issue 25): DistributedDataParallel (and ZeRO) with both ranks on cuda:0
// through the ring (a host group: buckets staged through pinned host twins), the tensor API on
// CUDA tensors, checkpoints moved between CUDA and the CPU with map_location. Needs a CUDA device;
// every test skips with "no CUDA device" where there is none.
//
// CUDA is only ever initialised in the rank processes (run_ranks forks them, and a child cannot
// use CUDA that its parent initialised), so whether a device exists is asked in a child too.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <functional>
#include <stdexcept>
#include <string>
#include <system_error>

#include <fmt/format.h>
#ifdef DDP_TEST_CUDA_ALLOCATOR
#include <c10/cuda/CUDACachingAllocator.h>
#endif

#include "comm/file_store.h"
#include "ddp/comm/nccl_process_group.h"
#include "ddp/runtime/init.h"
#include "ddp/torch/api/distributed.h"
#include "ddp/torch/api/distributed_objects.h"
#include "ddp/torch/api/join.h"
#include "ddp/torch/checkpoint/checkpoint.h"
#include "ddp/torch/core/tensor_collectives.h"
#include "ddp/torch/ddp/distributed_data_parallel.h"
#include "ddp/torch/ddp/grad_scaler.h"
#include "ddp/torch/ddp/hooks/powersgd_hook.h"
#include "ddp/torch/ddp/hooks/quantized_hook.h"
#include "ddp/torch/ddp/sync_batch_norm.h"
#include "ddp/torch/fsdp/fsdp_memory.h"
#include "ddp/torch/fsdp/fully_sharded_data_parallel.h"
#include "ddp/torch/parallel/pipeline/pipeline.h"
#include "ddp/torch/recompute/activation_checkpoint.h"
#include "ddp/torch/zero/zero_redundancy_optimizer.h"
#include "support/multiprocess.h"
#include "support/temp_dir.h"
#include "support/torch/ddp_test_models.h"
#include "support/torch/ddp_test_util.h"

namespace ddp {
namespace {

bool cuda_device_present() {
  static const bool present = [] {
    const pid_t pid = ::fork();
    if (pid == 0) ::_exit(torch::cuda::is_available() ? 0 : 1);
    int status = 0;
    if (pid < 0 || ::waitpid(pid, &status, 0) != pid) return false;
    return WIFEXITED(status) && WEXITSTATUS(status) == 0;
  }();
  return present;
}

#define SKIP_WITHOUT_CUDA()             \
  do {                                  \
    if (!cuda_device_present()) {       \
      GTEST_SKIP() << "no CUDA device"; \
    }                                   \
  } while (false)

#define SKIP_WITHOUT_CUDA_OR_NCCL()                                                           \
  do {                                                                                        \
    SKIP_WITHOUT_CUDA();                                                                      \
    if (!nccl_backend_available()) {                                                          \
      GTEST_SKIP() << "the nccl backend is not built: " << nccl_backend_unavailable_reason(); \
    }                                                                                         \
  } while (false)

// A nccl group of one rank on cuda:0 (one GPU allows no more), meeting through files in `dir`.
std::shared_ptr<ProcessGroup> nccl_world_of_one(const test::TempDir& dir) {
  return make_nccl_process_group(std::make_shared<test::FileStore>(dir.path()), 0, 1,
                                 {.device = 0});
}

// Runs `body` in one forked rank (CUDA is initialised there only) with a nccl group of one on
// cuda:0, meeting through files in a temporary directory named `name`.
void on_nccl_world_of_one(const char* name,
                          const std::function<void(const std::shared_ptr<ProcessGroup>&)>& body) {
  const auto results = test::run_ranks(1, [&](int) {
    test::TempDir dir(name);
    body(nccl_world_of_one(dir));
  });
  EXPECT_ALL_RANKS_OK(results);
}

// init_process_group with DDP_BACKEND=auto for a job of one rank (master on `port`): the ring
// group, and a nccl group for CUDA tensors where this process can drive the GPU.
std::shared_ptr<ProcessGroup> init_auto_world_of_one(int port) {
  InitOptions options;
  options.launch.rank = 0;
  options.launch.world_size = 1;
  options.launch.master_addr = "127.0.0.1";
  options.launch.master_port = port;
  options.backend = "auto";
  return init_process_group(options);
}

void require(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error(what);
}

const torch::Device kCuda0(torch::kCUDA, 0);

// Trains an Mlp for 5 steps on 2 ranks, both on cuda:0, with per-rank batch 8, after `setup`
// (a comm hook); returns rank 0's final parameters on the CPU through `out` (rank 0 checks).
// Every rank checks after every step that both hold bit-identical parameters.
void train_on_cuda(int rank, const std::shared_ptr<ProcessGroup>& pg, const test::Batches& data,
                   const torch::Device& device,
                   const std::function<void(DistributedDataParallelBase&)>& setup,
                   std::vector<torch::Tensor>& out, bool zero = false) {
  torch::manual_seed(100 + rank);  // different on every rank: construction must broadcast
  test::Mlp net;
  net->to(device);
  DistributedDataParallel model(net.ptr(), pg);
  if (setup) setup(*model);
  // make_sgd's options, whole or sharded by ZeRO (its shard broadcasts staged on the ring).
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  if (zero) {
    optimizer = std::make_unique<ZeroRedundancyOptimizer>(
        model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9), pg);
  } else {
    optimizer = std::make_unique<torch::optim::SGD>(test::make_sgd(model->parameters()));
  }
  auto& opt = *optimizer;
  for (int step = 0; step < data.inputs.size(0); ++step) {
    opt.zero_grad();
    const auto x = data.inputs[step].narrow(0, rank * 8, 8).to(device);
    const auto y = data.targets[step].narrow(0, rank * 8, 8).to(device);
    torch::nn::functional::cross_entropy(model->forward(x), y).backward();
    for (const auto& p : model->parameters())
      require(p.grad().device() == device, "a gradient left its device");
    opt.step();
    std::vector<torch::Tensor> on_cpu;
    for (const auto& p : model->parameters())
      on_cpu.push_back(p.detach().cpu());
    test::expect_identical_across_ranks(*pg, on_cpu, fmt::format("parameters after step {}", step));
  }
  out.clear();
  for (const auto& p : model->parameters())
    out.push_back(p.detach().cpu());
}

std::vector<torch::Tensor> one_process(const test::Batches& data, const torch::Device& device) {
  torch::manual_seed(100);
  test::Mlp reference;
  reference->to(device);
  auto opt = test::make_sgd(reference->parameters());
  for (int step = 0; step < data.inputs.size(0); ++step) {
    opt.zero_grad();
    torch::nn::functional::cross_entropy(reference->forward(data.inputs[step].to(device)),
                                         data.targets[step].to(device))
        .backward();
    opt.step();
  }
  std::vector<torch::Tensor> params;
  for (const auto& p : reference->parameters())
    params.push_back(p.detach().cpu());
  return params;
}

void expect_all_close(const std::vector<torch::Tensor>& got, const std::vector<torch::Tensor>& want,
                      double tolerance) {
  require(got.size() == want.size(), "parameter counts differ");
  for (std::size_t i = 0; i < got.size(); ++i)
    test::expect_close(got[i], want[i], fmt::format("parameter {}", i), tolerance,
                       std::max(1e-6, tolerance * 0.1));
}

TEST(Gpu, DdpOnCudaThroughTheStagedRingEqualsOneProcess) {
  SKIP_WITHOUT_CUDA();
  const int port = test::free_port();
  const auto results = test::run_ranks(2, [&](int rank) {
    auto pg = test::join_group(rank, 2, port);
    const auto data = test::make_batches(5, 16, {20});
    std::vector<torch::Tensor> got;
    train_on_cuda(rank, pg, data, kCuda0, nullptr, got);
    if (rank == 0) expect_all_close(got, one_process(data, kCuda0), 1e-5);
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(Gpu, ZeroOnCudaThroughTheStagedRingEqualsOneProcess) {
  SKIP_WITHOUT_CUDA();
  const int port = test::free_port();
  const auto results = test::run_ranks(2, [&](int rank) {
    auto pg = test::join_group(rank, 2, port);
    const auto data = test::make_batches(5, 16, {20});
    std::vector<torch::Tensor> got;
    train_on_cuda(rank, pg, data, kCuda0, nullptr, got, /*zero=*/true);
    if (rank == 0) expect_all_close(got, one_process(data, kCuda0), 1e-5);
  });
  EXPECT_ALL_RANKS_OK(results);
}

// FullyShardedDataParallel with its flat buffers on cuda:0: `world` ranks on the same batches
// (each its share), the full parameters gathered to rank 0 on the CPU at the end.
torch::nn::Sequential fsdp_test_model() {
  torch::manual_seed(11);
  return torch::nn::Sequential(torch::nn::Linear(20, 32), torch::nn::Tanh(),
                               torch::nn::Linear(32, 16), torch::nn::Tanh(),
                               torch::nn::Linear(16, 4));
}

// With `offload` (FsdpCpuOffload), the shards must be pinned host memory and their gradients and
// the optimizer's state host memory; without, all of them on the GPU.
std::vector<torch::Tensor> train_fsdp_on_cuda(int rank, int world,
                                              const std::shared_ptr<ProcessGroup>& pg,
                                              const test::Batches& data, ShardingStrategy strategy,
                                              bool offload = false) {
  auto net = fsdp_test_model();
  net->to(kCuda0);
  FullyShardedDataParallel model(net, pg,
                                 FsdpOptions{.sharding_strategy = strategy,
                                             .min_num_params = 500,
                                             .cpu_offload = {.offload_params = offload}});
  for (const auto& p : model->parameters()) {
    if (offload) {
      require(p.is_cpu() && p.is_pinned(), "an offloaded shard is not in pinned host memory");
    } else {
      require(p.is_cuda(), "a shard is not on the GPU");
    }
  }
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  const auto share = data.inputs.size(1) / world;
  for (int step = 0; step < data.inputs.size(0); ++step) {
    opt.zero_grad();
    const auto x = data.inputs[step].narrow(0, rank * share, share).to(kCuda0);
    model->forward(x).pow(2).mean().backward();
    for (const auto& p : model->parameters()) {
      require(!p.grad().defined() || p.grad().is_cuda() != offload,
              offload ? "an offloaded shard's gradient is on the GPU" : "a gradient left the GPU");
    }
    model->clip_grad_norm_(1.0);
    opt.step();
  }
  if (offload) {
    require(opt.state().size() == model->parameters().size(), "a shard has no optimizer state");
    for (const auto& entry : opt.state()) {
      const auto& momentum =
          static_cast<const torch::optim::SGDParamState&>(*entry.second).momentum_buffer();
      require(momentum.is_cpu(), "the optimizer's state of an offloaded shard is on the GPU");
    }
  }
  std::vector<torch::Tensor> full;
  for (const auto& item : model->full_state_dict(0))
    full.push_back(item.value().cpu());
  return full;
}

// The same model on the whole batch in one process, on the GPU, with the same clipping.
std::vector<torch::Tensor> fsdp_reference(const test::Batches& data) {
  auto net = fsdp_test_model();
  net->to(kCuda0);
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  for (int step = 0; step < data.inputs.size(0); ++step) {
    opt.zero_grad();
    net->forward(data.inputs[step].to(kCuda0)).pow(2).mean().backward();
    torch::nn::utils::clip_grad_norm_(net->parameters(), 1.0);
    opt.step();
  }
  std::vector<torch::Tensor> params;
  for (const auto& p : net->parameters())
    params.push_back(p.detach().cpu());
  return params;
}

// Both strategies at world 2 through the staged ring (both ranks on GPU 0) against one process.
void check_fsdp_through_the_staged_ring(bool offload) {
  const int port = test::free_port();
  const auto results = test::run_ranks(2, [&](int rank) {
    auto pg = test::join_group(rank, 2, port);
    const auto data = test::make_batches(4, 16, {20});
    for (const auto strategy : {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp}) {
      const auto got = train_fsdp_on_cuda(rank, 2, pg, data, strategy, offload);
      if (rank == 0) expect_all_close(got, fsdp_reference(data), 1e-5);
    }
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(Gpu, FsdpOnCudaThroughTheStagedRingEqualsOneProcess) {
  SKIP_WITHOUT_CUDA();
  check_fsdp_through_the_staged_ring(/*offload=*/false);
}

// FsdpCpuOffload: the shards, their gradients and the optimizer's state in host memory, the
// gathered units on the GPU; the same training as one process, through the staged ring at world 2
// (both ranks on GPU 0) ...
TEST(Gpu, FsdpWithCpuOffloadThroughTheStagedRingKeepsShardsOnTheHostAndEqualsOneProcess) {
  SKIP_WITHOUT_CUDA();
  check_fsdp_through_the_staged_ring(/*offload=*/true);
}

// ... and over nccl at world 1 (the gathers copy the host shard to the device first).
TEST(Gpu, FsdpWithCpuOffloadOverNcclEqualsOneProcess) {
  SKIP_WITHOUT_CUDA_OR_NCCL();
  on_nccl_world_of_one("ddp-gpu-nccl-fsdp-offload", [&](const std::shared_ptr<ProcessGroup>& pg) {
    const auto data = test::make_batches(4, 16, {20});
    for (const auto strategy : {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp}) {
      expect_all_close(train_fsdp_on_cuda(0, 1, pg, data, strategy, /*offload=*/true),
                       fsdp_reference(data), 1e-5);
    }
  });
}

// FsdpCpuOffload on the device: between steps FULL_SHARD keeps nothing there, and the peak of
// its unsharded device buffers over a step follows docs/sharding.md's formula, 4·(2U + 2U) bytes
// for U parameters per unit (fsdp_memory_test.cc checks the same count on the CPU). The CUDA
// caching allocator's own peak over the step counts everything else too (two reduce-scatter
// outputs and two gathers' shard copies, U/W each, autograd's weight-gradient temporary,
// activations): printed, and bounded by the formula plus those. Staged world 2 on cuda:0, four
// equal units of 4 MiB.
TEST(Gpu, FsdpWithCpuOffloadHoldsOnTheDeviceWhatTheFormulaSays) {
  SKIP_WITHOUT_CUDA();
  const int port = test::free_port();
  const auto results = test::run_ranks(2, [&](int rank) {
    constexpr std::int64_t kWidth = 1024, kUnitParams = kWidth * kWidth + kWidth;
    auto pg = test::join_group(rank, 2, port);
    torch::manual_seed(5);
    torch::nn::Sequential net(torch::nn::Linear(kWidth, kWidth));
    for (int u = 1; u < 4; ++u) {
      net->push_back(torch::nn::Tanh());
      net->push_back(torch::nn::Linear(kWidth, kWidth));
    }
    net->to(kCuda0);
    FullyShardedDataParallel fsdp(net, pg,
                                  FsdpOptions{.sharding_strategy = ShardingStrategy::kFullShard,
                                              .min_num_params = 1'000'000,
                                              .cpu_offload = {.offload_params = true}});
    require(fsdp->unit_count() == 4, "not four units");
    torch::optim::SGD opt(fsdp->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
    const auto step = [&] {
      opt.zero_grad();
      torch::manual_seed(100 + rank);
      fsdp->forward(torch::randn({8, kWidth}).to(kCuda0)).pow(2).mean().backward();
      opt.step();
      torch::cuda::synchronize();
    };
    step();  // cuBLAS's workspace and the allocator's first blocks
    require(fsdp_buffer_bytes(FsdpMemoryPlace::kDevice).live == 0,
            "FSDP keeps device memory between steps with cpu_offload");
#ifdef DDP_TEST_CUDA_ALLOCATOR
    namespace allocator = c10::cuda::CUDACachingAllocator;
    constexpr std::size_t kAll = 0;  // StatType::AGGREGATE, in every libtorch 2.x
    allocator::resetPeakStats(0);
    const auto before = allocator::getDeviceStats(0).allocated_bytes[kAll].current;
#endif
    reset_fsdp_buffer_peak();
    step();
    const auto counted = fsdp_buffer_bytes(FsdpMemoryPlace::kDevice);
    const std::int64_t formula = 4 * (2 * kUnitParams + 2 * kUnitParams);
    std::string report = fmt::format("rank {}: FSDP's device buffers peak {} bytes, formula {}",
                                     rank, counted.peak, formula);
#ifdef DDP_TEST_CUDA_ALLOCATOR
    const auto allocated = allocator::getDeviceStats(0).allocated_bytes[kAll].peak - before;
    const std::int64_t bound = formula + 4 * 4 * kUnitParams / 2 + 4 * kUnitParams + (4 << 20);
    report += fmt::format("; the CUDA allocator's peak over the step {} bytes (bound {})",
                          allocated, bound);
    require(allocated <= bound, report);
#endif
    std::printf("%s\n", report.c_str());
    require(counted.peak <= formula && counted.peak >= formula * 85 / 100 && counted.live == 0,
            report);
  });
  EXPECT_ALL_RANKS_OK(results);
}

// A compressing hook runs on the host twin (the staging thread): the same arithmetic as on the
// CPU, so CUDA DDP equals CPU DDP with the same hook up to the gradients' own CUDA/CPU difference
// (which fp16 rounding may magnify to one ulp of fp16: hence the tolerance of the CPU suite).
void check_hook_on_cuda_equals_on_cpu(
    const std::function<void(DistributedDataParallelBase&)>& setup, double tolerance) {
  const int port = test::free_port();
  const auto results = test::run_ranks(2, [&](int rank) {
    auto pg = test::join_group(rank, 2, port);
    const auto data = test::make_batches(5, 16, {20});
    std::vector<torch::Tensor> on_cuda;
    std::vector<torch::Tensor> on_cpu;
    train_on_cuda(rank, pg, data, kCuda0, setup, on_cuda);
    train_on_cuda(rank, pg, data, torch::Device(torch::kCPU), setup, on_cpu);
    expect_all_close(on_cuda, on_cpu, tolerance);
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(Gpu, Fp16HookOnCudaEqualsTheCpuRun) {
  SKIP_WITHOUT_CUDA();
  check_hook_on_cuda_equals_on_cpu(
      [](DistributedDataParallelBase& m) { m.register_comm_hook(fp16_compress_hook()); }, 1e-2);
}

TEST(Gpu, PowerSgdOnCudaEqualsTheCpuRun) {
  SKIP_WITHOUT_CUDA();
  check_hook_on_cuda_equals_on_cpu(
      [](DistributedDataParallelBase& m) {
        m.register_comm_hook(powersgd_hook(std::make_shared<PowerSGDState>(
            PowerSGDOptions{.matrix_approximation_rank = 2, .start_powersgd_iter = 2})));
      },
      1e-4);
}

TEST(Gpu, TensorHelpersStageCudaTensorsOnAHostGroupInPlace) {
  SKIP_WITHOUT_CUDA();
  const int port = test::free_port();
  const auto results = test::run_ranks(2, [&](int rank) {
    auto pg = test::join_group(rank, 2, port);
    auto tensor = torch::full({1000}, static_cast<float>(rank + 1), torch::TensorOptions(kCuda0));
    const auto before = tensor.data_ptr();
    allreduce_tensor(*pg, tensor, ReduceOp::kSum)->wait();
    require(tensor.is_cuda() && tensor.data_ptr() == before, "the result is not in place");
    require(torch::equal(tensor.cpu(), torch::full({1000}, 3.0f)), "allreduce sum is wrong");

    std::vector<torch::Tensor> tensors{
        torch::full({3}, rank * 10.0, torch::TensorOptions(kCuda0)),
        torch::full({2}, static_cast<std::int64_t>(rank),
                    torch::TensorOptions(kCuda0).dtype(torch::kLong))};
    broadcast_coalesced(*pg, tensors, /*root=*/1);
    require(torch::equal(tensors[0].cpu(), torch::full({3}, 10.0f)), "broadcast (float) is wrong");
    require(torch::equal(tensors[1].cpu(), torch::full({2}, 1, torch::kLong)),
            "broadcast (int64) is wrong");
  });
  EXPECT_ALL_RANKS_OK(results);
}

// Every kind of call of the tensor API (distributed.h) with CUDA tensors on a host group (the
// ring, both ranks on cuda:0): staged through host copies, the results in place on the device.
TEST(Gpu, TensorApiStagesCudaTensorsOnAHostGroup) {
  SKIP_WITHOUT_CUDA();
  const int port = test::free_port();
  const auto results = test::run_ranks(2, [&](int rank) {
    auto pg = test::join_group(rank, 2, port);
    const auto on_gpu = torch::TensorOptions(kCuda0).dtype(torch::kFloat64);
    auto values = [&](int r, std::int64_t n) {
      return torch::arange(1, n + 1, on_gpu) * (r + 1);  // rank r's input, on the device
    };
    auto expect = [&](const torch::Tensor& got, const torch::Tensor& want, const char* what) {
      require(got.is_cuda(), std::string(what) + ": the result left the device");
      require(torch::equal(got.cpu(), want.cpu()), std::string(what) + ": wrong values");
    };
    auto t = values(rank, 5);
    const auto before = t.data_ptr();
    all_reduce(t, ReduceOp::kSum, *pg);
    require(t.data_ptr() == before, "all_reduce is not in place");
    expect(t, values(0, 5) * 3, "all_reduce");
    auto b = values(rank, 3);
    broadcast(b, 1, *pg);
    expect(b, values(1, 3), "broadcast");
    auto r = values(rank, 4);
    reduce(r, 0, ReduceOp::kMax, *pg);
    expect(r, rank == 0 ? values(1, 4) : values(rank, 4), "reduce");
    std::vector<torch::Tensor> list{torch::zeros({3}, on_gpu), torch::zeros({3}, on_gpu)};
    all_gather(list, values(rank, 3), *pg);
    expect(list[0], values(0, 3), "all_gather [0]");
    expect(list[1], values(1, 3), "all_gather [1]");
    auto gathered = torch::zeros({6}, on_gpu);
    all_gather_into_tensor(gathered, values(rank, 3), *pg);
    expect(gathered, torch::cat({values(0, 3), values(1, 3)}), "all_gather_into_tensor");
    auto block = torch::zeros({3}, on_gpu);
    reduce_scatter_tensor(block, values(rank, 6), ReduceOp::kSum, *pg);
    expect(block, (values(0, 6) * 3).narrow(0, rank * 3, 3), "reduce_scatter_tensor");
    auto swapped = torch::zeros({4}, on_gpu);
    all_to_all_single(swapped, values(rank, 4), {}, {}, *pg);
    expect(swapped,
           torch::cat({values(0, 4).narrow(0, rank * 2, 2), values(1, 4).narrow(0, rank * 2, 2)}),
           "all_to_all_single");
    std::vector<torch::Tensor> several{values(rank, 2), values(rank, 3)};
    all_reduce_coalesced(several, ReduceOp::kSum, *pg);
    expect(several[1], values(0, 3) * 3, "all_reduce_coalesced");
    auto received = torch::zeros({5}, on_gpu);
    if (rank == 0) {
      send(values(0, 5), 1, 4, *pg);
    } else {
      recv(received, 0, 4, *pg);
      expect(received, values(0, 5), "recv");
    }
    auto later = values(rank, 5);
    auto work = all_reduce_async(later, ReduceOp::kSum, *pg);
    work->wait();
    expect(later, values(0, 5) * 3, "all_reduce_async");
    require(work->result_as<std::vector<torch::Tensor>>()[0].is_cuda(),
            "the async result is not the device tensor");
  });
  EXPECT_ALL_RANKS_OK(results);
}

// On a nccl group (world 1: one GPU) the single-tensor calls hand the tensor's device memory to
// NCCL, ordered after the current stream; the list forms run staged and relayed.
TEST(Gpu, TensorApiHandsCudaTensorsToANcclGroupDirectly) {
  SKIP_WITHOUT_CUDA_OR_NCCL();
  on_nccl_world_of_one("ddp-gpu-nccl-api", [&](const std::shared_ptr<ProcessGroup>& pg) {
    const auto on_gpu = torch::TensorOptions(kCuda0).dtype(torch::kFloat32);
    const auto values = torch::arange(1, 7, on_gpu);
    auto expect = [&](const torch::Tensor& got, const torch::Tensor& want, const char* what) {
      require(got.is_cuda(), std::string(what) + ": the result left the device");
      require(torch::equal(got.cpu(), want.cpu()), std::string(what) + ": wrong values");
    };
    auto t = values.clone();
    const auto before = t.data_ptr();
    all_reduce(t, ReduceOp::kSum, pg);
    require(t.data_ptr() == before, "all_reduce is not in place");
    expect(t, values, "all_reduce");
    all_reduce(t, make_premul_sum(2.0), pg);
    expect(t, values * 2, "all_reduce PREMUL_SUM");
    t.copy_(values);
    broadcast(t, 0, pg);
    expect(t, values, "broadcast");
    reduce(t, 0, ReduceOp::kMax, pg);
    expect(t, values, "reduce");
    auto out = torch::zeros({6}, on_gpu);
    all_gather_into_tensor(out, values, pg);
    expect(out, values, "all_gather_into_tensor");
    out.zero_();
    reduce_scatter_tensor(out, values, ReduceOp::kSum, pg);
    expect(out, values, "reduce_scatter_tensor");
    out.zero_();
    all_to_all_single(out, values, {}, {}, pg);
    expect(out, values, "all_to_all_single");
    auto later = values.clone();
    auto work = all_reduce_async(later, ReduceOp::kSum, pg);
    work->wait();
    expect(later, values, "all_reduce_async");
    // The list forms pack on the host: staged, and relayed to the device for NCCL.
    std::vector<torch::Tensor> list{torch::zeros({6}, on_gpu)};
    all_gather(list, values, pg);
    expect(list[0], values, "all_gather (a list form)");
  });
}

// DistributedDataParallel (with SGD, then with ZeroRedundancyOptimizer) over nccl at world 1 (a
// second rank would need a second GPU): the buckets stay on the device, DDP's own checks (parameter
// agreement, unused-parameter map, divergence check) and Join's plans travel through device copies
// (host_values.h), and the training equals one process on the same data; the object collectives
// work over nccl too.
TEST(Gpu, DdpOverNcclEqualsOneProcess) {
  SKIP_WITHOUT_CUDA_OR_NCCL();
  on_nccl_world_of_one("ddp-gpu-nccl-ddp", [&](const std::shared_ptr<ProcessGroup>& pg) {
    const auto data = test::make_batches(5, 16, {20});
    const auto want = one_process(data, kCuda0);
    for (const bool zero : {false, true}) {
      torch::manual_seed(100);
      test::Mlp net;
      net->to(kCuda0);
      DistributedDataParallel model(net.ptr(), pg,
                                    {.find_unused_parameters = true, .divergence_check_every = 1});
      std::unique_ptr<torch::optim::Optimizer> optimizer;
      if (zero) {
        optimizer = std::make_unique<ZeroRedundancyOptimizer>(
            model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9), pg);
      } else {
        optimizer = std::make_unique<torch::optim::SGD>(test::make_sgd(model->parameters()));
      }
      {
        Join join({*model});
        for (int step = 0; step < data.inputs.size(0); ++step) {
          optimizer->zero_grad();
          torch::nn::functional::cross_entropy(model->forward(data.inputs[step].to(kCuda0)),
                                               data.targets[step].to(kCuda0))
              .backward();
          for (const auto& p : model->parameters())
            require(p.grad().device() == kCuda0, "a gradient left its device");
          optimizer->step();
        }
      }
      std::vector<torch::Tensor> got;
      for (const auto& p : model->parameters())
        got.push_back(p.detach().cpu());
      expect_all_close(got, want, 1e-5);
    }
    try {
      ZeroRedundancyOptimizer cpu_on_nccl({torch::zeros({4}, torch::requires_grad())},
                                          torch::optim::SGDOptions(0.1), pg);
      throw std::runtime_error("ZeroRedundancyOptimizer took CPU parameters on nccl");
    } catch (const Error& e) {
      require(std::string(e.what()).find("is on cpu, but the process group (nccl) takes CUDA "
                                         "memory only") != std::string::npos,
              std::string("the refusal of CPU parameters on nccl does not say why: ") + e.what());
    }
    std::vector<std::string> names;
    all_gather_object(names, std::string("rank 0"), pg);
    require(names == std::vector<std::string>{"rank 0"}, "all_gather_object over nccl");
  });
}

// FullyShardedDataParallel over nccl (world 1: one GPU) equals one process; parameters that are
// not on the group's GPU, or on two devices, are named errors.
TEST(Gpu, FsdpOverNcclEqualsOneProcessAndNamesParametersOffTheGroupsGpu) {
  SKIP_WITHOUT_CUDA_OR_NCCL();
  on_nccl_world_of_one("ddp-gpu-nccl-fsdp", [&](const std::shared_ptr<ProcessGroup>& pg) {
    const auto data = test::make_batches(4, 16, {20});
    expect_all_close(train_fsdp_on_cuda(0, 1, pg, data, ShardingStrategy::kFullShard),
                     fsdp_reference(data), 1e-5);
    try {
      FullyShardedDataParallel on_cpu(fsdp_test_model(), pg);
      throw std::runtime_error("FSDP took CPU parameters on nccl");
    } catch (const ConfigError& e) {
      require(
          std::string(e.what()).find("takes this process's CUDA memory only") != std::string::npos,
          std::string("the refusal of CPU parameters on nccl does not say why: ") + e.what());
    }
    auto split = fsdp_test_model();
    split[0]->to(kCuda0);
    try {
      FullyShardedDataParallel on_two(split, pg);
      throw std::runtime_error("FSDP took parameters on two devices");
    } catch (const ConfigError& e) {
      require(std::string(e.what()).find("every parameter of a wrapper must be on one device") !=
                  std::string::npos,
              std::string("parameters on two devices are not named: ") + e.what());
    }
  });
}

// DDP_BACKEND=auto at world 1 on a GPU: the nccl group exists, and CUDA tensors go to it when no
// group is passed (DDP and a single-tensor call), CPU tensors to the ring.
TEST(Gpu, AutoSendsCudaTensorsToNcclAndCpuTensorsToTheRing) {
  SKIP_WITHOUT_CUDA_OR_NCCL();
  const int port = test::free_port();
  const auto results = test::run_ranks(1, [&](int) {
    auto ring = init_auto_world_of_one(port);
    require(ring->backend() == "ring", "auto's default group is not a ring group");
    auto cuda_group = default_cuda_process_group();
    require(cuda_group != nullptr && cuda_group->backend() == "nccl",
            "no nccl group under auto on a GPU: " + cuda_process_group_absent_reason());
    torch::manual_seed(100);
    test::Mlp on_gpu;
    on_gpu->to(kCuda0);
    DistributedDataParallel gpu_model(on_gpu.ptr());
    require(&gpu_model->process_group() == cuda_group.get(),
            "DDP of CUDA parameters is not on nccl");
    test::Mlp on_cpu;
    DistributedDataParallel cpu_model(on_cpu.ptr());
    require(&cpu_model->process_group() == ring.get(), "DDP of CPU parameters is not on the ring");
    auto t = torch::ones({4}, torch::TensorOptions(kCuda0));
    all_reduce(t, ReduceOp::kSum);
    require(torch::equal(t.cpu(), torch::ones({4})), "all_reduce of a CUDA tensor under auto");
    destroy_process_group();
  });
  EXPECT_ALL_RANKS_OK(results);
}

// What nccl cannot do is named, not done wrongly: the int8 hook (it quantizes host memory) on
// DDP's device buckets fails the backward with its reason; under DDP_BACKEND=auto a CUDA tensor's
// receive from any source (NCCL has none) names the way through host memory.
TEST(Gpu, Int8HookOnNcclBucketsAndReceiveFromAnySourceUnderAutoAreNamed) {
  SKIP_WITHOUT_CUDA_OR_NCCL();
  const int port = test::free_port();
  const auto results = test::run_ranks(1, [&](int) {
    init_auto_world_of_one(port);
    require(default_cuda_process_group() != nullptr,
            "no nccl group under auto: " + cuda_process_group_absent_reason());
    test::Mlp net;
    net->to(kCuda0);
    DistributedDataParallel model(net.ptr());
    model->register_comm_hook(int8_quantize_hook(std::make_shared<Int8QuantizeState>()));
    const auto data = test::make_batches(1, 8, {20});
    try {
      torch::nn::functional::cross_entropy(model->forward(data.inputs[0].to(kCuda0)),
                                           data.targets[0].to(kCuda0))
          .backward();
      throw std::runtime_error("the int8 hook ran on nccl's device buckets");
    } catch (const Error& e) {
      require(std::string(e.what()).find("this hook quantizes host memory") != std::string::npos,
              std::string("the int8 hook's refusal does not say why: ") + e.what());
    }
    try {
      recv_any_source(torch::zeros({4}, torch::TensorOptions(kCuda0)));
      throw std::runtime_error("recv_any_source of a CUDA tensor went to nccl under auto");
    } catch (const ConfigError& e) {
      require(
          std::string(e.what()).find("which has no receive from any source") != std::string::npos,
          std::string("recv_any_source under auto does not say why: ") + e.what());
    }
    destroy_process_group();
  });
  EXPECT_ALL_RANKS_OK(results);
}

// SyncBatchNorm on cuda:0 at world 2 (statistics through float64 host tensors on the ring)
// equals the same layer on the CPU; GradScaler's inf check runs on the device and one rank's
// overflow skips the step on both.
TEST(Gpu, SyncBatchNormAndGradScalerOnCudaEqualTheCpu) {
  SKIP_WITHOUT_CUDA();
  const int port = test::free_port();
  const auto results = test::run_ranks(2, [&](int rank) {
    auto pg = test::join_group(rank, 2, port);
    torch::manual_seed(7 + rank);
    const auto x = torch::randn({6, 3, 4}, torch::kFloat64);
    std::vector<torch::Tensor> out, grad;
    for (const auto& device : {torch::Device(torch::kCPU), kCuda0}) {
      SyncBatchNorm bn(SyncBatchNormOptions(3).process_group(pg));
      bn->to(device, torch::kFloat64);
      // A copy on every device: x.to(kCPU) is x itself, and requires_grad_ on it would make the
      // CUDA input a non-leaf (copied from a tensor that requires grad) with no .grad().
      const auto input = x.to(device).clone().requires_grad_(true);
      const auto y = bn->forward(input);
      (y * y).sum().backward();
      out.push_back(y.detach().cpu());
      grad.push_back(input.grad().cpu());
      require(bn->running_mean.device() == device, "running statistics left the device");
    }
    test::expect_close(out[1], out[0], "SyncBatchNorm output on CUDA", 1e-10, 1e-10);
    test::expect_close(grad[1], grad[0], "SyncBatchNorm input gradient on CUDA", 1e-10, 1e-10);

    auto param = torch::ones({4}, torch::TensorOptions(kCuda0)).requires_grad_(true);
    torch::optim::SGD sgd({param}, 0.1);
    GradScaler scaler({.init_scale = 8.0}, pg);
    param.mutable_grad() = torch::full({4}, rank == 1 ? INFINITY : 8.0f, param.options());
    require(!scaler.step(sgd), "an inf on rank 1 did not skip the step");
    require(torch::equal(param.detach().cpu(), torch::ones({4})), "a skipped step moved");
    scaler.update();
    require(scaler.get_scale() == 4.0, "the scale did not back off after the overflow");
    param.mutable_grad() = torch::full({4}, 4.0f, param.options());
    require(scaler.step(sgd), "a finite step was skipped");
    require(torch::allclose(param.detach().cpu(), torch::full({4}, 0.9f)), "the step is wrong");
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(Gpu, CheckpointMapLocationMovesBetweenCudaAndTheCpu) {
  SKIP_WITHOUT_CUDA();
  const auto results = test::run_ranks(1, [&](int) {
    test::TempDir dir("ddp-gpu-checkpoint");
    torch::manual_seed(1);
    test::Mlp on_cuda;
    on_cuda->to(kCuda0);
    auto cuda_opt = test::make_sgd(on_cuda->parameters());
    save_checkpoint(dir.path() / "cuda.pt", *on_cuda, cuda_opt, {.epoch = 1, .tag = "mlp"});

    torch::manual_seed(2);
    test::Mlp on_cpu;
    auto cpu_opt = test::make_sgd(on_cpu->parameters());
    load_checkpoint(dir.path() / "cuda.pt", *on_cpu, cpu_opt, "mlp", torch::Device(torch::kCPU));
    for (std::size_t i = 0; i < on_cpu->parameters().size(); ++i) {
      require(on_cpu->parameters()[i].device().is_cpu(), "a CPU parameter moved");
      require(torch::equal(on_cpu->parameters()[i], on_cuda->parameters()[i].cpu()),
              "CUDA checkpoint loaded on the CPU differs");
    }

    torch::manual_seed(3);
    test::Mlp saved_on_cpu;
    auto saved_opt = test::make_sgd(saved_on_cpu->parameters());
    save_checkpoint(dir.path() / "cpu.pt", *saved_on_cpu, saved_opt, {.epoch = 1, .tag = "mlp"});
    load_checkpoint(dir.path() / "cpu.pt", *on_cuda, cuda_opt, "mlp", kCuda0);
    for (std::size_t i = 0; i < on_cuda->parameters().size(); ++i) {
      require(on_cuda->parameters()[i].is_cuda(), "a CUDA parameter moved");
      require(torch::equal(on_cuda->parameters()[i].cpu(), saved_on_cpu->parameters()[i]),
              "CPU checkpoint loaded on CUDA differs");
    }
  });
  EXPECT_ALL_RANKS_OK(results);
}

// Activation checkpointing on CUDA (issue 52): the RNG of the inputs' device is saved in forward
// and restored for the recomputation, so dropout on the GPU draws the same masks; five SGD steps
// in float64 equal the run without checkpointing bit for bit.
TEST(Gpu, ActivationCheckpointOnCudaWithDropoutEqualsTheRunWithout) {
  SKIP_WITHOUT_CUDA();
  const auto results = test::run_ranks(1, [&](int) {
    const auto train = [](bool checkpointed) {
      torch::manual_seed(7);
      torch::nn::Sequential model(torch::nn::Linear(8, 32), torch::nn::Tanh(),
                                  torch::nn::Dropout(0.3), torch::nn::Linear(32, 4));
      model->to(kCuda0, torch::kFloat64);
      auto run =
          checkpointed ? apply_activation_checkpointing(model, checkpoint_every_child()) : model;
      torch::optim::SGD sgd(run->parameters(), torch::optim::SGDOptions(0.1));
      torch::manual_seed(11);
      for (int step = 0; step < 5; ++step) {
        auto x = torch::randn({16, 8}, torch::kFloat64).to(kCuda0);
        auto y = torch::randn({16, 4}, torch::kFloat64).to(kCuda0);
        sgd.zero_grad();
        torch::mse_loss(run->forward(x), y).backward();
        sgd.step();
      }
      std::vector<torch::Tensor> params;
      for (const auto& p : model->parameters())
        params.push_back(p.detach().cpu());
      return params;
    };
    const auto plain = train(false);
    const auto checkpointed = train(true);
    for (std::size_t i = 0; i < plain.size(); ++i) {
      require(torch::equal(plain[i], checkpointed[i]),
              fmt::format("parameter {} differs with checkpointing on CUDA", i));
    }
  });
  EXPECT_ALL_RANKS_OK(results);
}

// A pipeline whose two stages run on cuda:0, over the ring (a host group: each activation and
// gradient is copied to the host to be sent and back to the stage's GPU once received), equals
// the same pipeline on the CPU to float64 rounding.
TEST(Gpu, PipelineWithCudaStagesThroughTheRingEqualsTheCpuPipeline) {
  SKIP_WITHOUT_CUDA();
  const int port = test::free_port();
  const auto results = test::run_ranks(2, [&](int rank) {
    auto pg = test::join_group(rank, 2, port);
    const auto mse = [](const torch::Tensor& out, const torch::Tensor& target) {
      return torch::mse_loss(out, target);
    };
    const auto train = [&](c10::Device device) {
      torch::manual_seed(3);
      torch::nn::Sequential model(torch::nn::Linear(6, 8), torch::nn::Tanh(),
                                  torch::nn::Linear(8, 8), torch::nn::Linear(8, 2));
      model->to(device, torch::kFloat64);
      Pipeline pipe(model, pg, mse, {.schedule = PipelineSchedule::k1F1B, .micro_batches = 2});
      torch::optim::SGD sgd(pipe.parameters(), torch::optim::SGDOptions(0.1));
      torch::manual_seed(9);
      for (int step = 0; step < 3; ++step) {
        auto x = torch::randn({4, 6}, torch::kFloat64).to(device);
        auto y = torch::randn({4, 2}, torch::kFloat64).to(device);
        sgd.zero_grad();
        pipe.step(x, y);
        sgd.step();
      }
      std::vector<torch::Tensor> params;
      for (const auto& p : pipe.parameters()) {
        require(p.device() == device, "a stage's parameter left its device");
        params.push_back(p.detach().cpu());
      }
      return params;
    };
    const auto on_cpu = train(c10::Device(c10::kCPU));
    expect_all_close(train(kCuda0), on_cpu, 1e-10);
  });
  EXPECT_ALL_RANKS_OK(results);
}

// Needs no GPU, but runs in the program the GPU machine builds: PyPI's libtorch.so of PyTorch
// 2.11 exports its own std::filesystem, whose remove_all calls through a null pointer, and
// ddp::libtorch lists libstdc++ first so that a program's calls bind to libstdc++'s copy
// (cmake/DdpFindTorch.cmake). A rank killed here says that the order did not hold on this
// machine's linker; scripts/gpu_link_probe.sh shows which copy the calls bound to.
TEST(Gpu, StdFilesystemRemoveAllBindsToLibstdcxxBesideLibtorch) {
  test::TempDir dir("ddp-gpu-remove-all");
  const auto tree = dir.path() / "tree";
  std::filesystem::create_directories(tree / "a" / "b");
  const auto results = test::run_ranks(1, [&](int) {
    std::error_code error;
    const auto removed = std::filesystem::remove_all(tree, error);
    require(!error, "remove_all failed: " + error.message());
    require(removed == 3, "remove_all removed " + std::to_string(removed) + " entries, not 3");
  });
  EXPECT_ALL_RANKS_OK(results);
  EXPECT_FALSE(std::filesystem::exists(tree));
}

}  // namespace
}  // namespace ddp
