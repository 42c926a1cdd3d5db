// FullyShardedDataParallel's no_sync() (gradient accumulation without reduction) and
// clip_grad_norm_ (the norm over every rank's shards), against DDP's no_sync and
// torch::nn::utils::clip_grad_norm_ over the full gradients; summon_full_params. Every test forks
// real ranks.
#include <cmath>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "ddp/error.h"
#include "ddp/torch/ddp/distributed_data_parallel.h"
#include "ddp/torch/fsdp/fully_sharded_data_parallel.h"
#include "support/multiprocess.h"
#include "support/torch/ddp_test_util.h"
#include "support/unity_namespace.h"

namespace ddp {
namespace {
namespace DDP_UNITY_ID {

using test::expect_close;
using test::join_group;
using test::run_ranks;

constexpr int kIn = 5, kOut = 3, kMicroBatch = 4, kSteps = 5;

// Children: Linear(5, 7), Tanh, Linear(7, 6), Tanh, Linear(6, 3): 42 + 48 + 21 parameters.
torch::nn::Sequential make_model() {
  torch::manual_seed(11);
  return torch::nn::Sequential(torch::nn::Linear(kIn, 7), torch::nn::Tanh(),
                               torch::nn::Linear(7, 6), torch::nn::Tanh(),
                               torch::nn::Linear(6, kOut));
}

// The same layers, the first in a nested wrapper when `pg` is given (the root shards the rest).
struct TwoStageImpl : torch::nn::Module {
  TwoStageImpl(const std::shared_ptr<ProcessGroup>& pg, ShardingStrategy strategy) {
    torch::manual_seed(11);
    torch::nn::Linear linear(kIn, 7);
    first = linear.ptr();
    if (pg)
      first =
          FullyShardedDataParallel(linear, pg, FsdpOptions{.sharding_strategy = strategy}).ptr();
    register_module("first", first);
    rest = register_module(
        "rest", torch::nn::Sequential(torch::nn::Tanh(), torch::nn::Linear(7, 6), torch::nn::Tanh(),
                                      torch::nn::Linear(6, kOut)));
  }
  torch::Tensor forward(torch::Tensor x) {
    return rest->forward(fsdp_call<torch::nn::LinearImpl>(first, x));
  }
  std::shared_ptr<torch::nn::Module> first;
  torch::nn::Sequential rest{nullptr};
};
TORCH_MODULE(TwoStage);

// Micro-batch `micro` of step `step` on `rank`.
std::pair<torch::Tensor, torch::Tensor> make_batch(int rank, int step, int micro) {
  const double base = 0.1 * rank + 0.37 * step + 0.05 * micro;
  auto x = torch::sin(torch::arange(kMicroBatch * kIn, torch::kFloat64) * 0.3 + base)
               .view({kMicroBatch, kIn})
               .to(torch::kFloat);
  auto y = torch::cos(torch::arange(kMicroBatch * kOut, torch::kFloat64) * 0.7 + base)
               .view({kMicroBatch, kOut})
               .to(torch::kFloat);
  return {x * 3, y};  // large inputs: gradients whose norm exceeds the clip
}

bool grads_are_empty(const std::vector<torch::Tensor>& params) {
  for (const auto& p : params) {
    if (p.grad().defined() && p.grad().abs().max().item<double>() != 0.0) return false;
  }
  return true;
}

// Each step: two micro-batches under no_sync, a third synced, the gradient clipped to
// `max_norm` in `norm_type`, an SGD step. DDP + torch's clip over the full gradients against each
// strategy: the norms and (every step) the parameters agree to 1e-5.
void expect_accumulated_and_clipped_as_ddp(double norm_type, bool nested = false) {
  const int world = 3;
  const int port = test::free_port();
  const auto results = run_ranks(world, [&](int rank) {
    auto pg = join_group(rank, world, port);
    for (const auto strategy : {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp,
                                ShardingStrategy::kNoShard}) {
      const std::string name = to_string(strategy);
      const FsdpOptions options{.sharding_strategy = strategy, .min_num_params = 40};
      std::shared_ptr<torch::nn::Module> plain;
      std::function<torch::Tensor(torch::Tensor)> ddp_forward;
      FullyShardedDataParallel fsdp{nullptr};
      std::shared_ptr<DistributedDataParallelBase> ddp_base;
      if (nested) {
        auto model = TwoStage(nullptr, strategy);
        plain = model.ptr();
        auto wrapped = std::make_shared<DistributedDataParallelImpl<TwoStageImpl>>(model.ptr(), pg);
        ddp_base = wrapped;
        ddp_forward = [wrapped](torch::Tensor x) { return wrapped->forward(x); };
        fsdp = FullyShardedDataParallel(TwoStage(pg, strategy), pg, options);
      } else {
        auto model = make_model();
        plain = model.ptr();
        auto wrapped = std::make_shared<DistributedDataParallelImpl<torch::nn::SequentialImpl>>(
            model.ptr(), pg);
        ddp_base = wrapped;
        ddp_forward = [wrapped](torch::Tensor x) { return wrapped->forward(x); };
        fsdp = FullyShardedDataParallel(make_model(), pg, options);
      }
      auto& ddp = ddp_base;
      torch::optim::SGD full(ddp->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
      torch::optim::SGD sharded(fsdp->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
      const double max_norm = 0.5;
      int clipped = 0;
      for (int step = 0; step < kSteps; ++step) {
        full.zero_grad();
        sharded.zero_grad();
        for (int micro = 0; micro < 3; ++micro) {
          auto [x, y] = make_batch(rank, step, micro);
          if (micro < 2) {
            auto ddp_guard = ddp->no_sync();
            auto fsdp_guard = fsdp->no_sync();
            torch::mse_loss(ddp_forward(x), y).backward();
            torch::mse_loss(fsdp->forward(x), y).backward();
            // Nothing was reduced into the shards.
            if (!grads_are_empty(fsdp->parameters())) {
              throw std::runtime_error(name + ": a no_sync backward reached the shards");
            }
          } else {
            torch::mse_loss(ddp_forward(x), y).backward();
            torch::mse_loss(fsdp->forward(x), y).backward();
          }
        }
        const double want =
            torch::nn::utils::clip_grad_norm_(plain->parameters(), max_norm, norm_type);
        const double got = fsdp->clip_grad_norm_(max_norm, norm_type).item<double>();
        expect_close(torch::tensor(got), torch::tensor(want),
                     fmt::format("{} step {}: gradient norm", name, step));
        if (want > max_norm) ++clipped;
        full.step();
        sharded.step();
        const auto state = fsdp->full_state_dict(0);
        if (rank == 0) {
          for (const auto& item : plain->named_parameters()) {
            expect_close(state[item.key()], item.value().detach(),
                         fmt::format("{} step {}: {}", name, step, item.key()));
          }
        }
      }
      if (clipped == 0) throw std::runtime_error(name + ": the clip never applied");
    }
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(FsdpNoSyncAndClip, AccumulatedAndClippedInTheTwoNormAsDdp) {
  expect_accumulated_and_clipped_as_ddp(2.0);
}

TEST(FsdpNoSyncAndClip, ClippedInTheInfinityNormAsDdp) {
  expect_accumulated_and_clipped_as_ddp(std::numeric_limits<double>::infinity());
}

TEST(FsdpNoSyncAndClip, NestedWrappersAccumulateAndClipAsOneModel) {
  expect_accumulated_and_clipped_as_ddp(2.0, /*nested=*/true);
}

// summon_full_params: the wrapped module's parameters hold the full model inside the body (equal
// to full_state_dict, and the module evaluates as the wrapper does), nothing stays gathered after
// it, and writeback keeps what the body wrote; in every strategy and through a nested wrapper.
TEST(FsdpSummonFullParams, ShowsTheFullModelAndWritesBack) {
  const int world = 2;
  const int port = test::free_port();
  const auto results = run_ranks(world, [&](int rank) {
    auto pg = join_group(rank, world, port);
    for (const auto strategy : {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp,
                                ShardingStrategy::kNoShard}) {
      for (const bool nested : {false, true}) {
        const std::string name = fmt::format("{}{}", to_string(strategy), nested ? " nested" : "");
        const FsdpOptions options{.sharding_strategy = strategy, .min_num_params = 40};
        FullyShardedDataParallel fsdp =
            nested ? FullyShardedDataParallel(TwoStage(pg, strategy), pg, options)
                   : FullyShardedDataParallel(make_model(), pg, options);
        torch::optim::SGD opt(fsdp->parameters(), 0.1);
        for (int step = 0; step < 2; ++step) {
          auto [x, y] = make_batch(rank, step, 0);
          opt.zero_grad();
          torch::mse_loss(fsdp->forward(x), y).backward();
          opt.step();
        }
        const auto before = fsdp->full_state_dict(0);
        const auto [x, y] = make_batch(0, 9, 0);
        torch::Tensor wrapper_output;
        {
          torch::NoGradGuard no_grad;
          wrapper_output = fsdp->forward(x);
        }
        std::map<std::string, torch::Tensor> seen;
        torch::Tensor module_output;
        fsdp->summon_full_params([&] {
          torch::NoGradGuard no_grad;
          for (const auto& item : fsdp->wrapped_module()->named_parameters()) {
            if (item.key().find("unit_") == std::string::npos)
              seen[item.key()] = item.value().detach().clone();
          }
          if (nested) {
            auto* two = fsdp->wrapped_module()->as<TwoStageImpl>();
            auto* inner = two->first->as<FullyShardedDataParallelImpl>();
            // The nested wrapper's module is gathered too: run the model on it directly.
            auto first = inner->wrapped_module()->as<torch::nn::LinearImpl>();
            seen["first.weight"] = first->weight.detach().clone();
            seen["first.bias"] = first->bias.detach().clone();
            module_output = two->rest->forward(first->forward(x));
          } else {
            module_output = fsdp->wrapped_module()->as<torch::nn::SequentialImpl>()->forward(x);
          }
        });
        expect_close(module_output, wrapper_output, name + ": the summoned module's output");
        if (rank == 0) {
          if (seen.size() != before.size()) {
            throw std::runtime_error(fmt::format("{}: summoned {} parameters, the model has {}",
                                                 name, seen.size(), before.size()));
          }
          for (const auto& [key, value] : seen)
            expect_close(value, before[key], name + ": summoned " + key);
        }
        if (strategy == ShardingStrategy::kFullShard && fsdp->gathered_parameter_bytes() != 0) {
          throw std::runtime_error(name + ": parameters stay gathered after summon_full_params");
        }
        // writeback: halve every parameter of the tree.
        fsdp->summon_full_params(
            [&] {
              torch::NoGradGuard no_grad;
              for (auto& item : fsdp->wrapped_module()->named_parameters()) {
                // The nested wrapper's shards ("first.unit_0") are not the model's parameters.
                if (item.key().find("unit_") == std::string::npos) item.value().mul_(0.5);
              }
              if (nested) {
                auto* two = fsdp->wrapped_module()->as<TwoStageImpl>();
                for (auto& p :
                     two->first->as<FullyShardedDataParallelImpl>()->wrapped_module()->parameters())
                  p.mul_(0.5);
              }
            },
            /*writeback=*/true);
        const auto after = fsdp->full_state_dict(0);
        if (rank == 0) {
          for (const auto& item : before)
            expect_close(after[item.key()], item.value() * 0.5,
                         name + ": written back " + item.key());
        }
      }
    }
    FullyShardedDataParallel bf16(
        make_model(), pg, FsdpOptions{.mixed_precision = {.param_dtype = torch::kBFloat16}});
    test::expect_throws<ConfigError>([&] { bf16->summon_full_params([] {}, true); },
                                     "writeback with a 16-bit param_dtype", "bf16 writeback");
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(FsdpNoSyncAndClip, BadArgumentsAreNamed) {
  const int port = test::free_port();
  const auto results = run_ranks(2, [&](int rank) {
    auto pg = join_group(rank, 2, port);
    FullyShardedDataParallel fsdp(make_model(), pg);
    test::expect_throws<ConfigError>([&] { fsdp->clip_grad_norm_(0.0); }, "must be positive",
                                     "max_norm 0");
    test::expect_throws<ConfigError>([&] { fsdp->clip_grad_norm_(1.0, -2.0); }, "must be positive",
                                     "norm_type -2");
  });
  EXPECT_ALL_RANKS_OK(results);
}

}  // namespace DDP_UNITY_ID
}  // namespace
}  // namespace ddp
