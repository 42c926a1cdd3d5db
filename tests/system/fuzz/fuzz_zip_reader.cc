// libFuzzer harness: the zip reader (src/archive/zip_reader.h) and what ddp's state-dict reader
// does with it, without torch: the archive's folder, data.pkl through the restricted pickle
// reader, every storage the pickle names read (when its record's declared size fits what the
// pickle asks, as the torch layer requires before allocating) whole and through a window (the
// same bytes, or a finding) and as an array window (a region of it as rows and columns), and the
// CRC-32 of the records nobody read. Any outcome but a result or a FormatError is a finding; so
// are time or memory beyond libFuzzer's limits (a zip bomb, an overlap, a size that lies).
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "archive/zip_reader.h"
#include "pytorch_archive_walk.h"

namespace {

// The harness's own bound on what a storage may allocate: the torch layer allocates what the
// pickle declares; here that is capped so a declared 4 GiB tensor is not a finding.
constexpr std::uint64_t kMaxStorageBytes = std::uint64_t{64} << 20;

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  try {
    const auto zip =
        ddp::archive::ZipReader::from_bytes(std::string(reinterpret_cast<const char*>(data), size));
    const std::string prefix = ddp::archive::pytorch_record_prefix(zip);
    const auto* pickle_entry = zip.find(prefix + "data.pkl");
    if (pickle_entry == nullptr) {
      zip.verify_unread();
      return 0;
    }
    const std::string pickle = zip.read_string(*pickle_entry, std::uint64_t{64} << 20);
    const auto tree = ddp::archive::read_pickle(pickle, {.allow_global = ddp::fuzz::torch_global});
    tree.check_shape({});
    ddp::fuzz::walk_pickle(tree, [&](const std::string& key, std::uint64_t numel) {
      const auto* entry = zip.find(prefix + "data/" + key);
      if (entry == nullptr || entry->size < numel || entry->size - numel >= 16 ||
          entry->size > kMaxStorageBytes) {
        return;
      }
      std::vector<char> bytes(static_cast<std::size_t>(entry->size));
      zip.read(*entry, bytes.data());
      // A window of the record (what a resharding load reads) holds the same bytes as the whole
      // read: a window placed by the input's own size, so the fuzzer moves it.
      const std::uint64_t begin = entry->size == 0 ? 0 : size % (entry->size + 1);
      const std::uint64_t length = (entry->size - begin) / 2 + (size & 1) * (entry->size > begin);
      std::vector<char> window(static_cast<std::size_t>(length));
      zip.read_window(*entry, begin, length, window.data());
      if (!std::equal(window.begin(), window.end(),
                      bytes.begin() + static_cast<std::ptrdiff_t>(begin))) {
        std::fprintf(stderr, "fuzz_zip_reader: a window of '%s' differs from the whole read\n",
                     entry->name.c_str());
        std::abort();
      }
      // The record as a [rows, cols] array of bytes, a region of it kept in a destination whose
      // rows are one byte longer (a column split's read): each byte kept is the whole read's.
      std::uint64_t cols = 1 + size % 8;
      if (entry->size % cols != 0) cols = 1;
      const std::uint64_t rows = entry->size / cols;
      const std::uint64_t row0 = size % (rows + 1), col0 = (size / 8) % (cols + 1);
      const std::uint64_t row_count = (rows - row0 + 1) / 2, col_count = cols - col0;
      std::vector<unsigned char> kept(static_cast<std::size_t>(row_count * (col_count + 1)) + 1);
      zip.read_array_window(*entry, {.shape = {rows, cols},
                                     .element_bytes = 1,
                                     .begin = {row0, col0},
                                     .count = {row_count, col_count},
                                     .out = kept.data(),
                                     .out_strides = {col_count + 1, 1}});
      for (std::uint64_t r = 0; r < row_count; ++r) {
        for (std::uint64_t c = 0; c < col_count; ++c) {
          if (kept[r * (col_count + 1) + c] !=
              static_cast<unsigned char>(bytes[(row0 + r) * cols + col0 + c])) {
            std::fprintf(stderr, "fuzz_zip_reader: an array window of '%s' differs\n",
                         entry->name.c_str());
            std::abort();
          }
        }
      }
    });
    zip.verify_unread();
  } catch (const ddp::archive::FormatError&) {
  }
  return 0;
}
