// libFuzzer harness: the Fashion-MNIST IDX/gzip reader (examples/fashion_mnist/idx_reader.h).
//
// The first input byte picks what the rest is: bit 0 = 0, an IDX payload the harness
// gzip-compresses (so inputs reach the IDX checks), bit 0 = 1, the file's raw bytes (gzip framing
// and zlib's error paths); bit 1 picks read_idx_labels over read_idx_images, bit 2 asks for an
// expected count of 1. The reader must return or throw DatasetError naming the file, nothing
// else; what it returns must be consistent with what it checked.
#include <unistd.h>
#include <zlib.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <optional>
#include <string>

#include "idx_reader.h"

namespace {

// A temporary file for this process, removed at exit.
struct ScratchFile {
  std::filesystem::path path;
  ScratchFile() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "ddp-fuzz-idx-XXXXXX").string();
    const int fd = ::mkstemp(tmpl.data());
    if (fd < 0) {
      std::perror("mkstemp");
      std::abort();
    }
    ::close(fd);
    path = tmpl;
  }
  ~ScratchFile() {
    std::error_code ignored;
    std::filesystem::remove(path, ignored);
  }
};

const std::filesystem::path& scratch_file() {
  static const ScratchFile file;
  return file.path;
}

void write_file(const std::filesystem::path& path, const std::uint8_t* data, std::size_t size,
                bool compress) {
  if (compress) {
    gzFile out = gzopen(path.c_str(), "wb");
    if (out == nullptr || (size > 0 && gzwrite(out, data, static_cast<unsigned>(size)) == 0) ||
        gzclose(out) != Z_OK) {
      std::abort();
    }
    return;
  }
  std::FILE* out = std::fopen(path.c_str(), "wb");
  if (out == nullptr || std::fwrite(data, 1, size, out) != size || std::fclose(out) != 0) {
    std::abort();
  }
}

[[noreturn]] void fail(const char* what) {
  std::fprintf(stderr, "fuzz_idx_reader: %s\n", what);
  std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  const std::uint8_t mode = data[0];
  const auto& path = scratch_file();
  write_file(path, data + 1, size - 1, (mode & 1) == 0);
  const std::optional<std::size_t> expected =
      (mode & 4) != 0 ? std::optional<std::size_t>(1) : std::nullopt;
  try {
    if ((mode & 2) != 0) {
      const auto labels = fmnist::read_idx_labels(path, expected);
      if (expected && labels.size() != *expected) fail("labels: count differs from expected");
      for (const auto label : labels)
        if (label >= fmnist::kClasses) fail("labels: a label outside 0..9 was returned");
    } else {
      const auto images = fmnist::read_idx_images(path, expected);
      if (images.rows != fmnist::kRows || images.cols != fmnist::kCols) fail("images: bad shape");
      if (images.pixels.size() != images.count * images.rows * images.cols) {
        fail("images: pixel count differs from the header");
      }
      if (expected && images.count != *expected) fail("images: count differs from expected");
    }
  } catch (const fmnist::DatasetError& e) {
    if (std::string(e.what()).find(path.string()) == std::string::npos) {
      fail("a DatasetError does not name the file");
    }
  }
  return 0;
}
