// FullyShardedDataParallel over any module, nested wrappers and fsdp_auto_wrap (PyTorch's FSDP1
// nesting and size_based_auto_wrap_policy). Every test forks real ranks. Each model is built twice
// from the same seed, once plain (trained by DistributedDataParallel with the full optimizer) and
// once wrapped; after every step the wrapped model's full_state_dict must equal DDP's parameters.
#include <functional>
#include <memory>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "ddp/error.h"
#include "ddp/torch/checkpoint/train_state.h"
#include "ddp/torch/ddp/distributed_data_parallel.h"
#include "ddp/torch/fsdp/fully_sharded_data_parallel.h"
#include "support/multiprocess.h"
#include "support/temp_dir.h"
#include "support/torch/ddp_test_util.h"
#include "support/unity_namespace.h"

namespace ddp {
namespace {
namespace DDP_UNITY_ID {

using namespace std::chrono_literals;
using test::expect_close;
using test::expect_throws;
using test::join_group;
using test::run_ranks;

constexpr int kIn = 6, kOut = 2, kGlobalBatch = 12, kSteps = 6;

// A forward with two arguments and two results: what forward(Tensor) cannot carry.
struct TwoPathImpl : torch::nn::Module {
  TwoPathImpl()
      : from_hidden(register_module("from_hidden", torch::nn::Linear(9, 4))),
        from_input(register_module("from_input", torch::nn::Linear(kIn, 4))) {}
  std::tuple<torch::Tensor, torch::Tensor> forward(const torch::Tensor& hidden,
                                                   const torch::Tensor& input) {
    return {from_hidden(hidden), from_input(input)};
  }
  torch::nn::Linear from_hidden, from_input;
};
TORCH_MODULE(TwoPath);

// fc1 and block are wrapped (when `wrap`), head and the BatchNorm stay with the root wrapper.
struct NetImpl : torch::nn::Module {
  NetImpl(bool wrap, const std::shared_ptr<ProcessGroup>& pg, const FsdpOptions& options) {
    auto fc1_plain = torch::nn::Linear(kIn, 9);
    auto block_plain = TwoPath();
    fc1 = fc1_plain.ptr();
    block = block_plain.ptr();
    if (wrap) {
      fc1 = FullyShardedDataParallel(fc1_plain, pg, options).ptr();
      block = FullyShardedDataParallel(block_plain, pg, options).ptr();
    }
    register_module("fc1", fc1);
    register_module("block", block);
    norm = register_module("norm", torch::nn::BatchNorm1d(4));
    head = register_module("head", torch::nn::Linear(4, kOut));
  }
  torch::Tensor forward(torch::Tensor x) {
    const auto hidden = torch::tanh(fsdp_call<torch::nn::LinearImpl>(fc1, x));
    const auto [a, b] = fsdp_call<TwoPathImpl>(block, hidden, x);
    return head(norm(torch::tanh(a) + b));
  }
  std::shared_ptr<torch::nn::Module> fc1, block;
  torch::nn::BatchNorm1d norm{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(Net);

// A block of a tower, its width set per block so that the auto-wrap policy splits them.
struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(int width) : fc(register_module("fc", torch::nn::Linear(width, width))) {}
  torch::Tensor forward(torch::Tensor x) { return torch::tanh(fc(x)) + x; }
  torch::nn::Linear fc;
};
TORCH_MODULE(Block);

// A ModuleList of blocks (one of them a Sequential, one too small to be wrapped) and a head.
struct TowerImpl : torch::nn::Module {
  TowerImpl(bool wrap, const std::shared_ptr<ProcessGroup>& pg, const FsdpOptions& options) {
    // forward_as casts every floating-point Tensor argument to param_dtype.
    FullyShardedDataParallel bf16(
        TwoPath(), pg, FsdpOptions{.mixed_precision = {.param_dtype = torch::kBFloat16}});
    const auto [a, b] = bf16->forward_as<TwoPathImpl>(torch::ones({2, 9}), torch::ones({2, kIn}));
    if (a.scalar_type() != torch::kBFloat16 || b.scalar_type() != torch::kBFloat16) {
      throw std::runtime_error("forward_as did not cast its inputs to param_dtype");
    }
    torch::nn::ModuleList list;
    list->push_back(torch::nn::Linear(kIn, 8));                           // 56 parameters
    list->push_back(Block(8));                                            // 72
    list->push_back(torch::nn::Sequential(Block(8), torch::nn::Tanh()));  // 72 (a Sequential)
    list->push_back(Block(2));                                            // 6: under the policy
    list->push_back(torch::nn::Linear(8, 2));                             // 18
    blocks = register_module("blocks", wrap ? fsdp_auto_wrap(list, pg, options) : list);
  }
  torch::Tensor forward(torch::Tensor x) {
    x = fsdp_call<torch::nn::LinearImpl>(blocks[0], x);
    x = fsdp_call<BlockImpl>(blocks[1], x);
    x = fsdp_call<torch::nn::SequentialImpl>(blocks[2], x);
    x = fsdp_call<torch::nn::LinearImpl>(blocks[4], x);
    return fsdp_call<BlockImpl>(blocks[3], x);
  }
  torch::nn::ModuleList blocks{nullptr};
};
TORCH_MODULE(Tower);

std::pair<torch::Tensor, torch::Tensor> make_batch(int rank, int world, int step) {
  std::vector<double> x, y;
  for (int s = 0; s < kGlobalBatch; ++s) {
    for (int f = 0; f < kIn; ++f)
      x.push_back(std::sin(0.013 * (step * 100 + s * kIn + f) + 0.4 * f));
    for (int o = 0; o < kOut; ++o)
      y.push_back(std::cos(0.019 * (step * 100 + s * kOut + o)));
  }
  const int per = kGlobalBatch / world;
  auto xs = torch::tensor(x, torch::kFloat64).view({kGlobalBatch, kIn}).to(torch::kFloat32);
  auto ys = torch::tensor(y, torch::kFloat64).view({kGlobalBatch, kOut}).to(torch::kFloat32);
  return {xs.narrow(0, rank * per, per), ys.narrow(0, rank * per, per)};
}

template <class Model>
void train_step(Model& model, torch::optim::Optimizer& opt, int rank, int world, int step) {
  auto [x, y] = make_batch(rank, world, step);
  opt.zero_grad();
  torch::mse_loss(model->forward(x), y).backward();
  opt.step();
}

// Throws unless the gathered state has exactly the plain model's names, and its values.
void expect_state_equals(const torch::OrderedDict<std::string, torch::Tensor>& gathered,
                         const torch::nn::Module& plain, const std::string& what) {
  std::set<std::string> want, got;
  for (const auto& item : plain.named_parameters())
    want.insert(item.key());
  for (const auto& item : plain.named_buffers())
    want.insert(item.key());
  for (const auto& item : gathered)
    got.insert(item.key());
  if (want != got) {
    throw std::runtime_error(fmt::format("{}: full_state_dict names {} but the model has {}", what,
                                         fmt::join(got, ","), fmt::join(want, ",")));
  }
  for (const auto& item : plain.named_parameters())
    expect_close(gathered[item.key()], item.value().detach(), what + " " + item.key());
  for (const auto& item : plain.named_buffers())
    expect_close(gathered[item.key()].to(torch::kFloat), item.value().detach().to(torch::kFloat),
                 what + " buffer " + item.key());
}

// DDP over the plain model, then each strategy over the wrapped one, from the same seed; after
// every step rank 0's full_state_dict equals DDP's model.
template <class MakeModel, class Check>
void expect_wrapped_equals_ddp(int world, const MakeModel& make, const Check& check_structure) {
  const int port = test::free_port();
  const auto results = run_ranks(world, [&](int rank) {
    auto pg = join_group(rank, world, port);
    for (const auto strategy : {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp,
                                ShardingStrategy::kNoShard}) {
      const std::string name = to_string(strategy);
      const FsdpOptions options{.sharding_strategy = strategy, .min_num_params = 50};
      torch::manual_seed(7);
      auto plain = make(false, pg, options);
      DistributedDataParallel ddp(plain, pg);
      torch::optim::SGD full(ddp->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
      torch::manual_seed(7);
      FullyShardedDataParallel root(make(true, pg, options), pg, options);
      check_structure(*root, name);
      torch::optim::SGD sharded(root->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
      for (int step = 0; step < kSteps; ++step) {
        train_step(ddp, full, rank, world, step);
        train_step(root, sharded, rank, world, step);
        const auto state = root->full_state_dict(0);
        if (rank == 0) expect_state_equals(state, *plain, fmt::format("{} step {}", name, step));
      }
      if (strategy == ShardingStrategy::kFullShard) {
        // Nothing stays gathered between steps, in the root or in a nested wrapper.
        std::int64_t held = root->gathered_parameter_bytes();
        for (const auto& [path, nested] : root->nested_wrappers())
          held += nested->gathered_parameter_bytes();
        if (held != 0) throw std::runtime_error(fmt::format("{} bytes stay gathered", held));
      }
    }
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(FsdpNested, WrappersInsideAUserModuleWithATupleForwardEqualDdp) {
  expect_wrapped_equals_ddp(
      3,
      [](bool wrap, const std::shared_ptr<ProcessGroup>& pg, const FsdpOptions& options) {
        return Net(wrap, pg, options);
      },
      [](FullyShardedDataParallelImpl& root, const std::string& name) {
        std::vector<std::string> paths;
        for (const auto& [path, nested] : root.nested_wrappers())
          paths.push_back(path);
        // The root shards head (10 parameters) and norm (8), the nested wrappers the rest; one
        // optimizer over the root's parameters() sees every shard of the tree.
        if (paths != std::vector<std::string>{"fc1", "block"} || root.unit_count() != 1 ||
            root.unit_info(0).numel != 18 || root.parameters().size() != 3) {
          throw std::runtime_error(fmt::format("{}: nested {} units {} shards {}", name,
                                               fmt::join(paths, ","), root.unit_count(),
                                               root.parameters().size()));
        }
      });
}

TEST(FsdpNested, AutoWrapOfAModuleListWrapsTheLargeElementsAndEqualsDdp) {
  expect_wrapped_equals_ddp(
      2,
      [](bool wrap, const std::shared_ptr<ProcessGroup>& pg, const FsdpOptions& options) {
        return Tower(wrap, pg, options);
      },
      [](FullyShardedDataParallelImpl& root, const std::string& name) {
        std::vector<std::string> paths;
        for (const auto& [path, nested] : root.nested_wrappers())
          paths.push_back(path);
        // 56, 72 and 72 parameters reach min_num_params 50 (the Sequential's Block(8), bottom-up,
        // which leaves the Sequential nothing to wrap); the 6 of Block(2) and 18 of the last
        // Linear stay with the root.
        const std::vector<std::string> want{"blocks.0", "blocks.1", "blocks.2.0"};
        if (paths != want || root.unit_count() != 1 || root.unit_info(0).numel != 24) {
          throw std::runtime_error(fmt::format("{}: nested {}, {} units", name,
                                               fmt::join(paths, ","), root.unit_count()));
        }
      });
}

TEST(FsdpNested, AutoWrapOfASequentialGivesEachLargeChildItsOwnWrapper) {
  const int port = test::free_port();
  const auto results = run_ranks(2, [&](int rank) {
    auto pg = join_group(rank, 2, port);
    const auto make = [] {
      torch::manual_seed(3);
      return torch::nn::Sequential(torch::nn::Linear(kIn, 8), torch::nn::Tanh(), Block(8),
                                   torch::nn::Linear(8, 4), torch::nn::Tanh(),
                                   torch::nn::Linear(4, kOut));
    };
    auto plain = make();
    DistributedDataParallel ddp(plain, pg);
    torch::optim::Adam full(ddp->parameters(), torch::optim::AdamOptions(0.01));
    auto root = fsdp_auto_wrap(make(), pg, FsdpOptions{.min_num_params = 50});
    torch::optim::Adam sharded(root->parameters(), torch::optim::AdamOptions(0.01));
    // Linear(6, 8) (56) and Block(8) (72) get wrappers; Linear(8, 4) (36) and Linear(4, 2) (10)
    // make the root's units.
    if (root->nested_wrappers().size() != 2 || root->nested_wrappers()[1].first != "2") {
      throw std::runtime_error("expected wrappers for children 0 and 2");
    }
    for (int step = 0; step < kSteps; ++step) {
      train_step(ddp, full, rank, 2, step);
      train_step(root, sharded, rank, 2, step);
    }
    const auto state = root->full_state_dict(0);
    if (rank == 0) expect_state_equals(state, *plain, "auto-wrapped Sequential");
  });
  EXPECT_ALL_RANKS_OK(results);
}

// The sharded TrainState of a tree (the root's and both nested wrappers' shards, Adam's state,
// the root's BatchNorm statistics): saved at world 2 after 3 steps, it loads at world 3 with the
// same full model, and resumed at world 2 it ends 2 steps later bit for bit where the
// uninterrupted run ended.
TEST(FsdpNested, ATreeResumesFromItsShardedTrainState) {
  test::TempDir dir;
  const auto ckpt = dir.path() / "state";
  const auto expected = dir.path() / "expected.pt";
  const FsdpOptions options{.sharding_strategy = ShardingStrategy::kFullShard};
  const int port = test::free_port();
  EXPECT_ALL_RANKS_OK(run_ranks(2, [&](int rank) {
    auto pg = join_group(rank, 2, port);
    torch::manual_seed(7);
    FullyShardedDataParallel root(Net(true, pg, options), pg, options);
    torch::optim::Adam opt(root->parameters(), 0.01);
    ShardedTrainState state(*root, opt, {.tag = "tree"});
    for (int step = 0; step < 3; ++step)
      train_step(root, opt, rank, 2, step);
    state.save(ckpt, {.global_step = 3}, 2);
    auto saved = root->full_state_dict(0);
    for (int step = 3; step < 5; ++step)
      train_step(root, opt, rank, 2, step);
    const auto final_state = root->full_state_dict(0);
    if (rank != 0) return;
    torch::serialize::OutputArchive archive;
    for (const auto& item : saved)
      archive.write("saved/" + item.key(), item.value());
    for (const auto& item : final_state)
      archive.write("final/" + item.key(), item.value());
    archive.save_to(expected.string());
  }));
  for (const int world : {3, 2}) {
    const int port_resumed = test::free_port();
    EXPECT_ALL_RANKS_OK(run_ranks(world, [&](int rank) {
      auto pg = join_group(rank, world, port_resumed);
      torch::manual_seed(1234);  // another start: everything must come from the checkpoint
      FullyShardedDataParallel root(Net(true, pg, options), pg, options);
      torch::optim::Adam opt(root->parameters(), 0.01);
      ShardedTrainState state(*root, opt, {.tag = "tree"});
      if (state.load(ckpt).global_step != 3) throw std::runtime_error("progress not restored");
      torch::serialize::InputArchive want;
      want.load_from(expected.string());
      const auto loaded = root->full_state_dict(0);
      if (rank == 0) {
        for (const auto& item : loaded) {
          torch::Tensor saved;
          want.read("saved/" + item.key(), saved);
          if (!torch::equal(item.value(), saved)) {
            throw std::runtime_error(fmt::format("world {}: {} not restored", world, item.key()));
          }
        }
      }
      if (world != 2) return;
      for (int step = 3; step < 5; ++step)
        train_step(root, opt, rank, 2, step);
      const auto final_state = root->full_state_dict(0);
      if (rank != 0) return;
      for (const auto& item : final_state) {
        torch::Tensor end;
        want.read("final/" + item.key(), end);
        if (!torch::equal(item.value(), end)) {
          throw std::runtime_error("resumed run differs from the uninterrupted one at " +
                                   item.key());
        }
      }
    }));
  }
}

// Every misuse is named, on every rank, before any collective can hang.
TEST(FsdpNested, MisuseIsNamed) {
  const int port = test::free_port();
  const auto results = run_ranks(2, [&](int rank) {
    auto pg = join_group(rank, 2, port, 10s);
    // A parameter shared by a nested wrapper and its parent (tied weights).
    expect_throws<ConfigError>(
        [&] {
          auto shared = torch::nn::Linear(3, 3);
          auto parent = std::make_shared<torch::nn::Module>();
          parent->register_module("wrapped", FullyShardedDataParallel(shared, pg));
          parent->register_module("tied", shared);
          FullyShardedDataParallel root(parent, pg);
        },
        "is shared with the nested wrapper at 'wrapped'", "tied weights");
    // One module wrapped by two wrappers that are not nested.
    expect_throws<ConfigError>(
        [&] {
          auto shared = torch::nn::Linear(3, 3);
          FullyShardedDataParallel first(shared, pg);
          FullyShardedDataParallel second(torch::nn::Sequential(shared), pg);
        },
        "already sharded by another FullyShardedDataParallel", "wrapped twice");
    expect_throws<ConfigError>(
        [&] {
          FullyShardedDataParallel inner(torch::nn::Linear(3, 3), pg);
          FullyShardedDataParallel outer(inner, pg);
        },
        "already a FullyShardedDataParallel", "a wrapper of a wrapper");
    expect_throws<ConfigError>(
        [&] {
          FullyShardedDataParallel w(torch::nn::Linear(3, 3), pg, FsdpOptions{.units = {{0, 1}}});
        },
        "units are child ranges of a Sequential", "units of a Linear");
    FullyShardedDataParallel linear(torch::nn::Linear(3, 2), pg);
    expect_throws<ConfigError>(
        [&] {
          linear->forward_as<BlockImpl>(torch::ones({1, 3}));
        },
        "the wrapped module is a torch::nn::Linear", "forward_as");
    FullyShardedDataParallel erased(std::shared_ptr<torch::nn::Module>(Block(3).ptr()), pg);
    expect_throws<ConfigError>(
        [&] {
          erased->forward(torch::ones({1, 3}));
        },
        "its forward is unknown", "forward of a type-erased module");
    // ... while forward_as reaches it, and trains.
    auto out = erased->forward_as<BlockImpl>(torch::ones({2, 3}));
    out.sum().backward();
    if (!erased->parameters()[0].grad().defined()) {
      throw std::runtime_error("forward_as gave the shard no gradient");
    }
    torch::nn::ModuleList list;
    list->push_back(Block(3));
    list->push_back(Block(4));
    auto wrapped_list = fsdp_auto_wrap(list, pg, FsdpOptions{.min_num_params = 13});
    const auto one = torch::ones({1, 4});
    expect_throws<ConfigError>([&] { fsdp_call<TwoPathImpl>(wrapped_list[1], one, one); },
                               "the wrapped module is a", "fsdp_call of the wrong type");
    expect_throws<ConfigError>([&] { fsdp_call<TwoPathImpl>(wrapped_list[0], one, one); },
                               "neither the type asked for nor a FullyShardedDataParallel",
                               "fsdp_call of a plain module");
    // Block(3) has 12 parameters, under 13: not wrapped; Block(4) has 20.
    if (wrapped_list[0]->as<FullyShardedDataParallelImpl>() != nullptr ||
        wrapped_list[1]->as<FullyShardedDataParallelImpl>() == nullptr) {
      throw std::runtime_error("fsdp_auto_wrap wrapped the wrong elements");
    }
    expect_throws<ConfigError>([&] { fsdp_auto_wrap(list, pg, FsdpOptions{.min_num_params = 0}); },
                               "min_num_params must be positive", "auto-wrap threshold");
    auto holder = std::make_shared<torch::nn::Module>();
    holder->register_module("inner", FullyShardedDataParallel(torch::nn::Linear(3, 3), pg));
    FullyShardedDataParallel root(holder, pg);
    torch::optim::SGD opt(root->parameters(), 0.1);
    auto mixed = std::make_shared<torch::nn::Module>();
    mixed->register_module(
        "inner",
        FullyShardedDataParallel(torch::nn::Linear(3, 3), pg,
                                 FsdpOptions{.sharding_strategy = ShardingStrategy::kNoShard}));
    mixed->register_module("own", torch::nn::Linear(3, 3));
    FullyShardedDataParallel mixed_root(mixed, pg);
    torch::optim::SGD mixed_opt(mixed_root->parameters(), 0.1);
    test::TempDir dir;
    expect_throws<ConfigError>([&] { mixed_root->save_sharded_checkpoint(dir.path(), mixed_opt); },
                               "the nested wrapper at 'inner' is NO_SHARD",
                               "a sharded checkpoint of a tree with two strategies");
    (void)rank;
  });
  EXPECT_ALL_RANKS_OK(results);
}

}  // namespace DDP_UNITY_ID
}  // namespace
}  // namespace ddp
