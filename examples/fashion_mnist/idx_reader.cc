#include "idx_reader.h"

#include <zlib.h>

#include <limits>
#include <memory>
#include <system_error>

#include <fmt/format.h>

namespace fmnist {
namespace {

[[noreturn]] void fail(const std::filesystem::path& path, const std::string& what) {
  throw DatasetError(fmt::format("Fashion-MNIST file {}: {}", path.string(), what));
}

struct GzCloser {
  void operator()(gzFile file) const { gzclose(file); }
};
using GzFile = std::unique_ptr<gzFile_s, GzCloser>;

std::uint32_t read_big_endian_u32(const std::vector<std::uint8_t>& bytes, std::size_t offset) {
  return (std::uint32_t{bytes[offset]} << 24) | (std::uint32_t{bytes[offset + 1]} << 16) |
         (std::uint32_t{bytes[offset + 2]} << 8) | std::uint32_t{bytes[offset + 3]};
}

// Checks the header of an IDX file of unsigned bytes with `dimensions` sizes and returns the
// sizes; then checks that exactly their product of payload bytes follows.
std::vector<std::size_t> parse_header(const std::vector<std::uint8_t>& bytes,
                                      std::uint32_t expected_magic, std::size_t dimensions,
                                      const std::filesystem::path& path) {
  const std::size_t header_size = 4 + 4 * dimensions;
  // The magic number first: a file of the wrong kind is better named as such than as too short.
  if (bytes.size() >= 4) {
    const std::uint32_t magic = read_big_endian_u32(bytes, 0);
    if (magic != expected_magic) {
      fail(path, fmt::format("magic number is 0x{:08x}, expected 0x{:08x} ({} of unsigned "
                             "bytes); is this the right file?",
                             magic, expected_magic,
                             expected_magic == kImagesMagic ? "IDX images" : "IDX labels"));
    }
  }
  if (bytes.size() < header_size) {
    fail(path, fmt::format("only {} bytes after decompression; an IDX header of {} dimensions "
                           "needs {}",
                           bytes.size(), dimensions, header_size));
  }
  std::vector<std::size_t> sizes;
  std::size_t payload = 1;
  for (std::size_t d = 0; d < dimensions; ++d) {
    sizes.push_back(read_big_endian_u32(bytes, 4 + 4 * d));
    payload *= sizes.back();  // each size < 2^32 and dimensions <= 3: no overflow in 64 bits
  }
  const std::size_t actual = bytes.size() - header_size;
  if (actual < payload) {
    fail(path, fmt::format("truncated: the header announces {} bytes of data but only {} follow",
                           payload, actual));
  }
  if (actual > payload) {
    fail(path, fmt::format("{} unexpected bytes after the {} bytes of data the header announces",
                           actual - payload, payload));
  }
  return sizes;
}

void check_count(std::size_t count, std::optional<std::size_t> expected,
                 const std::filesystem::path& path, const char* what) {
  if (expected && count != *expected) {
    fail(path, fmt::format("holds {} {}, expected {}", count, what, *expected));
  }
}

}  // namespace

std::vector<std::uint8_t> read_gzip_file(const std::filesystem::path& path) {
  std::error_code error;
  if (!std::filesystem::exists(path, error)) {
    fail(path,
         "no such file (install Debian's dataset-fashion-mnist, or pass --data-dir with "
         "the folder holding the four *-ubyte.gz files)");
  }
  if (!std::filesystem::is_regular_file(path, error)) fail(path, "not a regular file");

  GzFile file(gzopen(path.c_str(), "rb"));
  if (!file) fail(path, fmt::format("cannot open: {}", std::generic_category().message(errno)));
  gzbuffer(file.get(), 1 << 17);

  std::vector<std::uint8_t> bytes;
  std::size_t size = 0;
  bytes.resize(1 << 20);
  for (;;) {
    if (size == bytes.size()) bytes.resize(bytes.size() * 2);
    const auto want = static_cast<unsigned>(
        std::min<std::size_t>(bytes.size() - size, std::numeric_limits<int>::max()));
    const int got = gzread(file.get(), bytes.data() + size, want);
    if (got < 0) {
      int code = Z_OK;
      const char* message = gzerror(file.get(), &code);
      fail(path, fmt::format("corrupt or truncated gzip data ({})",
                             message != nullptr ? message : "unknown zlib error"));
    }
    // zlib reads files without a gzip header transparently; a dataset file must be compressed.
    if (size == 0 && got > 0 && gzdirect(file.get()) == 1) {
      fail(path, "not a gzip file (the IDX files are expected gzip-compressed, as *.gz)");
    }
    if (got == 0) break;
    size += static_cast<std::size_t>(got);
  }
  // gzread reports a stream cut short as end of file on some zlib versions: ask explicitly.
  int code = Z_OK;
  const char* message = gzerror(file.get(), &code);
  if (code != Z_OK) {
    fail(path, fmt::format("corrupt or truncated gzip data ({})",
                           message != nullptr ? message : "unknown zlib error"));
  }
  if (size == 0) fail(path, "empty file");
  bytes.resize(size);
  return bytes;
}

Images read_idx_images(const std::filesystem::path& path,
                       std::optional<std::size_t> expected_count) {
  auto bytes = read_gzip_file(path);
  const auto sizes = parse_header(bytes, kImagesMagic, 3, path);
  if (sizes[1] != kRows || sizes[2] != kCols) {
    fail(path, fmt::format("images are {}x{}, expected {}x{}", sizes[1], sizes[2], kRows, kCols));
  }
  check_count(sizes[0], expected_count, path, "images");
  Images images{.count = sizes[0], .rows = sizes[1], .cols = sizes[2]};
  bytes.erase(bytes.begin(), bytes.begin() + 16);
  images.pixels = std::move(bytes);
  return images;
}

std::vector<std::uint8_t> read_idx_labels(const std::filesystem::path& path,
                                          std::optional<std::size_t> expected_count) {
  auto bytes = read_gzip_file(path);
  const auto sizes = parse_header(bytes, kLabelsMagic, 1, path);
  check_count(sizes[0], expected_count, path, "labels");
  bytes.erase(bytes.begin(), bytes.begin() + 8);
  for (std::size_t i = 0; i < bytes.size(); ++i) {
    if (bytes[i] >= kClasses) {
      fail(path,
           fmt::format("label {} of sample {} is outside 0..{}", int{bytes[i]}, i, kClasses - 1));
    }
  }
  return bytes;
}

Split load_split(const std::filesystem::path& dir, const std::string& prefix,
                 std::optional<std::size_t> expected_count) {
  const auto images_path = dir / (prefix + "-images-idx3-ubyte.gz");
  const auto labels_path = dir / (prefix + "-labels-idx1-ubyte.gz");
  auto images = read_idx_images(images_path, expected_count);
  auto labels = read_idx_labels(labels_path, expected_count);
  if (images.count != labels.size()) {
    fail(images_path, fmt::format("holds {} images but {} holds {} labels", images.count,
                                  labels_path.string(), labels.size()));
  }
  return Split{
      .count = images.count, .pixels = std::move(images.pixels), .labels = std::move(labels)};
}

Dataset load_dataset(const std::filesystem::path& dir) {
  std::error_code error;
  if (!std::filesystem::is_directory(dir, error)) {
    throw DatasetError(
        fmt::format("Fashion-MNIST folder {} does not exist or is not a folder (install Debian's "
                    "dataset-fashion-mnist, or pass --data-dir with the folder holding "
                    "train-images-idx3-ubyte.gz and the other three files)",
                    dir.string()));
  }
  return Dataset{.train = load_split(dir, "train", kTrainCount),
                 .test = load_split(dir, "t10k", kTestCount)};
}

}  // namespace fmnist
