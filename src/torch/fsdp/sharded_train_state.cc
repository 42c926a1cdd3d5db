// ShardedTrainState (train_state.h): a training state of a FullyShardedDataParallel model as a
// folder of numbered checkpoints (each PyTorch's distributed checkpoint of the model and its
// optimizer, beside the progress) and a pointer to the newest complete one.
#include <cctype>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "ddp/error.h"
#include "ddp/torch/api/distributed.h"
#include "ddp/torch/checkpoint/checkpoint.h"
#include "ddp/torch/checkpoint/distributed_checkpoint_save.h"
#include "ddp/torch/checkpoint/train_state.h"
#include "ddp/torch/fsdp/fully_sharded_data_parallel.h"
#include "torch/api/rank_agreement.h"
#include "torch/checkpoint/train_state_archive.h"

namespace ddp {
namespace {

constexpr const char* kShardedFormatEntry = "ddp_sharded_train_state_format";
constexpr std::int64_t kShardedFormat = 1;
constexpr const char* kLatest = "latest.pt";
constexpr const char* kStateFile = "train_state.pt";
constexpr const char* kBufferPrefix = "buffer/";

std::string checkpoint_name(std::int64_t number) {
  return fmt::format("ckpt-{}", number);
}

// The number of a "ckpt-<n>" name, or nullopt for any other name (so that a latest.pt written by
// someone else cannot send load, or the clean-up, outside DIR).
std::optional<std::int64_t> checkpoint_number(const std::string& name) {
  constexpr std::string_view prefix = "ckpt-";
  if (name.size() <= prefix.size() || name.size() > prefix.size() + 18 ||
      name.compare(0, prefix.size(), prefix) != 0) {
    return std::nullopt;
  }
  std::int64_t number = 0;
  for (std::size_t i = prefix.size(); i < name.size(); ++i) {
    if (std::isdigit(static_cast<unsigned char>(name[i])) == 0) return std::nullopt;
    number = number * 10 + (name[i] - '0');
  }
  return number;
}

// The checkpoint DIR/latest.pt names; Error when it is damaged or names anything else.
std::string read_latest(const std::filesystem::path& dir) {
  auto archive = load_archive(dir / kLatest);  // ConfigError when missing
  c10::IValue name;
  if (!archive.try_read("checkpoint", name) || !name.isString() ||
      !checkpoint_number(name.toStringRef())) {
    throw Error(fmt::format(
        "sharded train state: {} does not name a ckpt-<n> folder of {} (damaged, or not written "
        "by ShardedTrainState)",
        (dir / kLatest).string(), dir.string()));
  }
  return name.toStringRef();
}

// The buffers of the model in every wrapper of the tree, under the unwrapped model's names (a
// nested wrapper's module is not a child of its parent, so its buffers are collected here).
void collect_buffers(const FullyShardedDataParallelImpl& wrapper, const std::string& prefix,
                     std::vector<std::pair<std::string, torch::Tensor>>& out) {
  for (const auto& item : wrapper.wrapped_module()->named_buffers())
    out.emplace_back(prefix + item.key(), item.value());
  for (const auto& [path, nested] : wrapper.nested_wrappers())
    collect_buffers(*nested, prefix + path + ".", out);
}

std::vector<std::pair<std::string, torch::Tensor>> model_buffers(
    const FullyShardedDataParallelImpl& model) {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  collect_buffers(model, "", out);
  return out;
}

}  // namespace

ShardedTrainState::ShardedTrainState(FullyShardedDataParallelImpl& model,
                                     torch::optim::Optimizer& optimizer, TrainStateOptions options)
    : model_(model), optimizer_(optimizer), options_(std::move(options)) {}

void ShardedTrainState::save(const std::filesystem::path& dir, const TrainProgress& progress,
                             int world_size) const {
  ProcessGroup& group = model_.process_group();
  const bool leader = group.rank() == 0;
  // Rank 0 picks the next number (after the one latest.pt names) and clears a folder of that
  // name that a failed save may have left; every rank then writes into it.
  std::string failure;
  auto number = torch::zeros({1}, torch::kInt64);
  if (leader) {
    try {
      std::filesystem::create_directories(dir);
      std::int64_t previous = 0;
      if (std::filesystem::exists(dir / kLatest)) previous = *checkpoint_number(read_latest(dir));
      number[0] = previous + 1;
      std::filesystem::remove_all(dir / checkpoint_name(previous + 1));
    } catch (const std::exception& e) {
      failure = e.what();
    }
  }
  detail::raise_if_any_rank_failed(group, failure,
                                   "sharded train state: preparing " + dir.string());
  broadcast(number, 0, group);
  const std::string name = checkpoint_name(number.item<std::int64_t>());
  const auto folder = dir / name;

  // The model and its optimizer as PyTorch's distributed checkpoint, under the model's own names:
  // it loads at any world size, strategy or wrapping (and in PyTorch). Collective over the
  // model's group (not owned here: the aliasing pointer has no owner); throws on every rank when
  // any rank could not write.
  DcpSaveOptions save_options;
  save_options.group = std::shared_ptr<ProcessGroup>(std::shared_ptr<ProcessGroup>(), &group);
  save_dcp(model_.dcp_state(&optimizer_), folder, save_options);

  if (leader) {
    try {
      torch::serialize::OutputArchive archive;
      detail::write_train_progress(archive, kShardedFormatEntry, kShardedFormat, options_, progress,
                                   world_size);
      for (const auto& [name, buffer] : model_buffers(model_))
        archive.write(kBufferPrefix + name, buffer.detach());
      save_archive_atomically(archive, folder / kStateFile);
      torch::serialize::OutputArchive latest;
      latest.write("checkpoint", c10::IValue(name));
      save_archive_atomically(latest, dir / kLatest);
      // Older checkpoints go only now that the new one is the one load finds.
      for (const auto& entry : std::filesystem::directory_iterator(dir)) {
        const auto other = entry.path().filename().string();
        if (other != name && checkpoint_number(other) && entry.is_directory()) {
          std::error_code ignored;  // a folder left behind costs disk, not correctness
          std::filesystem::remove_all(entry.path(), ignored);
        }
      }
    } catch (const std::exception& e) {
      failure = e.what();
    }
  }
  detail::raise_if_any_rank_failed(
      group, failure, "sharded train state: writing " + (folder / kStateFile).string());
}

TrainProgress ShardedTrainState::load(const std::filesystem::path& dir) {
  const std::string name = read_latest(dir);
  const auto folder = dir / name;
  const auto state_path = folder / kStateFile;
  if (!std::filesystem::exists(state_path)) {
    throw Error(fmt::format(
        "sharded train state: {} names {}, which holds no {} (the folder was changed after the "
        "save)",
        (dir / kLatest).string(), folder.string(), kStateFile));
  }
  auto archive = load_archive(state_path);
  const auto fail = [&](const std::string& what) {
    return Error(fmt::format("sharded train state: {}: {}", state_path.string(), what));
  };
  const auto stored =
      detail::read_train_progress(archive, kShardedFormatEntry, kShardedFormat, options_, fail);
  // Every buffer of the model, by name and shape, before anything changes.
  std::vector<std::pair<torch::Tensor, torch::Tensor>> buffers;  // the model's, the saved
  for (const auto& [name, buffer] : model_buffers(model_)) {
    torch::Tensor saved;
    if (!archive.try_read(kBufferPrefix + name, saved) || !saved.defined()) {
      throw fail(fmt::format("it holds no buffer '{}' (saved for another model?)", name));
    }
    if (saved.sizes() != buffer.sizes()) {
      throw fail(fmt::format("buffer '{}' has shape {} there but {} in this model", name,
                             fmt::join(saved.sizes(), "x"), fmt::join(buffer.sizes(), "x")));
    }
    buffers.emplace_back(buffer, saved);
  }
  // Checks the model's entries and the optimizer's state before it changes the shards (nothing
  // changed on error); then the rest, which can no longer fail. A folder without DCP's .metadata
  // was saved before checkpoints were DCP (ddp's own sharded format): it still loads.
  if (std::filesystem::exists(folder / ".metadata")) {
    model_.load_dcp_state(folder, &optimizer_);
  } else {
    model_.load_sharded_checkpoint(folder, optimizer_);
  }
  {
    torch::NoGradGuard no_grad;
    for (auto& [mine, saved] : buffers)
      mine.copy_(saved);
  }
  detail::apply_generators(stored, options_);
  return stored.progress;
}

}  // namespace ddp
