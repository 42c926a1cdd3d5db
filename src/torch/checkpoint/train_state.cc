#include "ddp/torch/checkpoint/train_state.h"

#include <limits>
#include <mutex>
#include <sstream>

#include <ATen/CPUGeneratorImpl.h>
#include <fmt/format.h>

#include "ddp/error.h"
#include "ddp/torch/checkpoint/checkpoint.h"
#include "torch/checkpoint/checkpoint_payload.h"
#include "torch/checkpoint/train_state_archive.h"

namespace ddp {
namespace {

// Distinct from save_checkpoint's "ddp_checkpoint_format", so that neither loads the other.
constexpr const char* kFormatEntry = "ddp_train_state_format";
constexpr std::int64_t kFormat = 1;

std::string mt19937_text(const std::mt19937& rng) {
  std::ostringstream text;
  text << rng;
  return text.str();
}

torch::Tensor torch_generator_state() {
  auto generator = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(generator.mutex());
  return generator.get_state();
}

}  // namespace

namespace detail {

void write_train_progress(torch::serialize::OutputArchive& archive, const char* format_entry,
                          std::int64_t format, const TrainStateOptions& options,
                          const TrainProgress& progress, int world_size) {
  archive.write(format_entry, c10::IValue(format));
  archive.write("tag", c10::IValue(options.tag));
  archive.write("epoch", c10::IValue(static_cast<std::int64_t>(progress.epoch)));
  archive.write("epoch_offset", c10::IValue(static_cast<std::int64_t>(progress.epoch_offset)));
  archive.write("global_step", c10::IValue(progress.global_step));
  archive.write("scheduler_step", c10::IValue(progress.scheduler_step));
  archive.write(
      "world_size",
      c10::IValue(static_cast<std::int64_t>(world_size > 0 ? world_size : progress.world_size)));
  archive.write("dataset_size", c10::IValue(static_cast<std::int64_t>(progress.dataset_size)));
  archive.write("torch_rng", torch_generator_state());
  archive.write("user_rng",
                c10::IValue(options.rng != nullptr ? mt19937_text(*options.rng) : std::string()));
}

StoredTrainProgress read_train_progress(torch::serialize::InputArchive& archive,
                                        const char* format_entry, std::int64_t format,
                                        const TrainStateOptions& options,
                                        const std::function<Error(const std::string&)>& fail) {
  const auto read_int = [&](const char* key) {
    c10::IValue value;
    if (!archive.try_read(key, value) || !value.isInt()) {
      throw fail(fmt::format("the '{}' entry is missing or not an integer", key));
    }
    return value.toInt();
  };
  StoredTrainProgress stored;
  TrainProgress& progress = stored.progress;
  c10::IValue stored_format;
  if (!archive.try_read(format_entry, stored_format) || !stored_format.isInt()) {
    throw fail(
        fmt::format("not a ddp training state (no {} entry; a file of save_checkpoint "
                    "loads with load_checkpoint)",
                    format_entry));
  }
  if (stored_format.toInt() != format) {
    throw fail(fmt::format("training-state format {} is not supported (this build reads {})",
                           stored_format.toInt(), format));
  }
  c10::IValue tag;
  if (!archive.try_read("tag", tag) || !tag.isString()) {
    throw fail("the 'tag' entry is missing or not text");
  }
  if (!options.tag.empty() && tag.toStringRef() != options.tag) {
    throw fail(fmt::format("it was saved for '{}', but this run uses '{}' (another model?)",
                           tag.toStringRef(), options.tag));
  }
  const std::int64_t epoch = read_int("epoch");
  const std::int64_t epoch_offset = read_int("epoch_offset");
  if (epoch < 0 || epoch_offset < 0) {
    throw fail(fmt::format("epoch {} or epoch_offset {} is negative", epoch, epoch_offset));
  }
  progress.epoch = static_cast<std::uint64_t>(epoch);
  progress.epoch_offset = static_cast<std::uint64_t>(epoch_offset);
  progress.global_step = read_int("global_step");
  progress.scheduler_step = read_int("scheduler_step");
  const std::int64_t world_size = read_int("world_size");
  if (progress.global_step < 0 || progress.scheduler_step < 0) {
    throw fail(fmt::format("global_step {} or scheduler_step {} is negative", progress.global_step,
                           progress.scheduler_step));
  }
  if (world_size < 0 || world_size > std::numeric_limits<int>::max()) {
    throw fail(fmt::format("world_size {} is not a world size", world_size));
  }
  progress.world_size = static_cast<int>(world_size);
  // Absent in files written before it was stored: 0, not recorded.
  c10::IValue dataset_size;
  if (archive.try_read("dataset_size", dataset_size)) {
    if (!dataset_size.isInt() || dataset_size.toInt() < 0) {
      throw fail("the 'dataset_size' entry is not a non-negative integer");
    }
    progress.dataset_size = static_cast<std::uint64_t>(dataset_size.toInt());
  }

  // The generators are parsed before anything changes, like the tensors.
  if (!archive.try_read("torch_rng", stored.torch_rng) || !stored.torch_rng.defined()) {
    throw fail("it holds no 'torch_rng' entry (torch's generator state)");
  }
  c10::IValue user_rng_text;
  if (!archive.try_read("user_rng", user_rng_text) || !user_rng_text.isString()) {
    throw fail("the 'user_rng' entry is missing or not text");
  }
  if (options.rng != nullptr) {
    if (user_rng_text.toStringRef().empty()) {
      throw fail(
          "it was saved without a std::mt19937 (TrainStateOptions::rng), but this run "
          "expects one");
    }
    std::istringstream text(user_rng_text.toStringRef());
    std::mt19937 user_rng;
    text >> user_rng;
    if (!text) throw fail("its 'user_rng' entry is not a std::mt19937 state");
    stored.user_rng = user_rng;
  }
  return stored;
}

void apply_generators(const StoredTrainProgress& stored, const TrainStateOptions& options) {
  {
    auto generator = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(generator.mutex());
    generator.set_state(stored.torch_rng);
  }
  if (options.rng != nullptr && stored.user_rng) *options.rng = *stored.user_rng;
}

}  // namespace detail

TrainState::TrainState(torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                       TrainStateOptions options)
    : model_(model), optimizer_(optimizer), options_(std::move(options)) {}

void TrainState::save(const std::filesystem::path& path, const TrainProgress& progress,
                      int world_size) const {
  torch::serialize::OutputArchive archive;
  detail::write_train_progress(archive, kFormatEntry, kFormat, options_, progress, world_size);
  detail::write_model_and_optimizer(archive, model_, optimizer_);
  save_archive_atomically(archive, path);
}

TrainProgress TrainState::load(const std::filesystem::path& path) {
  auto archive = load_archive(path);  // ConfigError when missing; checksums verified
  const auto fail = [&](const std::string& what) {
    return Error(fmt::format("train state: {}: {}", path.string(), what));
  };
  try {
    const auto stored = detail::read_train_progress(archive, kFormatEntry, kFormat, options_, fail);
    detail::load_model_and_optimizer(archive, model_, optimizer_, path, "the training state in");
    detail::apply_generators(stored, options_);
    return stored.progress;
  } catch (const c10::Error& e) {
    throw fail(fmt::format("does not fit this model, optimizer or generator: {}",
                           e.what_without_backtrace()));
  }
}

}  // namespace ddp
