// train-gpt: a small character-level GPT (minGPT/nanoGPT style) trained with data, tensor and
// pipeline parallelism at once, on a DeviceMesh of pp x dp x tp ranks (docs/model-parallel.md).
//
//   ddprun --standalone --nproc-per-node 8 train-gpt --dp 2 --tp 2 --pp 2 --microbatches 2
//       --schedule 1f1b --steps 20      (one command line)
//
// The model: a token embedding split over the vocabulary (VocabParallelEmbedding) plus a learned
// position embedding, --layers GptBlocks parallelised by Megatron's plan (attention heads and the
// MLP split over tp), a final LayerNorm and a column-parallel head over the vocabulary, trained
// with vocab-parallel cross-entropy. The Sequential of those children is split into --pp pipeline
// stages (GPipe or 1F1B over --microbatches micro-batches), and the pipeline is replicated over dp
// (PipelineOptions::dp_group: each replica takes its rows of the batch, gradients averaged once
// per step). Every layout of the same run trains the same model on the same batches: the weights
// come from fixed seeds, the vocabulary is padded to a multiple of 8, and each step's batch is
// drawn from --seed. AdamW. The text: --data (default: the GPL's text from Debian's base-files),
// or a generated one when the file is missing.
//
// Rank 0 prints "step <k> loss <loss>" every --log-every steps, and last
// "final loss=<loss> param_sum=<sum of every element of every parameter of the whole model>",
// the same on every layout (the split parameters gathered, each stage counted once).
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include <ATen/CPUGeneratorImpl.h>
#include <fmt/format.h>
#include <torch/torch.h>
#include <CLI/CLI.hpp>

#include "ddp/error.h"
#include "ddp/init.h"
#include "ddp/torch/device_mesh.h"
#include "ddp/torch/distributed.h"
#include "ddp/torch/gpt_block.h"
#include "ddp/torch/mesh_train_state.h"
#include "ddp/torch/pipeline.h"
#include "ddp/torch/tensor_parallel.h"

namespace {

struct Options {
  int dp = 1, tp = 1, pp = 1;
  int microbatches = 1;
  std::string schedule = "1f1b";
  int steps = 20;
  int log_every = 5;
  std::uint64_t seed = 1;
  std::string dtype = "float32";
  std::string data = "/usr/share/common-licenses/GPL-3";
  int layers = 4;
  std::int64_t hidden = 32, heads = 4, block_size = 16, batch_size = 8;
  double lr = 3e-3;
  int threads = 1;
  std::string checkpoint;  // a folder: MeshTrainState, saved every checkpoint_every steps and last
  int checkpoint_every = 0;
  bool resume = false;
  int time_after = -1;              // >= 0: time the steps after this many (the median is printed)
  std::int64_t vocab_at_least = 0;  // pads the vocabulary further (benchmarks: a larger head)
};

// The text to learn: the file, or (when it is missing) a generated one, the same on every rank.
std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (in) {
    std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (text.size() > 1000) return text;
  }
  std::string text;
  const char* words[] = {"the ",      "model ",     "is ",   "split ",    "over ",
                         "ranks ",    "and ",       "data ", "pipeline ", "tensor ",
                         "parallel ", "gradients ", "\n"};
  std::uint64_t state = 12345;
  while (text.size() < 20000) {
    state = state * 6364136223846793005ULL + 1442695040888963407ULL;
    text += words[(state >> 33) % std::size(words)];
  }
  return text;
}

// Token embedding (split over the vocabulary on tp) plus a learned position embedding.
struct EmbeddingsImpl : torch::nn::Module {
  EmbeddingsImpl(std::int64_t vocab, const Options& o, torch::Dtype dtype,
                 const std::shared_ptr<ddp::ProcessGroup>& tp) {
    token = register_module(
        "token",
        ddp::VocabParallelEmbedding(
            ddp::VocabParallelEmbeddingOptions{
                .num_embeddings = vocab, .embedding_dim = o.hidden, .seed = 1000, .dtype = dtype},
            tp));
    auto generator = at::detail::createCPUGenerator(1001);
    position = register_parameter("position", torch::randn({o.block_size, o.hidden}, generator,
                                                           torch::TensorOptions().dtype(dtype)) *
                                                  0.02);
  }
  torch::Tensor forward(const torch::Tensor& ids) {
    return token(ids) + position.narrow(0, 0, ids.size(1));
  }
  ddp::VocabParallelEmbedding token{nullptr};
  torch::Tensor position;
};
TORCH_MODULE(Embeddings);

// The final LayerNorm and the head, split over the vocabulary (its output is this rank's part).
struct HeadImpl : torch::nn::Module {
  HeadImpl(std::int64_t vocab, const Options& o, torch::Dtype dtype,
           const std::shared_ptr<ddp::ProcessGroup>& tp) {
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({o.hidden})));
    norm->to(dtype);
    proj = register_module(
        "proj", ddp::ColumnParallelLinear(ddp::ColumnParallelLinearOptions{.in_features = o.hidden,
                                                                           .out_features = vocab,
                                                                           .bias = false,
                                                                           .seed = 2000,
                                                                           .dtype = dtype},
                                          tp));
  }
  torch::Tensor forward(const torch::Tensor& x) { return proj(norm(x)); }
  torch::nn::LayerNorm norm{nullptr};
  ddp::ColumnParallelLinear proj{nullptr};
};
TORCH_MODULE(Head);

// The sum of every element of this stage's parameters, the split ones gathered over tp
// (collective over tp, in the same order on every tp rank).
double full_parameter_sum(torch::nn::Sequential& stage) {
  double sum = 0.0;
  const auto add = [&](const torch::Tensor& t) {
    sum += t.to(torch::kFloat64).sum().item<double>();
  };
  for (const auto& child : stage->children()) {
    if (auto* embeddings = child->as<EmbeddingsImpl>()) {
      add(embeddings->token->gather_full());
      add(embeddings->position.detach());
    } else if (auto* block = child->as<ddp::GptBlockImpl>()) {
      for (const auto& [name, value] : block->full_named_parameters())
        add(value);
    } else if (auto* head = child->as<HeadImpl>()) {
      for (const auto& p : head->norm->parameters())
        add(p.detach());
      add(head->proj->gather_full().weight);
    }
  }
  return sum;
}

int run(const Options& o) {
  torch::set_num_threads(o.threads);
  auto world = ddp::init_process_group();
  if (o.dp * o.tp * o.pp != world->size()) {
    throw ddp::ConfigError(fmt::format(
        "--dp {} x --tp {} x --pp {} = {} ranks, but the job has {}: launch that many (ddprun "
        "--nproc-per-node {})",
        o.dp, o.tp, o.pp, o.dp * o.tp * o.pp, world->size(), o.dp * o.tp * o.pp));
  }
  if (o.dtype != "float32" && o.dtype != "float64") {
    throw ddp::ConfigError(fmt::format("--dtype {}: float32 or float64", o.dtype));
  }
  const auto dtype = o.dtype == "float64" ? torch::kFloat64 : torch::kFloat32;
  if (o.batch_size % o.dp != 0 || (o.batch_size / o.dp) % o.microbatches != 0) {
    throw ddp::ConfigError(fmt::format(
        "--batch-size {} must split into --dp {} replicas of --microbatches {} equal micro-batches",
        o.batch_size, o.dp, o.microbatches));
  }
  ddp::DeviceMesh mesh({{"pp", o.pp}, {"dp", o.dp}, {"tp", o.tp}}, world);
  const auto tp = mesh.group("tp");

  const std::string text = read_text(o.data);
  const std::set<char> chars(text.begin(), text.end());
  std::map<char, std::int64_t> id_of;
  for (const char c : chars)
    id_of.emplace(c, static_cast<std::int64_t>(id_of.size()));
  // Padded to a multiple of 8, the same on every layout (tp divides it up to 8).
  const std::int64_t vocab =
      (std::max<std::int64_t>(static_cast<std::int64_t>(chars.size()), o.vocab_at_least) + 7) / 8 *
      8;
  std::vector<std::int64_t> ids;
  ids.reserve(text.size());
  for (const char c : text)
    ids.push_back(id_of.at(c));
  const auto corpus = torch::tensor(ids, torch::kInt64);

  // The whole model on every rank (the split layers are cut for this tp rank); the pipeline keeps
  // this rank's stage.
  torch::nn::Sequential model;
  model->push_back("embeddings", Embeddings(vocab, o, dtype, tp));
  for (int layer = 0; layer < o.layers; ++layer) {
    ddp::GptBlock block(ddp::GptBlockOptions{.hidden = o.hidden,
                                             .heads = o.heads,
                                             .seed = 100 + 10 * static_cast<std::uint64_t>(layer),
                                             .dtype = dtype});
    ddp::parallelize_module(block, tp, ddp::gpt_block_tensor_parallel_plan());
    model->push_back(fmt::format("block{}", layer), block);
  }
  model->push_back("head", Head(vocab, o, dtype, tp));

  const auto loss_fn = [tp, vocab, size = o.tp](const torch::Tensor& logits,
                                                const torch::Tensor& target) {
    return ddp::vocab_parallel_cross_entropy(logits.reshape({-1, vocab / size}),
                                             target.reshape({-1}), tp)
        .mean();
  };
  ddp::Pipeline pipe(model, mesh.group("pp"), loss_fn,
                     {.schedule = ddp::pipeline_schedule_from_name(o.schedule),
                      .micro_batches = o.microbatches,
                      .dp_group = mesh.group("dp")});
  torch::optim::AdamW optimizer(pipe.parameters(), torch::optim::AdamWOptions(o.lr));

  // Each rank's part of the model and of AdamW's state (the dp replicas share theirs).
  ddp::MeshTrainState state(mesh, *pipe.stage_module(), optimizer, {.tag = "train-gpt"});
  ddp::TrainProgress progress;
  if (o.resume) {
    if (o.checkpoint.empty()) throw ddp::ConfigError("--resume needs --checkpoint DIR");
    progress = state.load(o.checkpoint);
    ddp::print_main_line(
        fmt::format("resuming from {} at step {}", o.checkpoint, progress.global_step));
  }

  const std::int64_t rows = o.batch_size / o.dp;
  const std::int64_t first_row = rows * mesh.coordinate("dp");
  double loss = 0.0;
  std::vector<double> step_ms;
  for (int step = static_cast<int>(progress.global_step); step < o.steps; ++step) {
    const bool timed = o.time_after >= 0 && step >= o.time_after;
    if (timed) ddp::barrier(world);
    const auto started = std::chrono::steady_clock::now();
    // The step's batch, the same on every rank: random windows of the text.
    auto generator =
        at::detail::createCPUGenerator(o.seed * 1'000'003 + static_cast<std::uint64_t>(step));
    const auto starts = torch::randint(static_cast<std::int64_t>(ids.size()) - o.block_size - 1,
                                       {o.batch_size}, generator, torch::kInt64);
    const auto offsets = torch::arange(o.block_size + 1, torch::kInt64);
    const auto windows = corpus.index({starts.unsqueeze(1) + offsets});  // [B, T + 1]
    const auto mine = windows.narrow(0, first_row, rows);
    optimizer.zero_grad();
    loss = pipe.step(mine.narrow(1, 0, o.block_size).contiguous(),
                     mine.narrow(1, 1, o.block_size).contiguous());
    optimizer.step();
    if (timed) {
      ddp::barrier(world);  // the step ends when every rank is done
      step_ms.push_back(
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - started)
              .count());
    }
    progress.global_step = step + 1;
    const bool last = step + 1 == o.steps;
    if (!o.checkpoint.empty() &&
        (last || (o.checkpoint_every > 0 && (step + 1) % o.checkpoint_every == 0))) {
      state.save(o.checkpoint, progress);
    }
    if ((step + 1) % o.log_every == 0)
      ddp::print_main_line(fmt::format("step {} loss {:.6f}", step + 1, loss));
  }
  if (!step_ms.empty()) {
    std::sort(step_ms.begin(), step_ms.end());
    const double median = step_ms[step_ms.size() / 2];
    ddp::print_main_line(fmt::format("median_step_ms={:.3f} samples_per_s={:.1f}", median,
                                     static_cast<double>(o.batch_size) * 1000.0 / median));
  }
  auto sum = torch::tensor({full_parameter_sum(pipe.stage_module())}, torch::kFloat64);
  ddp::all_reduce(sum, ddp::ReduceOp::kSum, *mesh.group("pp"));  // one sum per stage
  ddp::print_main_line(
      fmt::format("final loss={:.15g} param_sum={:.15g}", loss, sum.item<double>()));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"train-gpt: a character-level GPT with data, tensor and pipeline parallelism"};
  app.add_option("--dp", o.dp, "data-parallel replicas")->check(CLI::PositiveNumber);
  app.add_option("--tp", o.tp, "tensor-parallel ranks per layer (divides the heads and 8)")
      ->check(CLI::PositiveNumber);
  app.add_option("--pp", o.pp, "pipeline stages")->check(CLI::PositiveNumber);
  app.add_option("--microbatches", o.microbatches, "micro-batches per step and replica")
      ->check(CLI::PositiveNumber);
  app.add_option("--schedule", o.schedule, "gpipe or 1f1b");
  app.add_option("--steps", o.steps, "optimizer steps")->check(CLI::PositiveNumber);
  app.add_option("--log-every", o.log_every, "print the loss every N steps")
      ->check(CLI::PositiveNumber);
  app.add_option("--seed", o.seed, "draws the batches");
  app.add_option("--dtype", o.dtype, "float32 or float64");
  app.add_option("--data", o.data, "a text file (a generated text when missing)");
  app.add_option("--layers", o.layers, "transformer blocks")->check(CLI::PositiveNumber);
  app.add_option("--batch-size", o.batch_size, "sequences per step (all replicas together)")
      ->check(CLI::PositiveNumber);
  app.add_option("--lr", o.lr, "AdamW's learning rate")->check(CLI::PositiveNumber);
  app.add_option("--time-after", o.time_after,
                 "time the steps after this many and print median_step_ms (benchmarks)");
  app.add_option("--vocab-at-least", o.vocab_at_least,
                 "pad the vocabulary to at least this many entries (benchmarks)");
  app.add_option("--hidden", o.hidden, "model width (divisible by --heads)")
      ->check(CLI::PositiveNumber);
  app.add_option("--heads", o.heads, "attention heads (divisible by --tp)")
      ->check(CLI::PositiveNumber);
  app.add_option("--block-size", o.block_size, "characters per sequence")
      ->check(CLI::PositiveNumber);
  app.add_option("--threads", o.threads, "torch threads per rank")->check(CLI::PositiveNumber);
  app.add_option("--checkpoint", o.checkpoint,
                 "a folder for each rank's part of the model and optimizer (saved at the end)");
  app.add_option("--checkpoint-every", o.checkpoint_every, "also save every N steps")
      ->check(CLI::NonNegativeNumber);
  app.add_flag("--resume", o.resume, "continue from --checkpoint (the same tp x pp split)");
  CLI11_PARSE(app, argc, argv);
  try {
    return run(o);
  } catch (const std::exception& e) {
    fmt::print(stderr, "train-gpt: {}\n", e.what());
    return 1;
  }
}
