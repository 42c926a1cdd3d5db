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
// stages (GPipe or 1F1B over --microbatches micro-batches, the interleaved 1F1B schedule over
// --virtual-stages chunks per rank, or zero bubble), and the pipeline is replicated over dp
// (PipelineOptions::dp_group: each replica takes its rows of the batch, gradients averaged once
// per step). Every layout of the same run trains the same model on the same batches: the weights
// come from fixed seeds, the vocabulary is padded to a multiple of 8, and each step's batch is
// drawn from --seed. AdamW. The text: --data, or by default the GPL's text from Debian's
// base-files (a generated one where that file is missing).
//
// Every flag is range-checked before the job starts (a refusal names the flag, its value and what
// would be valid, and exits 1), the sizes together against the machine's memory; the layout
// against the job's world size once it has joined.
//
// With --fsdp the dp replicas do not each hold the model: it is built child by child and each
// child (the embeddings, every block, the head) is sharded over dp by FullyShardedDataParallel
// (FULL_SHARD) before the next is built (ddp::fsdp_build_sharded), so no rank ever holds more
// than its shards plus one child; the tensor-parallel layers inside are split over tp as without
// it (FSDP x TP, PyTorch's 2-D parallelism). --microbatches then accumulates gradients (no_sync);
// --pp must be 1. Its --checkpoint is the same DCP folder as without --fsdp (each rank's flat
// shards placed in the whole tensors), so either resumes the other's at any --dp x --tp.
// --fsdp-low-memory trades FSDP's overlap for memory (FsdpOptions::low_memory_backward): nothing
// is gathered or reduced ahead, and each parameter's gradient is reduced as soon as it is ready.
//
// Without --fsdp, --checkpoint DIR is a distributed checkpoint in PyTorch's format (DCP: the
// model and AdamW's state under the whole model's names, each tp rank's part of a split tensor a
// region of it, and the step), which --resume continues at any --dp, --tp and --pp; a
// MeshTrainState folder of an earlier train-gpt (DIR/mesh.pt) still resumes on its own split.
//
// With --moe-experts E every block's MLP is a mixture of E experts (ddp::MoeLayer: a top --top-k
// router, --capacity-factor, the load-balancing loss with weight --moe-aux-weight), the experts
// split over --ep ranks: the mesh is pp x dp x ep x tp, the batch's rows split over the dp x ep
// ranks, the experts' gradients averaged over dp and the rest over dp x ep; the experts stay whole
// on every tp rank, the attention is split over tp. Every such layout drops the tokens one process
// drops, and ends at its numbers with --microbatches 1 (a micro-batch routes its own tokens: with
// more, the micro-batches of a layout hold other rows than one process's).
//
// With --cp N each window's positions are split over N ranks (load balanced: rank r holds chunks r
// and 2N - 1 - r of 2N), every block's attention is ring attention over them (ddp::ring_attention)
// and the rest of the model works on the rank's positions alone; the mesh is pp x dp x cp x tp and
// gradients average over the dp x cp ranks. The same numbers as one process.
//
// Rank 0 prints "step <k> loss <loss>" every --log-every steps, and last
// "final loss=<loss> param_sum=<sum of every element of every parameter of the whole model>",
// the same on every layout (the split parameters gathered, each stage counted once), with and
// without --activation-checkpointing (every block recomputed in backward, ddp::checkpoint) and
// --fsdp.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <ATen/CPUGeneratorImpl.h>
#include <fmt/format.h>
#include <torch/torch.h>
#include <CLI/CLI.hpp>

#include "common/program_options.h"
#include "ddp/error.h"
#include "ddp/runtime/init.h"
#include "ddp/torch/api/distributed.h"
#include "ddp/torch/parallel/context/ring_attention.h"
#include "ddp/torch/parallel/mesh/device_mesh.h"
#include "gpt_model.h"
#include "gpt_trainer.h"

namespace {

constexpr const char* kDefaultData = "/usr/share/common-licenses/GPL-3";

// Bounds of the size flags: far above anything this example trains, low enough that no product
// of them overflows (the memory they need together is checked against the machine's).
constexpr std::int64_t kMaxSize = std::int64_t{1} << 20;
constexpr std::int64_t kMaxBatch = std::int64_t{1} << 30;

struct Options {
  int dp = 1, tp = 1, pp = 1;
  int microbatches = 1;
  std::string schedule = "1f1b";
  int virtual_stages = 1;  // model chunks per pipeline rank (--schedule interleaved)
  int steps = 20;
  int log_every = 5;
  std::uint64_t seed = 1;
  std::string dtype = "float32";
  std::string data = kDefaultData;
  bool data_given = false;  // --data on the command line: it must be there
  int layers = 4;
  std::int64_t hidden = 32, heads = 4, block_size = 16, batch_size = 8;
  double lr = 3e-3;
  int threads = 1;
  std::string checkpoint;  // a folder (DCP), saved every checkpoint_every steps and last
  int checkpoint_every = 0;
  bool resume = false;
  int time_after = -1;              // >= 0: time the steps after this many (the median is printed)
  std::int64_t vocab_at_least = 0;  // pads the vocabulary further (benchmarks: a larger head)
  bool activation_checkpointing = false;  // every block under ddp::checkpoint
  bool fsdp = false;             // FSDP (FULL_SHARD) over dp, each child built and sharded in turn
  bool fsdp_low_memory = false;  // with fsdp: nothing in flight, gradients reduced per parameter
  std::int64_t moe_experts = 0;  // > 0: every block's MLP a mixture of this many experts
  std::int64_t top_k = 1;
  int ep = 1;  // the experts split over this many ranks
  int cp = 1;  // each window's positions split over this many ranks (ring attention)
  double capacity_factor = 0.0;
  double moe_aux_weight = 0.01;
};

// The text to learn, the same on every rank: --data's file; without --data the default file, or a
// generated text where it is missing. (A file given by --data that cannot be read is refused: it
// is not silently replaced, nor is a short one.)
std::string read_text(const Options& o) {
  if (o.data_given || std::filesystem::exists(o.data)) {
    return ddp_programs::read_whole_file("--data", o.data);
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

// The vocabulary: one id per distinct character of the text, padded to a multiple of 8 (the same
// on every layout: tp divides it up to 8) and to --vocab-at-least.
std::int64_t padded_vocabulary(std::int64_t chars, const Options& o) {
  return (std::max(chars, o.vocab_at_least) + 7) / 8 * 8;
}

// Context parallelism: each window in 2 x --cp equal chunks; what does not compose with it yet is
// named.
void check_context(const Options& o) {
  if (o.cp == 1) return;
  if (o.block_size % (2 * o.cp) != 0) {
    throw ddp::ConfigError(fmt::format(
        "--block-size {} does not split into 2 x --cp {} = {} equal chunks (rank r of cp holds "
        "chunks r and 2 cp - 1 - r of each window): use a multiple of {}",
        o.block_size, o.cp, 2 * o.cp, 2 * o.cp));
  }
  if (o.moe_experts > 0 || o.fsdp || !o.checkpoint.empty()) {
    throw ddp::ConfigError(fmt::format("--cp {} with {}: not built yet; use --cp without it", o.cp,
                                       o.moe_experts > 0 ? "--moe-experts"
                                       : o.fsdp          ? "--fsdp"
                                                         : "--checkpoint"));
  }
}

// The mixture-of-experts flags: each needs --moe-experts, which --ep and --top-k must fit; what
// does not compose with experts yet is named.
void check_experts(const Options& o) {
  if (o.moe_experts == 0) {
    if (o.ep != 1 || o.top_k != 1 || o.capacity_factor != 0.0) {
      throw ddp::ConfigError(
          "--ep, --top-k and --capacity-factor need --moe-experts E (a mixture of E experts in "
          "place of each block's MLP)");
    }
    return;
  }
  if (o.top_k > o.moe_experts) {
    throw ddp::ConfigError(fmt::format(
        "--top-k {} must be at most --moe-experts {} (a token goes to k different experts)",
        o.top_k, o.moe_experts));
  }
  if (o.moe_experts % o.ep != 0) {
    throw ddp::ConfigError(fmt::format(
        "--moe-experts {} is not divisible by --ep {}: each ep rank holds the same number of "
        "experts (use a multiple of {} experts)",
        o.moe_experts, o.ep, o.ep));
  }
  if (o.fsdp) {
    throw ddp::ConfigError(
        "--moe-experts with --fsdp: FSDP over experts split along --ep is not built yet; train "
        "the experts without --fsdp");
  }
  if (!o.checkpoint.empty()) {
    throw ddp::ConfigError(
        "--moe-experts with --checkpoint: the experts' place in a distributed checkpoint is not "
        "built yet; train without --checkpoint");
  }
}

// The interleaved schedule's chunks: --layers blocks in --pp x --virtual-stages equal chunks (the
// embeddings join the first, the head the last), micro-batches in groups of --pp.
void check_schedule(const Options& o) {
  if (o.schedule != "interleaved") {
    if (o.virtual_stages != 1) {
      throw ddp::ConfigError(fmt::format(
          "--virtual-stages {} needs --schedule interleaved (the {} schedule runs one chunk of "
          "the model per pipeline rank)",
          o.virtual_stages, o.schedule));
    }
    return;
  }
  if (o.pp < 2) {
    throw ddp::ConfigError(
        "--schedule interleaved needs --pp 2 or more (it passes each micro-batch around the "
        "pipeline's ranks --virtual-stages times)");
  }
  const std::int64_t chunks = std::int64_t{o.pp} * o.virtual_stages;
  if (o.layers % chunks != 0) {
    throw ddp::ConfigError(fmt::format(
        "--layers {} does not divide into --pp {} x --virtual-stages {} = {} equal chunks of "
        "blocks: use a multiple of {} layers or another --virtual-stages",
        o.layers, o.pp, o.virtual_stages, chunks, chunks));
  }
  if (o.microbatches % o.pp != 0) {
    throw ddp::ConfigError(fmt::format(
        "--schedule interleaved runs micro-batches in groups of --pp: --microbatches {} is not a "
        "multiple of --pp {}",
        o.microbatches, o.pp));
  }
}

// Refuses, naming the flags, what the layout cannot run: the flags that must divide one another,
// a block the text cannot fill, and sizes that cannot fit in the machine's memory.
void check_options(const Options& o, const std::string& text, std::int64_t vocab) {
  const std::int64_t data_ranks = std::int64_t{o.dp} * o.ep;
  if (o.batch_size % data_ranks != 0 || (o.batch_size / data_ranks) % o.microbatches != 0) {
    throw ddp::ConfigError(fmt::format(
        "--batch-size {} must split into --dp {} x --ep {} replicas of --microbatches {} equal "
        "micro-batches",
        o.batch_size, o.dp, o.ep, o.microbatches));
  }
  check_experts(o);
  check_context(o);
  check_schedule(o);
  if (o.hidden % o.heads != 0) {
    throw ddp::ConfigError(
        fmt::format("--hidden {} must be a multiple of --heads {}", o.hidden, o.heads));
  }
  if (o.heads % o.tp != 0 || vocab % o.tp != 0) {
    throw ddp::ConfigError(fmt::format(
        "--tp {} must divide --heads {} and the vocabulary of {} (the text's characters padded "
        "to a multiple of 8 and to --vocab-at-least)",
        o.tp, o.heads, vocab));
  }
  // Each step draws windows of block_size + 1 characters (the inputs and the next character of
  // each) from random starts: the text must hold one at least.
  const auto characters = static_cast<std::int64_t>(text.size());
  if (characters < o.block_size + 2) {
    const std::string source = o.data_given || std::filesystem::exists(o.data)
                                   ? fmt::format("--data '{}'", o.data)
                                   : fmt::format("the generated text ('{}' is missing)", o.data);
    throw ddp::ConfigError(fmt::format(
        "--block-size {}: {} has {} characters, but it must be longer than the block size + 1 "
        "(at least {}): use a smaller --block-size or a longer text",
        o.block_size, source, characters, o.block_size + 2));
  }
  if (o.time_after >= o.steps) {
    throw ddp::ConfigError(fmt::format(
        "--time-after {}: no step after it would be timed, --steps is {} (valid: 0 to {})",
        o.time_after, o.steps, o.steps - 1));
  }
  if (o.fsdp_low_memory && !o.fsdp) {
    throw ddp::ConfigError(
        "--fsdp-low-memory without --fsdp: it sets how FSDP's backward spends memory; add --fsdp");
  }
  if (o.fsdp && o.pp != 1) {
    throw ddp::ConfigError(fmt::format(
        "--fsdp with --pp {}: FSDP shards the model over --dp and composes with --tp; a pipeline "
        "runs several micro-batches' forwards before their backwards, which FSDP's units do not "
        "take (use --pp 1 with --fsdp, or --pp {} without it)",
        o.pp, o.pp));
  }
  if (o.resume && o.checkpoint.empty()) throw ddp::ConfigError("--resume needs --checkpoint DIR");
  if (!o.checkpoint.empty() && std::filesystem::exists(o.checkpoint) &&
      !std::filesystem::is_directory(o.checkpoint)) {
    throw ddp::ConfigError(fmt::format(
        "--checkpoint '{}' is not a directory (it holds one file per part)", o.checkpoint));
  }
  // What a rank holds at once, at the least: its share of the parameters (every rank builds the
  // whole model, the split layers cut for its tp rank), one layer's attention scores of one
  // micro-batch, the step's windows of the text and the text itself as ids (both int64, the ids
  // twice: a vector and a tensor). Optimizer state, gradients and the other activations come on
  // top.
  const double h = static_cast<double>(o.hidden);
  double parameters =
      (2.0 * static_cast<double>(vocab) * h + static_cast<double>(o.layers) * 12.0 * h * h) /
          static_cast<double>(o.tp) +
      static_cast<double>(o.block_size) * h;
  // Experts: each ep rank holds E / ep MLPs of 8 h^2, whole on every tp rank.
  if (o.moe_experts > 0) {
    parameters +=
        static_cast<double>(o.layers) * 8.0 * h * h * static_cast<double>(o.moe_experts / o.ep);
  }
  // --fsdp: the shards, and one child (the embeddings or the head, or a block) whole.
  if (o.fsdp) {
    parameters = parameters / static_cast<double>(o.dp) +
                 std::max(static_cast<double>(vocab) * h, 12.0 * h * h) / static_cast<double>(o.tp);
  }
  const double rows = static_cast<double>(o.batch_size / o.dp / o.microbatches);
  const double scores = rows * static_cast<double>(o.heads / o.tp) *
                        static_cast<double>(o.block_size) * static_cast<double>(o.block_size);
  const double element = o.dtype == "float64" ? 8.0 : 4.0;
  const double windows =
      static_cast<double>(o.batch_size) * static_cast<double>(o.block_size + 1) * 8.0;
  const double ids = 16.0 * static_cast<double>(characters);
  ddp_programs::check_fits_in_memory(
      element * (parameters + scores) + windows + ids,
      fmt::format("--hidden {} x --layers {} (a vocabulary of {}) with --block-size {}, "
                  "--batch-size {} and --dtype {} ({:.3g} parameters per rank, attention scores "
                  "of {:.3g} elements per layer)",
                  o.hidden, o.layers, vocab, o.block_size, o.batch_size, o.dtype, parameters,
                  scores));
}

// This process's resident memory now ("VmRSS") or at its peak ("VmHWM") in MiB, from
// /proc/self/status; 0 where it does not say.
double resident_mib(const std::string& field) {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind(field + ":", 0) == 0) return std::stod(line.substr(field.size() + 1)) / 1024.0;
  }
  return 0.0;
}

// dp x ep x tp x pp, or nullopt where it overflows int64 (--dp 65536 --tp 65536 made "0 ranks" in
// int).
std::optional<std::int64_t> layout_ranks(const Options& o) {
  std::int64_t ranks = 1;
  for (const int size : {o.dp, o.ep, o.cp, o.tp, o.pp}) {
    if (__builtin_mul_overflow(ranks, size, &ranks)) return std::nullopt;
  }
  return ranks;
}

int run(const Options& o) {
  torch::set_num_threads(o.threads);
  // The layout first: where it does not fit the job, the other flags' checks (the batch split
  // over --dp, --tp against --heads) would name a symptom of it.
  auto world = ddp::init_process_group();
  const auto ranks = layout_ranks(o);
  if (ranks != world->size()) {
    const std::string product = ranks ? fmt::format("{}", *ranks) : "more than 2^63";
    throw ddp::ConfigError(fmt::format(
        "--dp {} x{}{} --tp {} x --pp {} = {} ranks, but the job has {}: their product must be "
        "the job's world size{}",
        o.dp, o.ep > 1 ? fmt::format(" --ep {} x", o.ep) : "",
        o.cp > 1 ? fmt::format(" --cp {} x", o.cp) : "", o.tp, o.pp, product, world->size(),
        ranks && *ranks <= std::numeric_limits<int>::max()
            ? fmt::format(" (or launch that many: ddprun --nproc-per-node {})", *ranks)
            : ""));
  }
  const std::string text = read_text(o);
  const std::set<char> chars(text.begin(), text.end());
  const std::int64_t vocab = padded_vocabulary(static_cast<std::int64_t>(chars.size()), o);
  check_options(o, text, vocab);

  const auto dtype = o.dtype == "float64" ? torch::kFloat64 : torch::kFloat32;
  // With experts: ep beside dp, and the group of the dp x ep ranks that split the batch (the
  // data mesh lays the same ranks out with dp and ep merged, its rank order the batch's).
  // With context parallelism the same for cp, whose ranks split each window's positions.
  const bool experts = o.moe_experts > 0, context = o.cp > 1;
  const ddp::DeviceMesh mesh =
      experts   ? ddp::DeviceMesh({{"pp", o.pp}, {"dp", o.dp}, {"ep", o.ep}, {"tp", o.tp}}, world)
      : context ? ddp::DeviceMesh({{"pp", o.pp}, {"dp", o.dp}, {"cp", o.cp}, {"tp", o.tp}}, world)
                : ddp::DeviceMesh({{"pp", o.pp}, {"dp", o.dp}, {"tp", o.tp}}, world);
  std::shared_ptr<ddp::ProcessGroup> data_group;
  if (experts || context) {
    data_group = ddp::DeviceMesh({{"pp", o.pp}, {"data", o.dp * o.ep * o.cp}, {"tp", o.tp}}, world)
                     .group("data");
  }

  std::map<char, std::int64_t> id_of;
  for (const char c : chars)
    id_of.emplace(c, static_cast<std::int64_t>(id_of.size()));
  std::vector<std::int64_t> ids;
  ids.reserve(text.size());
  for (const char c : text)
    ids.push_back(id_of.at(c));
  const auto corpus = torch::tensor(ids, torch::kInt64);

  // What the process holds before the model (libtorch, the text): the baseline of peak_added_mb.
  const double before_model_mib = resident_mib("VmRSS");
  const train_gpt::TrainerConfig config{.shape = {.vocab = vocab,
                                                  .hidden = o.hidden,
                                                  .heads = o.heads,
                                                  .block_size = o.block_size,
                                                  .layers = o.layers,
                                                  .dtype = dtype,
                                                  .moe_experts = o.moe_experts,
                                                  .top_k = o.top_k,
                                                  .capacity_factor = o.capacity_factor,
                                                  .aux_weight = o.moe_aux_weight / o.microbatches},
                                        .lr = o.lr,
                                        .schedule = o.schedule,
                                        .virtual_stages = o.virtual_stages,
                                        .microbatches = o.microbatches,
                                        .activation_checkpointing = o.activation_checkpointing,
                                        .fsdp_low_memory = o.fsdp_low_memory,
                                        .checkpoint = o.checkpoint,
                                        .data = data_group,
                                        .cp = context ? mesh.group("cp") : nullptr};
  auto trainer = o.fsdp ? train_gpt::make_fsdp_trainer(mesh, config)
                        : train_gpt::make_pipeline_trainer(mesh, config);
  // The peak of building the model (and sharding it, with --fsdp), before any step.
  const double built_peak_mib = resident_mib("VmHWM");

  ddp::TrainProgress progress;
  if (o.resume) {
    progress = trainer->load();
    // No step would run, and the final line would report a loss that no step computed. Every
    // rank loaded the same step, so every rank refuses alike.
    if (progress.global_step >= o.steps) {
      throw ddp::ConfigError(fmt::format(
          "--resume: the checkpoint in '{}' is at step {} already and --steps is {}: nothing to "
          "run (--steps counts from the start: pass more than {})",
          o.checkpoint, progress.global_step, o.steps, progress.global_step));
    }
    ddp::print_main_line(
        fmt::format("resuming from {} at step {}", o.checkpoint, progress.global_step));
  }

  // This rank's rows: its place among the dp (x ep) ranks.
  const std::int64_t rows = o.batch_size / o.dp / o.ep;
  const std::int64_t first_row =
      rows *
      (experts ? mesh.coordinate("dp") * o.ep + mesh.coordinate("ep") : mesh.coordinate("dp"));
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
    auto inputs = mine.narrow(1, 0, o.block_size), targets = mine.narrow(1, 1, o.block_size);
    if (context) {  // this cp rank's positions of each window
      inputs = ddp::context_parallel_shard(inputs, 1, *mesh.group("cp"));
      targets = ddp::context_parallel_shard(targets, 1, *mesh.group("cp"));
    }
    loss = trainer->step(inputs.contiguous(), targets.contiguous());
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
      trainer->save(progress);
    }
    if ((step + 1) % o.log_every == 0)
      ddp::print_main_line(fmt::format("step {} loss {:.6f}", step + 1, loss));
  }
  if (!step_ms.empty()) {
    std::sort(step_ms.begin(), step_ms.end());
    const double median = step_ms[step_ms.size() / 2];
    const double peak_mib = resident_mib("VmHWM");
    auto peaks =
        torch::tensor({peak_mib, peak_mib - before_model_mib, built_peak_mib - before_model_mib},
                      torch::kFloat64);
    ddp::all_reduce(peaks, ddp::ReduceOp::kMax, *world);  // the largest rank's
    ddp::print_main_line(fmt::format(
        "median_step_ms={:.3f} samples_per_s={:.1f} peak_rss_mb={:.1f} peak_added_mb={:.1f} "
        "build_added_mb={:.1f}",
        median, static_cast<double>(o.batch_size) * 1000.0 / median, peaks[0].item<double>(),
        peaks[1].item<double>(), peaks[2].item<double>()));
  }
  const double sum = trainer->parameter_sum();
  ddp::print_main_line(fmt::format("final loss={:.15g} param_sum={:.15g}", loss, sum));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"train-gpt: a character-level GPT with data, tensor and pipeline parallelism"};
  // Whole-number flags: CLI::PositiveNumber printed its range as "0.000000 to 1797693134...".
  const auto positive_int = CLI::Range(1, std::numeric_limits<int>::max());
  const auto size = CLI::Range(std::int64_t{1}, kMaxSize);
  app.add_option("--dp", o.dp, "data-parallel replicas (dp x tp x pp = the world size)")
      ->check(positive_int);
  app.add_option("--tp", o.tp,
                 "tensor-parallel ranks per layer (divides the heads and the vocabulary)")
      ->check(positive_int);
  app.add_option("--pp", o.pp, "pipeline stages")->check(positive_int);
  app.add_option("--microbatches", o.microbatches, "micro-batches per step and replica")
      ->check(positive_int);
  app.add_option("--schedule", o.schedule,
                 "gpipe, 1f1b, interleaved (--virtual-stages chunks per pipeline rank) or "
                 "zero-bubble (backward split into input and weight passes)")
      ->check(CLI::IsMember({"gpipe", "1f1b", "interleaved", "zero-bubble"}));
  app.add_option("--virtual-stages", o.virtual_stages,
                 "model chunks per pipeline rank (--schedule interleaved; divides --layers / --pp)")
      ->check(positive_int);
  app.add_option("--steps", o.steps,
                 "optimizer steps (in all: a resumed run counts from the start)")
      ->check(positive_int);
  app.add_option("--log-every", o.log_every, "print the loss every N steps")->check(positive_int);
  app.add_option("--seed", o.seed, "draws the batches")->check(ddp_programs::kUint64);
  app.add_option("--dtype", o.dtype, "float32 or float64")
      ->check(CLI::IsMember({"float32", "float64"}));
  app.add_option("--data", o.data,
                 fmt::format("a text file (default: {}, or a generated text where it is missing)",
                             kDefaultData))
      ->check(ddp_programs::kReadableFile);
  app.add_option("--layers", o.layers, "transformer blocks")
      ->check(CLI::Range(1, static_cast<int>(kMaxSize)));
  app.add_option("--batch-size", o.batch_size, "sequences per step (all replicas together)")
      ->check(CLI::Range(std::int64_t{1}, kMaxBatch));
  app.add_option("--lr", o.lr, "AdamW's learning rate")
      ->check(ddp_programs::positive_at_most(10.0));
  app.add_option("--time-after", o.time_after,
                 "time the steps after this many and print median_step_ms and the largest "
                 "rank's peak memory (benchmarks)")
      ->check(CLI::Range(0, std::numeric_limits<int>::max()));
  app.add_option("--vocab-at-least", o.vocab_at_least,
                 "pad the vocabulary to at least this many entries (benchmarks)")
      ->check(CLI::Range(std::int64_t{0}, kMaxSize));
  app.add_option("--hidden", o.hidden, "model width (divisible by --heads)")->check(size);
  app.add_option("--heads", o.heads, "attention heads (divisible by --tp)")->check(size);
  app.add_option("--block-size", o.block_size,
                 "characters per sequence (the text must be longer than this + 1)")
      ->check(size);
  app.add_option("--threads", o.threads, "torch threads per rank")->check(ddp_programs::kThreads);
  app.add_option("--checkpoint", o.checkpoint,
                 "a folder for the model and optimizer, in PyTorch's distributed checkpoint format "
                 "(with --fsdp: a ShardedTrainState per tp rank); saved at the end");
  app.add_option("--checkpoint-every", o.checkpoint_every, "also save every N steps")
      ->check(CLI::Range(0, std::numeric_limits<int>::max()));
  app.add_flag("--activation-checkpointing", o.activation_checkpointing,
               "keep each block's input only and recompute its activations in backward");
  app.add_flag("--fsdp", o.fsdp,
               "shard the model over --dp with FSDP (FULL_SHARD), each block built and sharded in "
               "turn (with --tp; --pp 1)");
  app.add_flag("--fsdp-low-memory", o.fsdp_low_memory,
               "with --fsdp: no gather or reduction in flight, each parameter's gradient reduced "
               "and freed as soon as it is ready (less memory, no overlap)");
  app.add_option("--moe-experts", o.moe_experts,
                 "a mixture of this many experts in place of each block's MLP (0: the MLP)")
      ->check(CLI::Range(std::int64_t{0}, kMaxSize));
  app.add_option("--top-k", o.top_k, "experts per token (with --moe-experts)")
      ->check(CLI::Range(std::int64_t{1}, kMaxSize));
  app.add_option("--ep", o.ep,
                 "ranks the experts are split over (dp x ep x tp x pp = the world size)")
      ->check(positive_int);
  app.add_option("--cp", o.cp,
                 "ranks each window's positions are split over, attention by ring attention "
                 "(dp x ep x cp x tp x pp = the world size)")
      ->check(positive_int);
  app.add_option("--capacity-factor", o.capacity_factor,
                 "each expert takes at most ceil(factor x tokens x k / E) of a step's tokens, the "
                 "rest dropped (0: no limit)")
      ->check(CLI::Range(0.0, 1e6));
  app.add_option("--moe-aux-weight", o.moe_aux_weight, "the load-balancing loss's weight")
      ->check(CLI::Range(0.0, 1e6));
  app.add_flag("--resume", o.resume,
               "continue from --checkpoint, at any --dp x --tp x --pp, with or without --fsdp");
  if (const auto code = ddp_programs::parse_command_line(app, argc, argv, "train-gpt")) {
    return *code;
  }
  o.data_given = app.count("--data") > 0;
  try {
    return run(o);
  } catch (const std::exception& e) {
    fmt::print(stderr, "train-gpt: {}\n", e.what());
    return 1;
  }
}
