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
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <torch/torch.h>
#include <CLI/CLI.hpp>

#include "ddp/error.h"
#include "ddp/init.h"
#include "ddp/torch/checkpoint.h"
#include "ddp/torch/data_loader_sampler.h"
#include "ddp/torch/distributed_data_parallel.h"
#include "ddp/torch/grad_scaler.h"

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
    std::ifstream in(path, std::ios::binary);
    if (!in) throw ddp::ConfigError(fmt::format("--data {}: cannot read it", path));
    const std::string text{std::istreambuf_iterator<char>(in), {}};
    if (static_cast<std::int64_t>(text.size()) <= block_size + 1) {
      throw ddp::ConfigError(fmt::format("--data {}: {} characters, fewer than --block-size {} + 2",
                                         path, text.size(), block_size));
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
    torch::manual_seed(static_cast<std::uint64_t>(options.seed));
    GPT gpt(options);
    // The optimizer holds the module's own tensors, which are also the wrapper's parameters.
    optimizer_ = std::make_unique<torch::optim::AdamW>(
        gpt->parameters(), torch::optim::AdamWOptions(options.learning_rate));
    // Load the snapshot before wrapping, on every rank: every rank resumes the same state.
    if (!options.snapshot.empty() && std::filesystem::exists(options.snapshot)) {
      const auto info = ddp::load_checkpoint(options.snapshot, *gpt, *optimizer_, "char-gpt");
      first_epoch_ = static_cast<int>(info.epoch) + 1;
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
  app.add_option("--data", options.data, "a text file to learn")->capture_default_str();
  app.add_option("--snapshot", options.snapshot,
                 "snapshot file: written by rank 0 after each epoch, resumed from when present");
  app.add_option("--epochs", options.epochs, "epochs")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--max-steps", options.max_steps, "at most this many steps per epoch (0: all)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--batch-size", options.batch_size, "per rank")->check(CLI::PositiveNumber);
  app.add_option("--block-size", options.block_size, "context length")->check(CLI::PositiveNumber);
  app.add_option("--layers", options.layers, "transformer blocks")->check(CLI::PositiveNumber);
  app.add_option("--lr", options.learning_rate, "AdamW learning rate")->check(CLI::PositiveNumber);
  app.add_option("--grad-clip", options.grad_clip, "gradient norm clip")
      ->check(CLI::PositiveNumber);
  app.add_flag("--amp", options.amp, "bf16 autocast for the forward");
  CLI11_PARSE(app, argc, argv);
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
