// DistributedDataParallel with sparse gradients (an Embedding with sparse = true), in real
// processes: the averaged gradient and the trained weights equal those of the same model with a
// dense Embedding, the bytes sent follow the rows touched, an embedding unused on one rank
// (find_unused_parameters) adds nothing there, nor does a rank that joined (Join), and a comm hook
// is refused by name.
#include <set>

#include <gtest/gtest.h>

#include "ddp/error.h"
#include "ddp/torch/api/join.h"
#include "ddp/torch/ddp/distributed_data_parallel.h"
#include "ddp/torch/ddp/hooks/comm_hooks.h"
#include "support/multiprocess.h"
#include "support/torch/ddp_test_util.h"
#include "support/unity_namespace.h"

namespace ddp {
namespace {
namespace DDP_UNITY_ID {

using test::join_group;
using test::run_ranks;

constexpr std::int64_t kRows = 40;
constexpr std::int64_t kWidth = 3;

// An embedding table, the mean of the looked-up rows, then a linear layer; or (use_table false) the
// linear layer alone on a constant, so that the table gets no gradient on this rank.
struct LookupNetImpl : torch::nn::Module {
  explicit LookupNetImpl(bool sparse)
      : table(register_module(
            "table",
            torch::nn::Embedding(torch::nn::EmbeddingOptions(kRows, kWidth).sparse(sparse)))),
        head(register_module("head", torch::nn::Linear(kWidth, 1))) {}
  torch::Tensor forward(const torch::Tensor& rows, bool use_table = true) {
    const auto features = use_table ? table->forward(rows).mean(1)
                                    : torch::ones({rows.size(0), kWidth}, torch::kFloat64);
    return head->forward(features);
  }
  torch::nn::Embedding table;
  torch::nn::Linear head;
};
TORCH_MODULE(LookupNet);

LookupNet make_net(bool sparse) {
  torch::manual_seed(7);
  LookupNet net(sparse);
  net->to(torch::kFloat64);
  return net;
}

// This rank's batch of rows: `count` lookups, overlapping the other ranks' rows in part.
torch::Tensor rows_of(int rank, std::int64_t count, int step) {
  return (torch::arange(count, torch::kLong) * 3 + rank * 5 + step).remainder(kRows).view({-1, 2});
}

TEST(DdpSparseGradients, EqualTheDenseEmbeddingsGradientsAndTraining) {
  const int size = 3;
  const int port = test::free_port();
  const auto results = run_ranks(size, [&](int rank) {
    auto pg = join_group(rank, size, port);
    auto sparse_net = make_net(true);
    auto dense_net = make_net(false);
    DistributedDataParallel sparse_model(sparse_net.ptr(), pg);
    DistributedDataParallel dense_model(dense_net.ptr(), pg);
    torch::optim::SGD sparse_opt(sparse_model->parameters(), 0.5);
    torch::optim::SGD dense_opt(dense_model->parameters(), 0.5);
    for (int step = 0; step < 3; ++step) {
      const auto rows = rows_of(rank, 8, step);
      sparse_opt.zero_grad();
      dense_opt.zero_grad();
      sparse_model->forward(rows).pow(2).mean().backward();
      dense_model->forward(rows).pow(2).mean().backward();
      const auto grad = sparse_net->table->weight.grad();
      if (!grad.is_sparse()) throw std::runtime_error("the table's gradient is not sparse");
      test::expect_close(grad.to_dense(), dense_net->table->weight.grad(),
                         fmt::format("averaged table gradient, step {}", step), 1e-12, 1e-14);
      test::expect_close(sparse_net->head->weight.grad(), dense_net->head->weight.grad(),
                         "averaged head gradient", 1e-12, 1e-14);
      test::expect_identical_across_ranks(*pg, {grad.to_dense()}, "the sparse average");
      sparse_opt.step();
      dense_opt.step();
      test::expect_close(sparse_net->table->weight, dense_net->table->weight,
                         fmt::format("table after step {}", step), 1e-12, 1e-14);
    }
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(DdpSparseGradients, SendBytesThatGrowWithTheRowsTouched) {
  const int size = 2;
  const int port = test::free_port();
  const auto results = run_ranks(size, [&](int rank) {
    auto pg = join_group(rank, size, port);
    auto net = make_net(true);
    DistributedDataParallel model(net.ptr(), pg);
    std::vector<std::size_t> sent;
    for (const std::int64_t lookups : {4, 16}) {
      model->zero_grad();
      const auto rows = rows_of(rank, lookups, 0);
      model->forward(rows).sum().backward();
      // This rank's part: its entry count, then one index and one row of values per row touched.
      const auto touched = static_cast<std::size_t>(std::get<0>(at::_unique(rows)).numel());
      const std::size_t want =
          sizeof(std::int64_t) + touched * sizeof(std::int64_t) + touched * kWidth * sizeof(double);
      const auto timeline = model->reducer().last_timeline();
      if (timeline.sparse_bytes_sent != want) {
        throw std::runtime_error(fmt::format("{} rows touched: {} sparse bytes sent, want {}",
                                             touched, timeline.sparse_bytes_sent, want));
      }
      sent.push_back(timeline.sparse_bytes_sent);
    }
    const std::size_t table_bytes = kRows * kWidth * sizeof(double);
    if (!(sent[0] < sent[1] && sent[1] < table_bytes)) {
      throw std::runtime_error(
          fmt::format("bytes sent {} then {}: not growing with the rows, or "
                      "not below the table's {}",
                      sent[0], sent[1], table_bytes));
    }
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(DdpSparseGradients, AnEmbeddingUnusedOnOneRankAddsNothingThere) {
  const int size = 2;
  const int port = test::free_port();
  const auto results = run_ranks(size, [&](int rank) {
    auto pg = join_group(rank, size, port);
    auto sparse_net = make_net(true);
    auto dense_net = make_net(false);
    const DdpOptions options{.find_unused_parameters = true};
    DistributedDataParallel sparse_model(sparse_net.ptr(), pg, options);
    DistributedDataParallel dense_model(dense_net.ptr(), pg, options);
    const auto rows = rows_of(rank, 6, 0);
    const bool use_table = rank == 0;
    sparse_model->forward(rows, use_table).sum().backward();
    dense_model->forward(rows, use_table).sum().backward();
    test::expect_close(sparse_net->table->weight.grad().to_dense(), dense_net->table->weight.grad(),
                       "table gradient, used on rank 0 only", 1e-12, 1e-14);
    if (sparse_model->reducer().unused_parameter_names() !=
        std::vector<std::string>(rank == 0 ? 0 : 1, "table.weight")) {
      throw std::runtime_error("the unused table is not reported as unused");
    }
  });
  EXPECT_ALL_RANKS_OK(results);
}

// Uneven inputs under Join: the rank that runs out shadows the others' steps, adding no rows,
// and the models end equal to the dense embedding's under the same Join.
TEST(DdpSparseGradients, AJoinedRankShadowsTheSparseReduction) {
  const int size = 2;
  const int port = test::free_port();
  const auto results = run_ranks(size, [&](int rank) {
    auto pg = join_group(rank, size, port);
    std::vector<torch::Tensor> weights;
    for (const bool sparse : {true, false}) {
      auto net = make_net(sparse);
      DistributedDataParallel model(net.ptr(), pg);
      torch::optim::SGD opt(model->parameters(), 0.5);
      {
        Join join({*model});
        for (int step = 0; step < (rank == 0 ? 3 : 1); ++step) {
          opt.zero_grad();
          model->forward(rows_of(rank, 6, step)).pow(2).mean().backward();
          opt.step();
        }
        join.finish();
      }
      weights.push_back(net->table->weight.detach().clone());
    }
    test::expect_close(weights[0], weights[1], "table after uneven steps under Join", 1e-12, 1e-14);
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(DdpSparseGradients, ACommHookIsRefusedByName) {
  const int port = test::free_port();
  const auto results = run_ranks(1, [&](int rank) {
    auto pg = join_group(rank, 1, port);
    auto net = make_net(true);
    DistributedDataParallel model(net.ptr(), pg);
    test::expect_throws<ConfigError>(
        [&] { model->register_comm_hook(fp16_compress_hook(), "fp16"); },
        "'table.weight' has sparse gradients", "a comm hook over sparse gradients");
    // A sparse gradient from a module DDP does not know as sparse (not an Embedding) fails
    // backward with an Error naming the parameter.
    struct RawLookupImpl : torch::nn::Module {
      RawLookupImpl() : weight(register_parameter("weight", torch::randn({kRows, kWidth}))) {}
      torch::Tensor forward(const torch::Tensor& rows) {
        return torch::embedding(weight, rows, -1, false, /*sparse=*/true).sum();
      }
      torch::Tensor weight;
    };
    auto raw = std::make_shared<RawLookupImpl>();
    DistributedDataParallel raw_model(raw, pg);
    test::expect_throws<Error>([&] { raw_model->forward(rows_of(rank, 4, 0)).backward(); },
                               "'weight' received a sparse gradient", "an unexpected sparse one");
    // reduce_dtype is a compression hook too.
    test::expect_throws<ConfigError>(
        [&] {
          DistributedDataParallel compressed(make_net(true).ptr(), pg,
                                             DdpOptions{.reduce_dtype = torch::kBFloat16});
        },
        "has sparse gradients", "reduce_dtype over sparse gradients");
  });
  EXPECT_ALL_RANKS_OK(results);
}

}  // namespace DDP_UNITY_ID
}  // namespace
}  // namespace ddp
