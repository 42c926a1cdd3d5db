// train-fashion-mnist: the main job. Trains a small CNN (or a wide MLP) on Fashion-MNIST with
// DistributedDataParallel, one process per rank:
//
//   ddprun --standalone --nproc-per-node 2 train-fashion-mnist             # defaults: >= 0.91
//   ddprun --standalone --nproc-per-node 2 train-fashion-mnist --model mlp --epochs 5
//
// Every rank loads the whole dataset (about 200 MB as floats), trains on its DistributedSampler
// share, and averages gradients through DDP. Rank 0 alone evaluates on the full test set after
// each epoch (no collectives there, so no rank can wait on an evaluation that others skip),
// prints the progress, and writes the checkpoint. The last line rank 0 prints starts with
// "final test_accuracy=". Exit status 0 on success, 1 on any error (the message says what).
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <functional>
#include <iostream>
#include <limits>
#include <optional>
#include <string>
#include <system_error>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/torch.h>
#include <CLI/CLI.hpp>

#include "common/program_options.h"
#include "ddp/comm/trace.h"
#include "ddp/error.h"
#include "ddp/runtime/init.h"
#include "ddp/torch/api/join.h"
#include "ddp/torch/checkpoint/checkpoint.h"
#include "ddp/torch/checkpoint/train_state.h"
#include "ddp/torch/core/version.h"
#include "ddp/torch/ddp/distributed_data_parallel.h"
#include "ddp/torch/ddp/grad_scaler.h"
#include "ddp/torch/ddp/hooks/comm_hook_by_name.h"
#include "ddp/torch/ddp/sync_batch_norm.h"
#include "ddp/torch/formats/optimizer_state_dict.h"
#include "ddp/torch/formats/state_dict.h"
#include "ddp/torch/fsdp/fully_sharded_data_parallel.h"
#include "ddp/torch/samplers/distributed_sampler.h"
#include "ddp/torch/zero/zero_redundancy_optimizer.h"
#include "idx_reader.h"
#include "metrics_log.h"
#include "progress_bar.h"
namespace {

// Fashion-MNIST's pixel mean and standard deviation (of x / 255, over the training set).
constexpr double kPixelMean = 0.2860;
constexpr double kPixelStd = 0.3530;

struct Options {
  std::string model = "cnn";
  int epochs = 4;
  int batch_size = 64;  // per rank
  // > 0: samples per optimizer step over every rank; each step accumulates global / (batch_size x
  // world size) micro-batches, so the optimizer sees the same batch whatever the world size.
  std::int64_t global_batch_size = 0;
  std::string optimizer = "sgd";           // sgd (with momentum) or adam
  std::string sharding = "ddp";            // ddp, zero1, zero2 or fsdp (docs/sharding.md)
  std::int64_t fsdp_min_params = 100'000;  // zero2/fsdp: parameters per unit (auto-wrap policy)
  double lr = 0.05;                        // for sgd; adam's default is kAdamDefaultLr
  double momentum = 0.9;
  double weight_decay = 5e-4;
  std::string schedule = "cosine";  // of the learning rate: cosine (to 0 at the end) or constant
  std::uint64_t seed = 42;
  std::string data_dir = fmnist::kDefaultDataDir;
  std::string checkpoint;
  bool resume = false;
  int threads = 0;              // 0 = OMP_NUM_THREADS, else 1
  std::size_t limit_train = 0;  // 0 = all
  std::size_t limit_test = 0;   // 0 = all
  int log_every = 100;          // batches; 0 = no progress lines
  bool uneven = false;          // no sampler padding, rank r skips r * uneven_skew batches
  int uneven_skew = 10;         // batches per epoch that each higher rank has fewer
  bool sync_bn = false;         // BatchNorm statistics over every rank's batch (SyncBatchNorm)
  std::string mixed_precision = "none";  // bf16: autocast forward, bf16 gradient reduction
  std::string metrics;                   // rank 0 writes JSON lines here (metrics_log.h)
  int checkpoint_every_steps = 0;        // > 0: a ddp::TrainState every N steps (mid-epoch resume)
  std::string comm_hook = "none";        // ddp::comm_hook_from_name's names
  int powersgd_rank = 4;
  std::int64_t powersgd_start_iter = 10;
  // State dicts that cross to and from PyTorch (docs/interop.md, train_fashion_mnist.py).
  std::string init_state_dict;         // the model starts from this Python-layout state dict
  std::string init_optimizer_state;    // the optimizer from this Python optimizer.state_dict()
  std::string export_state_dict;       // rank 0 writes the model's state dict here at the end
  std::string export_optimizer_state;  // and the optimizer's state dict here
  int start_epoch = 0;                 // > 0: the first epoch this run trains (a handed-over run)
};

// Batches per epoch of `rank`: its unpadded share with --uneven, less rank * uneven_skew (an
// imbalance like data-dependent filtering would make), at least one.
std::int64_t batches_of(const Options& options, std::size_t samples, int rank, int world_size) {
  const ddp::DistributedSampler sampler(samples, rank, world_size, {.pad = !options.uneven});
  const auto batch = static_cast<std::int64_t>(options.batch_size);
  const auto full = (static_cast<std::int64_t>(sampler.size()) + batch - 1) / batch;
  if (!options.uneven) return full;
  return std::max<std::int64_t>(1, full - static_cast<std::int64_t>(rank) * options.uneven_skew);
}

// Adam's usual rate (PyTorch's default); SGD's 0.05 would make Adam diverge.
constexpr double kAdamDefaultLr = 1e-3;

int default_threads() {
  if (const char* value = std::getenv("OMP_NUM_THREADS")) {
    try {
      const int threads = std::stoi(value);
      if (threads >= 1) return threads;
    } catch (const std::exception&) {
    }
  }
  return 1;
}

// The network: one type for both architectures so that one DDP instantiation serves both.
class NetImpl : public torch::nn::Module {
 public:
  explicit NetImpl(const std::string& kind) {
    namespace nn = torch::nn;
    if (kind == "cnn") {
      // Conv biases are left out: the BatchNorm that follows each conv has its own shift.
      layers_ = nn::Sequential(nn::Conv2d(nn::Conv2dOptions(1, 32, 3).padding(1).bias(false)),
                               nn::BatchNorm2d(32), nn::ReLU(), nn::MaxPool2d(2),
                               nn::Conv2d(nn::Conv2dOptions(32, 64, 3).padding(1).bias(false)),
                               nn::BatchNorm2d(64), nn::ReLU(), nn::MaxPool2d(2), nn::Flatten(),
                               nn::Linear(64 * 7 * 7, 128), nn::ReLU(), nn::Linear(128, 10));
    } else if (kind == "mlp") {
      layers_ = nn::Sequential(nn::Flatten(), nn::Linear(784, 4096), nn::ReLU(),
                               nn::Linear(4096, 4096), nn::ReLU(), nn::Linear(4096, 10));
    } else {
      throw ddp::ConfigError(fmt::format("--model {}: unknown model; use cnn or mlp", kind));
    }
    register_module("layers", layers_);
  }

  torch::Tensor forward(torch::Tensor x) { return layers_->forward(x); }
  // What FullyShardedDataParallel wraps (it runs a Sequential unit by unit).
  torch::nn::Sequential layers() const { return layers_; }

 private:
  torch::nn::Sequential layers_{nullptr};
};
TORCH_MODULE(Net);

// Images as normalised float tensors [N, 1, 28, 28] and labels as int64 [N].
struct TensorSplit {
  torch::Tensor images;
  torch::Tensor labels;
  std::int64_t size() const { return labels.size(0); }
};

TensorSplit to_tensors(fmnist::Split& split, std::size_t limit) {
  const auto count =
      static_cast<std::int64_t>(limit == 0 ? split.count : std::min(limit, split.count));
  const auto rows = static_cast<std::int64_t>(fmnist::kRows);
  const auto cols = static_cast<std::int64_t>(fmnist::kCols);
  auto images = torch::from_blob(split.pixels.data(), {count, 1, rows, cols}, torch::kUInt8)
                    .to(torch::kFloat32)
                    .div_(255.0)
                    .sub_(kPixelMean)
                    .div_(kPixelStd);
  auto labels = torch::from_blob(split.labels.data(), {count}, torch::kUInt8).to(torch::kInt64);
  return {images, labels};
}

// Test accuracy of `forward` (through `module`, which is put in evaluation mode meanwhile).
double evaluate(torch::nn::Module& module,
                const std::function<torch::Tensor(torch::Tensor)>& forward,
                const TensorSplit& test) {
  torch::NoGradGuard no_grad;
  module.eval();
  std::int64_t correct = 0;
  // Small batches: at 1,000 a convolution's buffers (100 MB) exceed glibc's mmap threshold, so
  // every batch maps and faults them in afresh; at 100 they are reused, and one evaluation of the
  // cnn takes 2.4 s instead of 6.1 (one thread, without ddprun's malloc tuning).
  constexpr std::int64_t kEvalBatch = 100;
  for (std::int64_t start = 0; start < test.size(); start += kEvalBatch) {
    const auto length = std::min(kEvalBatch, test.size() - start);
    const auto logits = forward(test.images.narrow(0, start, length));
    correct += logits.argmax(1).eq(test.labels.narrow(0, start, length)).sum().item<std::int64_t>();
  }
  module.train();
  return static_cast<double>(correct) / static_cast<double>(test.size());
}

// The learning rate of step `step` of `total_steps` (both counted over the whole run, so a resumed
// run continues the same curve). Annealing to zero over the run is what lets a few epochs reach
// the accuracy of many at a constant rate.
double learning_rate(const Options& options, std::int64_t step, std::int64_t total_steps) {
  if (options.schedule == "constant" || total_steps <= 0) return options.lr;
  constexpr double kPi = 3.14159265358979323846;
  const double progress = static_cast<double>(step) / static_cast<double>(total_steps);
  return options.lr * 0.5 * (1.0 + std::cos(kPi * progress));
}

// On a ZeroRedundancyOptimizer this sets the rate of its param_groups(); its step() passes it on.
void set_learning_rate(torch::optim::Optimizer& optimizer, double lr) {
  for (auto& group : optimizer.param_groups())
    group.options().set_lr(lr);
}

// The optimizer of --optimizer over the model's parameters; with --sharding zero1 each rank
// keeps the state of its shard only (ddp::ZeroRedundancyOptimizer, collective to build).
std::unique_ptr<torch::optim::Optimizer> make_optimizer(
    const Options& options, std::vector<torch::Tensor> parameters,
    const std::shared_ptr<ddp::ProcessGroup>& group) {
  const bool zero = options.sharding == "zero1";
  if (options.optimizer == "adam") {
    const auto defaults = torch::optim::AdamOptions(options.lr).weight_decay(options.weight_decay);
    if (zero)
      return std::make_unique<ddp::ZeroRedundancyOptimizer>(std::move(parameters), defaults, group);
    return std::make_unique<torch::optim::Adam>(std::move(parameters), defaults);
  }
  const auto defaults = torch::optim::SGDOptions(options.lr)
                            .momentum(options.momentum)
                            .weight_decay(options.weight_decay);
  if (zero)
    return std::make_unique<ddp::ZeroRedundancyOptimizer>(std::move(parameters), defaults, group);
  return std::make_unique<torch::optim::SGD>(std::move(parameters), defaults);
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// The folder of --checkpoint must exist and be writable before training starts, not only when
// the first epoch ends and rank 0 saves.
// `sharded`: --sharding zero2|fsdp, whose checkpoint is a folder (ddp::ShardedTrainState).
void check_checkpoint_folder(const std::string& checkpoint, bool sharded) {
  std::error_code is_folder_error;
  if (sharded) {
    std::error_code exists_error;
    if (std::filesystem::exists(checkpoint, exists_error) &&
        !std::filesystem::is_directory(checkpoint, is_folder_error)) {
      throw ddp::ConfigError(fmt::format(
          "--checkpoint {} is a file; with --sharding zero2 or fsdp the checkpoint is a folder "
          "of sharded checkpoints (ddp::ShardedTrainState): give a folder path",
          checkpoint));
    }
  } else if (std::filesystem::is_directory(checkpoint, is_folder_error)) {
    std::string stem = checkpoint;
    while (stem.size() > 1 && stem.back() == '/')
      stem.pop_back();
    throw ddp::ConfigError(fmt::format(
        "--checkpoint {} is a folder; give a file path such as {}/ck.pt", checkpoint, stem));
  }
  std::filesystem::path folder = std::filesystem::path(checkpoint).parent_path();
  if (folder.empty()) folder = ".";
  std::error_code error;
  if (!std::filesystem::is_directory(folder, error)) {
    throw ddp::ConfigError(fmt::format(
        "--checkpoint {}: the folder {} does not exist or is not a folder (create it first)",
        checkpoint, folder.string()));
  }
  if (::access(folder.c_str(), W_OK | X_OK) != 0) {
    throw ddp::ConfigError(fmt::format("--checkpoint {}: the folder {} is not writable ({})",
                                       checkpoint, folder.string(),
                                       std::generic_category().message(errno)));
  }
}

// The command line that builds an optimizer described as ddp's checkpoints describe it
// (OptimizerMismatchError), or the description itself for kinds this program does not build.
std::string optimizer_flags(const std::string& description) {
  if (description == "Adam") return "--optimizer adam";
  if (description == "SGD with momentum") return "--optimizer sgd";
  if (description == "SGD without momentum") return "--optimizer sgd --momentum 0";
  return description;
}

// Runs `load` (a resume from --checkpoint); an optimizer of another kind than the file's is
// named with the options that would fit it.
template <class Load>
auto resume_or_explain(const Options& options, const std::string& what, Load load) {
  try {
    return load();
  } catch (const ddp::OptimizerMismatchError& e) {
    const auto space = e.stored().find(' ');
    throw ddp::ConfigError(fmt::format(
        "{} {} holds an {} optimizer's state{}; this run uses {} ({}). Resume with {} or start "
        "without --resume",
        what, options.checkpoint, e.stored().substr(0, space),
        space == std::string::npos ? std::string() : " (" + e.stored().substr(space + 1) + ")",
        e.current(), optimizer_flags(e.current()), optimizer_flags(e.stored())));
  }
}

// A training state's sampler position counts samples of the saved run's shuffled order: over
// another number of training samples it points elsewhere (or past the end), so such a resume is
// refused. Files that did not record the size are checked as far as they can be.
void check_resumed_dataset(const Options& options, const ddp::TrainProgress& resumed,
                           std::uint64_t samples) {
  const std::string this_run =
      options.limit_train > 0 ? fmt::format("{} (--limit-train {})", samples, options.limit_train)
                              : fmt::format("{} (the whole training set)", samples);
  if (resumed.dataset_size != 0 && resumed.dataset_size != samples) {
    throw ddp::ConfigError(fmt::format(
        "the training state in {} was saved for {} training samples (at world size {}, epoch {}, "
        "{} samples into it); this run has {}. Its sampler position does not fit another "
        "dataset size: resume with the --limit-train it was saved with, or start without "
        "--resume",
        options.checkpoint, resumed.dataset_size, resumed.world_size, resumed.epoch + 1,
        resumed.epoch_offset, this_run));
  }
  if (resumed.epoch_offset > samples) {
    throw ddp::ConfigError(fmt::format(
        "the training state in {} is {} samples into epoch {}, past the {} training samples "
        "this run has{}; resume with the --limit-train it was saved with, or start without "
        "--resume",
        options.checkpoint, resumed.epoch_offset, resumed.epoch + 1, samples,
        options.limit_train > 0 ? fmt::format(" (--limit-train {})", options.limit_train) : ""));
  }
}

// The state dict options, before anything starts: files to read exist, folders to write exist,
// and the run can take them (the model must be whole on every rank: not zero2/fsdp; the
// optimizer state is Python's plain SGD or Adam layout: not a ZeRO shard).
void check_state_dict_options(const Options& options) {
  const bool any = !options.init_state_dict.empty() || !options.init_optimizer_state.empty() ||
                   !options.export_state_dict.empty() || !options.export_optimizer_state.empty();
  if (any && (options.sharding == "zero2" || options.sharding == "fsdp")) {
    throw ddp::ConfigError(fmt::format(
        "--init-from-state-dict, --init-optimizer-state, --export-state-dict and "
        "--export-optimizer-state need the whole model on every rank: --sharding ddp or zero1, "
        "not {}",
        options.sharding));
  }
  const bool optimizer_state =
      !options.init_optimizer_state.empty() || !options.export_optimizer_state.empty();
  if (optimizer_state && options.sharding == "zero1") {
    throw ddp::ConfigError(
        "--init-optimizer-state and --export-optimizer-state hold Python's plain optimizer "
        "layout: use them with --sharding ddp (a ZeroRedundancyOptimizer keeps only its shard)");
  }
  for (const auto& [flag, path] :
       {std::pair{"--init-from-state-dict", &options.init_state_dict},
        std::pair{"--init-optimizer-state", &options.init_optimizer_state}}) {
    std::error_code error;
    if (!path->empty() && !std::filesystem::is_regular_file(*path, error)) {
      throw ddp::ConfigError(
          fmt::format("{} {}: no such file (write one with Python's "
                      "torch.save(...state_dict(), PATH), or with this "
                      "program's --export-state-dict)",
                      flag, *path));
    }
  }
  for (const auto& [flag, path] :
       {std::pair{"--export-state-dict", &options.export_state_dict},
        std::pair{"--export-optimizer-state", &options.export_optimizer_state}}) {
    if (path->empty()) continue;
    std::error_code error;
    if (std::filesystem::is_directory(*path, error)) {
      throw ddp::ConfigError(
          fmt::format("{} {} is a folder; give the path of a file in it", flag, *path));
    }
    const auto folder = std::filesystem::absolute(*path).parent_path();
    if (!std::filesystem::is_directory(folder, error)) {
      throw ddp::ConfigError(
          fmt::format("{} {}: the folder {} does not exist", flag, *path, folder.string()));
    }
  }
  if (options.start_epoch != 0) {
    if (options.start_epoch < 1 || options.start_epoch > options.epochs) {
      throw ddp::ConfigError(fmt::format("--start-epoch {} is outside 1..--epochs ({})",
                                         options.start_epoch, options.epochs));
    }
    if (options.resume) {
      throw ddp::ConfigError(
          "--start-epoch continues a run handed over by state dicts; --resume takes its epoch "
          "from the checkpoint: use one of the two");
    }
  }
}

// Reports a failure of this rank and ends the process without unwinding (see run()): the
// error line, then the trace (DDP_TRACE) so far, then exit status 1.
[[noreturn]] void stop_now(const std::string& what) {
  std::fflush(stdout);
  std::cerr << "train-fashion-mnist: error: " << what << std::endl;
  if (ddp::trace_enabled()) {
    try {
      ddp::flush_trace();
    } catch (const std::exception& e) {
      std::cerr << "train-fashion-mnist: warning: " << e.what() << std::endl;
    }
  }
  std::_Exit(1);
}

int run(const Options& options) {
  const auto job_start = std::chrono::steady_clock::now();
  if (options.resume && options.checkpoint.empty()) {
    throw ddp::ConfigError("--resume needs --checkpoint PATH (the file to resume from)");
  }
  const bool fsdp = options.sharding == "zero2" || options.sharding == "fsdp";
  if (!options.checkpoint.empty()) check_checkpoint_folder(options.checkpoint, fsdp);
  check_state_dict_options(options);
  const bool train_state_file = options.checkpoint_every_steps > 0;
  if (train_state_file && options.checkpoint.empty()) {
    throw ddp::ConfigError("--checkpoint-every-steps needs --checkpoint PATH (where to write)");
  }
  if (train_state_file && options.uneven) {
    throw ddp::ConfigError(
        "--checkpoint-every-steps cannot be combined with --uneven (ranks make different numbers "
        "of steps there, so no single step marks a position of the whole job)");
  }
  if (options.global_batch_size > 0 && options.uneven) {
    throw ddp::ConfigError(
        "--global-batch-size cannot be combined with --uneven (the ranks make different numbers "
        "of micro-batches there)");
  }
  if (options.sharding != "ddp" && options.uneven) {
    throw ddp::ConfigError(fmt::format(
        "--sharding {} cannot be combined with --uneven in this program: it joins once over the "
        "whole run, and its sharded evaluation (zero2/fsdp) and checkpoints are collective, so a "
        "rank that finished early would evaluate while the others train (the library's Join "
        "takes ZeroRedundancyOptimizer and FullyShardedDataParallel: docs/sharding.md); use "
        "--sharding ddp with --uneven",
        options.sharding));
  }
  if (fsdp) {
    // FullyShardedDataParallel replaces DDP: what only DDP's reducer or a full local model offers
    // is named rather than silently dropped.
    const auto refuse = [&](bool given, const std::string& option, const std::string& why) {
      if (given) {
        throw ddp::ConfigError(
            fmt::format("--sharding {} cannot be combined with {}: {}; use --sharding ddp or zero1 "
                        "for it",
                        options.sharding, option, why));
      }
    };
    refuse(options.comm_hook != "none", "--comm-hook " + options.comm_hook,
           "comm hooks are DDP's; FullyShardedDataParallel reduce-scatters the gradients itself");
    refuse(options.sync_bn, "--sync-bn", "SyncBatchNorm has not been tried under it");
  }
  if (options.comm_hook != "none" && options.mixed_precision != "none") {
    throw ddp::ConfigError(fmt::format(
        "--comm-hook {} with --mixed-precision {}: the hook would replace the {} gradient "
        "reduction; use one of the two",
        options.comm_hook, options.mixed_precision, options.mixed_precision));
  }
  // Before loading the data, so that bad PowerSGD options fail at once.
  const auto hook = ddp::comm_hook_from_name(
      options.comm_hook,
      {.powersgd_rank = options.powersgd_rank, .powersgd_start_iter = options.powersgd_start_iter});
  torch::set_num_threads(options.threads > 0 ? options.threads : default_threads());
  // The files the run starts from, read and checked before the data loads (which takes seconds):
  // a damaged, hostile or mismatched file fails at once. The model's state is kept; the optimizer
  // file is loaded into a throwaway optimizer of the same model, which checks its shapes and
  // values, and again into the real one once the job has started. Before the seed is set: the
  // throwaway model draws from the generator.
  std::optional<ddp::StateDict> init_state;
  if (!options.init_state_dict.empty()) init_state = ddp::read_state_dict(options.init_state_dict);
  if (!options.init_optimizer_state.empty()) {
    Net probe(options.model);
    ddp::load_optimizer_state_dict(*make_optimizer(options, probe->parameters(), nullptr),
                                   options.init_optimizer_state);
  }
  torch::manual_seed(options.seed);

  // Load (and validate) the data before joining the job: a wrong --data-dir fails at once.
  auto dataset = fmnist::load_dataset(options.data_dir);
  if (options.limit_train > dataset.train.count) {
    throw ddp::ConfigError(fmt::format("--limit-train {} exceeds the {} training samples",
                                       options.limit_train, dataset.train.count));
  }
  const TensorSplit train = to_tensors(dataset.train, options.limit_train);
  if (options.limit_test > dataset.test.count) {
    throw ddp::ConfigError(fmt::format("--limit-test {} exceeds the {} test samples",
                                       options.limit_test, dataset.test.count));
  }
  const TensorSplit test = to_tensors(dataset.test, options.limit_test);
  dataset = {};  // the tensors own copies; free the bytes

  auto group = ddp::init_process_group();
  // From here on this process is one rank of a job. A failure on it (a checkpoint that cannot be
  // written, a collective that fails) is reported and ends the process at once: unwinding would
  // first destroy the group, whose closed connections make the peers fail and exit, often before
  // this rank, and the launcher would then name a peer as the rank that failed first.
  const auto in_job = [&]() -> int {
    const int rank = group->rank();
    const int world_size = group->size();
    // Micro-batches per optimizer step (1 unless --global-batch-size asks for more).
    std::int64_t accumulation = 1;
    if (options.global_batch_size > 0) {
      const std::int64_t per_pass = static_cast<std::int64_t>(options.batch_size) * world_size;
      if (options.global_batch_size % per_pass != 0) {
        throw ddp::ConfigError(fmt::format(
            "--global-batch-size {} is not a multiple of --batch-size {} x {} rank(s) = {}: every "
            "optimizer step must take whole micro-batches on every rank. Choose a global batch "
            "that this world size divides (an elastic job: one that every world size it may run "
            "at divides), or another --batch-size",
            options.global_batch_size, options.batch_size, world_size, per_pass));
      }
      accumulation = options.global_batch_size / per_pass;
    }
    const bool leader = rank == 0;
    std::optional<fmnist::MetricsLog> metrics;
    if (leader && !options.metrics.empty()) metrics.emplace(options.metrics);
    // A bar on a terminal; plain lines (unchanged) otherwise.
    std::optional<fmnist::ProgressBar> bar;
    if (leader && options.log_every > 0 && ::isatty(STDOUT_FILENO) == 1) bar.emplace();
    if (leader) {
      // First, so that a log says which libtorch (DDP_LIBTORCH=debian|pytorch) produced it.
      fmt::print("train-fashion-mnist: libtorch {}, {} ranks\n", ddp::libtorch_version(),
                 world_size);
    }

    Net net(options.model);
    // Before the optimizer and DDP, as in PyTorch (the conversion keeps the same tensors anyway).
    if (options.sync_bn) {
      ddp::convert_sync_batchnorm(net.ptr(), group);
      if (leader)
        fmt::print("BatchNorm statistics are synchronised across ranks (SyncBatchNorm)\n");
    }
    // zero2 = FSDP's SHARD_GRAD_OP, fsdp = FULL_SHARD; the optimizer then steps on the shards.
    std::optional<ddp::FullyShardedDataParallel> sharded;
    if (fsdp) {
      sharded.emplace(
          net->layers(), group,
          ddp::FsdpOptions{.sharding_strategy = options.sharding == "zero2"
                                                    ? ddp::ShardingStrategy::kShardGradOp
                                                    : ddp::ShardingStrategy::kFullShard,
                           .min_num_params = options.fsdp_min_params,
                           // --mixed-precision bf16: as DDP's, the forward under autocast and
                           // the gradients reduce-scattered in bf16 (FsdpMixedPrecision).
                           .mixed_precision = {.reduce_dtype = options.mixed_precision == "bf16"
                                                                   ? std::optional(torch::kBFloat16)
                                                                   : std::nullopt}});
    }
    const auto optimizer_owner =
        make_optimizer(options, sharded ? (*sharded)->parameters() : net->parameters(), group);
    torch::optim::Optimizer& optimizer = *optimizer_owner;
    // Rank 0 writes checkpoints; with ZeRO every rank first sends it its optimizer shard.
    auto* zero_optimizer = dynamic_cast<ddp::ZeroRedundancyOptimizer*>(optimizer_owner.get());
    const auto gather_optimizer_state = [&] {
      if (zero_optimizer) zero_optimizer->consolidate_state_dict(0);
    };

    int first_epoch = options.start_epoch > 0 ? options.start_epoch : 1;
    // Every rank loads the same files, so ranks agree before DDP's broadcast makes sure of it.
    if (init_state) {
      ddp::load_state_dict(ddp::state_dict(*net), *init_state, {}, options.init_state_dict);
      if (leader) fmt::print("model state from {}\n", options.init_state_dict);
    }
    if (!options.init_optimizer_state.empty()) {
      ddp::load_optimizer_state_dict(optimizer, options.init_optimizer_state);
      if (leader) fmt::print("optimizer state from {}\n", options.init_optimizer_state);
    }
    // With --checkpoint-every-steps the file is a ddp::TrainState (mid-epoch position included).
    ddp::TrainState train_state(*net, optimizer, {.tag = options.model});
    // zero2/fsdp: no rank holds the whole model, so the checkpoint is a folder of sharded ones
    // that every rank writes its part of (at every epoch's end, and with --checkpoint-every-steps
    // mid-epoch too), resumable at any world size.
    std::optional<ddp::ShardedTrainState> sharded_state;
    if (sharded)
      sharded_state.emplace(**sharded, optimizer, ddp::TrainStateOptions{.tag = options.model});
    const auto load_train_state = [&] {
      return sharded_state ? sharded_state->load(options.checkpoint)
                           : train_state.load(options.checkpoint);
    };
    std::optional<ddp::TrainProgress> resumed;
    if (options.resume && (train_state_file || sharded_state)) {
      // Under `ddprun --max-restarts`, every attempt runs the same command line: the first one
      // finds no file yet and starts from scratch. (A sharded state without latest.pt names the
      // folder as holding no checkpoint, unless the run saves every N steps.)
      const bool found =
          sharded_state
              ? !train_state_file ||
                    std::filesystem::exists(std::filesystem::path(options.checkpoint) / "latest.pt")
              : std::filesystem::exists(options.checkpoint);
      if (found) {
        resumed = resume_or_explain(options, "the training state in", load_train_state);
        check_resumed_dataset(options, *resumed, static_cast<std::uint64_t>(train.size()));
        first_epoch = static_cast<int>(resumed->epoch) + 1;
        if (leader) {
          fmt::print(
              "resumed from {} at epoch {}, {} samples into it, global step {} (saved at world "
              "size {}, now {})\n",
              options.checkpoint, first_epoch, resumed->epoch_offset, resumed->global_step,
              resumed->world_size, world_size);
        }
      } else if (leader) {
        fmt::print("no checkpoint at {} yet; starting from scratch\n", options.checkpoint);
      }
    } else if (options.resume) {
      // Every rank loads the same file, so ranks agree before DDP's broadcast makes sure of it.
      const auto info = resume_or_explain(options, "the checkpoint", [&] {
        return ddp::load_checkpoint(options.checkpoint, *net, optimizer, options.model);
      });
      first_epoch = static_cast<int>(info.epoch) + 1;
      if (leader) {
        fmt::print("resumed from {} after epoch {}; continuing at epoch {}\n", options.checkpoint,
                   info.epoch, first_epoch);
      }
    }
    const bool bf16 = options.mixed_precision == "bf16";
    ddp::DdpOptions ddp_options;
    if (bf16) ddp_options.reduce_dtype = torch::kBFloat16;
    std::optional<ddp::DistributedDataParallel<NetImpl>> ddp_model;
    if (!sharded) ddp_model.emplace(net.ptr(), group, ddp_options);
    if (hook.hook) (*ddp_model)->register_comm_hook(*hook.hook, options.comm_hook);
    const auto forward = [&](torch::Tensor x) {
      return sharded ? (*sharded)->forward(std::move(x)) : (*ddp_model)->forward(std::move(x));
    };
    // Gradient bytes the last step handed to collectives: DDP's reducer counts them; -1 where
    // nothing counts them (zero2/fsdp).
    const auto bytes_per_step = [&]() -> std::int64_t {
      return ddp_model
                 ? static_cast<std::int64_t>((*ddp_model)->reducer().last_timeline().bytes_sent)
                 : -1;
    };
    // With FSDP every rank evaluates (its forward is collective); otherwise rank 0 alone.
    const auto evaluate_model = [&] {
      return sharded ? evaluate(**sharded, forward, test)
                     : evaluate(
                           *net, [&](torch::Tensor x) { return net->forward(std::move(x)); }, test);
    };

    const auto samples = static_cast<std::size_t>(train.size());
    ddp::DistributedSampler sampler(
        samples, *group, {.shuffle = true, .seed = options.seed, .pad = !options.uneven});
    const auto batch = static_cast<std::int64_t>(options.batch_size);
    const auto per_rank = static_cast<std::int64_t>(sampler.size());
    const std::int64_t batches = batches_of(options, samples, rank, world_size);
    // The learning rate follows the step count of the rank with the most batches (rank 0), so that
    // ranks at the same step use the same rate also with --uneven.
    const std::int64_t batches_most = batches_of(options, samples, 0, world_size);
    // The schedule counts optimizer steps: with accumulation, one per `accumulation` batches.
    const std::int64_t total_steps =
        (batches_most + accumulation - 1) / accumulation * options.epochs;
    if (leader) {
      fmt::print(
          "training {} on {} samples ({} per rank, {} batches of {} per rank and epoch), "
          "{} ranks, {} thread(s) each, {}{}, lr {} ({}) weight decay {}{}{}{}\n",
          options.model, train.size(), per_rank, batches, batch, world_size,
          torch::get_num_threads(),
          options.optimizer == "sgd" ? fmt::format("sgd momentum {}", options.momentum) : "adam",
          options.sharding == "zero1"   ? " sharded by ZeroRedundancyOptimizer (ZeRO stage 1)"
          : options.sharding == "zero2" ? fmt::format(" sharded by FullyShardedDataParallel "
                                                      "SHARD_GRAD_OP (ZeRO stage 2), {} units",
                                                      (*sharded)->unit_count())
          : options.sharding == "fsdp"  ? fmt::format(" sharded by FullyShardedDataParallel "
                                                       "FULL_SHARD (ZeRO stage 3), {} units",
                                                      (*sharded)->unit_count())
                                        : std::string(),
          options.lr, options.schedule, options.weight_decay,
          bf16 ? ", mixed precision bf16 (autocast forward, bf16 gradient reduction)" : "",
          hook.powersgd_state
              ? fmt::format(", comm hook {} (rank {}, from step {})", options.comm_hook,
                            options.powersgd_rank, options.powersgd_start_iter)
          : hook.hook ? fmt::format(", comm hook {}", options.comm_hook)
                      : "",
          options.global_batch_size > 0
              ? fmt::format(", global batch {} ({} micro-batch(es) of {} per rank and step)",
                            options.global_batch_size, accumulation, batch)
              : "");
      if (options.uneven) {
        std::vector<std::int64_t> counts;
        for (int r = 0; r < world_size; ++r)
          counts.push_back(batches_of(options, samples, r, world_size));
        fmt::print("uneven inputs under ddp::Join: batches per epoch by rank {}\n",
                   fmt::join(counts, ", "));
      }
      std::fflush(stdout);
    }

    // With --uneven the ranks make different numbers of steps; one Join over the whole run lets the
    // ranks that finish first shadow the others (joining once, at the end, also keeps the
    // optimizers' momentum identical on every rank).
    std::optional<ddp::Join> join;
    if (options.uneven)
      join.emplace(std::vector<std::reference_wrapper<ddp::Joinable>>{**ddp_model});

    double accuracy = 0.0;
    bool evaluated = false;
    const std::int64_t steps_per_epoch = (batches + accumulation - 1) / accumulation;
    std::int64_t step = (first_epoch - 1) * steps_per_epoch;  // of the learning-rate schedule
    std::int64_t global_step = step;                          // optimizer steps
    if (resumed) {
      global_step = resumed->global_step;
      // At the saved world size the schedule continues at its step; at another, steps per epoch
      // differ, so the schedule continues at the step of the data position instead.
      const auto per_step = static_cast<std::uint64_t>(batch * world_size * accumulation);
      step = resumed->world_size == world_size
                 ? resumed->scheduler_step
                 : (first_epoch - 1) * steps_per_epoch +
                       static_cast<std::int64_t>((resumed->epoch_offset + per_step - 1) / per_step);
    }
    for (int epoch = first_epoch; epoch <= options.epochs; ++epoch) {
      const auto epoch_start = std::chrono::steady_clock::now();
      const std::uint64_t start_offset =
          resumed && epoch == first_epoch ? resumed->epoch_offset : 0;
      sampler.set_epoch(static_cast<std::uint64_t>(epoch - 1), start_offset);
      const auto indices_vector = sampler.indices();
      const auto indices = torch::tensor(indices_vector, torch::kInt64);
      // A resumed epoch has fewer batches (sampler.size() counts what is left of it).
      const auto epoch_per_rank = static_cast<std::int64_t>(sampler.size());
      const std::int64_t epoch_batches =
          options.uneven ? batches : (epoch_per_rank + batch - 1) / batch;

      double loss_sum = 0.0;
      double window_loss = 0.0;
      std::int64_t window_batches = 0;
      auto window_start = std::chrono::steady_clock::now();
      if (bar) bar->start(epoch, static_cast<std::int64_t>(samples));
      for (std::int64_t b = 0; b < epoch_batches; ++b) {
        const auto start = b * batch;
        torch::Tensor x, y;
        {
          auto span = ddp::trace_span("data loading", "train", {{"step", step}});
          const auto rows = indices.narrow(0, start, std::min(batch, epoch_per_rank - start));
          x = train.images.index_select(0, rows);
          y = train.labels.index_select(0, rows);
        }
        // A step of `accumulation` micro-batches (a resume lands on a step boundary: checkpoints
        // are written after steps, at multiples of the global batch); the epoch's last may be
        // short.
        const std::int64_t group_first = b - b % accumulation;
        const std::int64_t group_size = std::min(accumulation, epoch_batches - group_first);
        const bool steps_now = b + 1 == group_first + group_size;
        if (b == group_first) {
          set_learning_rate(optimizer, learning_rate(options, step++, total_steps));
          optimizer.zero_grad();
        }
        torch::Tensor loss;
        {
          // bf16 has fp32's exponent range: no loss scaling needed (as PyTorch's recipe for it).
          ddp::AutocastGuard autocast(torch::kBFloat16, /*enabled=*/bf16);
          loss = torch::nn::functional::cross_entropy(forward(x).to(torch::kFloat32), y);
        }
        {
          auto span = ddp::trace_span("backward", "train", {{"step", step}});
          // Micro-batches before a group's last add their gradients locally (DDP's no_sync); the
          // last one's backward averages the sum over the ranks. Each contributes 1/group_size.
          std::optional<ddp::NoSyncGuard> no_sync;
          if (!steps_now && ddp_model) no_sync.emplace((*ddp_model)->no_sync());
          (group_size > 1 ? loss / static_cast<double>(group_size) : loss).backward();
        }
        if (steps_now) {
          auto span = ddp::trace_span("optimizer step", "train", {{"step", step}});
          optimizer.step();
          ++global_step;
        }
        const bool checkpoint_now = steps_now && train_state_file &&
                                    global_step % options.checkpoint_every_steps == 0 &&
                                    b + 1 < epoch_batches;
        if (checkpoint_now) gather_optimizer_state();
        if ((leader || sharded_state) && checkpoint_now) {
          auto span = ddp::trace_span("checkpoint", "train", {{"step", step}});
          const auto consumed = sampler.consumed_after(
              static_cast<std::uint64_t>(std::min<std::int64_t>((b + 1) * batch, epoch_per_rank)));
          const ddp::TrainProgress progress{.epoch = static_cast<std::uint64_t>(epoch - 1),
                                            .epoch_offset = consumed,
                                            .global_step = global_step,
                                            .scheduler_step = step,
                                            .dataset_size = samples};
          if (sharded_state) {
            sharded_state->save(options.checkpoint, progress, world_size);  // every rank
          } else {
            train_state.save(options.checkpoint, progress, world_size);
          }
          if (leader) {
            fmt::print("checkpoint global_step {} epoch {} offset {}\n", global_step, epoch,
                       consumed);
            std::fflush(stdout);
          }
        }

        const double value = loss.item<double>();
        loss_sum += value;
        window_loss += value;
        ++window_batches;
        // Global samples of the epoch done, counting those before a resume.
        const auto seen = static_cast<std::int64_t>(sampler.consumed_after(
            static_cast<std::uint64_t>(std::min<std::int64_t>((b + 1) * batch, epoch_per_rank))));
        if (bar) bar->update(seen, window_loss / static_cast<double>(window_batches));
        if (leader && options.log_every > 0 && (b + 1) % options.log_every == 0) {
          if (!bar) {
            fmt::print("epoch {} [{}/{}] loss {:.4f}\n", epoch, seen, samples,
                       window_loss / static_cast<double>(window_batches));
            std::fflush(stdout);
          }
          if (metrics) {
            const double window_seconds = seconds_since(window_start);
            metrics->write(
                {.kind = "step",
                 .epoch = epoch,
                 .step = step,
                 .loss = window_loss / static_cast<double>(window_batches),
                 .samples_per_s =
                     static_cast<double>(window_batches * batch * world_size) / window_seconds,
                 .step_time_s = window_seconds / static_cast<double>(window_batches),
                 .bytes_per_step = bytes_per_step(),
                 .world_size = world_size,
                 .time_s = seconds_since(job_start)});
          }
          window_loss = 0.0;
          window_batches = 0;
          window_start = std::chrono::steady_clock::now();
        }
      }
      const double train_seconds = seconds_since(epoch_start);
      if (bar) bar->finish();
      if (!options.checkpoint.empty()) gather_optimizer_state();
      if (leader || sharded) {
        auto span = ddp::trace_span("evaluate", "train", {{"epoch", epoch}});
        accuracy = evaluate_model();
        evaluated = true;
      }
      // The progress after a whole epoch: the next one, from its start.
      const ddp::TrainProgress epoch_done{.epoch = static_cast<std::uint64_t>(epoch),
                                          .epoch_offset = 0,
                                          .global_step = global_step,
                                          .scheduler_step = step,
                                          .dataset_size = samples};
      if (sharded_state && !options.checkpoint.empty()) {
        sharded_state->save(options.checkpoint, epoch_done, world_size);  // every rank
        if (leader) {
          fmt::print("checkpoint global_step {} epoch {} offset 0\n", global_step, epoch + 1);
        }
      }
      if (leader) {
        if (sharded_state) {
          // Written above, by every rank.
        } else if (train_state_file) {
          train_state.save(options.checkpoint, epoch_done, world_size);
          fmt::print("checkpoint global_step {} epoch {} offset 0\n", global_step, epoch + 1);
        } else if (!options.checkpoint.empty()) {
          ddp::save_checkpoint(options.checkpoint, *net, optimizer,
                               {.epoch = epoch, .tag = options.model});
        }
        // loss: the mean over rank 0's batches (a loss averaged over ranks would cost a
        // collective per epoch for a number only printed).
        fmt::print("epoch {} loss {:.4f} test_accuracy {:.4f} samples_per_s {:.0f} time {:.1f}\n",
                   epoch, loss_sum / static_cast<double>(std::max<std::int64_t>(epoch_batches, 1)),
                   accuracy, static_cast<double>(sampler.total_size()) / train_seconds,
                   seconds_since(epoch_start));
        std::fflush(stdout);
        if (metrics) {
          metrics->write(
              {.kind = "epoch",
               .epoch = epoch,
               .step = step,
               .loss = loss_sum / static_cast<double>(std::max<std::int64_t>(epoch_batches, 1)),
               .accuracy = accuracy,
               .samples_per_s = static_cast<double>(sampler.total_size()) / train_seconds,
               .step_time_s =
                   train_seconds / static_cast<double>(std::max<std::int64_t>(epoch_batches, 1)),
               .bytes_per_step = bytes_per_step(),
               .world_size = world_size,
               .time_s = seconds_since(job_start)});
        }
      }
    }
    if (join) join->finish();
    if ((leader || sharded) && !evaluated) accuracy = evaluate_model();  // resumed, nothing to do
    if (leader && !options.export_state_dict.empty()) {
      ddp::save_state_dict(*net, options.export_state_dict);
      fmt::print("model state dict written to {}\n", options.export_state_dict);
    }
    if (leader && !options.export_optimizer_state.empty()) {
      ddp::save_optimizer_state_dict(optimizer, options.export_optimizer_state);
      fmt::print("optimizer state dict written to {}\n", options.export_optimizer_state);
    }

    // Leave together: rank 0 hosts the rendezvous store, and the others may still be in their
    // last collective when rank 0 finishes evaluating.
    group->barrier()->wait();
    if (leader) {
      fmt::print(
          "final test_accuracy={:.4f} epochs={} world_size={} model={} batch_size={} "
          "lr={} train_samples={} time_s={:.1f} bytes_per_step={}\n",
          accuracy, options.epochs, world_size, options.model, options.batch_size, options.lr,
          train.size(), seconds_since(job_start), bytes_per_step());
      std::fflush(stdout);
    }
    ddp::destroy_process_group();
    return 0;
  };
  try {
    return in_job();
  } catch (const std::exception& e) {
    stop_now(e.what());
  }
}

}  // namespace

int main(int argc, char** argv) {
  Options options;
  CLI::App app{
      "Train a CNN or MLP on Fashion-MNIST with ddp::DistributedDataParallel. Run one "
      "process per rank, e.g. ddprun --standalone --nproc-per-node 2 "
      "train-fashion-mnist",
      "train-fashion-mnist"};
  app.add_option("--model", options.model, "cnn or mlp")
      ->check(CLI::IsMember({"cnn", "mlp"}))
      ->capture_default_str();
  app.add_option("--epochs", options.epochs, "epochs to train (in all, counting resumed ones)")
      ->check(CLI::Range(1, 1000000))
      ->capture_default_str();
  app.add_option("--batch-size", options.batch_size, "samples per batch and rank")
      ->check(CLI::Range(1, 60000))
      ->capture_default_str();
  app.add_option("--global-batch-size", options.global_batch_size,
                 "samples per optimizer step over every rank (default: --batch-size x world "
                 "size); each step accumulates global / (batch size x world size) micro-batches, "
                 "so an elastic job keeps its batch when the world shrinks")
      ->check(CLI::Range(std::int64_t{1}, std::int64_t{1} << 40));
  app.add_option("--optimizer", options.optimizer, "sgd (with --momentum) or adam")
      ->check(CLI::IsMember({"sgd", "adam"}))
      ->capture_default_str();
  app.add_option("--sharding", options.sharding,
                 "ddp (every rank holds everything), zero1 (each rank holds its shard's optimizer "
                 "state: ZeroRedundancyOptimizer), zero2 (and gradients: FullyShardedDataParallel "
                 "SHARD_GRAD_OP) or fsdp (and parameters: FULL_SHARD); docs/sharding.md")
      ->check(CLI::IsMember({"ddp", "zero1", "zero2", "fsdp"}))
      ->capture_default_str();
  app.add_option("--fsdp-min-params", options.fsdp_min_params,
                 "with --sharding zero2|fsdp: a unit closes once it holds this many parameters")
      ->check(CLI::Range(std::int64_t{1}, std::int64_t{1} << 40))
      ->capture_default_str();
  auto* lr_option =
      app.add_option("--lr", options.lr, "learning rate (default: 0.05 with sgd, 0.001 with adam)")
          ->check(ddp_programs::kFinite)
          ->check(CLI::Range(1e-6, 10.0));
  app.add_option("--momentum", options.momentum, "SGD momentum")
      ->check(ddp_programs::kFinite)
      ->check(CLI::Range(0.0, 0.999))
      ->capture_default_str();
  app.add_option("--weight-decay", options.weight_decay, "weight decay (L2, added to the gradient)")
      ->check(ddp_programs::kFinite)
      ->check(CLI::Range(0.0, 1.0))
      ->capture_default_str();
  app.add_option("--lr-schedule", options.schedule,
                 "cosine (anneal to 0 over all epochs, per step) or constant")
      ->check(CLI::IsMember({"cosine", "constant"}))
      ->capture_default_str();
  app.add_option("--seed", options.seed, "seed of the model's initialisation and the shuffling")
      ->check(ddp_programs::kUint64)
      ->capture_default_str();
  app.add_option("--data-dir", options.data_dir,
                 "folder with the four *-ubyte.gz files of Fashion-MNIST")
      ->capture_default_str();
  app.add_option("--checkpoint", options.checkpoint,
                 "rank 0 writes model, optimizer and epoch here after every epoch (atomically)");
  app.add_option("--init-from-state-dict", options.init_state_dict,
                 "start the model from this state dict (PyTorch's torch.save(model.state_dict()) "
                 "of the same architecture, or --export-state-dict's; docs/interop.md)");
  app.add_option("--init-optimizer-state", options.init_optimizer_state,
                 "start the optimizer from this PyTorch optimizer.state_dict() (SGD or Adam)");
  app.add_option("--export-state-dict", options.export_state_dict,
                 "at the end, rank 0 writes the model's state dict here (Python: "
                 "model.load_state_dict(torch.load(PATH, weights_only=True)))");
  app.add_option("--export-optimizer-state", options.export_optimizer_state,
                 "at the end, rank 0 writes the optimizer's state dict here (Python's layout)");
  app.add_option("--start-epoch", options.start_epoch,
                 "the first epoch to train (of --epochs): continues a run handed over with "
                 "--init-from-state-dict, with the sampler's order and the schedule of that epoch")
      ->check(CLI::PositiveNumber);
  app.add_flag("--resume", options.resume,
               "continue from --checkpoint (every rank loads it) at the epoch after it");
  app.add_option("--checkpoint-every-steps", options.checkpoint_every_steps,
                 "rank 0 writes a training state (model, optimizer, schedule, sampler position, "
                 "RNG) to --checkpoint every N steps and after every epoch; with --resume, "
                 "training continues mid-epoch from it, also at another world size (and starts "
                 "from scratch when the file does not exist yet)")
      ->check(CLI::Range(1, 100000000));
  app.add_option("--threads", options.threads,
                 "torch threads per rank (default: OMP_NUM_THREADS, else 1)")
      ->check(ddp_programs::kThreads);
  app.add_option("--limit-train", options.limit_train,
                 "train on the first N training samples only (for quick tests)")
      ->check(CLI::Range(std::size_t{1}, fmnist::kTrainCount));
  app.add_option("--limit-test", options.limit_test,
                 "evaluate on the first N test samples only (for quick tests; the accuracy is "
                 "then that of those N)")
      ->check(CLI::Range(std::size_t{1}, fmnist::kTestCount));
  app.add_option("--log-every", options.log_every,
                 "rank 0 prints the loss every N batches (0: only once per epoch)")
      ->check(CLI::Range(0, 1000000))
      ->capture_default_str();
  app.add_flag("--uneven", options.uneven,
               "uneven inputs: no padding in the sampler, and rank r trains on --uneven-skew * r "
               "fewer batches per epoch; ddp::Join keeps the ranks together");
  app.add_option("--uneven-skew", options.uneven_skew,
                 "with --uneven: batches per epoch that each higher rank has fewer")
      ->check(CLI::Range(0, 1000000))
      ->capture_default_str();
  app.add_flag("--sync-bn", options.sync_bn,
               "replace the cnn's BatchNorms by ddp::SyncBatchNorm (statistics over all ranks)");
  app.add_option("--mixed-precision", options.mixed_precision,
                 "bf16: forward under CPU autocast in bfloat16 and gradients reduced in bfloat16 "
                 "(parameters and optimizer stay fp32)")
      ->check(CLI::IsMember({"none", "bf16"}))
      ->capture_default_str();
  app.add_option("--metrics", options.metrics,
                 "rank 0 writes one JSON line per logged step and per epoch to this file (loss, "
                 "accuracy, samples/s, step time, bytes per step; docs/fashion-mnist.md)");
  app.add_option("--comm-hook", options.comm_hook,
                 "gradient reduction: none (DDP's allreduce), fp16, bf16, powersgd, "
                 "batched-powersgd, int8 or noop (docs/ddp.md, comm hooks)")
      ->check(CLI::IsMember(ddp::comm_hook_names()))
      ->capture_default_str();
  app.add_option("--powersgd-rank", options.powersgd_rank,
                 "with --comm-hook powersgd: PowerSGD's matrix_approximation_rank")
      ->check(CLI::Range(1, 1024))
      ->capture_default_str();
  app.add_option("--powersgd-start-iter", options.powersgd_start_iter,
                 "with --comm-hook powersgd: plain allreduce for the steps before (>= 2)")
      ->check(CLI::Range(std::int64_t{2}, std::int64_t{1} << 40))
      ->capture_default_str();
  if (const auto code = ddp_programs::parse_command_line(app, argc, argv, "train-fashion-mnist")) {
    return *code;
  }
  if (options.optimizer == "adam" && lr_option->count() == 0) options.lr = kAdamDefaultLr;

  try {
    return run(options);
  } catch (const std::exception& e) {
    std::cerr << "train-fashion-mnist: error: " << e.what() << std::endl;
    return 1;
  }
}
