// Reading PyTorch's zip archive: the zip layer is libtorch's PyTorchStreamReader (the reader
// Python's torch.load uses too); what is not a state dict is told apart here, before the pickle
// is read, so each kind of wrong file gets its own error.
#include <array>
#include <fstream>

#include <caffe2/serialize/inline_container.h>
#include <fmt/format.h>

#include "ddp/torch/state_dict.h"
#include "pytorch_archive.h"

namespace ddp::detail {
namespace {

std::string first_line(const std::string& text) {
  return text.substr(0, text.find('\n'));
}

// What the file starts with, told apart before libtorch's zip reader sees it.
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

}  // namespace

c10::IValue read_pytorch_archive(const std::filesystem::path& path) {
  const std::string source = path.string();
  check_leading_bytes(path);
  std::unique_ptr<caffe2::serialize::PyTorchStreamReader> reader;
  try {
    reader = std::make_unique<caffe2::serialize::PyTorchStreamReader>(source);
  } catch (const c10::Error& e) {
    throw StateDictFormatError(
        fmt::format("{}: not a readable PyTorch zip archive (truncated or corrupted?): {}", source,
                    first_line(e.what_without_backtrace())));
  }
  try {
    if (reader->hasRecord("constants.pkl") || reader->hasRecord("code/__torch__.py")) {
      throw StateDictFormatError(
          fmt::format("{}: a TorchScript archive (torch.jit.save), not a state dict: load it with "
                      "torch::jit::load, or save model.state_dict() from Python",
                      source));
    }
    if (!reader->hasRecord("data.pkl")) {
      throw StateDictFormatError(
          fmt::format("{}: a zip archive without data.pkl, not a file torch.save wrote", source));
    }
    if (reader->hasRecord("byteorder")) {
      auto [data, size] = reader->getRecord("byteorder");
      const std::string order(static_cast<const char*>(data.get()), size);
      if (order != "little") {
        throw StateDictFormatError(fmt::format(
            "{}: tensors stored in byte order '{}'; ddp reads only 'little'", source, order));
      }
    }
    auto [pickle, pickle_size] = reader->getRecord("data.pkl");
    const StorageLoader load_storage = [&](const StorageRequest& request) {
      const std::string name = "data/" + request.key;
      if (!reader->hasRecord(name)) {
        throw StateDictFormatError(fmt::format(
            "{}: the pickle refers to storage '{}', which the archive lacks", source, request.key));
      }
      auto [bytes, size] = reader->getRecord(name);
      const auto want = static_cast<std::size_t>(request.numel) * c10::elementSize(request.dtype);
      if (size < want) {
        throw StateDictFormatError(
            fmt::format("{}: storage '{}' holds {} bytes; its {} elements of {} need {}", source,
                        request.key, size, request.numel, c10::toString(request.dtype), want));
      }
      return at::Storage(at::Storage::use_byte_size_t(), want, std::move(bytes),
                         /*allocator=*/nullptr, /*resizable=*/false);
    };
    return unpickle_restricted(
        std::string_view(static_cast<const char*>(pickle.get()), pickle_size), load_storage,
        source);
  } catch (const c10::Error& e) {
    // A record whose checksum or header is wrong (getRecord checks the CRC-32).
    throw StateDictFormatError(fmt::format("{}: a damaged PyTorch zip archive: {}", source,
                                           first_line(e.what_without_backtrace())));
  }
}

}  // namespace ddp::detail
