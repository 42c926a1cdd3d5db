#include "support/torch/c10d_wrap_checks.h"

#include <algorithm>
#include <cmath>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "ddp/torch/api/join.h"
#include "ddp/torch/ddp/distributed_data_parallel.h"
#include "ddp/torch/ddp/sync_batch_norm.h"
#include "ddp/torch/zero/zero_redundancy_optimizer.h"
#include "support/torch/ddp_test_util.h"
#include "support/unity_namespace.h"

namespace ddp::test {

void expect_equal(const at::Tensor& got, const at::Tensor& want, const std::string& what) {
  if (!torch::equal(got.to(torch::kFloat64), want.to(torch::kFloat64))) {
    std::ostringstream text;
    text << what << ": got " << got.to(torch::kFloat64) << " want " << want.to(torch::kFloat64);
    throw std::runtime_error(text.str());
  }
}

namespace {
namespace DDP_UNITY_ID {

// Every rank's results as a tensor of `type`, from values worked out in double.
at::Tensor as(const std::vector<double>& values, at::ScalarType type) {
  return torch::tensor(values, torch::kFloat64).to(type);
}

// v(r, i) = r + 1 + i % 3: small enough that sums and products of 3 ranks fit int8 exactly.
double v(int r, int i) {
  return r + 1 + i % 3;
}

void check_allreduce(ProcessGroup& pg, at::ScalarType type, ReduceOp op) {
  const int n = pg.size(), r = pg.rank(), count = 7;
  std::vector<double> mine, want;
  for (int i = 0; i < count; ++i) {
    mine.push_back(v(r, i));
    double acc = op == ReduceOp::kProduct ? 1
                 : op == ReduceOp::kMin   ? 1e9
                 : op == ReduceOp::kMax   ? -1e9
                 : op == ReduceOp::kBand  ? v(0, i)
                                          : 0;
    for (int q = 0; q < n; ++q) {
      const auto bits = [&] { return static_cast<long long>(acc); };
      const auto value = static_cast<long long>(v(q, i));
      switch (op) {
        case ReduceOp::kBand:
          acc = static_cast<double>(bits() & value);
          break;
        case ReduceOp::kBor:
          acc = static_cast<double>(bits() | value);
          break;
        case ReduceOp::kBxor:
          acc = static_cast<double>(bits() ^ value);
          break;
        case ReduceOp::kSum:
        case ReduceOp::kAvg:
          acc += v(q, i);
          break;
        case ReduceOp::kProduct:
          acc *= v(q, i);
          break;
        case ReduceOp::kMin:
          acc = std::min(acc, v(q, i));
          break;
        case ReduceOp::kMax:
          acc = std::max(acc, v(q, i));
          break;
      }
    }
    if (op == ReduceOp::kAvg) {
      acc = c10::isIntegralType(type, false) ? std::trunc(acc / n) : acc / n;
    }
    want.push_back(acc);
  }
  auto t = as(mine, type);
  const auto what = fmt::format("allreduce {} {}", c10::toString(type), to_string(op));
  pg.allreduce(t.data_ptr(), static_cast<std::size_t>(count), to_dtype(type), op)->wait();
  expect_equal(t, as(want, type), what);
  // Out of place: send stays, recv gets the result.
  auto send = as(mine, type);
  auto recv = torch::zeros_like(send);
  pg.allreduce(send.data_ptr(), recv.data_ptr(), static_cast<std::size_t>(count), to_dtype(type),
               op)
      ->wait();
  expect_equal(recv, as(want, type), what + " (out of place)");
  expect_equal(send, as(mine, type), what + " (send untouched)");
}

// Every operation of ProcessGroup with equal blocks, in float32.
void check_block_collectives(ProcessGroup& pg) {
  const int n = pg.size(), r = pg.rank();
  constexpr std::size_t c = 5;
  const auto f32 = DType::kFloat32;
  const auto values = [](std::size_t count, auto fn) {
    std::vector<double> out;
    for (std::size_t i = 0; i < count; ++i)
      out.push_back(fn(static_cast<int>(i)));
    return as(out, torch::kFloat32);
  };
  {  // broadcast from the last rank
    auto buf = r == n - 1 ? values(c, [](int i) { return 7.0 + i; }) : torch::zeros({long(c)});
    pg.broadcast(buf.data_ptr(), c, f32, n - 1)->wait();
    expect_equal(buf, values(c, [](int i) { return 7.0 + i; }), "broadcast");
  }
  for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax}) {  // reduce to rank 1
    auto send = values(c, [&](int i) { return v(r, i); });
    auto recv = torch::full({long(c)}, -1.0);
    pg.reduce(send.data_ptr(), r == 1 ? recv.data_ptr() : nullptr, c, f32, op, 1)->wait();
    expect_equal(send, values(c, [&](int i) { return v(r, i); }), "reduce: send untouched");
    if (r == 1) {
      expect_equal(recv,
                   values(c,
                          [&](int i) {
                            double s = 0, m = -1e9;
                            for (int q = 0; q < n; ++q)
                              s += v(q, i), m = std::max(m, v(q, i));
                            return op == ReduceOp::kSum ? s : op == ReduceOp::kAvg ? s / n : m;
                          }),
                   fmt::format("reduce {}", to_string(op)));
    }
  }
  {  // allgather
    auto send = values(c, [&](int i) { return 10.0 * r + i; });
    auto recv = torch::zeros({long(c) * n});
    pg.allgather(send.data_ptr(), recv.data_ptr(), c, f32)->wait();
    expect_equal(recv, values(c * n, [&](int k) { return 10.0 * (k / int(c)) + k % int(c); }),
                 "allgather");
  }
  {  // gather to rank 0
    auto send = values(c, [&](int i) { return 10.0 * r + i; });
    auto recv = torch::zeros({long(c) * n});
    pg.gather(send.data_ptr(), r == 0 ? recv.data_ptr() : nullptr, c, f32, 0)->wait();
    if (r == 0) {
      expect_equal(recv, values(c * n, [&](int k) { return 10.0 * (k / int(c)) + k % int(c); }),
                   "gather");
    }
  }
  {  // scatter from rank 1
    auto send = values(c * n, [&](int k) { return 100.0 * (k / int(c)) + k % int(c); });
    auto recv = torch::zeros({long(c)});
    pg.scatter(r == 1 ? send.data_ptr() : nullptr, recv.data_ptr(), c, f32, 1)->wait();
    expect_equal(recv, values(c, [&](int i) { return 100.0 * r + i; }), "scatter");
  }
  for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMin}) {  // reduce_scatter
    auto send = values(c * n, [&](int k) { return r + 10.0 * (k / int(c)) + k % int(c); });
    auto recv = torch::zeros({long(c)});
    pg.reduce_scatter(send.data_ptr(), recv.data_ptr(), c, f32, op)->wait();
    expect_equal(recv,
                 values(c,
                        [&](int i) {
                          const double base = 10.0 * r + i;
                          const double sum = n * base + n * (n - 1) / 2.0;
                          return op == ReduceOp::kSum ? sum : op == ReduceOp::kAvg ? sum / n : base;
                        }),
                 fmt::format("reduce_scatter {}", to_string(op)));
  }
  {  // alltoall: block j of rank r goes to rank j
    auto send = values(c * n, [&](int k) { return 100.0 * r + 10.0 * (k / int(c)) + k % int(c); });
    auto recv = torch::zeros({long(c) * n});
    pg.alltoall(send.data_ptr(), recv.data_ptr(), c, f32)->wait();
    expect_equal(recv,
                 values(c * n, [&](int k) { return 100.0 * (k / int(c)) + 10.0 * r + k % int(c); }),
                 "alltoall");
  }
  pg.barrier()->wait();
  {  // allreduce_segments: two pieces reduced as one buffer
    auto a = values(3, [&](int i) { return v(r, i); });
    auto b = values(4, [&](int i) { return v(r, i + 3); });
    pg.allreduce_segments({{a.data_ptr(), 3}, {b.data_ptr(), 4}}, f32, ReduceOp::kSum)->wait();
    const auto sum = [&](int i) {
      double s = 0;
      for (int q = 0; q < n; ++q)
        s += v(q, i);
      return s;
    };
    expect_equal(a, values(3, sum), "allreduce_segments (first)");
    expect_equal(b, values(4, [&](int i) { return sum(i + 3); }), "allreduce_segments (second)");
  }
}

// The uneven collectives (counts differ by rank).
void check_uneven_collectives(ProcessGroup& pg) {
  const int n = pg.size(), r = pg.rank();
  const auto f32 = DType::kFloat32;
  {  // allgather_v: rank j holds j + 1 elements 10 j + i
    std::vector<std::size_t> counts;
    std::vector<double> want;
    for (int j = 0; j < n; ++j) {
      counts.push_back(static_cast<std::size_t>(j + 1));
      for (int i = 0; i <= j; ++i)
        want.push_back(10.0 * j + i);
    }
    std::vector<double> mine;
    for (int i = 0; i <= r; ++i)
      mine.push_back(10.0 * r + i);
    auto send = as(mine, torch::kFloat32);
    auto recv = torch::zeros({static_cast<long>(want.size())});
    pg.allgather_v(send.data_ptr(), mine.size(), recv.data_ptr(), counts, f32)->wait();
    expect_equal(recv, as(want, torch::kFloat32), "allgather_v");
  }
  {  // alltoall_v: rank a sends a + b + 1 elements 1000 a + 100 b + i to rank b
    const auto count = [](int from, int to) { return static_cast<std::size_t>(from + to + 1); };
    std::vector<std::size_t> send_counts, recv_counts;
    std::vector<double> mine, want;
    for (int j = 0; j < n; ++j) {
      send_counts.push_back(count(r, j));
      recv_counts.push_back(count(j, r));
      for (std::size_t i = 0; i < count(r, j); ++i)
        mine.push_back(1000.0 * r + 100.0 * j + i);
      for (std::size_t i = 0; i < count(j, r); ++i)
        want.push_back(1000.0 * j + 100.0 * r + i);
    }
    auto send = as(mine, torch::kFloat32);
    auto recv = torch::zeros({static_cast<long>(want.size())});
    pg.alltoall_v(send.data_ptr(), send_counts, recv.data_ptr(), recv_counts, f32)->wait();
    expect_equal(recv, as(want, torch::kFloat32), "alltoall_v");
  }
  {  // reduce_scatter_v: block j has j + 1 elements; every rank sends r + offset
    std::vector<std::size_t> counts;
    std::size_t total = 0, offset = 0;
    for (int j = 0; j < n; ++j) {
      counts.push_back(static_cast<std::size_t>(j + 1));
      if (j < r) offset += counts.back();
      total += counts.back();
    }
    std::vector<double> mine, want;
    for (std::size_t k = 0; k < total; ++k)
      mine.push_back(r + static_cast<double>(k));
    for (std::size_t i = 0; i < counts[static_cast<std::size_t>(r)]; ++i) {
      want.push_back(n * static_cast<double>(offset + i) + n * (n - 1) / 2.0);
    }
    auto send = as(mine, torch::kFloat32);
    auto recv = torch::zeros({static_cast<long>(want.size())});
    pg.reduce_scatter_v(send.data_ptr(), recv.data_ptr(), counts, f32, ReduceOp::kSum)->wait();
    expect_equal(recv, as(want, torch::kFloat32), "reduce_scatter_v");
  }
}

// Around a ring: each rank sends two tagged messages to the next, posted in the opposite order
// of the receives; tags keep them apart.
void check_send_recv(ProcessGroup& pg) {
  const int n = pg.size(), r = pg.rank();
  const int next = (r + 1) % n, prev = (r + n - 1) % n;
  auto out7 = torch::full({4}, 10.0 * r + 7), out3 = torch::full({6}, 10.0 * r + 3);
  auto in7 = torch::zeros({4}), in3 = torch::zeros({6});
  auto recv3 = pg.recv(in3.data_ptr(), 6, DType::kFloat32, prev, 3);
  auto recv7 = pg.recv(in7.data_ptr(), 4, DType::kFloat32, prev, 7);
  auto send7 = pg.send(out7.data_ptr(), 4, DType::kFloat32, next, 7);
  auto send3 = pg.send(out3.data_ptr(), 6, DType::kFloat32, next, 3);
  recv3->wait();
  recv7->wait();
  send7->wait();
  send3->wait();
  expect_equal(in7, torch::full({4}, 10.0 * prev + 7), "recv tag 7");
  expect_equal(in3, torch::full({6}, 10.0 * prev + 3), "recv tag 3");
  // No rank leaves before every rank's last send and receive is done: a point-to-point connection
  // is made when first used, by asking rank 0's store for the peer's address, and a rank 0 that
  // returned (and exited, under run_ranks) before its neighbours connected took the store with it
  // (seen once in 1235 tests: "connection to store ... lost during get('.../p2p/addr/2')").
  pg.barrier()->wait();
}

}  // namespace DDP_UNITY_ID
}  // namespace

void check_every_operation(ProcessGroup& pg) {
  using namespace DDP_UNITY_ID;
  std::vector<at::ScalarType> types = {torch::kFloat32, torch::kFloat64, torch::kFloat16,
                                       torch::kInt8,    torch::kUInt8,   torch::kInt32,
                                       torch::kInt64};
  for (auto type : types) {
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMin, ReduceOp::kMax,
                        ReduceOp::kProduct, ReduceOp::kBand, ReduceOp::kBor, ReduceOp::kBxor}) {
      if (is_bitwise(op) && !c10::isIntegralType(type, /*includeBool=*/false)) continue;
      check_allreduce(pg, type, op);
    }
  }
  check_block_collectives(pg);
  check_uneven_collectives(pg);
  check_send_recv(pg);
}

namespace {
namespace DDP_UNITY_ID {

constexpr int kIn = 6, kHidden = 8, kOut = 3, kBatch = 4, kSteps = 4;

torch::nn::Sequential make_model(bool batch_norm) {
  torch::nn::Sequential model(torch::nn::Linear(kIn, kHidden));
  if (batch_norm) model->push_back(torch::nn::BatchNorm1d(kHidden));
  model->push_back(torch::nn::Tanh());
  model->push_back(torch::nn::Linear(kHidden, kOut));
  torch::NoGradGuard no_grad;
  int k = 0;
  for (auto& p : model->parameters()) {
    auto values = torch::arange(p.numel(), torch::kFloat64);
    p.copy_((0.3 * torch::sin(0.37 * (values + 1) + k)).view(p.sizes()).to(torch::kFloat32));
    ++k;
  }
  return model;
}

std::pair<at::Tensor, at::Tensor> make_batch(int rank, int step) {
  auto x =
      torch::sin(0.011 * (torch::arange(kBatch * kIn, torch::kFloat64) + rank * 1000 + step * 50));
  auto y =
      torch::cos(0.017 * (torch::arange(kBatch * kOut, torch::kFloat64) + rank * 1000 + step * 50));
  return {x.view({kBatch, kIn}).to(torch::kFloat32), y.view({kBatch, kOut}).to(torch::kFloat32)};
}

// Trains on 2 ranks over the group `make_group` builds; returns rank 0's parameters and buffers
// (every rank checks that all hold the same parameters).
}  // namespace DDP_UNITY_ID
}  // namespace

torch::nn::Sequential make_c10d_check_model(bool batch_norm) {
  using namespace DDP_UNITY_ID;
  return make_model(batch_norm);
}

std::vector<at::Tensor> train_c10d_check_model(const std::shared_ptr<ProcessGroup>& pg,
                                               C10dTraining training) {
  using namespace DDP_UNITY_ID;
  const int rank = pg->rank();
  auto net = make_model(training == C10dTraining::kSyncBatchNorm);
  if (training == C10dTraining::kSyncBatchNorm) convert_sync_batchnorm(net.ptr(), pg);
  DistributedDataParallel model(net, pg);
  std::unique_ptr<torch::optim::Optimizer> opt;
  if (training == C10dTraining::kZero) {
    opt = std::make_unique<ZeroRedundancyOptimizer>(
        model->parameters(), optimizer_factory<torch::optim::Adam>(torch::optim::AdamOptions(0.01)),
        pg);
  } else {
    opt = std::make_unique<torch::optim::SGD>(model->parameters(),
                                              torch::optim::SGDOptions(0.1).momentum(0.9));
  }
  const int steps = training == C10dTraining::kJoin ? kSteps + rank : kSteps;
  {
    Join join({*model}, {.enable = training == C10dTraining::kJoin});
    for (int step = 0; step < steps; ++step) {
      auto [x, y] = make_batch(rank, step);
      opt->zero_grad();
      torch::mse_loss(model->forward(x), y).backward();
      opt->step();
    }
  }
  expect_identical_across_ranks(*pg, model->parameters(), "parameters");
  std::vector<at::Tensor> state;
  for (const auto& p : net->parameters())
    state.push_back(p.detach().clone());
  for (const auto& b : net->buffers())
    state.push_back(b.detach().clone());
  return state;
}

}  // namespace ddp::test
