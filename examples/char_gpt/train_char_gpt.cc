// train-char-gpt: PyTorch's distributed/minGPT-ddp example, ported to C++ with ddp.
//
//   ddprun --standalone --nproc-per-node 2 train-char-gpt --data input.txt --snapshot gpt.pt
//   torchrun --nproc-per-node 2 --no-python train-char-gpt ...   (torchrun's defaults work too)
//
// A character-level GPT trained on a text file: every rank reads the whole text, trains on its
// DistributedSampler share through libtorch's DataLoader (ddp::DataLoaderSampler), with the model
// held by a Trainer as a ddp::DistributedDataParallel member, AdamW, gradient clipping, optional
// bf16 autocast, and a snapshot that rank 0 writes after each epoch and every rank loads before
// wrapping (so a restarted job resumes at the next epoch). docs/porting.md walks through it next
// to the Python original. Rank 0 prints one line per epoch and finally "final_loss=<loss>".
// Every flag is range-checked: a refusal names the flag, its value and what would be valid, and
// exits 1 (as any other error).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <limits>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <torch/torch.h>
#include <CLI/CLI.hpp>

#include "common/program_options.h"
#include "ddp/error.h"
#include "ddp/runtime/init.h"
#include "ddp/torch/checkpoint/checkpoint.h"
#include "ddp/torch/ddp/distributed_data_parallel.h"
#include "ddp/torch/ddp/grad_scaler.h"
#include "ddp/torch/samplers/data_loader_sampler.h"

namespace {

struct Options {
  std::string data = "/usr/share/common-licenses/GPL-3";
  std::string snapshot;  // empty: no snapshots
  int epochs = 2;
  std::int64_t max_steps = 0;  // > 0: at most this many steps per epoch (smoke runs)
  std::int64_t batch_size = 16;
  std::int64_t block_size = 32;
  std::int64_t embedding = 64;
  std::int64_t heads = 4;
  std::int64_t layers = 2;
  double learning_rate = 3e-3;
  double grad_clip = 1.0;
  bool amp = false;
  std::uint64_t seed = 42;
};

// The text as one sequence of character ids; sample i is the block starting at i and the same
// block shifted by one (the next character of each position).
class CharDataset : public torch::data::datasets::Dataset<CharDataset> {
 public:
  CharDataset(const std::string& path, std::int64_t block_size) : block_size_(block_size) {
    const std::string text = ddp_programs::read_whole_file("--data", path);
    if (static_cast<std::int64_t>(text.size()) <= block_size + 1) {
      throw ddp::ConfigError(fmt::format(
          "--block-size {}: --data '{}' has {} characters, but it must be longer than the block "
          "size + 1 (at least {}): use a smaller --block-size or a longer text",
          block_size, path, text.size(), block_size + 2));
    }
    std::vector<std::int64_t> ids(text.size());
    for (std::size_t i = 0; i < text.size(); ++i)
      ids[i] = static_cast<unsigned char>(text[i]);
    ids_ = torch::tensor(ids, torch::kInt64);
  }
  torch::data::Example<> get(std::size_t index) override {
    const auto start = static_cast<std::int64_t>(index);
    return {ids_.narrow(0, start, block_size_), ids_.narrow(0, start + 1, block_size_)};
  }
  torch::optional<std::size_t> size() const override {
    return static_cast<std::size_t>(ids_.size(0) - block_size_ - 1);
  }
  static constexpr std::int64_t kVocabulary = 256;  // bytes

 private:
  std::int64_t block_size_;
  torch::Tensor ids_;
};

struct BlockImpl : torch::nn::Module {
  BlockImpl(std::int64_t embedding, std::int64_t heads)
      : heads(heads),
        ln1(register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({embedding})))),
        qkv(register_module("qkv", torch::nn::Linear(embedding, 3 * embedding))),
        proj(register_module("proj", torch::nn::Linear(embedding, embedding))),
        ln2(register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({embedding})))),
        fc(register_module("fc", torch::nn::Linear(embedding, 4 * embedding))),
        out(register_module("out", torch::nn::Linear(4 * embedding, embedding))) {}

  torch::Tensor forward(torch::Tensor x) {
    const auto batch = x.size(0), time = x.size(1), channels = x.size(2);
    auto parts = qkv(ln1(x)).chunk(3, /*dim=*/2);
    const auto split = [&](const torch::Tensor& t) {
      return t.view({batch, time, heads, channels / heads}).transpose(1, 2);
    };
    auto q = split(parts[0]), k = split(parts[1]), v = split(parts[2]);
    auto scores = torch::matmul(q, k.transpose(-2, -1)) / std::sqrt(double(channels / heads));
    const auto causal = torch::ones({time, time}, torch::kBool).tril().logical_not();
    scores = scores.masked_fill(causal, -std::numeric_limits<float>::infinity());
    auto attended = torch::matmul(torch::softmax(scores, -1), v);
    x = x + proj(attended.transpose(1, 2).contiguous().view({batch, time, channels}));
    return x + out(torch::gelu(fc(ln2(x))));
  }

  std::int64_t heads;
  torch::nn::LayerNorm ln1;
  torch::nn::Linear qkv, proj;
  torch::nn::LayerNorm ln2;
  torch::nn::Linear fc, out;
};
TORCH_MODULE(Block);

struct GPTImpl : torch::nn::Module {
  GPTImpl(const Options& o)
      : tokens(
            register_module("tokens", torch::nn::Embedding(CharDataset::kVocabulary, o.embedding))),
        positions(register_parameter("positions", torch::zeros({o.block_size, o.embedding}))),
        blocks(register_module("blocks", torch::nn::Sequential())),
        ln(register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({o.embedding})))),
        head(register_module("head", torch::nn::Linear(o.embedding, CharDataset::kVocabulary))) {
    for (std::int64_t i = 0; i < o.layers; ++i)
      blocks->push_back(Block(o.embedding, o.heads));
  }
  torch::Tensor forward(torch::Tensor ids) {
    auto x = tokens(ids) + positions.narrow(0, 0, ids.size(1));
    return head(ln(blocks->forward(x)));
  }

  torch::nn::Embedding tokens;
  torch::Tensor positions;
  torch::nn::Sequential blocks;
  torch::nn::LayerNorm ln;
  torch::nn::Linear head;
};
TORCH_MODULE(GPT);

// minGPT-ddp's Trainer: the wrapped model is a member, the loader deals this rank's share.
class Trainer {
 public:
  Trainer(const Options& options, std::shared_ptr<ddp::ProcessGroup> group)
      : options_(options),
        group_(std::move(group)),
        dataset_(options.data, options.block_size),
        sampler_(dataset_.size().value(), *group_, {.shuffle = true, .seed = options.seed}) {
    check_fits_in_memory();
    torch::manual_seed(static_cast<std::uint64_t>(options.seed));
    GPT gpt(options);
    // The optimizer holds the module's own tensors, which are also the wrapper's parameters.
    optimizer_ = std::make_unique<torch::optim::AdamW>(
        gpt->parameters(), torch::optim::AdamWOptions(options.learning_rate));
    // Load the snapshot before wrapping, on every rank: every rank resumes the same state.
    if (!options.snapshot.empty() && std::filesystem::exists(options.snapshot)) {
      const auto info = ddp::load_checkpoint(options.snapshot, *gpt, *optimizer_, "char-gpt");
      first_epoch_ = static_cast<int>(info.epoch) + 1;
      // No epoch would run, and the final line would report a loss that no step computed. Every
      // rank loaded the same snapshot, so every rank refuses alike.
      if (first_epoch_ >= options.epochs) {
        throw ddp::ConfigError(fmt::format(
            "--epochs {}: the snapshot '{}' has trained epochs 0 to {} already: nothing to run "
            "(--epochs counts from the start: pass {} or more to train on from it)",
            options.epochs, options.snapshot, info.epoch, first_epoch_ + 1));
      }
      if (group_->rank() == 0) {
        fmt::print("resuming from snapshot {} at epoch {}\n", options.snapshot, first_epoch_);
      }
    }
    model_ = ddp::DistributedDataParallel(gpt, group_);
    loader_ =
        torch::data::make_data_loader(dataset_.map(torch::data::transforms::Stack<>()), sampler_,
                                      torch::data::DataLoaderOptions(options.batch_size));
  }

  // Returns the last epoch's mean loss over this rank's batches.
  double train() {
    double mean_loss = std::nan("");
    for (int epoch = first_epoch_; epoch < options_.epochs; ++epoch) {
      sampler_.set_epoch(static_cast<std::uint64_t>(epoch));
      double total = 0;
      std::int64_t steps = 0;
      for (auto& batch : *loader_) {
        if (options_.max_steps > 0 && steps == options_.max_steps) break;
        total += step(batch.data, batch.target);
        ++steps;
      }
      mean_loss = total / static_cast<double>(std::max<std::int64_t>(steps, 1));
      if (group_->rank() == 0) {
        fmt::print("epoch {} steps {} loss {:.4f}\n", epoch, steps, mean_loss);
        std::fflush(stdout);
        if (!options_.snapshot.empty()) {
          ddp::save_checkpoint(options_.snapshot, *model_->module(), *optimizer_,
                               {.epoch = epoch, .tag = "char-gpt"});
        }
      }
    }
    return mean_loss;
  }

 private:
  // What a rank holds at once, at the least: the model's parameters (fp32), one layer's attention
  // scores of one batch (the loader deals at most this rank's share of the samples) and the text
  // as ids (an int64 vector and tensor). AdamW's state, gradients and other activations come on
  // top.
  void check_fits_in_memory() const {
    const double e = static_cast<double>(options_.embedding);
    const double t = static_cast<double>(options_.block_size);
    const double parameters = 2.0 * CharDataset::kVocabulary * e + t * e +
                              static_cast<double>(options_.layers) * (12.0 * e * e + 13.0 * e);
    const auto samples = static_cast<std::int64_t>(dataset_.size().value());
    const auto share = (samples + group_->size() - 1) / group_->size();
    const double rows = static_cast<double>(std::min(options_.batch_size, share));
    const double scores = rows * static_cast<double>(options_.heads) * t * t;
    ddp_programs::check_fits_in_memory(
        4.0 * (parameters + scores) + 16.0 * static_cast<double>(samples),
        fmt::format("--layers {} with --block-size {} and --batch-size {} ({:.3g} parameters, "
                    "attention scores of {:.3g} elements per layer)",
                    options_.layers, options_.block_size, options_.batch_size, parameters, scores));
  }

  double step(const torch::Tensor& ids, const torch::Tensor& targets) {
    optimizer_->zero_grad();
    torch::Tensor loss;
    {
      ddp::AutocastGuard autocast(torch::kBFloat16, options_.amp);
      const auto logits = model_->forward(ids);
      loss = torch::nn::functional::cross_entropy(
          logits.view({-1, logits.size(-1)}).to(torch::kFloat), targets.reshape({-1}));
    }
    loss.backward();
    torch::nn::utils::clip_grad_norm_(model_->parameters(), options_.grad_clip);
    optimizer_->step();
    return loss.item<double>();
  }

  Options options_;
  std::shared_ptr<ddp::ProcessGroup> group_;
  CharDataset dataset_;
  ddp::DataLoaderSampler sampler_;
  ddp::DistributedDataParallel<GPT> model_{nullptr};
  std::unique_ptr<torch::optim::AdamW> optimizer_;
  std::unique_ptr<torch::data::StatelessDataLoader<
      torch::data::datasets::MapDataset<CharDataset, torch::data::transforms::Stack<>>,
      ddp::DataLoaderSampler>>
      loader_;
  int first_epoch_ = 0;
};

}  // namespace

int main(int argc, char** argv) {
  Options options;
  CLI::App app{"train-char-gpt: minGPT-ddp ported to C++ with ddp (run it under ddprun)"};
  // Far above anything this example trains, low enough that no product of them overflows (the
  // memory they need together is checked against the machine's).
  constexpr std::int64_t kMaxSize = std::int64_t{1} << 20;
  app.add_option("--data", options.data, "a text file to learn")
      ->check(ddp_programs::kReadableFile)
      ->capture_default_str();
  app.add_option("--snapshot", options.snapshot,
                 "snapshot file: written by rank 0 after each epoch, resumed from when present");
  app.add_option("--epochs", options.epochs, "epochs (in all: a resumed run counts from the start)")
      ->check(CLI::Range(1, 1'000'000))
      ->capture_default_str();
  app.add_option("--max-steps", options.max_steps, "at most this many steps per epoch (0: all)")
      ->check(CLI::Range(std::int64_t{0}, std::numeric_limits<std::int64_t>::max()));
  app.add_option("--batch-size", options.batch_size, "per rank")
      ->check(CLI::Range(std::int64_t{1}, kMaxSize));
  app.add_option("--block-size", options.block_size,
                 "context length (the text must be longer than this + 1)")
      ->check(CLI::Range(std::int64_t{1}, kMaxSize));
  app.add_option("--layers", options.layers, "transformer blocks")
      ->check(CLI::Range(std::int64_t{1}, kMaxSize));
  app.add_option("--lr", options.learning_rate, "AdamW learning rate")
      ->check(ddp_programs::positive_at_most(10.0));
  app.add_option("--grad-clip", options.grad_clip, "gradient norm clip")
      ->check(ddp_programs::kPositiveFinite);
  app.add_flag("--amp", options.amp, "bf16 autocast for the forward");
  if (const auto code = ddp_programs::parse_command_line(app, argc, argv, "train-char-gpt")) {
    return *code;
  }
  // A snapshot path that cannot be written failed only after the first epoch's training.
  if (!options.snapshot.empty()) {
    namespace fs = std::filesystem;
    const fs::path snapshot(options.snapshot);
    const auto folder = snapshot.has_parent_path() ? snapshot.parent_path() : fs::path(".");
    std::string problem;
    if (fs::exists(snapshot) && !fs::is_regular_file(snapshot)) {
      problem = "it exists and is not a regular file";
    } else if (fs::exists(folder) && !fs::is_directory(folder)) {
      problem = fmt::format("'{}' is not a folder", folder.string());
    } else if (!fs::exists(folder)) {
      problem = fmt::format("its folder '{}' does not exist", folder.string());
    }
    if (!problem.empty()) {
      std::cerr << fmt::format("train-char-gpt: --snapshot '{}': {}\n", options.snapshot, problem);
      return 1;
    }
  }
  try {
    torch::set_num_threads(1);
    auto group = ddp::init_process_group();
    Trainer trainer(options, group);
    const double loss = trainer.train();
    if (group->rank() == 0) fmt::print("final_loss={:.4f}\n", loss);
    ddp::destroy_process_group();
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "train-char-gpt: " << e.what() << "\n";
    return 1;
  }
}
