// The tensor-level torch.distributed API (ddp/torch/api/distributed.h) across real rank processes:
// every collective against values computed here from the formula each rank used, the async forms
// and their results, point to point, monitored_barrier, groups, the convenience calls, and bad
// arguments, which must give a named error on every rank without a hang.
#include <chrono>
#include <numeric>
#include <set>
#include <string>
#include <thread>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "ddp/comm/comm_error.h"
#include "ddp/error.h"
#include "ddp/runtime/init.h"
#include "ddp/torch/api/distributed.h"
#include "support/forwarding_group.h"
#include "support/multiprocess.h"
#include "support/torch/ddp_test_util.h"
#include "support/unity_namespace.h"
#include "torch/core/host_staging.h"

namespace ddp {
namespace {
namespace DDP_UNITY_ID {

using namespace std::chrono_literals;
using test::free_port;
using test::join_group;
using test::run_ranks;

void require(bool condition, const std::string& what) {
  if (!condition) throw std::runtime_error(what);
}

void require_equal(const torch::Tensor& got, const torch::Tensor& want, const std::string& what) {
  if (!torch::equal(got, want)) {
    std::ostringstream out;
    out << what << ": got " << got << " expected " << want;
    throw std::runtime_error(out.str());
  }
}

// Runs `call`, which must throw an E whose message contains `needle`.
template <class E, class F>
void require_throws(F&& call, const std::string& needle, const std::string& what) {
  try {
    call();
  } catch (const E& e) {
    require(std::string(e.what()).find(needle) != std::string::npos,
            fmt::format("{}: the error '{}' does not mention '{}'", what, e.what(), needle));
    return;
  } catch (const std::exception& e) {
    throw std::runtime_error(fmt::format("{}: threw the wrong kind of error: {}", what, e.what()));
  }
  throw std::runtime_error(what + ": did not throw");
}

// With `staged`, every tensor of this thread's calls is staged through host copies, as a CUDA
// tensor on a host group is (host_staging.h); require_staged then checks that copies were made
// both ways. The values must be the same as without.
std::unique_ptr<detail::ScopedStagingOfCpuTensorsForTests> stage_if(bool staged) {
  return staged ? std::make_unique<detail::ScopedStagingOfCpuTensorsForTests>() : nullptr;
}
void require_staged(const std::unique_ptr<detail::ScopedStagingOfCpuTensorsForTests>& staging) {
  if (!staging) return;
  require(staging->copies_to_host() > 0 && staging->copies_back() > 0,
          fmt::format("the staged run made {} copies to the host and {} back; both must be some",
                      staging->copies_to_host(), staging->copies_back()));
}

// Rank r's input for a collective: (r + 1) * (1, 2, ..., n) + offset, in float64 (exact).
torch::Tensor input_of(int r, std::int64_t n, double offset = 0,
                       torch::Dtype dtype = torch::kFloat64) {
  return ((torch::arange(1, n + 1, torch::kFloat64) * (r + 1)) + offset).to(dtype);
}

// Test names of the suites run with their tensors as they are and staged (stage_if).
std::string staged_name(const ::testing::TestParamInfo<bool>& info) {
  return info.param ? "StagedThroughHostCopies" : "Direct";
}

// ---- every collective, world 1..4 --------------------------------------------------------------

void run_every_collective(int rank, int size) {
  const int n = size;
  const double sum_ranks = n * (n + 1) / 2.0;  // sum of (r + 1)
  // all_reduce: sum, max, avg.
  {
    auto t = input_of(rank, 5);
    all_reduce(t);
    require_equal(t, torch::arange(1, 6, torch::kFloat64) * sum_ranks, "all_reduce sum");
    auto m = input_of(rank, 5, 0, torch::kInt64);
    all_reduce(m, ReduceOp::kMax);
    require_equal(m, (torch::arange(1, 6, torch::kFloat64) * n).to(torch::kInt64),
                  "all_reduce max");
    auto a = input_of(rank, 4, 0, torch::kFloat32);
    all_reduce(a, ReduceOp::kAvg);
    require(torch::allclose(
                a, (torch::arange(1, 5, torch::kFloat64) * sum_ranks / n).to(torch::kFloat32)),
            "all_reduce avg");
  }
  // broadcast from the last rank.
  {
    auto t = input_of(rank, 3);
    broadcast(t, n - 1);
    require_equal(t, input_of(n - 1, 3), "broadcast");
  }
  // reduce to dst 0: the sum there, untouched elsewhere.
  {
    auto t = input_of(rank, 4);
    reduce(t, 0);
    require_equal(t,
                  rank == 0 ? torch::arange(1, 5, torch::kFloat64) * sum_ranks : input_of(rank, 4),
                  "reduce");
  }
  // all_gather into a list, equal and uneven sizes (rank r contributes r + 1 elements).
  {
    std::vector<torch::Tensor> list;
    for (int r = 0; r < n; ++r)
      list.push_back(torch::zeros({2, 3}, torch::kFloat64));
    all_gather(list, input_of(rank, 6).view({2, 3}));
    for (int r = 0; r < n; ++r)
      require_equal(list[r], input_of(r, 6).view({2, 3}), fmt::format("all_gather [{}]", r));
    std::vector<torch::Tensor> uneven;
    for (int r = 0; r < n; ++r)
      uneven.push_back(torch::zeros({r + 1}, torch::kInt32));
    all_gather(uneven, input_of(rank, rank + 1, 0, torch::kInt32));
    for (int r = 0; r < n; ++r)
      require_equal(uneven[r], input_of(r, r + 1, 0, torch::kInt32),
                    fmt::format("uneven all_gather [{}]", r));
  }
  // all_gather_into_tensor: output [n * 3].
  {
    auto out = torch::zeros({n * 3}, torch::kFloat32);
    all_gather_into_tensor(out, input_of(rank, 3, 0, torch::kFloat32));  // a temporary input
    std::vector<torch::Tensor> want;
    for (int r = 0; r < n; ++r)
      want.push_back(input_of(r, 3, 0, torch::kFloat32));
    require_equal(out, torch::cat(want), "all_gather_into_tensor");
  }
  // reduce_scatter (list, equal and uneven) and reduce_scatter_tensor.
  {
    std::vector<torch::Tensor> inputs;
    for (int j = 0; j < n; ++j)
      inputs.push_back(input_of(rank, 3, 10.0 * j));
    auto out = torch::zeros({3}, torch::kFloat64);
    reduce_scatter(out, inputs);
    // sum over r of ((r + 1) * (1, 2, 3) + 10 * rank_me)
    require_equal(out, torch::arange(1, 4, torch::kFloat64) * sum_ranks + 10.0 * rank * n,
                  "reduce_scatter");
    std::vector<torch::Tensor> uneven;
    for (int j = 0; j < n; ++j)
      uneven.push_back(input_of(rank, j + 1, 10.0 * j));
    auto mine = torch::zeros({rank + 1}, torch::kFloat64);
    reduce_scatter(mine, uneven);
    require_equal(mine, torch::arange(1, rank + 2, torch::kFloat64) * sum_ranks + 10.0 * rank * n,
                  "uneven reduce_scatter");
    auto flat = torch::cat(inputs);
    auto block = torch::zeros({3}, torch::kFloat64);
    reduce_scatter_tensor(block, flat, ReduceOp::kMin);
    require_equal(block, input_of(0, 3, 10.0 * rank), "reduce_scatter_tensor min");
  }
  // all_to_all with lists of uneven sizes: rank r sends j + r + 1 elements to rank j, valued
  // 100 r + j.
  {
    std::vector<torch::Tensor> inputs;
    std::vector<torch::Tensor> outputs;
    for (int j = 0; j < n; ++j) {
      inputs.push_back(torch::full({j + rank + 1}, 100.0 * rank + j, torch::kFloat64));
      outputs.push_back(torch::zeros({rank + j + 1}, torch::kFloat64));
    }
    all_to_all(outputs, inputs);
    for (int j = 0; j < n; ++j)
      require_equal(outputs[j], torch::full({rank + j + 1}, 100.0 * j + rank, torch::kFloat64),
                    fmt::format("all_to_all from {}", j));
  }
  // all_to_all_single, equal splits and explicit splits (rows of 2): rank r sends (r + j) % 3 rows
  // to rank j, valued 100 r + j.
  {
    auto in = torch::arange(0, 2 * n * 2, torch::kFloat64).view({2 * n, 2}) + 1000 * rank;
    auto out = torch::zeros({2 * n, 2}, torch::kFloat64);
    all_to_all_single(out, in);
    for (int j = 0; j < n; ++j)
      require_equal(out.narrow(0, 2 * j, 2),
                    (torch::arange(0, 2 * n * 2, torch::kFloat64).view({2 * n, 2}) + 1000 * j)
                        .narrow(0, 2 * rank, 2),
                    fmt::format("all_to_all_single equal from {}", j));
    std::vector<std::int64_t> in_splits, out_splits;
    std::vector<torch::Tensor> pieces;
    for (int j = 0; j < n; ++j) {
      in_splits.push_back((rank + j) % 3);
      out_splits.push_back((j + rank) % 3);
      pieces.push_back(torch::full({(rank + j) % 3, 2}, 100.0 * rank + j, torch::kFloat64));
    }
    auto rows_out = std::accumulate(out_splits.begin(), out_splits.end(), std::int64_t{0});
    auto got = torch::full({rows_out, 2}, -1.0, torch::kFloat64);
    all_to_all_single(got, torch::cat(pieces), out_splits, in_splits);
    std::vector<torch::Tensor> want;
    for (int j = 0; j < n; ++j)
      want.push_back(torch::full({(j + rank) % 3, 2}, 100.0 * j + rank, torch::kFloat64));
    require_equal(got, torch::cat(want), "all_to_all_single with splits");
  }
  // gather to the last rank, scatter from rank 0.
  {
    const int dst = n - 1;
    std::vector<torch::Tensor> list;
    if (rank == dst)
      for (int r = 0; r < n; ++r)
        list.push_back(torch::zeros({4}, torch::kInt64));
    gather(input_of(rank, 4, 0, torch::kInt64), list, dst);
    if (rank == dst)
      for (int r = 0; r < n; ++r)
        require_equal(list[r], input_of(r, 4, 0, torch::kInt64), fmt::format("gather [{}]", r));
    std::vector<torch::Tensor> parts;
    if (rank == 0)
      for (int r = 0; r < n; ++r)
        parts.push_back(torch::full({3}, 7.0 * r, torch::kBFloat16));
    auto mine = torch::zeros({3}, torch::kBFloat16);
    scatter(mine, parts, 0);
    require_equal(mine, torch::full({3}, 7.0 * rank, torch::kBFloat16), "scatter");
  }
  barrier();
  require(get_rank() == rank && get_world_size() == n, "get_rank/get_world_size");
  require(is_main_process() == (rank == 0), "is_main_process");
  require(average_across_ranks(rank + 1.0) == sum_ranks / n, "average_across_ranks");
  require(all_reduce_scalar(rank, ReduceOp::kMax) == n - 1, "all_reduce_scalar max");
}

class DistributedApi : public ::testing::TestWithParam<int> {};

TEST_P(DistributedApi, EveryCollectiveGivesTheValuesComputedFromEachRanksInput) {
  const int size = GetParam();
  const int port = free_port();
  const auto results = run_ranks(size, [&](int rank) {
    join_group(rank, size, port);
    run_every_collective(rank, size);
    destroy_process_group();
  });
  EXPECT_ALL_RANKS_OK(results);
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, DistributedApi, ::testing::Values(1, 2, 3, 4));

// Every collective again with its tensors staged through host copies (what a CUDA tensor on a
// host group gets): the same values.
TEST(DistributedApiStaged, EveryCollectiveThroughHostCopiesGivesTheSameValues) {
  for (const int size : {1, 3}) {
    const int port = free_port();
    const auto results = run_ranks(size, [&](int rank) {
      join_group(rank, size, port);
      const auto staging = stage_if(true);
      run_every_collective(rank, size);
      require_staged(staging);
      destroy_process_group();
    });
    EXPECT_ALL_RANKS_OK(results);
  }
}

// ---- async forms, results and chains -----------------------------------------------------------

class DistributedApiAsync : public ::testing::TestWithParam<bool> {};

TEST_P(DistributedApiAsync, AsyncFormsCompleteLaterAndCarryTheirOutputs) {
  const int size = 3;
  const int port = free_port();
  const auto results = run_ranks(size, [&](int rank) {
    const auto staging = stage_if(GetParam());
    auto pg = join_group(rank, size, port);
    auto t = input_of(rank, 8);
    auto work = all_reduce_async(t, ReduceOp::kSum, *pg);
    std::vector<torch::Tensor> list(size, torch::Tensor());
    for (auto& x : list)
      x = torch::zeros({2}, torch::kFloat64);
    auto gathered = all_gather_async(list, input_of(rank, 2), pg);
    auto scattered_out = torch::zeros({2}, torch::kFloat64);
    std::vector<torch::Tensor> inputs(size, input_of(rank, 2));
    auto rs = reduce_scatter_async(scattered_out, inputs);
    auto b = barrier_async();
    work->wait();
    gathered->wait();
    rs->wait();
    b->wait();
    const auto out = work->result_as<std::vector<torch::Tensor>>();
    require(out.size() == 1 && out[0].data_ptr() == t.data_ptr(),
            "all_reduce result is the tensor");
    require_equal(t, torch::arange(1, 9, torch::kFloat64) * 6, "async all_reduce");
    const auto lists = gathered->result_as<std::vector<torch::Tensor>>();
    require(lists.size() == static_cast<std::size_t>(size), "all_gather result has the list");
    for (int r = 0; r < size; ++r)
      require_equal(lists[r], input_of(r, 2), "async all_gather");
    require_equal(scattered_out, torch::arange(1, 3, torch::kFloat64) * 6, "async reduce_scatter");
    // Rooted calls carry their tensor on every rank, the root's too.
    auto root_tensor = input_of(rank, 3);
    auto rooted = broadcast_async(root_tensor, 0, *pg);
    rooted->wait();
    require_equal(root_tensor, input_of(0, 3), "async broadcast");
    auto rooted_result = rooted->result_as<std::vector<torch::Tensor>>();
    require(rooted_result.size() == 1 && rooted_result[0].data_ptr() == root_tensor.data_ptr(),
            "the broadcast's result is its tensor");
    rooted = reduce_async(root_tensor, 1, ReduceOp::kSum, *pg);
    rooted->wait();
    rooted_result = rooted->result_as<std::vector<torch::Tensor>>();
    require(rooted_result.size() == 1 && rooted_result[0].data_ptr() == root_tensor.data_ptr(),
            "the reduce's result is its tensor");
    // A chain of two collectives without blocking in between (what a comm hook does).
    auto x = torch::ones({4}, torch::kFloat64) * (rank + 1);
    auto chain = all_reduce_async(x, ReduceOp::kSum, *pg)->and_then([&](Work&) {
      x.mul_(2);
      return all_reduce_async(x, ReduceOp::kMax, *pg);
    });
    chain->wait();
    require_equal(x, torch::full({4}, 12.0, torch::kFloat64), "chained all_reduce");
    require(chain->result_as<std::vector<torch::Tensor>>()[0].data_ptr() == x.data_ptr(),
            "the chain carries its last result");
    require_throws<ConfigError>([&] { chain->result_as<int>(); }, "not the type",
                                "result_as with the wrong type");
    require_staged(staging);
  });
  EXPECT_ALL_RANKS_OK(results);
}

INSTANTIATE_TEST_SUITE_P(DirectAndStaged, DistributedApiAsync, ::testing::Bool(), staged_name);

// ---- point to point ----------------------------------------------------------------------------

class DistributedApiP2P : public ::testing::TestWithParam<bool> {};

TEST_P(DistributedApiP2P, SendRecvWithTagsAndABatchedRingExchange) {
  const int size = 3;
  const int port = free_port();
  const auto results = run_ranks(size, [&](int rank) {
    const auto staging = stage_if(GetParam());
    auto pg = join_group(rank, size, port);
    const int next = (rank + 1) % size;
    const int prev = (rank + size - 1) % size;
    if (rank == 0) {
      send(torch::full({5}, 1.5, torch::kFloat32), 1, /*tag=*/7);
      auto w = isend(torch::full({2}, 9, torch::kInt64), 2, 3);
      w->wait();
    } else if (rank == 1) {
      auto t = torch::zeros({5}, torch::kFloat32);
      require(recv(t, 0, 7) == 0, "recv returns the source");
      require_equal(t, torch::full({5}, 1.5, torch::kFloat32), "recv");
    } else {
      auto t = torch::zeros({2}, torch::kInt64);
      irecv(t, 0, 3)->wait();
      require_equal(t, torch::full({2}, 9, torch::kInt64), "irecv");
    }
    // A halo exchange: send to both neighbours, receive from both.
    auto to_next = torch::full({3}, 10.0 * rank + 1, torch::kFloat64);
    auto to_prev = torch::full({3}, 10.0 * rank + 2, torch::kFloat64);
    auto from_prev = torch::zeros({3}, torch::kFloat64);
    auto from_next = torch::zeros({3}, torch::kFloat64);
    auto works = batch_isend_irecv({{P2POp::Kind::kIsend, to_next, next, *pg, 1},
                                    {P2POp::Kind::kIsend, to_prev, prev, *pg, 2},
                                    {P2POp::Kind::kIrecv, from_prev, prev, *pg, 1},
                                    {P2POp::Kind::kIrecv, from_next, next, *pg, 2}});
    for (auto& w : works)
      w->wait();
    require_equal(from_prev, torch::full({3}, 10.0 * prev + 1, torch::kFloat64), "halo from prev");
    require_equal(from_next, torch::full({3}, 10.0 * next + 2, torch::kFloat64), "halo from next");
    require_throws<ConfigError>(
        [&] {
          batch_isend_irecv({{P2POp::Kind::kIsend, to_next, rank, *pg, 0}});
        },
        "ops[0].peer", "batch_isend_irecv to self");
    // Rank 0 receives from any source, once from each other rank, and learns who sent.
    if (rank == 0) {
      std::set<int> senders;
      for (int k = 1; k < size; ++k) {
        auto t = torch::zeros({4}, torch::kInt32);
        const int from = recv_any_source(t, 5);
        require_equal(t, torch::full({4}, from, torch::kInt32), "recv_any_source's data");
        senders.insert(from);
      }
      require(senders == std::set<int>{1, 2}, "recv_any_source heard from ranks 1 and 2");
    } else {
      send(torch::full({4}, rank, torch::kInt32), 0, 5);
    }
    barrier();
    require_staged(staging);
  });
  EXPECT_ALL_RANKS_OK(results);
}

INSTANTIATE_TEST_SUITE_P(DirectAndStaged, DistributedApiP2P, ::testing::Bool(), staged_name);

// ---- monitored_barrier -------------------------------------------------------------------------

TEST(DistributedApiMonitoredBarrier, PassesWhenAllArriveAndNamesEveryMissingRank) {
  const int size = 4;
  const int port = free_port();
  const auto results = run_ranks(size, [&](int rank) {
    join_group(rank, size, port, 20s);
    monitored_barrier({.timeout = 5s});
    if (rank >= 2) {
      std::this_thread::sleep_for(4s);  // ranks 2 and 3 never come
      return;
    }
    const auto start = std::chrono::steady_clock::now();
    if (rank == 0) {
      require_throws<TimeoutError>(
          [&] { monitored_barrier({.timeout = 1s, .wait_all_ranks = true}); }, "ranks 2, 3",
          "monitored_barrier on rank 0");
    } else {
      require_throws<TimeoutError>([&] { monitored_barrier({.timeout = 1s}); }, "rank 0",
                                   "monitored_barrier on rank 1");
    }
    require(std::chrono::steady_clock::now() - start < 4s, "monitored_barrier took too long");
  });
  EXPECT_ALL_RANKS_OK(results);
}

// ---- groups ------------------------------------------------------------------------------------

TEST(DistributedApiGroups, NewGroupAndNewSubgroupsRunCollectivesOfTheirMembers) {
  const int size = 4;
  const int port = free_port();
  const auto results = run_ranks(size, [&](int rank) {
    join_group(rank, size, port);
    auto odd = new_group({3, 1});
    require((odd != nullptr) == (rank % 2 == 1), "new_group membership");
    if (odd) {
      require(get_world_size(odd) == 2 && get_rank(odd) == rank / 2, "subgroup rank");
      auto t = torch::full({2}, static_cast<double>(rank), torch::kFloat64);
      all_reduce(t, ReduceOp::kSum, odd);
      require_equal(t, torch::full({2}, 4.0, torch::kFloat64), "subgroup all_reduce");
    } else {
      require_throws<ConfigError>([&] { all_reduce(torch::zeros({1}), ReduceOp::kSum, odd); },
                                  "not a member", "a collective on a group without this rank");
    }
    require_throws<ConfigError>([&] { new_group({1, 1}); }, "listed twice", "duplicate ranks");
    auto halves = new_subgroups(2);
    require(halves.ranks == std::vector<std::vector<int>>{{0, 1}, {2, 3}}, "subgroup ranks");
    require(halves.mine && get_world_size(halves.mine) == 2, "own subgroup");
    require(average_across_ranks(rank, halves.mine) == (rank < 2 ? 0.5 : 2.5), "subgroup average");
    require_throws<ConfigError>([&] { new_subgroups(3); }, "does not divide", "group size 3");
    barrier();
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(DistributedApiGroups, SplitGroupAndTheWorldRanksOfSubgroups) {
  const int size = 4;
  const int port = free_port();
  const auto results = run_ranks(size, [&](int rank) {
    join_group(rank, size, port);
    require(get_process_group_ranks() == std::vector<int>{0, 1, 2, 3}, "world ranks of the world");
    // Rank 1 is in no split; {3, 0} is sorted to {0, 3}.
    auto mine = split_group({{3, 0}, {2}});
    require((mine != nullptr) == (rank != 1), "split_group membership");
    if (rank == 0 || rank == 3) {
      require(get_process_group_ranks(mine) == std::vector<int>{0, 3}, "ranks of split {0, 3}");
      require(get_rank(mine) == (rank == 3 ? 1 : 0), "rank in split {0, 3}");
      require(get_global_rank(mine, 1) == 3 && get_group_rank(mine, 3) == 1, "global <-> group");
      require_throws<ConfigError>([&] { get_group_rank(mine, 2); }, "world rank 2 is not in",
                                  "get_group_rank of a rank outside the group");
      require_throws<ConfigError>([&] { get_global_rank(mine, 2); }, "not a rank of the group",
                                  "get_global_rank past the group's size");
      // A subgroup of the subgroup maps through both.
      auto inner = new_group({1}, mine);
      if (rank == 3) require(get_process_group_ranks(inner) == std::vector<int>{3}, "nested");
      auto t = torch::full({3}, static_cast<double>(rank), torch::kFloat64);
      all_reduce(t, ReduceOp::kSum, mine);
      require_equal(t, torch::full({3}, 3.0, torch::kFloat64), "all_reduce in split {0, 3}");
    }
    if (rank == 2) require(get_process_group_ranks(mine) == std::vector<int>{2}, "split {2}");
    // Bad splits: the same on every rank, or different across ranks, are a named error on every
    // rank, and the group still works afterwards.
    require_throws<ConfigError>(
        [&] {
          split_group({{0, 1}, {1, 2}});
        },
        "rank 1 is in split 0 and in split 1", "overlapping splits");
    require_throws<ConfigError>(
        [&] {
          split_group({{0, 4}});
        },
        "not a rank of the group", "a split naming rank 4 of 4");
    require_throws<ConfigError>(
        [&] {
          split_group({{0, 1}, {rank == 2 ? 3 : 2}});
        },
        "different splits", "splits that differ across ranks");
    require(average_across_ranks(rank) == 1.5, "the group works after the refusals");
  });
  EXPECT_ALL_RANKS_OK(results);
}

// ---- coalesced forms and bitwise reductions
// ------------------------------------------------------

class DistributedApiCoalesced : public ::testing::TestWithParam<bool> {};

TEST_P(DistributedApiCoalesced, EachEqualsOneCallPerTensorInOneEngineCall) {
  const int size = 3;
  const int port = free_port();
  const auto results = run_ranks(size, [&](int rank) {
    const auto staging = stage_if(GetParam());
    join_group(rank, size, port);
    const std::vector<std::int64_t> lengths = {5, 1, 0, 7};
    auto make = [&](int r, std::int64_t n, double salt) { return input_of(r, n, salt); };
    // all_reduce_coalesced, against one all_reduce per tensor.
    std::vector<torch::Tensor> tensors, singles;
    for (std::size_t i = 0; i < lengths.size(); ++i) {
      tensors.push_back(make(rank, lengths[i], static_cast<double>(i)));
      singles.push_back(tensors.back().clone());
    }
    all_reduce_coalesced(tensors, ReduceOp::kMax);
    for (std::size_t i = 0; i < tensors.size(); ++i) {
      all_reduce(singles[i], ReduceOp::kMax);
      require_equal(tensors[i], singles[i], fmt::format("all_reduce_coalesced tensor {}", i));
    }
    // all_gather_into_tensor_coalesced.
    std::vector<torch::Tensor> inputs, outputs;
    for (std::size_t i = 0; i < lengths.size(); ++i) {
      inputs.push_back(make(rank, lengths[i], 10.0 * static_cast<double>(i)));
      outputs.push_back(torch::full({size * lengths[i]}, -1.0, torch::kFloat64));
    }
    all_gather_into_tensor_coalesced(outputs, inputs);
    for (std::size_t i = 0; i < lengths.size(); ++i) {
      std::vector<torch::Tensor> parts;
      for (int r = 0; r < size; ++r)
        parts.push_back(make(r, lengths[i], 10.0 * static_cast<double>(i)));
      require_equal(outputs[i], torch::cat(parts), fmt::format("all_gather coalesced {}", i));
    }
    // A gather moves bytes: its pairs may have different dtypes.
    std::vector<torch::Tensor> mixed = {torch::zeros({size * 2}, torch::kInt32),
                                        torch::zeros({size}, torch::kFloat16)};
    all_gather_into_tensor_coalesced(mixed, {torch::full({2}, rank, torch::kInt32),
                                             torch::full({1}, rank + 0.5, torch::kFloat16)});
    require_equal(mixed[0], torch::arange(size).repeat_interleave(2).to(torch::kInt32),
                  "coalesced gather of int32 beside float16");
    require_equal(mixed[1], (torch::arange(size) + 0.5).to(torch::kFloat16),
                  "coalesced gather of float16 beside int32");
    // reduce_scatter_tensor_coalesced: inputs of world x n, each rank gets its block.
    std::vector<torch::Tensor> big, small;
    for (std::size_t i = 0; i < lengths.size(); ++i) {
      big.push_back(make(rank, size * lengths[i], static_cast<double>(i)));
      small.push_back(torch::full({lengths[i]}, -1.0, torch::kFloat64));
    }
    auto work = reduce_scatter_tensor_coalesced_async(small, big, ReduceOp::kSum);
    work->wait();
    require(work->result_as<std::vector<torch::Tensor>>().size() == lengths.size(),
            "the async form's result holds the outputs");
    for (std::size_t i = 0; i < lengths.size(); ++i) {
      torch::Tensor sum = torch::zeros({size * lengths[i]}, torch::kFloat64);
      for (int r = 0; r < size; ++r)
        sum += make(r, size * lengths[i], static_cast<double>(i));
      require_equal(small[i], sum.narrow(0, rank * lengths[i], lengths[i]),
                    fmt::format("reduce_scatter coalesced {}", i));
    }
    // Bad input: mixed dtypes, an empty list, sizes that do not fit; the group works after.
    require_throws<ConfigError>(
        [&] {
          all_reduce_coalesced({torch::zeros({2}), torch::zeros({2}, torch::kInt32)});
        },
        "tensors[1] has dtype Int", "mixed dtypes");
    require_throws<ConfigError>([&] { all_reduce_coalesced({}); }, "is empty", "no tensors");
    require_throws<ConfigError>(
        [&] { all_gather_into_tensor_coalesced({torch::zeros({2})}, {torch::zeros({2})}); },
        "world size 3", "an output that is not world x its input");
    // Bitwise reductions of integers, and their refusal on floating point.
    auto bits = torch::tensor({0b1100 | rank, 0xff ^ (1 << rank), 1 << rank}, torch::kInt32);
    auto ored = bits.clone(), xored = bits.clone();
    all_reduce(bits, ReduceOp::kBand);
    all_reduce(ored, ReduceOp::kBor);
    all_reduce(xored, ReduceOp::kBxor);
    require_equal(bits, torch::tensor({0b1100, 0xff ^ 0b111, 0}, torch::kInt32), "band");
    require_equal(ored, torch::tensor({0b1111, 0xff, 0b111}, torch::kInt32), "bor");
    require_equal(xored, torch::tensor({0b1100 ^ 0 ^ 1 ^ 2, 0xff ^ 0b111, 0b111}, torch::kInt32),
                  "bxor");
    require_throws<ConfigError>([&] { all_reduce(torch::ones({2}), ReduceOp::kBxor); },
                                "needs an integer dtype", "bxor of float32");
    require(average_across_ranks(rank) == 1.0, "the group works after the refusals");
    require_staged(staging);
  });
  EXPECT_ALL_RANKS_OK(results);
}

INSTANTIATE_TEST_SUITE_P(DirectAndStaged, DistributedApiCoalesced, ::testing::Bool(), staged_name);

// PREMUL_SUM (make_premul_sum): every reducing call sums each rank's input times that rank's
// factor, and leaves the inputs as they were.
class DistributedApiPremulSum : public ::testing::TestWithParam<bool> {};

TEST_P(DistributedApiPremulSum, EveryReducingCallSumsTheScaledInputs) {
  const int size = 3;
  const int port = free_port();
  const auto results = run_ranks(size, [&](int rank) {
    const auto staging = stage_if(GetParam());
    join_group(rank, size, port);
    // Each rank's own factor (a double on even ranks, a one-element tensor on odd ones).
    auto factor_of = [](int r) { return 0.5 + r; };
    const TensorReduceOp op = rank % 2 == 0 ? make_premul_sum(factor_of(rank))
                                            : make_premul_sum(torch::tensor({factor_of(rank)}));
    require(op.is_premul_sum() && op.op() == ReduceOp::kSum, "PREMUL_SUM runs as a sum");
    const std::int64_t n = 4;
    auto scaled_sum = [&](std::int64_t count, double salt) {
      torch::Tensor sum = torch::zeros({count}, torch::kFloat64);
      for (int r = 0; r < size; ++r)
        sum += input_of(r, count, salt) * factor_of(r);
      return sum;
    };
    auto t = input_of(rank, n);
    all_reduce(t, op);
    require_equal(t, scaled_sum(n, 0), "all_reduce");
    auto a = input_of(rank, n, 1.0);
    all_reduce_async(a, op)->wait();
    require_equal(a, scaled_sum(n, 1.0), "all_reduce_async");
    // reduce: the root gets the scaled sum, the others keep their input.
    auto rt = input_of(rank, n, 2.0);
    reduce(rt, /*dst=*/1, op);
    require_equal(rt, rank == 1 ? scaled_sum(n, 2.0) : input_of(rank, n, 2.0), "reduce");
    // reduce_scatter_tensor and reduce_scatter: the input is left as it was.
    auto in = input_of(rank, size * n, 3.0);
    auto out = torch::zeros({n}, torch::kFloat64);
    reduce_scatter_tensor(out, in, op);
    require_equal(out, scaled_sum(size * n, 3.0).narrow(0, rank * n, n), "reduce_scatter_tensor");
    require_equal(in, input_of(rank, size * n, 3.0), "reduce_scatter_tensor's input unchanged");
    std::vector<torch::Tensor> list;
    for (int r = 0; r < size; ++r)
      list.push_back(in.narrow(0, r * n, n).clone());
    auto out_list = torch::zeros({n}, torch::kFloat64);
    reduce_scatter(out_list, list, op);
    require_equal(out_list, out, "reduce_scatter");
    require_equal(list[0], input_of(rank, size * n, 3.0).narrow(0, 0, n), "list input unchanged");
    // The coalesced forms.
    std::vector<torch::Tensor> several = {input_of(rank, 2, 4.0), input_of(rank, 3, 5.0)};
    all_reduce_coalesced(several, op);
    require_equal(several[0], scaled_sum(2, 4.0), "all_reduce_coalesced 0");
    require_equal(several[1], scaled_sum(3, 5.0), "all_reduce_coalesced 1");
    std::vector<torch::Tensor> outs = {torch::zeros({n}, torch::kFloat64)};
    reduce_scatter_tensor_coalesced(outs, {in}, op);
    require_equal(outs[0], out, "reduce_scatter_tensor_coalesced");
    // float32 is multiplied in float32, as NCCL does.
    auto f = input_of(rank, n, 0.0, torch::kFloat32);
    all_reduce(f, op);
    require(torch::allclose(f, scaled_sum(n, 0).to(torch::kFloat32)), "float32 all_reduce");
    // Bad input: an integer tensor (every rank refuses it the same way), a factor that is not
    // finite or not one element, the factor of an op that is not PREMUL_SUM.
    auto ints = torch::ones({2}, torch::kInt32);
    require_throws<ConfigError>([&] { all_reduce(ints, op); }, "takes floating-point tensors",
                                "PREMUL_SUM of int32");
    require_equal(ints, torch::ones({2}, torch::kInt32), "the refused tensor is unchanged");
    require_throws<ConfigError>([&] { make_premul_sum(std::nan("")); }, "not finite", "nan");
    require_throws<ConfigError>([&] { make_premul_sum(torch::ones({2})); }, "has 2 elements",
                                "a two-element factor");
    require_throws<ConfigError>([&] { (void)TensorReduceOp(ReduceOp::kMax).premul_factor(); },
                                "not PREMUL_SUM", "factor of max");
    require(average_across_ranks(rank) == 1.0, "the group works after the refusals");
    require_staged(staging);
  });
  EXPECT_ALL_RANKS_OK(results);
}

INSTANTIATE_TEST_SUITE_P(DirectAndStaged, DistributedApiPremulSum, ::testing::Bool(), staged_name);

// A group that forwards everything to another and pretends that every `per_host` consecutive
// ranks share a host: what a backend that knows its hosts reports (local_rank/local_size).
class PretendHosts final : public test::ForwardingGroup {
 public:
  PretendHosts(std::shared_ptr<ProcessGroup> inner, int per_host)
      : ForwardingGroup(std::move(inner)), per_host_(per_host) {}
  int local_rank() const override { return rank() % per_host_; }
  int local_size() const override { return per_host_; }

 private:
  int per_host_;
};

TEST(DistributedApiGroups, NewSubgroupsByDefaultMakesOneSubgroupPerHost) {
  const int size = 4;
  const int port = free_port();
  const auto results = run_ranks(size, [&](int rank) {
    auto pg = join_group(rank, size, port);
    PretendHosts hosts(pg, 2);
    require(get_local_rank(hosts) == rank % 2 && get_local_world_size(hosts) == 2, "local rank");
    auto per_host = new_subgroups(0, hosts);
    require(per_host.ranks == std::vector<std::vector<int>>{{0, 1}, {2, 3}}, "per-host ranks");
    require(all_reduce_scalar(1.0, ReduceOp::kSum, per_host.mine) == 2.0, "per-host all_reduce");
    // Hosts of 3 ranks do not tile 4 ranks: a ConfigError on every rank, before any subgroup.
    PretendHosts uneven(pg, 3);
    require_throws<ConfigError>([&] { new_subgroups(0, uneven); }, "does not divide",
                                "hosts that do not tile the group");
    barrier(*pg);
  });
  EXPECT_ALL_RANKS_OK(results);
}

// ---- bad input ---------------------------------------------------------------------------------

// Every rank makes the same mistake: every rank throws the named ConfigError, and the group is
// still in step afterwards.
TEST(DistributedApiBadInput, TheSameMistakeOnEveryRankIsANamedErrorThatLeavesTheGroupWorking) {
  const int size = 3;
  const int port = free_port();
  const auto results = run_ranks(size, [&](int rank) {
    join_group(rank, size, port, 20s);
    const auto f32 = torch::zeros({4}, torch::kFloat32);
    auto list_of = [&](int count, torch::Dtype dtype) {
      std::vector<torch::Tensor> list;
      for (int i = 0; i < count; ++i)
        list.push_back(torch::zeros({4}, dtype));
      return list;
    };
    require_throws<ConfigError>([&] { all_gather(list_of(size - 1, torch::kFloat32), f32); },
                                "tensor_list has 2 tensors", "list too short");
    auto mixed = list_of(size, torch::kFloat32);
    mixed[1] = torch::zeros({4}, torch::kFloat64);
    require_throws<ConfigError>([&] { all_gather(mixed, f32); }, "tensor_list[1] has dtype Double",
                                "wrong dtype in the list");
    require_throws<ConfigError>([&] { all_reduce(torch::zeros({4}, torch::kBool)); }, "dtype Bool",
                                "bool tensor");
    require_throws<ConfigError>(
        [&] {
          all_reduce(torch::zeros({4, 4}).t());
        },
        "not contiguous", "transposed tensor");
    require_throws<ConfigError>(
        [&] { broadcast(torch::zeros({4}, torch::TensorOptions().device(torch::kMeta)), 0); },
        "ddp moves CPU and CUDA tensors only", "a tensor on another device");
    require_throws<ConfigError>([&] { all_gather_into_tensor(torch::zeros({5}), f32); }, "needs 12",
                                "all_gather_into_tensor output of the wrong size");
    require_throws<ConfigError>(
        [&] {
          all_to_all_single(torch::zeros({6}), torch::zeros({6}), {2, 2, 2}, {1, 2, 2});
        },
        "add up to 5 rows", "input splits that do not add up");
    require_throws<ConfigError>([&] { all_to_all_single(torch::zeros({4}), torch::zeros({4})); },
                                "do not split evenly", "rows that do not split evenly");
    require_throws<ConfigError>([&] { gather(f32, list_of(1, torch::kFloat32), 0); },
                                "gather: gather_list", "a gather_list of one tensor on every rank");
    // Still in step.
    auto t = torch::ones({3}, torch::kFloat64);
    all_reduce(t);
    require_equal(t, torch::full({3}, 3.0, torch::kFloat64), "all_reduce after the errors");
  });
  EXPECT_ALL_RANKS_OK(results);
}

// Split sizes that differ across ranks: a ConfigError on every rank (they exchange sizes first).
TEST(DistributedApiBadInput, SplitSizesThatDifferAcrossRanksAreAConfigErrorOnEveryRank) {
  const int size = 3;
  const int port = free_port();
  const auto results = run_ranks(size, [&](int rank) {
    join_group(rank, size, port, 20s);
    // Rank 1 expects 2 rows from rank 0, which sends 1.
    std::vector<std::int64_t> out_splits{1, 1, 1};
    if (rank == 1) out_splits = {2, 1, 1};
    const auto start = std::chrono::steady_clock::now();
    require_throws<ConfigError>(
        [&] {
          all_to_all_single(torch::zeros({rank == 1 ? 4 : 3}), torch::zeros({3}), out_splits,
                            {1, 1, 1});
        },
        "rank 0 sends 1 to rank 1, which expects 2", "splits that differ");
    require(std::chrono::steady_clock::now() - start < 10s, "the error took too long");
    auto t = torch::ones({1}, torch::kFloat64);
    all_reduce(t);
    require_equal(t, torch::full({1}, 3.0, torch::kFloat64), "all_reduce after the error");
  });
  EXPECT_ALL_RANKS_OK(results);
}

// One rank alone passes a bad list: it throws its ConfigError, and the ranks that made the call
// fail at once (the refusing rank's barrier meets their collective) instead of waiting 60 s.
TEST(DistributedApiBadInput, AMistakeOnOneRankFailsEveryRankPromptly) {
  const int size = 3;
  const int port = free_port();
  const auto results = run_ranks(size, [&](int rank) {
    join_group(rank, size, port, 60s);
    std::vector<torch::Tensor> list(rank == 1 ? size + 1 : size, torch::Tensor());
    for (auto& t : list)
      t = torch::zeros({4});
    const auto start = std::chrono::steady_clock::now();
    try {
      all_gather(list, torch::zeros({4}));
      throw std::runtime_error("all_gather with a bad list on rank 1 did not fail here");
    } catch (const ConfigError& e) {
      require(rank == 1, fmt::format("rank {} got the ConfigError: {}", rank, e.what()));
      require(std::string(e.what()).find("tensor_list has 4 tensors") != std::string::npos,
              e.what());
    } catch (const CommError& e) {
      require(rank != 1, fmt::format("rank 1 got a CommError: {}", e.what()));
    }
    require(std::chrono::steady_clock::now() - start < 20s, "the failure took too long");
  });
  EXPECT_ALL_RANKS_OK(results);
}

// A staged call that fails copies nothing back: the tensors keep the values they had (rank 1's
// list is refused; the others' all_gather fails on the mismatch it leaves).
TEST(DistributedApiStaged, AFailedCallLeavesTheTensorsAsTheyWere) {
  const int size = 3;
  const int port = free_port();
  const auto results = run_ranks(size, [&](int rank) {
    join_group(rank, size, port, 60s);
    const auto staging = stage_if(true);
    std::vector<torch::Tensor> list(rank == 1 ? size + 1 : size, torch::Tensor());
    for (auto& t : list)
      t = torch::full({4}, -1.0);
    try {
      all_gather(list, torch::full({4}, static_cast<double>(rank)));
      throw std::runtime_error("all_gather with a bad list on rank 1 did not fail here");
    } catch (const ConfigError& e) {
      require(rank == 1, fmt::format("rank {} got the ConfigError: {}", rank, e.what()));
    } catch (const CommError& e) {
      require(rank != 1, fmt::format("rank 1 got a CommError: {}", e.what()));
    }
    for (const auto& t : list)
      require_equal(t, torch::full({4}, -1.0), "an output of the failed all_gather");
    require(staging->copies_back() == 0, "the failed call copied results back");
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(DistributedApiBadInput, NoDefaultGroupIsANamedError) {
  const auto results = run_ranks(1, [&](int) {
    require(!is_initialized(), "no default group yet");
    require(is_main_process(), "a process without a group is the main process");
    require_throws<ConfigError>([] { all_reduce(torch::zeros({1})); }, "init_process_group",
                                "all_reduce without a group");
  });
  EXPECT_ALL_RANKS_OK(results);
}

}  // namespace DDP_UNITY_ID
}  // namespace
}  // namespace ddp
