#include "ddp/torch/checkpoint/checkpoint.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <optional>
#include <string>
#include <system_error>

#include <fmt/format.h>

#include "archive/zip_reader.h"
#include "ddp/error.h"
#include "torch/checkpoint/checkpoint_integrity.h"
#include "torch/checkpoint/checkpoint_payload.h"
#include "torch/core/parameter_devices.h"

namespace ddp {
namespace {

constexpr std::int64_t kCheckpointFormat = 1;

std::string errno_text(int error) {
  return std::generic_category().message(error);
}

// Writes everything or returns the errno of the first failure (0 on success). Never throws: it
// runs inside libtorch's archive writer, whose destructor writes the zip's end again, so an
// exception thrown from here would escape that destructor into std::terminate.
int write_all(int fd, const char* data, std::size_t size) noexcept {
  while (size > 0) {
    const ssize_t written = ::write(fd, data, size);
    if (written < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    data += written;
    size -= static_cast<std::size_t>(written);
  }
  return 0;
}

// Checkpoints written before ddp stored checksums still load (refusing them would strand every
// run that has one), with a warning that says how to get a verified file.
void warn_if_unverified(torch::serialize::InputArchive& archive,
                        const std::filesystem::path& path) {
  c10::IValue checksums;
  if (archive.try_read(detail::kChecksumsEntry, checksums)) return;  // verified by load_archive
  TORCH_WARN("checkpoint ", path.string(),
             " has no checksums (written by an older ddp or by torch::save), so damage to it "
             "cannot be detected; it is loaded unverified. Save it again to add them.");
}

// A checkpoint path that names a folder is a mistake in the program's options (--snapshot D meant
// as D/snapshot.pt): said as such, before a save writes anything (the rename onto the folder would
// fail only after the whole file was written) and before a load reports the file as missing.
void refuse_folder(const std::filesystem::path& path) {
  std::error_code error;
  if (!std::filesystem::is_directory(path, error)) return;
  std::string folder = path.string();
  while (folder.size() > 1 && folder.back() == '/')
    folder.pop_back();
  throw ConfigError(
      fmt::format("checkpoint: {} is a folder; give the path of a file in it, such as "
                  "{}/checkpoint.pt",
                  path.string(), folder));
}

}  // namespace

void save_archive_atomically(torch::serialize::OutputArchive& archive,
                             const std::filesystem::path& path) {
  refuse_folder(path);
  detail::add_checksums(archive);
  const std::filesystem::path temporary = path.string() + ".tmp";
  const int raw_fd = ::open(temporary.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (raw_fd < 0) {
    throw Error(
        fmt::format("checkpoint: cannot create {}: {} (does the folder exist and is it "
                    "writable?)",
                    temporary.string(), errno_text(errno)));
  }
  // Every failure from here on removes the partial temporary file (a full disk must not stay
  // full of it) and says that `path` itself was not touched.
  const auto failed = [&](const std::string& what) {
    ::unlink(temporary.c_str());
    std::error_code error;
    const bool previous = std::filesystem::exists(path, error);
    return Error(fmt::format(
        "checkpoint: {}; the partial {} was removed and {}", what, temporary.string(),
        previous ? fmt::format("{} is unchanged (the previous checkpoint is intact)", path.string())
                 : fmt::format("nothing was written to {}", path.string())));
  };
  {
    // Closes the file on the error paths; the normal path closes it itself to see close's error.
    struct Closer {
      int fd;
      bool closed = false;
      ~Closer() {
        if (!closed) ::close(fd);
      }
    } closer{raw_fd};
    int write_error = 0;
    try {
      archive.save_to([&](const void* data, std::size_t size) -> std::size_t {
        // After a failure the rest is dropped (the writer must not see a short write: it would
        // throw, and throw again from its destructor); the failure is reported below.
        if (write_error == 0) write_error = write_all(raw_fd, static_cast<const char*>(data), size);
        return size;
      });
    } catch (const c10::Error& e) {
      throw failed(
          fmt::format("writing {} failed: {}", temporary.string(), e.what_without_backtrace()));
    } catch (const std::exception& e) {  // std::bad_alloc while serialising, say
      throw failed(fmt::format("writing {} failed: {}", temporary.string(), e.what()));
    }
    if (write_error != 0) {
      throw failed(
          fmt::format("writing {} failed: {}", temporary.string(), errno_text(write_error)));
    }
    if (::fsync(raw_fd) != 0) {
      throw failed(fmt::format("fsync of {} failed: {}", temporary.string(), errno_text(errno)));
    }
    closer.closed = true;
    if (::close(raw_fd) != 0) {
      throw failed(fmt::format("closing {} failed: {}", temporary.string(), errno_text(errno)));
    }
  }
  if (::rename(temporary.c_str(), path.c_str()) != 0) {
    const int rename_errno = errno;
    throw failed(fmt::format("renaming {} to {} failed: {}", temporary.string(), path.string(),
                             errno_text(rename_errno)));
  }
  // The rename lives in the folder's entries: without this fsync a crash may forget it.
  auto folder = path.parent_path();
  if (folder.empty()) folder = ".";
  const int dir_fd = ::open(folder.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir_fd < 0) {
    throw Error(fmt::format("checkpoint: cannot open folder {} to sync it: {}", folder.string(),
                            errno_text(errno)));
  }
  const int sync_result = ::fsync(dir_fd);
  const int sync_errno = errno;
  ::close(dir_fd);
  if (sync_result != 0) {
    throw Error(fmt::format("checkpoint: fsync of folder {} failed: {}", folder.string(),
                            errno_text(sync_errno)));
  }
}

torch::serialize::InputArchive load_archive(const std::filesystem::path& path,
                                            std::optional<torch::Device> map_location) {
  if (map_location) detail::check_device_usable(*map_location, "load_archive's map_location");
  refuse_folder(path);
  std::error_code error;
  if (!std::filesystem::is_regular_file(path, error)) {
    throw ConfigError(
        fmt::format("checkpoint: {} does not exist or is not a regular file", path.string()));
  }
  // libtorch's zip reader (miniz) verifies no CRC and inflates before it compares sizes: the
  // archive's structure and every record's CRC-32 are checked here first, and libtorch reads only
  // an archive whose every record holds what was written, but for tensor data: a damaged tensor
  // record is left to ddp's own checksums below, which name the tensor ("model.0.weight", not
  // "archive/data/3"), and reported by its record where the archive has none (torch::save's).
  std::optional<std::string> damaged_tensor_record;
  try {
    const auto zip = archive::ZipReader::open(path);
    for (const auto& entry : zip.entries()) {
      try {
        zip.verify(entry);
      } catch (const archive::FormatError& e) {
        const bool tensor_data = entry.name.find("/data/") != std::string::npos &&
                                 e.kind() == archive::FormatError::Kind::kDamaged;
        if (!tensor_data) throw;
        if (!damaged_tensor_record) damaged_tensor_record = e.what();
      }
    }
  } catch (const archive::FormatError& e) {
    throw Error(
        fmt::format("checkpoint: {} is not a readable torch archive (corrupt or "
                    "truncated?): {}",
                    path.string(), e.what()));
  }
  torch::serialize::InputArchive archive;
  try {
    if (map_location) {
      archive.load_from(path.string(), *map_location);
    } else {
      archive.load_from(path.string());
    }
  } catch (const c10::Error& e) {
    throw Error(
        fmt::format("checkpoint: {} is not a readable torch archive (corrupt or "
                    "truncated?): {}",
                    path.string(), e.what_without_backtrace()));
  }
  detail::verify_checksums(archive, path);
  if (damaged_tensor_record) {
    throw Error(
        fmt::format("checkpoint: {} is damaged: {}", path.string(), *damaged_tensor_record));
  }
  return archive;
}

void save_checkpoint(const std::filesystem::path& path, const torch::nn::Module& model,
                     const torch::optim::Optimizer& optimizer, const CheckpointInfo& info) {
  torch::serialize::OutputArchive archive;
  archive.write("ddp_checkpoint_format", c10::IValue(kCheckpointFormat));
  archive.write("epoch", c10::IValue(info.epoch));
  archive.write("tag", c10::IValue(info.tag));
  detail::write_model_and_optimizer(archive, model, optimizer);
  save_archive_atomically(archive, path);
}

CheckpointInfo load_checkpoint(const std::filesystem::path& path, torch::nn::Module& model,
                               torch::optim::Optimizer& optimizer, const std::string& expected_tag,
                               std::optional<torch::Device> map_location) {
  auto archive = load_archive(path, map_location);
  const auto fail = [&](const std::string& what) {
    return Error(fmt::format("checkpoint: {}: {}", path.string(), what));
  };

  CheckpointInfo info;
  try {
    c10::IValue format;
    if (!archive.try_read("ddp_checkpoint_format", format) || !format.isInt()) {
      throw fail("not a ddp checkpoint (no ddp_checkpoint_format entry)");
    }
    if (format.toInt() != kCheckpointFormat) {
      throw fail(fmt::format("checkpoint format {} is not supported (this build reads {})",
                             format.toInt(), kCheckpointFormat));
    }
    warn_if_unverified(archive, path);
    c10::IValue epoch;
    c10::IValue tag;
    if (!archive.try_read("epoch", epoch) || !epoch.isInt() || !archive.try_read("tag", tag) ||
        !tag.isString()) {
      throw fail("the epoch or tag entry is missing or has the wrong type");
    }
    info.epoch = epoch.toInt();
    info.tag = tag.toStringRef();
    if (!expected_tag.empty() && info.tag != expected_tag) {
      throw fail(
          fmt::format("it was saved for '{}', but this run uses '{}'", info.tag, expected_tag));
    }

    detail::load_model_and_optimizer(archive, model, optimizer, path, "the checkpoint");
  } catch (const c10::Error& e) {
    throw fail(fmt::format("does not fit this model or optimizer: {}", e.what_without_backtrace()));
  }
  return info;
}

}  // namespace ddp
