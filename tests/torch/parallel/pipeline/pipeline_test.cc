// ddp::Pipeline (pipeline.h). Every multi-process test forks real ranks, one stage each. The
// model is a Sequential of 7 children (Linear 5->8, Tanh, Linear 8->8, Tanh, Linear 8->6, Tanh,
// Linear 6->2) in float64, built from one seed on every rank; the reference is one process
// training the whole model on the whole batch of 8 rows with the same SGD.
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "ddp/comm/comm_error.h"
#include "ddp/comm/trace.h"
#include "ddp/error.h"
#include "ddp/torch/parallel/mesh/device_mesh.h"
#include "ddp/torch/parallel/pipeline/pipeline.h"
#include "ddp/torch/parallel/tensor/tensor_parallel.h"
#include "ddp/torch/zero/zero_redundancy_optimizer.h"
#include "support/multiprocess.h"
#include "support/temp_dir.h"
#include "support/torch/ddp_test_util.h"
#include "support/unity_namespace.h"
#include "torch/parallel/pipeline/split_backward.h"

namespace ddp {
namespace {
namespace DDP_UNITY_ID {

using namespace std::chrono_literals;
using test::join_group;
using test::run_ranks;
using ::testing::HasSubstr;
using Kind = PipelineAction::Kind;

constexpr int kBatch = 8, kIn = 5, kOut = 2, kSteps = 5;
constexpr double kLearningRate = 0.1;

torch::nn::Sequential make_model(bool dropout = false) {
  torch::manual_seed(1234);
  // Dropout in place of the second Tanh (no parameters either: the same initial values).
  torch::nn::Sequential model(torch::nn::Linear(kIn, 8), torch::nn::Tanh(), torch::nn::Linear(8, 8),
                              dropout ? torch::nn::AnyModule(torch::nn::Dropout(0.3))
                                      : torch::nn::AnyModule(torch::nn::Tanh()),
                              torch::nn::Linear(8, 6), torch::nn::Tanh(),
                              torch::nn::Linear(6, kOut));
  model->to(torch::kFloat64);
  return model;
}

std::pair<torch::Tensor, torch::Tensor> make_batch(int step, int rows = kBatch) {
  auto options = torch::TensorOptions().dtype(torch::kFloat64);
  auto index = torch::arange(rows * kIn, options).view({rows, kIn});
  auto x = torch::sin(0.13 * index + 0.7 * step);
  auto y = torch::cos(0.29 * torch::arange(rows * kOut, options).view({rows, kOut}) + 0.3 * step);
  return {x, y};
}

torch::Tensor mse(const torch::Tensor& out, const torch::Tensor& target) {
  return torch::mse_loss(out, target);
}

struct Trained {
  std::vector<double> losses;
  std::map<std::string, torch::Tensor> parameters;
};

// One process, the whole batch.
Trained train_one_process() {
  auto model = make_model();
  torch::optim::SGD opt(model->parameters(), kLearningRate);
  Trained trained;
  for (int step = 0; step < kSteps; ++step) {
    auto [x, y] = make_batch(step);
    opt.zero_grad();
    auto loss = mse(model->forward(x), y);
    loss.backward();
    opt.step();
    trained.losses.push_back(loss.item<double>());
  }
  for (const auto& p : model->named_parameters())
    trained.parameters[p.key()] = p.value().detach().clone();
  return trained;
}

// Trains this rank's stage for kSteps; returns the losses step() returned.
std::vector<double> train_pipeline(Pipeline& pipe) {
  torch::optim::SGD opt(pipe.parameters(), kLearningRate);
  std::vector<double> losses;
  for (int step = 0; step < kSteps; ++step) {
    auto [x, y] = make_batch(step);
    opt.zero_grad();
    losses.push_back(pipe.step(x, y));
    opt.step();
  }
  return losses;
}

// Throws unless the losses and the stage's parameters equal the one-process run to 1e-5.
void expect_equals_one_process(Pipeline& pipe, const std::vector<double>& losses,
                               const std::string& what) {
  const auto reference = train_one_process();
  for (int step = 0; step < kSteps; ++step) {
    const double want = reference.losses[static_cast<std::size_t>(step)];
    const double got = losses[static_cast<std::size_t>(step)];
    if (std::abs(got - want) > 1e-5 * std::abs(want)) {
      throw std::runtime_error(fmt::format("{}: stage {} step {} loss {} but one process has {}",
                                           what, pipe.stage(), step, got, want));
    }
  }
  const auto params = pipe.stage_module()->named_parameters();
  if (params.size() == 0) throw std::runtime_error(what + ": the stage has no parameters");
  for (const auto& p : params) {
    test::expect_close(p.value(), reference.parameters.at(p.key()),
                       fmt::format("{}: stage {} parameter {}", what, pipe.stage(), p.key()));
  }
}

std::string describe_actions(const std::vector<PipelineAction>& actions) {
  std::string text;
  for (const auto& a : actions)
    text += fmt::format("{}{} ", a.kind == Kind::kForward ? 'F' : 'B', a.micro_batch);
  return text;
}

TEST(PipelineSchedule, GPipeRunsEveryForwardThenEveryBackward) {
  EXPECT_EQ(describe_actions(pipeline_actions(PipelineSchedule::kGPipe, 0, 2, 3)),
            "F0 F1 F2 B0 B1 B2 ");
}

TEST(PipelineSchedule, OneFOneBWarmsUpByTheStagesAfterIt) {
  EXPECT_EQ(describe_actions(pipeline_actions(PipelineSchedule::k1F1B, 0, 2, 4)),
            "F0 F1 B0 F2 B1 F3 B2 B3 ");
  EXPECT_EQ(describe_actions(pipeline_actions(PipelineSchedule::k1F1B, 1, 2, 4)),
            "F0 B0 F1 B1 F2 B2 F3 B3 ");
  EXPECT_EQ(describe_actions(pipeline_actions(PipelineSchedule::k1F1B, 0, 4, 4)),
            "F0 F1 F2 F3 B0 B1 B2 B3 ");
  EXPECT_EQ(describe_actions(pipeline_actions(PipelineSchedule::k1F1B, 1, 4, 5)),
            "F0 F1 F2 B0 F3 B1 F4 B2 B3 B4 ");
}

TEST(PipelineSchedule, NamesRoundTrip) {
  EXPECT_EQ(pipeline_schedule_from_name("GPipe"), PipelineSchedule::kGPipe);
  EXPECT_EQ(pipeline_schedule_from_name(to_string(PipelineSchedule::k1F1B)),
            PipelineSchedule::k1F1B);
  EXPECT_EQ(pipeline_schedule_from_name("Interleaved"), PipelineSchedule::kInterleaved1F1B);
  EXPECT_EQ(pipeline_schedule_from_name("zero-bubble"), PipelineSchedule::kZeroBubble);
  EXPECT_THROW(pipeline_schedule_from_name("zbv"), ConfigError);
}

// Zero bubble (ZB-H1) at p = 2 and 4: every micro-batch's F, B and W once each, in that order; a
// stage holds at most p - s micro-batches (F done minus W done); the last stage needs no warm-up;
// and the W's are what fills the waits: some stage runs a W before its last B.
TEST(PipelineSchedule, ZeroBubbleRunsEachMicroBatchsWeightPassAfterItsInputPass) {
  for (const int p : {2, 4}) {
    bool weight_before_last_backward = false;
    for (int s = 0; s < p; ++s) {
      const auto actions = pipeline_actions(PipelineSchedule::kZeroBubble, s, p, 8);
      std::map<std::pair<Kind, int>, int> at;
      int held = 0, peak = 0, last_backward = 0, first_weight = 1 << 20;
      for (int k = 0; k < static_cast<int>(actions.size()); ++k) {
        const auto& a = actions[static_cast<std::size_t>(k)];
        EXPECT_TRUE(at.emplace(std::make_pair(a.kind, a.micro_batch), k).second);
        held += a.kind == Kind::kForward ? 1 : a.kind == Kind::kWeight ? -1 : 0;
        peak = std::max(peak, held);
        if (a.kind == Kind::kBackward) last_backward = k;
        if (a.kind == Kind::kWeight) first_weight = std::min(first_weight, k);
      }
      EXPECT_EQ(actions.size(), 24u) << "p=" << p << " s=" << s;
      for (int i = 0; i < 8; ++i) {
        const int f = at[std::make_pair(Kind::kForward, i)];
        const int b = at[std::make_pair(Kind::kBackward, i)];
        const int w = at[std::make_pair(Kind::kWeight, i)];
        EXPECT_LT(f, b);
        EXPECT_LT(b, w);
      }
      EXPECT_LE(peak, p - s) << "p=" << p << " s=" << s;
      if (first_weight < last_backward) weight_before_last_backward = true;
    }
    EXPECT_TRUE(weight_before_last_backward) << "p=" << p;
    EXPECT_EQ(pipeline_actions(PipelineSchedule::kZeroBubble, p - 1, p, 8)[1].kind,
              Kind::kBackward);
  }
}

// The split backward (split_backward.h) against a whole backward, bit for bit: a stage of two
// Linears, a LayerNorm, a parameter added after them (its branch meets the input's path at the
// add) and one the stage does not use (no gradient either way); and the same with one Linear used
// twice (tied), which the weight half runs as a whole backward into the parameters.
TEST(PipelineSchedule, SplitBackwardAccumulatesWhatAWholeBackwardDoes) {
  const auto x = torch::sin(torch::arange(24, torch::kFloat64)).reshape({4, 6});
  const auto grad = torch::cos(torch::arange(24, torch::kFloat64)).reshape({4, 6});
  const auto run = [&](bool split, bool tied) {
    torch::manual_seed(11);
    torch::nn::Linear fc1(6, 6), fc2(6, 6);
    torch::nn::LayerNorm norm(torch::nn::LayerNormOptions({6}));
    fc1->to(torch::kFloat64);
    fc2->to(torch::kFloat64);
    norm->to(torch::kFloat64);
    const auto bias = torch::linspace(-1, 1, 6, torch::kFloat64).requires_grad_(true);
    const auto unused = torch::ones({3}, torch::kFloat64).requires_grad_(true);
    const auto input = x.clone().requires_grad_(true);
    const auto out = norm((tied ? fc1 : fc2)(torch::tanh(fc1(input))) + bias);
    std::vector<torch::Tensor> params = fc1->parameters();
    for (const auto& p : fc2->parameters())
      params.push_back(p);
    for (const auto& p : norm->parameters())
      params.push_back(p);
    params.push_back(bias);
    params.push_back(unused);
    torch::Tensor input_grad;
    if (split) {
      detail::SplitBackward halves;
      input_grad = halves.backward_input(out, grad, input, params);
      for (const auto& p : params) {
        if (p.grad().defined())
          throw std::runtime_error("the input half wrote a weight's gradient");
      }
      halves.backward_weight();
    } else {
      out.backward(grad);
      input_grad = input.grad();
    }
    std::vector<torch::Tensor> grads{input_grad};
    for (const auto& p : params)
      grads.push_back(p.grad());
    return grads;
  };
  for (const bool tied : {false, true}) {
    const auto whole = run(false, tied);
    const auto halves = run(true, tied);
    ASSERT_EQ(whole.size(), halves.size());
    for (std::size_t i = 0; i < whole.size(); ++i) {
      ASSERT_EQ(whole[i].defined(), halves[i].defined()) << "tied " << tied << " gradient " << i;
      if (whole[i].defined()) {
        EXPECT_TRUE(torch::equal(whole[i], halves[i]))
            << "tied " << tied << " gradient " << i << " differs by "
            << (whole[i] - halves[i]).abs().max().item<double>();
      }
    }
    EXPECT_FALSE(whole.back().defined());  // the unused parameter
  }
}

std::string describe_chunk_actions(const std::vector<PipelineAction>& actions) {
  std::string text;
  for (const auto& a : actions)
    text += fmt::format("{}{}.{} ", a.kind == Kind::kForward ? 'F' : 'B', a.chunk, a.micro_batch);
  return text;
}

// Megatron's interleaved order at p = 2, v = 2, m = 4: chunks in groups of p micro-batches;
// stage 0 warms up with 2 (p - 1) + (v - 1) p = 4 chunk forwards, stage 1 with 2.
TEST(PipelineSchedule, InterleavedRunsEachChunkOfAGroupOfMicroBatchesInTurn) {
  EXPECT_EQ(
      describe_chunk_actions(pipeline_actions(PipelineSchedule::kInterleaved1F1B, 0, 2, 4, 2)),
      "F0.0 F0.1 F1.0 F1.1 F0.2 B1.0 F0.3 B1.1 F1.2 B0.0 F1.3 B0.1 B1.2 B1.3 B0.2 B0.3 ");
  EXPECT_EQ(
      describe_chunk_actions(pipeline_actions(PipelineSchedule::kInterleaved1F1B, 1, 2, 4, 2)),
      "F0.0 F0.1 F1.0 B1.0 F1.1 B1.1 F0.2 B0.0 F0.3 B0.1 F1.2 B1.2 F1.3 B1.3 B0.2 B0.3 ");
}

// p stages, m = 4 micro-batches: equal to one process; the peak of stored activations is m for
// GPipe and p - s for 1F1B (at most that for zero bubble); every action is timed.
void expect_schedule_equals_one_process(PipelineSchedule schedule, int world, bool recompute) {
  const int port = test::free_port();
  const auto results = run_ranks(world, [&](int rank) {
    auto pg = join_group(rank, world, port);
    Pipeline pipe(make_model(), pg, mse,
                  {.schedule = schedule, .micro_batches = 4, .recompute = recompute});
    const std::string what =
        fmt::format("{} p={} recompute={}", to_string(schedule), world, recompute);
    expect_equals_one_process(pipe, train_pipeline(pipe), what);

    const auto& stats = pipe.last_step_stats();
    const bool zero_bubble = schedule == PipelineSchedule::kZeroBubble;
    const int want_peak = schedule == PipelineSchedule::kGPipe ? 4 : world - rank;
    if (zero_bubble ? stats.peak_stored_activations > want_peak
                    : stats.peak_stored_activations != want_peak) {
      throw std::runtime_error(fmt::format("{}: stage {} stored {} activations at once, not {}",
                                           what, rank, stats.peak_stored_activations, want_peak));
    }
    if (stats.timings.size() != (zero_bubble ? 12u : 8u) || stats.busy.count() <= 0 ||
        stats.wall < stats.busy || stats.idle_fraction < 0.0 || stats.idle_fraction >= 1.0) {
      throw std::runtime_error(fmt::format(
          "{}: stage {} timings: {} actions, busy {} ns, wall {} ns, idle {}", what, rank,
          stats.timings.size(), stats.busy.count(), stats.wall.count(), stats.idle_fraction));
    }
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(Pipeline, GPipeTwoStagesEqualsOneProcess) {
  expect_schedule_equals_one_process(PipelineSchedule::kGPipe, 2, false);
}

TEST(Pipeline, OneFOneBTwoStagesEqualsOneProcess) {
  expect_schedule_equals_one_process(PipelineSchedule::k1F1B, 2, false);
}

TEST(Pipeline, OneFOneBFourStagesEqualsOneProcess) {
  expect_schedule_equals_one_process(PipelineSchedule::k1F1B, 4, false);
}

TEST(Pipeline, RecomputationEqualsOneProcess) {
  expect_schedule_equals_one_process(PipelineSchedule::k1F1B, 2, true);
}

TEST(Pipeline, ZeroBubbleTwoStagesEqualsOneProcess) {
  expect_schedule_equals_one_process(PipelineSchedule::kZeroBubble, 2, false);
}

TEST(Pipeline, ZeroBubbleFourStagesEqualsOneProcess) {
  expect_schedule_equals_one_process(PipelineSchedule::kZeroBubble, 4, false);
}

TEST(Pipeline, ZeroBubbleWithRecomputationEqualsOneProcess) {
  expect_schedule_equals_one_process(PipelineSchedule::kZeroBubble, 2, true);
}

// Two chunks per rank (the model's 7 children in 4 chunks: 2, 2, 2, 1; rank 0 holds chunks 0
// and 2), 4 and 8 micro-batches, with and without recomputation: one process's losses and
// parameters; each rank's layers are its chunks' (their names the whole model's).
TEST(Pipeline, InterleavedTwoStagesOfTwoChunksEqualsOneProcess) {
  const int port = test::free_port();
  const auto results = run_ranks(2, [&](int rank) {
    auto pg = join_group(rank, 2, port);
    for (const int m : {4, 8}) {
      for (const bool recompute : {false, true}) {
        Pipeline pipe(make_model(), pg, mse,
                      {.schedule = PipelineSchedule::kInterleaved1F1B,
                       .micro_batches = m,
                       .virtual_stages = 2,
                       .recompute = recompute});
        const std::string what = fmt::format("interleaved v=2 m={} recompute={}", m, recompute);
        const auto want_layers = rank == 0 ? std::vector<std::string>{"0", "1", "4", "5"}
                                           : std::vector<std::string>{"2", "3", "6"};
        if (pipe.stage_module()->named_children().keys() != want_layers) {
          throw std::runtime_error(
              fmt::format("{}: stage {} holds layers {}", what, rank,
                          fmt::join(pipe.stage_module()->named_children().keys(), ",")));
        }
        expect_equals_one_process(pipe, train_pipeline(pipe), what);
        const auto& stats = pipe.last_step_stats();
        if (static_cast<int>(stats.timings.size()) != 2 * 2 * m) {
          throw std::runtime_error(
              fmt::format("{}: {} actions timed, not {}", what, stats.timings.size(), 4 * m));
        }
      }
    }
  });
  EXPECT_ALL_RANKS_OK(results);
}

// With dropout, a recomputed forward draws the masks of its first run: the same training as
// without recomputation. An explicit balance, and stage modules given directly, on the way.
TEST(Pipeline, RecomputationDrawsTheSameDropoutMasks) {
  const int port = test::free_port();
  const auto results = run_ranks(2, [&](int rank) {
    auto pg = join_group(rank, 2, port);
    std::vector<std::vector<double>> losses;
    std::vector<std::vector<torch::Tensor>> params;
    for (const bool recompute : {false, true}) {
      torch::manual_seed(99);  // the same masks for both runs
      Pipeline pipe(make_model(/*dropout=*/true), pg, mse,
                    {.schedule = PipelineSchedule::kGPipe,
                     .micro_batches = 2,
                     .balance = {5, 2},
                     .recompute = recompute});
      if (pipe.layer_range() != (rank == 0 ? std::pair{0, 5} : std::pair{5, 2})) {
        throw std::runtime_error("balance {5, 2} was not followed");
      }
      torch::manual_seed(5 + rank);
      losses.push_back(train_pipeline(pipe));
      params.push_back(pipe.parameters());
    }
    for (std::size_t i = 0; i < params[0].size(); ++i)
      test::expect_close(params[1][i], params[0][i], "recomputed parameter", 1e-12, 1e-12);
    if (losses[0] != losses[1]) throw std::runtime_error("recomputation changed the losses");
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(Pipeline, TakesEachStagesModuleDirectly) {
  const int port = test::free_port();
  const auto results = run_ranks(2, [&](int rank) {
    auto pg = join_group(rank, 2, port);
    auto whole = make_model();
    torch::nn::Sequential mine;
    const auto names = whole->named_children().keys();
    for (int k = rank * 4; k < std::min(7, rank * 4 + 4); ++k)
      mine->push_back(names[static_cast<std::size_t>(k)], *(whole->begin() + k));
    Pipeline pipe(PipelineStageModule{mine}, pg, mse,
                  {.schedule = PipelineSchedule::k1F1B, .micro_batches = 2});
    expect_equals_one_process(pipe, train_pipeline(pipe), "stage modules");
  });
  EXPECT_ALL_RANKS_OK(results);
}

// Stage 0's input may come out of layers before the pipeline (an embedding, say): the gradient
// reaches them, and a leaf input's .grad, as in one process, for both schedules, with and
// without recomputation (the graph before the pipeline is run backwards once per step).
TEST(Pipeline, TheGradientReachesWhatComesBeforeTheFirstStage) {
  const int port = test::free_port();
  const auto results = run_ranks(2, [&](int rank) {
    auto pg = join_group(rank, 2, port);
    const auto [x, y] = make_batch(0);
    auto make_front = [] {
      torch::manual_seed(77);
      torch::nn::Linear front(kIn, kIn);
      front->to(torch::kFloat64);
      return front;
    };
    // One process.
    auto front = make_front();
    auto model = make_model();
    const auto leaf = x.clone().requires_grad_(true);
    mse(model->forward(front->forward(leaf)), y).backward();
    for (const auto schedule :
         {PipelineSchedule::kGPipe, PipelineSchedule::k1F1B, PipelineSchedule::kZeroBubble}) {
      for (const bool recompute : {false, true}) {
        const std::string what = fmt::format("{} recompute={}", to_string(schedule), recompute);
        Pipeline pipe(make_model(), pg, mse,
                      {.schedule = schedule, .micro_batches = 4, .recompute = recompute});
        auto pipe_front = make_front();
        const auto pipe_leaf = x.clone().requires_grad_(true);
        pipe.step(pipe_front->forward(pipe_leaf), y);
        if (rank != 0) continue;
        if (!pipe_leaf.grad().defined() || !pipe_front->weight.grad().defined())
          throw std::runtime_error(what + ": no gradient before the first stage");
        test::expect_close(pipe_leaf.grad(), leaf.grad(), what + ": the input's gradient");
        test::expect_close(pipe_front->weight.grad(), front->weight.grad(),
                           what + ": the front layer's gradient");
      }
    }
  });
  EXPECT_ALL_RANKS_OK(results);
}

// ---- Composition: data-parallel replicas of a pipeline, tensor-parallel stages --------------

// Trains this rank's stage for kSteps on its dp replica's rows of each batch; returns step()'s
// losses (averaged over the replicas).
std::vector<double> train_replica(Pipeline& pipe, int dp_rank, int dp_size,
                                  torch::optim::Optimizer* optimizer = nullptr) {
  torch::optim::SGD sgd(pipe.parameters(), kLearningRate);
  auto& opt = optimizer != nullptr ? *optimizer : sgd;
  std::vector<double> losses;
  const int rows = kBatch / dp_size;
  for (int step = 0; step < kSteps; ++step) {
    auto [x, y] = make_batch(step);
    opt.zero_grad();
    losses.push_back(
        pipe.step(x.narrow(0, rows * dp_rank, rows), y.narrow(0, rows * dp_rank, rows)));
    opt.step();
  }
  return losses;
}

// DP x PP = 2 x 2: each replica of the two-stage pipeline trains on half of each batch, and the
// stage's gradients are averaged over its dp group once per step: equal to one process on the
// whole batch, for both schedules, and with ZeRO-1 over dp.
TEST(Pipeline, DataParallelReplicasOfAPipelineEqualOneProcess) {
  const int port = test::free_port();
  const auto results = run_ranks(4, [&](int rank) {
    auto world = join_group(rank, 4, port);
    DeviceMesh mesh({{"dp", 2}, {"pp", 2}}, world);
    for (const auto schedule :
         {PipelineSchedule::kGPipe, PipelineSchedule::k1F1B, PipelineSchedule::kZeroBubble}) {
      Pipeline pipe(make_model(), mesh.group("pp"), mse,
                    {.schedule = schedule, .micro_batches = 2, .dp_group = mesh.group("dp")});
      const auto losses = train_replica(pipe, mesh.coordinate("dp"), 2);
      expect_equals_one_process(pipe, losses, fmt::format("dp 2 x pp 2, {}", to_string(schedule)));
    }
    // ZeRO-1 over dp: each replica keeps the optimizer state of half of its stage's parameters,
    // steps those and broadcasts them over dp.
    Pipeline pipe(
        make_model(), mesh.group("pp"), mse,
        {.schedule = PipelineSchedule::k1F1B, .micro_batches = 2, .dp_group = mesh.group("dp")});
    ZeroRedundancyOptimizer zero(pipe.parameters(), torch::optim::SGDOptions(kLearningRate),
                                 mesh.group("dp"));
    const auto losses = train_replica(pipe, mesh.coordinate("dp"), 2, &zero);
    expect_equals_one_process(pipe, losses, "dp 2 x pp 2 with ZeRO-1 over dp");
  });
  EXPECT_ALL_RANKS_OK(results);
}

// A stage of make_model() with its Linear layers split over `tp` (Megatron's pairing: a
// column-parallel layer whose split output feeds a row-parallel one), from the same initial
// weights: stage 0 = children 0-3, stage 1 = children 4-6.
torch::nn::Sequential tensor_parallel_stage(int stage, const std::shared_ptr<ProcessGroup>& tp) {
  auto whole = make_model();
  const auto full = [&](int child) {
    auto* linear = (whole->begin() + child)->ptr()->as<torch::nn::LinearImpl>();
    return LinearParameters{linear->weight.detach().clone(), linear->bias.detach().clone()};
  };
  const auto column = [&](int child) {
    const auto p = full(child);
    return ColumnParallelLinear(ColumnParallelLinearOptions{.in_features = p.weight.size(1),
                                                            .out_features = p.weight.size(0)},
                                tp, p);
  };
  const auto row = [&](int child) {
    const auto p = full(child);
    return RowParallelLinear(
        RowParallelLinearOptions{.in_features = p.weight.size(1), .out_features = p.weight.size(0)},
        tp, p);
  };
  torch::nn::Sequential stage_module;
  if (stage == 0) {
    stage_module->push_back("0", column(0));
    stage_module->push_back("1", torch::nn::Tanh());
    stage_module->push_back("2", row(2));
    stage_module->push_back("3", torch::nn::Tanh());
  } else {
    stage_module->push_back("4", column(4));
    stage_module->push_back("5", torch::nn::Tanh());
    stage_module->push_back("6", row(6));
  }
  return stage_module;
}

// DP x TP x PP = 2 x 2 x 2 (8 processes): tensor-parallel stages, pipelined, replicated over dp.
// The loss and every parameter (gathered over tp) after 5 steps equal one process.
TEST(Pipeline, DataTensorAndPipelineParallelTwoByTwoByTwoEqualsOneProcess) {
  const int port = test::free_port();
  const auto results = run_ranks(8, [&](int rank) {
    auto world = join_group(rank, 8, port, 60s);
    DeviceMesh mesh({{"pp", 2}, {"dp", 2}, {"tp", 2}}, world);
    const auto tp = mesh.group("tp");
    const int stage = mesh.coordinate("pp");
    for (const auto schedule : {PipelineSchedule::kGPipe, PipelineSchedule::k1F1B}) {
      const auto what = fmt::format("2 x 2 x 2, {}", to_string(schedule));
      Pipeline pipe(PipelineStageModule{tensor_parallel_stage(stage, tp)}, mesh.group("pp"), mse,
                    {.schedule = schedule, .micro_batches = 2, .dp_group = mesh.group("dp")});
      const auto losses = train_replica(pipe, mesh.coordinate("dp"), 2);
      const auto reference = train_one_process();
      for (int step = 0; step < kSteps; ++step) {
        const double want = reference.losses[static_cast<std::size_t>(step)];
        const double got = losses[static_cast<std::size_t>(step)];
        if (std::abs(got - want) > 1e-5 * std::abs(want)) {
          throw std::runtime_error(
              fmt::format("{}: step {} loss {} but one process has {}", what, step, got, want));
        }
      }
      for (const auto& child : pipe.stage_module()->named_children()) {
        LinearParameters gathered;
        if (auto* c = child.value()->as<ColumnParallelLinearImpl>()) gathered = c->gather_full();
        if (auto* r = child.value()->as<RowParallelLinearImpl>()) gathered = r->gather_full();
        if (!gathered.weight.defined()) continue;
        test::expect_close(gathered.weight, reference.parameters.at(child.key() + ".weight"),
                           what + ": " + child.key() + ".weight");
        test::expect_close(gathered.bias, reference.parameters.at(child.key() + ".bias"),
                           what + ": " + child.key() + ".bias");
      }
    }
  });
  EXPECT_ALL_RANKS_OK(results);
}

// Replicas that hold different stages cannot average their gradients: named on every rank.
TEST(PipelineErrors, DataParallelReplicasWithDifferentSplits) {
  const int port = test::free_port();
  const auto results = run_ranks(4, [&](int rank) {
    auto world = join_group(rank, 4, port, 10s);
    DeviceMesh mesh({{"dp", 2}, {"pp", 2}}, world);
    // Replica 1 splits the seven children 3 + 4 instead of 4 + 3.
    const std::vector<int> balance =
        mesh.coordinate("dp") == 0 ? std::vector<int>{4, 3} : std::vector<int>{3, 4};
    test::expect_throws<ConfigError>(
        [&] {
          Pipeline pipe(make_model(), mesh.group("pp"), mse,
                        {.micro_batches = 2, .balance = balance, .dp_group = mesh.group("dp")});
        },
        "the data-parallel replicas of this stage differ", "replicas with different splits");
  });
  EXPECT_ALL_RANKS_OK(results);
}

// The bubble: p = 2 stages of four 256x256 layers each, a batch of 1024 rows, m = 4 and 8, both
// schedules. Prints each stage's idle fraction over three steps (after two warm-up steps) beside
// the theory, (p - 1) / (m + p - 1), and its busy and wall time per step (docs/pipeline-parallel.md
// keeps the numbers). The assertions are the timings' consistency: on a loaded machine the
// fraction itself varies too much to assert.
TEST(Pipeline, BubbleIdleFraction) {
  const int port = test::free_port();
  const auto results = run_ranks(2, [&](int rank) {
    auto pg = join_group(rank, 2, port);
    for (const auto schedule :
         {PipelineSchedule::kGPipe, PipelineSchedule::k1F1B, PipelineSchedule::kInterleaved1F1B,
          PipelineSchedule::kZeroBubble}) {
      const int v = schedule == PipelineSchedule::kInterleaved1F1B ? 2 : 1;
      for (const int m : {4, 8}) {
        torch::manual_seed(3);
        torch::nn::Sequential model;
        for (int k = 0; k < 8; ++k) {
          if (k % 2 == 0) model->push_back(torch::nn::Linear(256, 256));
          if (k % 2 == 1) model->push_back(torch::nn::Tanh());
        }
        Pipeline pipe(model, pg, mse,
                      {.schedule = schedule, .micro_batches = m, .virtual_stages = v});
        auto x = torch::randn({1024, 256});
        auto y = torch::randn({1024, 256});
        std::chrono::nanoseconds busy{0}, wall{0};
        for (int step = 0; step < 5; ++step) {
          pipe.step(x, y);
          const auto& stats = pipe.last_step_stats();
          const int passes = schedule == PipelineSchedule::kZeroBubble ? 3 : 2;
          if (static_cast<int>(stats.timings.size()) != passes * m * v || stats.busy > stats.wall) {
            throw std::runtime_error("inconsistent timings");
          }
          for (const auto& t : stats.timings) {
            if (t.end < t.start || t.end > stats.wall)
              throw std::runtime_error("timing out of step");
          }
          if (step >= 2) {
            busy += stats.busy;
            wall += stats.wall;
          }
        }
        const double idle =
            1.0 - static_cast<double>(busy.count()) / static_cast<double>(wall.count());
        std::printf(
            "pipeline bubble schedule=%s p=2 v=%d m=%d stage=%d idle=%.3f theory=%.3f "
            "busy_ms=%.1f wall_ms=%.1f\n",
            to_string(schedule), v, m, rank, idle, 1.0 / (v * m + 1), busy.count() / 3e6,
            wall.count() / 3e6);
        std::fflush(stdout);
      }
    }
  });
  EXPECT_ALL_RANKS_OK(results);
}

// Under a trace, every forward and backward of a micro-batch is a span of the stage's timeline.
TEST(Pipeline, TracesEachMicroBatch) {
  test::TempDir dir("ddp-pipeline-trace");
  const int port = test::free_port();
  const auto results = run_ranks(2, [&](int rank) {
    auto pg = join_group(rank, 2, port);
    Pipeline pipe(make_model(), pg, mse,
                  {.schedule = PipelineSchedule::kGPipe, .micro_batches = 4});
    start_trace({.dir = dir.path().string(), .rank = rank, .world_size = 2});
    auto [x, y] = make_batch(0);
    pipe.step(x, y);
    const auto path = flush_trace();
    std::ifstream in(path);
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    for (const char* name : {"\"pipeline forward\"", "\"pipeline backward\""}) {
      std::size_t count = 0;
      for (auto at = text.find(name); at != std::string::npos; at = text.find(name, at + 1))
        ++count;
      if (count != 4) {
        throw std::runtime_error(
            fmt::format("stage {}: {} spans named {} in {}, not 4", rank, count, name, path));
      }
    }
  });
  EXPECT_ALL_RANKS_OK(results);
}

// ---- Bad input: a ConfigError (or a named CommError) on every rank, never a hang -------------

// Runs `body` on `world` ranks with a short timeout and expects every rank to throw an error
// whose text contains `needle` (and to be of ConfigError unless `any_error`) within 8 s.
void expect_every_rank_fails(int world,
                             const std::function<void(int, std::shared_ptr<ProcessGroup>)>& body,
                             const std::string& needle) {
  const int port = test::free_port();
  const auto results = run_ranks(
      world,
      [&](int rank) {
        auto pg = join_group(rank, world, port, 10s);
        const auto start = std::chrono::steady_clock::now();
        try {
          body(rank, pg);
        } catch (const ConfigError& e) {
          if (std::string(e.what()).find(needle) == std::string::npos) {
            throw std::runtime_error(
                fmt::format("the error does not name '{}': {}", needle, e.what()));
          }
          if (std::chrono::steady_clock::now() - start > 8s) {
            throw std::runtime_error(fmt::format("the error took more than 8 s: {}", e.what()));
          }
          return;
        }
        throw std::runtime_error("no ConfigError");
      },
      60s);
  EXPECT_ALL_RANKS_OK(results);
}

TEST(PipelineErrors, MoreStagesThanLayers) {
  expect_every_rank_fails(
      2,
      [](int, std::shared_ptr<ProcessGroup> pg) {
        torch::nn::Sequential one(torch::nn::Linear(2, 2));
        Pipeline pipe(one, pg, mse, {.schedule = PipelineSchedule::kGPipe, .micro_batches = 2});
      },
      "the model has 1 children but the pp group has 2 stages");
}

// A stage's device is checked when the pipeline is built (CUDA stages are staged through host
// copies over a host group; tests/torch/gpu runs them): a device no stage runs on is named on
// every rank, by the stage that holds it.
TEST(PipelineErrors, AStageOnADeviceThatIsNeitherTheCpuNorCudaIsNamedOnEveryRank) {
  expect_every_rank_fails(
      2,
      [](int rank, std::shared_ptr<ProcessGroup> pg) {
        // Module::to(kMeta) is refused by libtorch 1.13: a layer made with a meta parameter.
        struct MetaLayerImpl : torch::nn::Module {
          MetaLayerImpl() { register_parameter("weight", torch::empty({4, 4}, torch::kMeta)); }
          torch::Tensor forward(const torch::Tensor& x) { return x; }
        };
        torch::nn::Sequential model(torch::nn::Linear(4, 4));
        if (rank == 1) {
          model->push_back(std::make_shared<MetaLayerImpl>());
        } else {
          model->push_back(torch::nn::Linear(4, 4));
        }
        Pipeline pipe(model, pg, mse, {.schedule = PipelineSchedule::kGPipe, .micro_batches = 2});
      },
      "stage 1 is on meta; stages run on the CPU or on a CUDA device");
}

TEST(PipelineErrors, OneFOneBWithFewerMicroBatchesThanStages) {
  expect_every_rank_fails(
      2,
      [](int, std::shared_ptr<ProcessGroup> pg) {
        Pipeline pipe(make_model(), pg, mse,
                      {.schedule = PipelineSchedule::k1F1B, .micro_batches = 1});
      },
      "at least as many micro-batches as stages");
}

TEST(PipelineErrors, InterleavedMisuseIsNamedOnEveryRank) {
  using Schedule = PipelineSchedule;
  const auto build = [](PipelineOptions options) {
    return [=](int, std::shared_ptr<ProcessGroup> pg) {
      Pipeline pipe(make_model(), pg, mse, options);
    };
  };
  expect_every_rank_fails(
      2, build({.schedule = Schedule::kInterleaved1F1B, .micro_batches = 3, .virtual_stages = 2}),
      "micro_batches is 3 with 2 stages: use a multiple of 2 micro-batches");
  expect_every_rank_fails(
      2, build({.schedule = Schedule::k1F1B, .micro_batches = 4, .virtual_stages = 2}),
      "virtual_stages 2 needs the interleaved schedule");
  // 7 children cannot fill 2 x 4 chunks.
  expect_every_rank_fails(
      2, build({.schedule = Schedule::kInterleaved1F1B, .micro_batches = 4, .virtual_stages = 4}),
      "fewer than the 2 stages x 4 virtual stages = 8 chunks");
  expect_every_rank_fails(2,
                          build({.schedule = Schedule::kInterleaved1F1B,
                                 .micro_batches = 4,
                                 .virtual_stages = 2,
                                 .balance = {3, 4}}),
                          "balance has 2 entries (3,4) but the pp group has 4 chunks");
  expect_every_rank_fails(
      2,
      [](int, std::shared_ptr<ProcessGroup> pg) {
        Pipeline pipe(
            PipelineStageModule{make_model()}, pg, mse,
            {.schedule = Schedule::kInterleaved1F1B, .micro_batches = 2, .virtual_stages = 2});
      },
      "give it the whole model");
}

TEST(PipelineErrors, ZeroBubbleWithFewerMicroBatchesThanStages) {
  expect_every_rank_fails(
      2,
      [](int, std::shared_ptr<ProcessGroup> pg) {
        Pipeline pipe(make_model(), pg, mse,
                      {.schedule = PipelineSchedule::kZeroBubble, .micro_batches = 1});
      },
      "the zero-bubble schedule needs at least as many micro-batches as stages");
}

TEST(PipelineErrors, RanksThatDisagreeOnTheSchedule) {
  expect_every_rank_fails(
      2,
      [](int rank, std::shared_ptr<ProcessGroup> pg) {
        Pipeline pipe(make_model(), pg, mse,
                      {.schedule = rank == 0 ? PipelineSchedule::kGPipe : PipelineSchedule::k1F1B,
                       .micro_batches = 4});
      },
      "rank 0 has schedule gpipe but rank 1 has schedule 1f1b");
}

TEST(PipelineErrors, RanksThatDisagreeOnTheSplit) {
  expect_every_rank_fails(
      2,
      [](int rank, std::shared_ptr<ProcessGroup> pg) {
        Pipeline pipe(
            make_model(), pg, mse,
            {.micro_batches = 4, .balance = rank == 0 ? std::vector{3, 4} : std::vector{4, 3}});
      },
      "rank 0 has split 3,4 but rank 1 has split 4,3");
}

// The batch is read on stage 0 only; stage 1 hears of the error through the pipeline. A later
// step is refused on both.
TEST(PipelineErrors, BatchNotDivisibleByTheMicroBatches) {
  expect_every_rank_fails(
      2,
      [](int, std::shared_ptr<ProcessGroup> pg) {
        Pipeline pipe(make_model(), pg, mse, {.micro_batches = 4});
        auto [x, y] = make_batch(0, 6);
        try {
          pipe.step(x, y);
        } catch (const ConfigError& e) {
          if (std::string(e.what()).find("pipeline stage 0: the input batch has 6 rows, which do "
                                         "not divide into 4 micro-batches") == std::string::npos) {
            throw std::runtime_error(std::string("wrong error: ") + e.what());
          }
          pipe.step(x, y);  // refused
        }
      },
      "an earlier step failed");
}

// A layer that throws at its `fail_at`-th forward (counting from 1).
struct ThrowingLayerImpl : torch::nn::Module {
  explicit ThrowingLayerImpl(int fail_at) : fail_at(fail_at) {}
  torch::Tensor forward(torch::Tensor x) {
    if (++calls == fail_at) throw std::runtime_error("injected failure in the stage's layer");
    return x;
  }
  int fail_at;
  int calls = 0;
};
TORCH_MODULE(ThrowingLayer);

// Three stages; the middle one throws in its third forward (mid-schedule). Stage 1 rethrows its
// own error, stages 0 and 2 throw CommError (aborted) naming stage 1, well before the timeout.
TEST(PipelineErrors, AStageThatThrowsMidScheduleStopsEveryStage) {
  const int port = test::free_port();
  const auto failing = run_ranks(
      3,
      [&](int rank) {
        auto pg = join_group(rank, 3, port, 10s);
        auto whole = make_model();
        const auto names = whole->named_children().keys();
        torch::nn::Sequential mine;
        const int first[] = {0, 3, 5}, count[] = {3, 2, 2};
        for (int k = first[rank]; k < first[rank] + count[rank]; ++k)
          mine->push_back(names[static_cast<std::size_t>(k)], *(whole->begin() + k));
        if (rank == 1) mine->push_back("throwing", ThrowingLayer(3));
        Pipeline pipe(PipelineStageModule{mine}, pg, mse,
                      {.schedule = PipelineSchedule::k1F1B, .micro_batches = 4});
        const auto start = std::chrono::steady_clock::now();
        auto [x, y] = make_batch(0);
        try {
          pipe.step(x, y);
          throw std::logic_error("step() returned");
        } catch (const CommError& e) {
          if (rank == 1 || e.kind() != CommErrorKind::kAborted || e.peer() != 1 ||
              std::string(e.what()).find("stage 1 failed: injected failure") == std::string::npos) {
            throw std::runtime_error(fmt::format("stage {}: wrong CommError: {}", rank, e.what()));
          }
        } catch (const std::runtime_error& e) {
          if (rank != 1 || std::string(e.what()) != "injected failure in the stage's layer") {
            throw std::runtime_error(fmt::format("stage {}: wrong error: {}", rank, e.what()));
          }
        }
        const auto took = std::chrono::steady_clock::now() - start;
        if (took > 5s) throw std::runtime_error("the failure took longer than 5 s to arrive");
        if (pipe.last_step_stats().timings.empty() && rank == 0) {
          throw std::runtime_error("stage 0 ran nothing before the failure");
        }
      },
      60s);
  EXPECT_ALL_RANKS_OK(failing);
}

// Interleaved, the messages go around the ring: rank 0's second chunk throws in its third
// forward, and rank 1, which waits on it from either side, hears of it well before the timeout.
TEST(PipelineErrors, AnInterleavedChunkThatThrowsStopsEveryStage) {
  const int port = test::free_port();
  const auto failing = run_ranks(
      2,
      [&](int rank) {
        auto pg = join_group(rank, 2, port, 10s);
        // The model's children with a throwing layer at 4: children 4 and 5 are rank 0's chunk 1.
        const auto whole = make_model();
        const auto names = whole->named_children().keys();
        torch::nn::Sequential model;
        for (std::size_t k = 0; k < names.size(); ++k) {
          if (k == 4) model->push_back("throwing", ThrowingLayer(3));
          model->push_back(names[k], *(whole->begin() + static_cast<std::ptrdiff_t>(k)));
        }
        Pipeline pipe(model, pg, mse,
                      {.schedule = PipelineSchedule::kInterleaved1F1B,
                       .micro_batches = 4,
                       .virtual_stages = 2});
        const auto start = std::chrono::steady_clock::now();
        auto [x, y] = make_batch(0);
        try {
          pipe.step(x, y);
          throw std::logic_error("step() returned");
        } catch (const CommError& e) {
          if (rank == 0 || e.kind() != CommErrorKind::kAborted || e.peer() != 0 ||
              std::string(e.what()).find("stage 0 failed: injected failure") == std::string::npos) {
            throw std::runtime_error(fmt::format("stage {}: wrong CommError: {}", rank, e.what()));
          }
        } catch (const std::runtime_error& e) {
          if (rank != 0 || std::string(e.what()) != "injected failure in the stage's layer") {
            throw std::runtime_error(fmt::format("stage {}: wrong error: {}", rank, e.what()));
          }
        }
        if (std::chrono::steady_clock::now() - start > 5s)
          throw std::runtime_error("the failure took longer than 5 s to arrive");
      },
      60s);
  EXPECT_ALL_RANKS_OK(failing);
}

// A layer that ends its process at its `exit_at`-th forward, as a crash would.
struct ExitingLayerImpl : torch::nn::Module {
  explicit ExitingLayerImpl(int exit_at) : exit_at(exit_at) {}
  torch::Tensor forward(torch::Tensor x) {
    if (++calls == exit_at) std::_Exit(3);
    return x;
  }
  int exit_at;
  int calls = 0;
};
TORCH_MODULE(ExitingLayer);

// The middle of three stages dies mid-schedule: its neighbours fail with a CommError naming it
// (peer gone), well before the group's timeout.
TEST(PipelineErrors, AStageThatDiesMidScheduleFailsItsNeighbours) {
  const int port = test::free_port();
  const auto results = run_ranks(
      3,
      [&](int rank) {
        auto pg = join_group(rank, 3, port, 10s);
        auto whole = make_model();
        const auto names = whole->named_children().keys();
        torch::nn::Sequential mine;
        const int first[] = {0, 3, 5}, count[] = {3, 2, 2};
        for (int k = first[rank]; k < first[rank] + count[rank]; ++k)
          mine->push_back(names[static_cast<std::size_t>(k)], *(whole->begin() + k));
        if (rank == 1) mine->push_back("exiting", ExitingLayer(3));
        Pipeline pipe(PipelineStageModule{mine}, pg, mse,
                      {.schedule = PipelineSchedule::k1F1B, .micro_batches = 4});
        const auto start = std::chrono::steady_clock::now();
        auto [x, y] = make_batch(0);
        try {
          pipe.step(x, y);
          throw std::logic_error("step() returned");
        } catch (const CommError& e) {
          if (std::chrono::steady_clock::now() - start > 8s) {
            throw std::runtime_error(
                fmt::format("stage {}: took more than 8 s: {}", rank, e.what()));
          }
          if (e.peer() != 1) {
            throw std::runtime_error(
                fmt::format("stage {}: does not name rank 1: {}", rank, e.what()));
          }
          std::printf("stage %d: %s (kind %s)\n", rank, e.what(), to_string(e.kind()));
        }
      },
      60s);
  ASSERT_EQ(results.size(), 3u);
  EXPECT_TRUE(results[0].ok()) << test::describe(results);
  EXPECT_EQ(results[1].exit_code, 3) << test::describe(results);
  EXPECT_TRUE(results[2].ok()) << test::describe(results);
}

}  // namespace DDP_UNITY_ID
}  // namespace
}  // namespace ddp
