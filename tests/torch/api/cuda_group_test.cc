// DistributedDataParallel, ZeroRedundancyOptimizer, FullyShardedDataParallel, Join, the tensor
// API's list forms and the object collectives over a group whose buffers are device memory (the
// nccl backend), checked without a GPU: DeviceMemoryGroup declares CUDA memory and forwards to a
// ring group, and ScopedCpuAsCudaGroupMemoryForTests lets the torch layer take CPU tensors as that
// memory. The torch layer's own host values (flags, hashes, plans, objects) must then reach the
// group only through copies in its memory (src/torch/core/host_values.h); the training itself must
// equal the same training over the ring bit for bit. gpu_test.cc runs DistributedDataParallel over
// real nccl where there is a GPU.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <mutex>
#include <numeric>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "ddp/runtime/init.h"
#include "ddp/torch/api/distributed.h"
#include "ddp/torch/api/distributed_objects.h"
#include "ddp/torch/api/join.h"
#include "ddp/torch/ddp/distributed_data_parallel.h"
#include "ddp/torch/fsdp/fully_sharded_data_parallel.h"
#include "ddp/torch/zero/zero_redundancy_optimizer.h"
#include "support/forwarding_group.h"
#include "support/multiprocess.h"
#include "support/torch/ddp_test_models.h"
#include "support/torch/ddp_test_util.h"
#include "support/unity_namespace.h"
#include "torch/core/host_staging.h"
#include "torch/core/host_values.h"

namespace ddp {
namespace {
namespace DDP_UNITY_ID {

using test::join_group;
using test::run_ranks;

void require(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error(what);
}

// Declares CUDA memory, as the nccl backend does, and records every buffer it is handed.
class DeviceMemoryGroup final : public test::ForwardingGroup {
 public:
  using ForwardingGroup::ForwardingGroup;
  MemorySpace memory_space() const override { return MemorySpace::kCuda; }

  using ProcessGroup::allreduce;
  std::shared_ptr<Work> allreduce(const void* s, void* r, std::size_t n, DType d, ReduceOp op,
                                  CallOptions o) override {
    handed({s, r});
    return inner().allreduce(s, r, n, d, op, o);
  }
  std::shared_ptr<Work> broadcast(void* b, std::size_t n, DType d, int root,
                                  CallOptions o) override {
    handed({b});
    return inner().broadcast(b, n, d, root, o);
  }
  std::shared_ptr<Work> reduce(const void* s, void* r, std::size_t n, DType d, ReduceOp op,
                               int root, CallOptions o) override {
    handed({s, r});
    return inner().reduce(s, r, n, d, op, root, o);
  }
  std::shared_ptr<Work> allgather(const void* s, void* r, std::size_t n, DType d,
                                  CallOptions o) override {
    handed({s, r});
    return inner().allgather(s, r, n, d, o);
  }
  std::shared_ptr<Work> gather(const void* s, void* r, std::size_t n, DType d, int root,
                               CallOptions o) override {
    handed({s, r});
    return inner().gather(s, r, n, d, root, o);
  }
  std::shared_ptr<Work> scatter(const void* s, void* r, std::size_t n, DType d, int root,
                                CallOptions o) override {
    handed({s, r});
    return inner().scatter(s, r, n, d, root, o);
  }
  std::shared_ptr<Work> reduce_scatter(const void* s, void* r, std::size_t n, DType d, ReduceOp op,
                                       CallOptions o) override {
    handed({s, r});
    return inner().reduce_scatter(s, r, n, d, op, o);
  }
  std::shared_ptr<Work> alltoall(const void* s, void* r, std::size_t n, DType d,
                                 CallOptions o) override {
    handed({s, r});
    return inner().alltoall(s, r, n, d, o);
  }
  std::shared_ptr<Work> send(const void* b, std::size_t n, DType d, int dst, int tag,
                             CallOptions o) override {
    handed({b});
    return inner().send(b, n, d, dst, tag, o);
  }
  std::shared_ptr<Work> recv(void* b, std::size_t n, DType d, int src, int tag,
                             CallOptions o) override {
    handed({b});
    return inner().recv(b, n, d, src, tag, o);
  }

  // Throws if any of `host` (host values' addresses) was handed to the group.
  void require_never_handed(const std::vector<const void*>& host, const std::string& call) {
    std::lock_guard lock(mutex_);
    for (const void* p : host) {
      require(handed_.count(p) == 0,
              fmt::format("{}: the group was handed the host values' own memory", call));
    }
  }

 private:
  void handed(std::initializer_list<const void*> buffers) {
    std::lock_guard lock(mutex_);
    for (const void* p : buffers) {
      if (p != nullptr) handed_.insert(p);
    }
  }
  std::mutex mutex_;
  std::set<const void*> handed_;
};

// Every call of the relay, at world 3 (so that rooted calls have a root, a non-root on either
// side): the values are right and the group saw none of their host memory.
TEST(CudaGroup, HostValuesReachADeviceMemoryGroupOnlyThroughCopiesForEveryCall) {
  const int world = 3;
  const int port = test::free_port();
  const auto results = run_ranks(world, [&](int rank) {
    auto ring = join_group(rank, world, port);
    require(&*detail::HostValues(*ring) == ring.get(), "a host group was relayed");
    detail::ScopedCpuAsCudaGroupMemoryForTests pretend;
    DeviceMemoryGroup group(ring);
    detail::HostValues values(group);
    require(&*values != &group, "a CUDA group was not relayed");
    const auto check = [&](const std::string& call, const std::vector<const void*>& host, bool ok) {
      group.require_never_handed(host, call);
      require(ok, call + ": wrong values");
    };
    const auto r = static_cast<std::int64_t>(rank);
    // Every host buffer exists before the first call, so that no copy the relay frees can be
    // at an address one of them takes later.
    std::vector<std::int64_t> in_place{r, 10 * r};
    const std::vector<std::int64_t> send{r + 1};
    std::vector<std::int64_t> recv{0};
    std::vector<std::int64_t> root_value{rank == 1 ? 42 : -1};
    std::vector<std::int64_t> reduced{-7};
    std::vector<std::int64_t> gathered(world);
    std::vector<std::int64_t> at_root(world, -1);
    const std::vector<std::int64_t> blocks{100, 101, 102};
    std::vector<std::int64_t> mine{0};
    std::vector<std::int64_t> part{0};
    const std::vector<std::int64_t> outgoing{10 * r, 10 * r + 1, 10 * r + 2};
    std::vector<std::int64_t> incoming(world);
    const std::vector<std::int64_t> uneven(static_cast<std::size_t>(rank + 1), r);
    std::vector<std::int64_t> all_uneven(6, -1);
    std::vector<std::int64_t> from_left{-1};

    values->allreduce(in_place.data(), 2, DType::kInt64, ReduceOp::kSum)->wait();
    check("allreduce in place", {in_place.data()}, in_place == std::vector<std::int64_t>{3, 30});

    values->allreduce(send.data(), recv.data(), 1, DType::kInt64, ReduceOp::kMax,
                      {.blocking = true});
    check("blocking allreduce", {send.data(), recv.data()}, recv[0] == 3);

    values->broadcast(root_value.data(), 1, DType::kInt64, /*root=*/1)->wait();
    check("broadcast", {root_value.data()}, root_value[0] == 42);

    values->reduce(send.data(), reduced.data(), 1, DType::kInt64, ReduceOp::kSum, /*root=*/2)
        ->wait();
    check("reduce", {send.data(), reduced.data()}, rank == 2 ? reduced[0] == 6 : reduced[0] == -7);

    values->allgather(send.data(), gathered.data(), 1, DType::kInt64)->wait();
    check("allgather", {send.data(), gathered.data()},
          gathered == std::vector<std::int64_t>{1, 2, 3});

    values->gather(send.data(), rank == 0 ? at_root.data() : nullptr, 1, DType::kInt64, 0)->wait();
    check("gather", {send.data(), at_root.data()},
          rank == 0 ? at_root == std::vector<std::int64_t>{1, 2, 3}
                    : at_root == std::vector<std::int64_t>(world, -1));

    values->scatter(rank == 1 ? blocks.data() : nullptr, mine.data(), 1, DType::kInt64, 1)->wait();
    check("scatter", {blocks.data(), mine.data()}, mine[0] == 100 + r);

    values->reduce_scatter(blocks.data(), part.data(), 1, DType::kInt64, ReduceOp::kSum)->wait();
    check("reduce_scatter", {blocks.data(), part.data()}, part[0] == 3 * (100 + r));

    values->alltoall(outgoing.data(), incoming.data(), 1, DType::kInt64)->wait();
    check("alltoall", {outgoing.data(), incoming.data()},
          incoming == std::vector<std::int64_t>{r, 10 + r, 20 + r});

    // Uneven sizes take the default path (counts exchanged first) over the relay's calls.
    values->allgather_v(uneven.data(), uneven.size(), all_uneven.data(), {1, 2, 3}, DType::kInt64)
        ->wait();
    check("allgather_v", {uneven.data(), all_uneven.data()},
          all_uneven == std::vector<std::int64_t>{0, 1, 1, 2, 2, 2});

    auto sent = values->send(send.data(), 1, DType::kInt64, (rank + 1) % world, /*tag=*/3);
    values->recv(from_left.data(), 1, DType::kInt64, (rank + world - 1) % world, 3)->wait();
    sent->wait();
    check("send/recv", {send.data(), from_left.data()},
          from_left[0] == (rank + world - 1) % world + 1);

    // The object collectives use the relay too.
    std::vector<std::string> names;
    all_gather_object(names, fmt::format("rank {}", rank), group);
    require(names == std::vector<std::string>{"rank 0", "rank 1", "rank 2"},
            "all_gather_object over the device-memory group");
    require(pretend.relayed_calls() >= 12,
            fmt::format("{} calls were relayed", pretend.relayed_calls()));
  });
  EXPECT_ALL_RANKS_OK(results);
}

// The list and coalesced forms of the tensor API pack on the host: on a CUDA group they are staged
// (host copies of the tensors) and their packed buffers reach the group through its relay. Here
// the tensors are CPU tensors that the staging switch treats as device tensors; every form gives
// the values computed from each rank's input, staged and relayed.
TEST(CudaGroup, ListAndCoalescedFormsReachADeviceMemoryGroupStagedAndRelayed) {
  const int world = 3;
  const int port = test::free_port();
  const auto results = run_ranks(world, [&](int rank) {
    auto ring = join_group(rank, world, port);
    detail::ScopedCpuAsCudaGroupMemoryForTests pretend;
    detail::ScopedStagingOfCpuTensorsForTests staging;
    std::shared_ptr<ProcessGroup> group = std::make_shared<DeviceMemoryGroup>(ring);
    const auto r = static_cast<float>(rank);
    const auto values = [](std::initializer_list<float> v) {
      return torch::tensor(std::vector<float>(v));
    };
    std::size_t relayed = 0, staged = 0;
    const auto check = [&](bool ok, const std::string& call) {
      require(ok, call + ": wrong values");
      require(pretend.relayed_calls() > relayed, call + ": nothing went through the relay");
      require(staging.copies_to_host() > staged, call + ": nothing was staged");
      relayed = pretend.relayed_calls();
      staged = staging.copies_to_host();
    };

    std::vector<torch::Tensor> gathered{torch::zeros({1}), torch::zeros({1}), torch::zeros({1})};
    all_gather(gathered, values({r}), group);
    check(torch::equal(torch::cat(gathered), values({0, 1, 2})), "all_gather");

    auto part = torch::zeros({1});
    reduce_scatter(part, {values({1}), values({2}), values({3})}, ReduceOp::kSum, group);
    check(torch::equal(part, values({3.0f * static_cast<float>(rank + 1)})), "reduce_scatter");

    std::vector<torch::Tensor> at_root;
    if (rank == 0) at_root = {torch::zeros({1}), torch::zeros({1}), torch::zeros({1})};
    gather(values({10 + r}), at_root, /*dst=*/0, group);
    check(rank != 0 || torch::equal(torch::cat(at_root), values({10, 11, 12})), "gather");

    auto mine = torch::zeros({1});
    std::vector<torch::Tensor> blocks;
    if (rank == 1) blocks = {values({20}), values({21}), values({22})};
    scatter(mine, blocks, /*src=*/1, group);
    check(torch::equal(mine, values({20 + r})), "scatter");

    std::vector<torch::Tensor> incoming{torch::zeros({1}), torch::zeros({1}), torch::zeros({1})};
    all_to_all(incoming, {values({10 * r}), values({10 * r + 1}), values({10 * r + 2})}, group);
    check(torch::equal(torch::cat(incoming), values({r, 10 + r, 20 + r})), "all_to_all");

    std::vector<torch::Tensor> both{values({r}), values({1, r})};
    all_reduce_coalesced(both, ReduceOp::kSum, group);
    check(torch::equal(both[0], values({3})) && torch::equal(both[1], values({3, 3})),
          "all_reduce_coalesced");

    std::vector<torch::Tensor> outputs{torch::zeros({3}), torch::zeros({6})};
    all_gather_into_tensor_coalesced(outputs, {values({r}), values({r, -r})}, group);
    check(torch::equal(outputs[0], values({0, 1, 2})) &&
              torch::equal(outputs[1], values({0, 0, 1, -1, 2, -2})),
          "all_gather_into_tensor_coalesced");

    std::vector<torch::Tensor> shards{torch::zeros({1}), torch::zeros({2})};
    reduce_scatter_tensor_coalesced(shards, {values({1, 2, 3}), values({1, 1, 2, 2, 3, 3})},
                                    ReduceOp::kSum, group);
    const float k = 3.0f * static_cast<float>(rank + 1);
    check(torch::equal(shards[0], values({k})) && torch::equal(shards[1], values({k, k})),
          "reduce_scatter_tensor_coalesced");
  });
  EXPECT_ALL_RANKS_OK(results);
}

// The same model trained by DistributedDataParallel over the ring and over the device-memory
// group (sharing the ring underneath), on the same data: gradients equal bit for bit after every
// backward. The options make DDP exchange every kind of host value it has: the parameter
// agreement, the unused-parameter map, the divergence guard and check, and (static_graph) the
// bucket order.
// With `zero`, each model's optimizer is a ZeroRedundancyOptimizer over its group (its shard
// broadcasts and the state consolidation's objects go through that group).
void check_ddp_over_device_memory_equals_the_ring(DdpOptions options, bool zero = false) {
  const int port = test::free_port();
  const auto results = run_ranks(2, [&](int rank) {
    auto ring = join_group(rank, 2, port);
    detail::ScopedCpuAsCudaGroupMemoryForTests pretend;
    auto device_group = std::make_shared<DeviceMemoryGroup>(ring);
    torch::manual_seed(5);
    test::Mlp ring_net;
    torch::manual_seed(5);
    test::Mlp device_net;
    DistributedDataParallel on_ring(ring_net.ptr(), ring, options);
    DistributedDataParallel on_device(device_net.ptr(), device_group, options);
    require(pretend.relayed_calls() > 0, "constructing DDP relayed no host values");
    const auto make_optimizer =
        [&](std::vector<torch::Tensor> params,
            std::shared_ptr<ProcessGroup> group) -> std::unique_ptr<torch::optim::Optimizer> {
      if (!zero) return std::make_unique<torch::optim::SGD>(test::make_sgd(std::move(params)));
      return std::make_unique<ZeroRedundancyOptimizer>(
          std::move(params), torch::optim::SGDOptions(0.1).momentum(0.9), std::move(group));
    };
    auto ring_optimizer = make_optimizer(on_ring->parameters(), ring);
    auto device_optimizer = make_optimizer(on_device->parameters(), device_group);
    auto& ring_opt = *ring_optimizer;
    auto& device_opt = *device_optimizer;
    const int steps = 4;
    const auto data = test::make_batches(steps, 16, {20});
    for (int step = 0; step < steps; ++step) {
      const auto x = data.inputs[step].narrow(0, rank * 8, 8);
      const auto y = data.targets[step].narrow(0, rank * 8, 8);
      const auto relayed_before = pretend.relayed_calls();
      for (auto* model : {&on_ring, &on_device}) {
        auto& opt = model == &on_ring ? ring_opt : device_opt;
        opt.zero_grad();
        torch::nn::functional::cross_entropy((*model)->forward(x), y).backward();
      }
      if (options.find_unused_parameters) {
        require(pretend.relayed_calls() > relayed_before,
                fmt::format("step {}: the unused-parameter map was not relayed", step));
      }
      const auto want = on_ring->parameters();
      const auto got = on_device->parameters();
      for (std::size_t i = 0; i < want.size(); ++i) {
        require(torch::equal(got[i].grad(), want[i].grad()),
                fmt::format("step {}: the gradient of parameter {} over the device-memory group "
                            "differs from the one over the ring",
                            step, i));
      }
      ring_opt.step();
      device_opt.step();
    }
    test::expect_identical_across_ranks(*ring, on_device->parameters(), "parameters");
    if (zero) {
      const auto relayed_before = pretend.relayed_calls();
      dynamic_cast<ZeroRedundancyOptimizer&>(device_opt).consolidate_state_dict(0);
      require(pretend.relayed_calls() > relayed_before,
              "consolidate_state_dict's objects were not relayed");
    }
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(CudaGroup, DdpWithUnusedParametersAndTheDivergenceCheckEqualsTheRingBitForBit) {
  check_ddp_over_device_memory_equals_the_ring(
      {.find_unused_parameters = true, .divergence_check_every = 1});
}

TEST(CudaGroup, DdpWithAStaticGraphEqualsTheRingBitForBit) {
  check_ddp_over_device_memory_equals_the_ring({.static_graph = true});
}

TEST(CudaGroup, DdpWithZeroRedundancyOptimizerEqualsTheRingBitForBit) {
  check_ddp_over_device_memory_equals_the_ring({}, /*zero=*/true);
}

// Uneven inputs under Join (rank r trains 2 + r steps): Join's counts and DDP's step plans and
// final synchronisation are host values; the parameters equal those trained over the ring.
TEST(CudaGroup, JoinWithUnevenInputsOverADeviceMemoryGroupEqualsTheRingBitForBit) {
  const int port = test::free_port();
  const auto results = run_ranks(2, [&](int rank) {
    auto ring = join_group(rank, 2, port);
    detail::ScopedCpuAsCudaGroupMemoryForTests pretend;
    const auto data = test::make_batches(3, 16, {20});
    std::vector<std::vector<torch::Tensor>> trained;
    for (const bool over_device : {false, true}) {
      std::shared_ptr<ProcessGroup> group =
          over_device ? std::make_shared<DeviceMemoryGroup>(ring) : ring;
      torch::manual_seed(5);
      test::Mlp net;
      DistributedDataParallel model(net.ptr(), group);
      auto opt = test::make_sgd(model->parameters());
      const auto relayed_before = pretend.relayed_calls();
      {
        Join join({*model});
        for (int step = 0; step < 2 + rank; ++step) {
          opt.zero_grad();
          const auto x = data.inputs[step].narrow(0, rank * 8, 8);
          const auto y = data.targets[step].narrow(0, rank * 8, 8);
          torch::nn::functional::cross_entropy(model->forward(x), y).backward();
          opt.step();
        }
      }
      require(over_device == (pretend.relayed_calls() > relayed_before),
              "Join's host values were relayed on the wrong group");
      std::vector<torch::Tensor> params;
      for (const auto& p : model->parameters())
        params.push_back(p.detach().clone());
      trained.push_back(params);
    }
    for (std::size_t i = 0; i < trained[0].size(); ++i) {
      require(torch::equal(trained[0][i], trained[1][i]),
              fmt::format("parameter {} after Join differs between the ring and the "
                          "device-memory group",
                          i));
    }
    test::expect_identical_across_ranks(*ring, trained[1], "parameters after Join");
  });
  EXPECT_ALL_RANKS_OK(results);
}

// FullyShardedDataParallel (every sharding strategy, and clip_grad_norm_ and full_state_dict)
// over the device-memory group equals the same training over the ring bit for bit: its
// construction's agreement travels relayed, and every collective it makes goes through the tensor
// API (so a nccl group would get device memory, never a host value of FSDP's own).
TEST(CudaGroup, FsdpOverADeviceMemoryGroupEqualsTheRingBitForBit) {
  const int port = test::free_port();
  const auto results = run_ranks(2, [&](int rank) {
    auto ring = join_group(rank, 2, port);
    detail::ScopedCpuAsCudaGroupMemoryForTests pretend;
    const auto data = test::make_batches(3, 8, {5});
    const auto make_model = [] {
      torch::manual_seed(11);
      return torch::nn::Sequential(torch::nn::Linear(5, 7), torch::nn::Tanh(),
                                   torch::nn::Linear(7, 6), torch::nn::Tanh(),
                                   torch::nn::Linear(6, 3));
    };
    for (const auto strategy : {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp,
                                ShardingStrategy::kNoShard}) {
      std::vector<std::vector<torch::Tensor>> trained;
      std::vector<torch::OrderedDict<std::string, torch::Tensor>> states;
      for (const bool over_device : {false, true}) {
        std::shared_ptr<ProcessGroup> group =
            over_device ? std::make_shared<DeviceMemoryGroup>(ring) : ring;
        const auto relayed_before = pretend.relayed_calls();
        FullyShardedDataParallel model(
            make_model(), group, FsdpOptions{.sharding_strategy = strategy, .min_num_params = 40});
        require(over_device == (pretend.relayed_calls() > relayed_before),
                "FSDP's construction relayed its agreement on the wrong group");
        torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
        for (int step = 0; step < 3; ++step) {
          opt.zero_grad();
          const auto x = data.inputs[step].narrow(0, rank * 4, 4);
          model->forward(x).pow(2).sum().backward();
          model->clip_grad_norm_(0.5);
          opt.step();
        }
        std::vector<torch::Tensor> shards;
        for (const auto& p : model->parameters())
          shards.push_back(p.detach().clone());
        trained.push_back(shards);
        states.push_back(model->full_state_dict(0));
      }
      for (std::size_t i = 0; i < trained[0].size(); ++i) {
        require(torch::equal(trained[0][i], trained[1][i]),
                fmt::format("{}: shard {} differs between the ring and the device-memory group",
                            to_string(strategy), i));
      }
      require(states[0].size() == states[1].size(), "full_state_dict sizes differ");
      for (const auto& item : states[0]) {
        require(torch::equal(item.value(), states[1][item.key()]),
                fmt::format("{}: full_state_dict's {} differs", to_string(strategy), item.key()));
      }
    }
  });
  EXPECT_ALL_RANKS_OK(results);
}

// DDP_BACKEND=auto where some rank cannot use nccl (here: none can, for want of a GPU): CUDA
// tensors' default group is the ring (staged), and DDP of a CPU model takes the ring.
TEST(CudaGroup, AutoWithoutNcclEverywhereLeavesCudaTensorsOnTheRing) {
  const int port = test::free_port();
  const auto results = run_ranks(2, [&](int rank) {
    torch::set_num_threads(1);
    ::setenv("DDP_QUIET", "1", 1);
    InitOptions options;
    options.launch.rank = rank;
    options.launch.world_size = 2;
    options.launch.master_addr = "127.0.0.1";
    options.launch.master_port = port;
    options.backend = "auto";
    options.timeout = std::chrono::seconds(30);
    auto ring = init_process_group(options);
    require(ring->backend() == "ring", "auto's default group is not a ring group");
    if (default_cuda_process_group() != nullptr) return;  // a machine where every rank has a GPU
    require(!cuda_process_group_absent_reason().empty(), "no reason for the missing nccl group");
    require(default_process_group_for(torch::Device(torch::kCUDA, 0)) == ring,
            "CUDA tensors' default group is not the ring");
    require(default_process_group_for(torch::Device(torch::kCPU)) == ring,
            "CPU tensors' default group is not the ring");
    test::Mlp net;
    DistributedDataParallel model(net.ptr());
    require(&model->process_group() == ring.get(), "DDP did not take the default group");
  });
  EXPECT_ALL_RANKS_OK(results);
}

}  // namespace DDP_UNITY_ID
}  // namespace
}  // namespace ddp
