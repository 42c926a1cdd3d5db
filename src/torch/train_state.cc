#include "ddp/torch/train_state.h"

#include <mutex>
#include <sstream>

#include <ATen/CPUGeneratorImpl.h>
#include <fmt/format.h>

#include "ddp/error.h"
#include "ddp/torch/checkpoint.h"
#include "torch/checkpoint_payload.h"

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

TrainState::TrainState(torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                       TrainStateOptions options)
    : model_(model), optimizer_(optimizer), options_(std::move(options)) {}

void TrainState::save(const std::filesystem::path& path, const TrainProgress& progress,
                      int world_size) const {
  torch::serialize::OutputArchive archive;
  archive.write(kFormatEntry, c10::IValue(kFormat));
  archive.write("tag", c10::IValue(options_.tag));
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
                c10::IValue(options_.rng != nullptr ? mt19937_text(*options_.rng) : std::string()));
  internal::write_model_and_optimizer(archive, model_, optimizer_);
  save_archive_atomically(archive, path);
}

TrainProgress TrainState::load(const std::filesystem::path& path) {
  auto archive = load_archive(path);  // ConfigError when missing; checksums verified
  const auto fail = [&](const std::string& what) {
    return Error(fmt::format("train state: {}: {}", path.string(), what));
  };
  const auto read_int = [&](const char* key) {
    c10::IValue value;
    if (!archive.try_read(key, value) || !value.isInt()) {
      throw fail(fmt::format("the '{}' entry is missing or not an integer", key));
    }
    return value.toInt();
  };
  TrainProgress progress;
  try {
    c10::IValue format;
    if (!archive.try_read(kFormatEntry, format) || !format.isInt()) {
      throw fail(
          fmt::format("not a ddp training state (no {} entry; a file of save_checkpoint "
                      "loads with load_checkpoint)",
                      kFormatEntry));
    }
    if (format.toInt() != kFormat) {
      throw fail(fmt::format("training-state format {} is not supported (this build reads {})",
                             format.toInt(), kFormat));
    }
    c10::IValue tag;
    if (!archive.try_read("tag", tag) || !tag.isString()) {
      throw fail("the 'tag' entry is missing or not text");
    }
    if (!options_.tag.empty() && tag.toStringRef() != options_.tag) {
      throw fail(fmt::format("it was saved for '{}', but this run uses '{}' (another model?)",
                             tag.toStringRef(), options_.tag));
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
    progress.world_size = static_cast<int>(read_int("world_size"));
    // Absent in files written before it was stored: 0, not recorded.
    c10::IValue dataset_size;
    if (archive.try_read("dataset_size", dataset_size)) {
      if (!dataset_size.isInt() || dataset_size.toInt() < 0) {
        throw fail("the 'dataset_size' entry is not a non-negative integer");
      }
      progress.dataset_size = static_cast<std::uint64_t>(dataset_size.toInt());
    }

    // The generators are parsed before anything changes, like the tensors.
    torch::Tensor torch_rng;
    if (!archive.try_read("torch_rng", torch_rng) || !torch_rng.defined()) {
      throw fail("it holds no 'torch_rng' entry (torch's generator state)");
    }
    c10::IValue user_rng_text;
    if (!archive.try_read("user_rng", user_rng_text) || !user_rng_text.isString()) {
      throw fail("the 'user_rng' entry is missing or not text");
    }
    std::mt19937 user_rng;
    if (options_.rng != nullptr) {
      if (user_rng_text.toStringRef().empty()) {
        throw fail(
            "it was saved without a std::mt19937 (TrainStateOptions::rng), but this run "
            "expects one");
      }
      std::istringstream text(user_rng_text.toStringRef());
      text >> user_rng;
      if (!text) throw fail("its 'user_rng' entry is not a std::mt19937 state");
    }

    internal::load_model_and_optimizer(archive, model_, optimizer_, path, "the training state in");
    {
      auto generator = at::detail::getDefaultCPUGenerator();
      std::lock_guard<std::mutex> lock(generator.mutex());
      generator.set_state(torch_rng);
    }
    if (options_.rng != nullptr) *options_.rng = user_rng;
  } catch (const c10::Error& e) {
    throw fail(fmt::format("does not fit this model, optimizer or generator: {}",
                           e.what_without_backtrace()));
  }
  return progress;
}

}  // namespace ddp
