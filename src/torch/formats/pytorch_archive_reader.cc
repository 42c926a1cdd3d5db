// Reading PyTorch's zip archive with ddp's own zip reader (archive/zip_reader.h) rather than
// libtorch's PyTorchStreamReader: miniz verifies no CRC on read (neither does Python's
// torch.load), so a flipped byte in a weight loaded silently, and it inflates a record whole
// before anything compares its size with what the tensor needs. Here every record's declared
// size is checked against its tensor before a byte is allocated, and every record's CRC-32 as it
// is read (the records nothing reads too, at the end). What is not a state dict is told apart
// before the pickle is read, so each kind of wrong file gets its own error.
#include <array>
#include <fstream>
#include <functional>
#include <optional>

#include <c10/core/CPUAllocator.h>
#include <fmt/format.h>

#include "archive/zip_reader.h"
#include "ddp/torch/formats/state_dict.h"
#include "torch/formats/pytorch_archive.h"

namespace ddp::detail {
namespace {

// A state dict's pickle holds names and tensor headers (~100 bytes a tensor); this is ~500,000
// tensors, and bounds the memory the pickle's tree may take (~50 bytes a pickle byte at worst).
constexpr std::uint64_t kMaxPickleBytes = std::uint64_t{64} << 20;
constexpr std::uint64_t kMaxSmallRecordBytes = 4096;

// What the file starts with, told apart before the zip reader sees it.
void check_leading_bytes(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw ConfigError(fmt::format("{}: cannot open the file to read", path.string()));
  std::array<char, 4> head{};
  in.read(head.data(), head.size());
  if (in.gcount() == 4 && head == std::array<char, 4>{'P', 'K', '\x03', '\x04'}) return;
  // torch.save(..., _use_new_zipfile_serialization=False) starts with a pickled magic number
  // (PROTO, then LONG1 0x1950a86a20f9469cfc6c).
  if (in.gcount() >= 3 && head[0] == '\x80' && head[2] == '\x8a') {
    throw StateDictFormatError(fmt::format(
        "{}: PyTorch's legacy (non-zip) format, which ddp does not read: save it again from "
        "Python with torch.save(state_dict, path) (the zip format, the default since 1.6)",
        path.string()));
  }
  throw StateDictFormatError(fmt::format(
      "{}: not a PyTorch zip archive (it does not start with a zip header): expected a file "
      "written by torch.save(model.state_dict(), path) or ddp::save_state_dict",
      path.string()));
}

// The value of an opened archive; `source` names it in errors.
c10::IValue read_opened_archive(const std::function<archive::ZipReader()>& open,
                                const std::string& source,
                                const PytorchArchiveReadOptions& options) {
  std::optional<archive::ZipReader> opened;
  std::string prefix;
  try {
    opened.emplace(open());
    prefix = archive::pytorch_record_prefix(*opened);
  } catch (const archive::FormatError& e) {
    throw StateDictFormatError(fmt::format(
        "{}: not a readable PyTorch zip archive (truncated or corrupted?): {}", source, e.what()));
  }
  const archive::ZipReader& zip = *opened;
  auto record = [&](std::string_view name) { return zip.find(prefix + std::string(name)); };
  try {
    if (record("constants.pkl") != nullptr || record("code/__torch__.py") != nullptr) {
      throw StateDictFormatError(
          fmt::format("{}: a TorchScript archive (torch.jit.save), not a state dict: load it with "
                      "torch::jit::load, or save model.state_dict() from Python",
                      source));
    }
    const archive::ZipEntry* pickle_entry = record("data.pkl");
    if (pickle_entry == nullptr) {
      throw StateDictFormatError(
          fmt::format("{}: a zip archive without data.pkl, not a file torch.save wrote", source));
    }
    if (const archive::ZipEntry* byteorder = record("byteorder")) {
      const std::string order = zip.read_string(*byteorder, kMaxSmallRecordBytes);
      if (order != "little") {
        throw StateDictFormatError(fmt::format(
            "{}: tensors stored in byte order '{}'; ddp reads only 'little'", source, order));
      }
    }
    const std::string pickle = zip.read_string(*pickle_entry, kMaxPickleBytes);
    bool into_used = false;
    const StorageLoader load_storage = [&](const StorageRequest& request) {
      const archive::ZipEntry* entry = record("data/" + request.key);
      if (entry == nullptr) {
        throw StateDictFormatError(fmt::format(
            "{}: the pickle refers to storage '{}', which the archive lacks", source, request.key));
      }
      // Overflow was ruled out by the caller; the record must hold the elements exactly (a
      // storage's bytes, at most one element's worth more), checked before it is allocated.
      const auto item = static_cast<std::uint64_t>(c10::elementSize(request.dtype));
      const auto want = static_cast<std::uint64_t>(request.numel) * item;
      if (entry->size < want || entry->size - want >= item) {
        throw StateDictFormatError(fmt::format(
            "{}: storage '{}' holds {} bytes; its {} elements of {} need {}", source, request.key,
            entry->size, request.numel, c10::toString(request.dtype), want));
      }
      at::DataPtr bytes;
      if (options.array_window != nullptr) {
        if (into_used) {
          throw StateDictFormatError(fmt::format(
              "{}: holds a second storage '{}' where one was expected", source, request.key));
        }
        into_used = true;
        const archive::ZipArrayWindow& window = *options.array_window;
        std::uint64_t array_bytes = window.element_bytes;
        for (const std::uint64_t n : window.shape)
          array_bytes = n != 0 && array_bytes > UINT64_MAX / n ? 0 : array_bytes * n;
        if (entry->size == array_bytes) {
          zip.read_array_window(*entry, window);
          return at::Storage(at::Storage::use_byte_size_t(), static_cast<std::size_t>(want),
                             at::DataPtr(nullptr, at::kCPU), /*allocator=*/nullptr,
                             /*resizable=*/false);
        }
      }
      if (options.into != nullptr) {
        const bool whole = options.into_offset == 0 && entry->size == options.into_bytes;
        if (into_used || entry->size < options.into_offset ||
            entry->size - options.into_offset < options.into_bytes) {
          throw StateDictFormatError(fmt::format(
              "{}: storage '{}' holds {} bytes where one storage of at least {} was expected",
              source, request.key, entry->size, options.into_offset + options.into_bytes));
        }
        into_used = true;
        if (!whole) {
          // A window of the storage: read into the caller's bytes; the tensor views no data.
          zip.read_window(*entry, options.into_offset, options.into_bytes, options.into);
          return at::Storage(at::Storage::use_byte_size_t(), static_cast<std::size_t>(want),
                             at::DataPtr(nullptr, at::kCPU), /*allocator=*/nullptr,
                             /*resizable=*/false);
        }
        bytes = at::DataPtr(options.into, at::kCPU);  // not owned: the caller's memory
      } else {
        bytes = c10::GetCPUAllocator()->allocate(static_cast<std::size_t>(entry->size));
      }
      if (options.verify_crc) {
        zip.read(*entry, bytes.get());
      } else {
        zip.read_unverified(*entry, bytes.get());
      }
      return at::Storage(at::Storage::use_byte_size_t(), static_cast<std::size_t>(want),
                         std::move(bytes), /*allocator=*/nullptr, /*resizable=*/false);
    };
    c10::IValue value = unpickle_restricted(pickle, load_storage, source);
    if ((options.into != nullptr || options.array_window != nullptr) && !into_used) {
      throw StateDictFormatError(fmt::format(
          "{}: holds no storage where one of {} bytes was expected", source, options.into_bytes));
    }
    if (options.verify_crc) zip.verify_unread();
    return value;
  } catch (const archive::FormatError& e) {
    throw StateDictFormatError(
        fmt::format("{}: a damaged PyTorch zip archive: {}", source, e.what()));
  }
}

}  // namespace

c10::IValue read_pytorch_archive(const std::filesystem::path& path,
                                 const PytorchArchiveReadOptions& options) {
  const std::string source = path.string();
  std::error_code ignored;
  if (std::filesystem::is_directory(path, ignored)) {
    throw ConfigError(fmt::format("{}: a directory, not a state dict file", source));
  }
  check_leading_bytes(path);
  return read_opened_archive([&] { return archive::ZipReader::open(path); }, source, options);
}

c10::IValue read_pytorch_archive_range(const std::filesystem::path& path, std::uint64_t offset,
                                       std::uint64_t length, const std::string& source,
                                       const PytorchArchiveReadOptions& options) {
  return read_opened_archive([&] { return archive::ZipReader::open_range(path, offset, length); },
                             source, options);
}

}  // namespace ddp::detail
