#include "torch/checkpoint/checkpoint_integrity.h"

#include <zlib.h>

#include <cstdint>
#include <map>
#include <set>
#include <sstream>
#include <string>

#include <fmt/format.h>

#include "ddp/error.h"

namespace ddp::detail {
namespace {

using Checksums = std::map<std::string, std::uint32_t>;

// Paths of collect()'s entries that are tensors, for messages.
using TensorPaths = std::set<std::string>;

std::uint32_t crc_of(std::uint32_t crc, const void* data, std::size_t size) {
  return static_cast<std::uint32_t>(
      ::crc32_z(crc, static_cast<const Bytef*>(data), static_cast<z_size_t>(size)));
}

std::uint32_t crc_of_text(const std::string& text) {
  return crc_of(::crc32_z(0, nullptr, 0), text.data(), text.size());
}

// dtype and shape first, so that a damaged header is caught as well as damaged data.
std::uint32_t crc_of_tensor(const torch::Tensor& tensor) {
  if (!tensor.defined()) return crc_of_text("undefined tensor");
  std::uint32_t crc = crc_of_text(
      fmt::format("{} [{}]", c10::toString(tensor.scalar_type()), fmt::join(tensor.sizes(), ",")));
  if (tensor.layout() != torch::kStrided) {
    std::ostringstream text;
    text << tensor;
    const std::string printed = text.str();
    return crc_of(crc, printed.data(), printed.size());
  }
  const torch::Tensor bytes = tensor.to(torch::kCPU).contiguous();
  return crc_of(crc, bytes.data_ptr(), bytes.nbytes());
}

// Every tensor and other value of `archive`, by dotted path; nested archives are walked.
void collect(torch::serialize::InputArchive& archive, const std::string& prefix, Checksums& out,
             TensorPaths* tensors = nullptr) {
  for (const std::string& key : archive.keys()) {
    if (prefix.empty() && key == kChecksumsEntry) continue;
    const std::string path = prefix.empty() ? key : prefix + "." + key;
    c10::IValue value;
    if (!archive.try_read(key, value)) continue;
    if (value.isTensor()) {
      out[path] = crc_of_tensor(value.toTensor());
      if (tensors != nullptr) tensors->insert(path);
    } else if (value.isObject() || value.isModule()) {
      torch::serialize::InputArchive nested;
      if (archive.try_read(key, nested)) collect(nested, path, out, tensors);
    } else {
      std::ostringstream text;
      text << value;
      out[path] = crc_of_text(text.str());
    }
  }
}

std::string to_text(const Checksums& checksums) {
  std::string text;
  for (const auto& [path, crc] : checksums)
    text += fmt::format("{:08x} {}\n", crc, path);
  return text;
}

// The inverse of to_text; false when the text is not in that form.
bool from_text(const std::string& text, Checksums& out) {
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    if (line.size() < 10 || line[8] != ' ') return false;
    std::uint32_t crc = 0;
    try {
      std::size_t used = 0;
      crc = static_cast<std::uint32_t>(std::stoul(line.substr(0, 8), &used, 16));
      if (used != 8) return false;
    } catch (const std::exception&) {
      return false;
    }
    out[line.substr(9)] = crc;
  }
  return true;
}

}  // namespace

void add_checksums(torch::serialize::OutputArchive& archive) {
  // The checksums describe the archive as it will be read back, so compute them from a copy
  // read back from memory (a replaced entry from an earlier call is skipped by collect()).
  std::string bytes;
  torch::serialize::InputArchive readback;
  try {
    archive.save_to([&](const void* data, std::size_t size) -> std::size_t {
      bytes.append(static_cast<const char*>(data), size);
      return size;
    });
    readback.load_from(bytes.data(), bytes.size());
  } catch (const c10::Error& e) {
    throw Error(fmt::format("checkpoint: cannot compute the checksums of an archive: {}",
                            e.what_without_backtrace()));
  }
  Checksums checksums;
  collect(readback, "", checksums);
  archive.write(kChecksumsEntry, c10::IValue(to_text(checksums)));
}

bool verify_checksums(torch::serialize::InputArchive& archive, const std::filesystem::path& path) {
  c10::IValue stored;
  if (!archive.try_read(kChecksumsEntry, stored)) return false;
  const auto fail = [&](const std::string& what) {
    return Error(
        fmt::format("checkpoint: {} is damaged: {}; restore it from a copy or save it "
                    "again",
                    path.string(), what));
  };
  Checksums expected;
  if (!stored.isString() || !from_text(stored.toStringRef(), expected)) {
    throw fail(fmt::format("its '{}' entry is unreadable", kChecksumsEntry));
  }
  Checksums actual;
  TensorPaths tensors;
  try {
    collect(archive, "", actual, &tensors);
  } catch (const c10::Error& e) {
    throw fail(fmt::format("an entry cannot be read: {}", e.what_without_backtrace()));
  }
  for (const auto& [name, crc] : actual) {
    const auto it = expected.find(name);
    if (it == expected.end()) {
      throw fail(fmt::format("entry '{}' is not in its list of checksums", name));
    }
    if (it->second != crc) {
      throw fail(
          fmt::format("{} '{}' has checksum {:08x}, but {:08x} was stored when it was "
                      "written",
                      tensors.contains(name) ? "tensor" : "value", name, crc, it->second));
    }
  }
  for (const auto& [name, crc] : expected) {
    if (!actual.contains(name)) throw fail(fmt::format("entry '{}' is missing", name));
  }
  return true;
}

}  // namespace ddp::detail
