#include "idx_reader.h"

#include <zlib.h>

#include <algorithm>
#include <limits>
#include <memory>
#include <system_error>

#include <fmt/format.h>
#include <fmt/ranges.h>

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

// The decompressed bytes of one gzip file, read in bounded steps so that no file can make the
// reader allocate more than its caller allows (a gzip bomb inflates a thousandfold).
class GzipInput {
 public:
  explicit GzipInput(const std::filesystem::path& path) : path_(path) {
    std::error_code error;
    if (!std::filesystem::exists(path, error)) {
      fail(path,
           "no such file (install Debian's dataset-fashion-mnist, or pass --data-dir with "
           "the folder holding the four *-ubyte.gz files)");
    }
    if (!std::filesystem::is_regular_file(path, error)) fail(path, "not a regular file");
    file_.reset(gzopen(path.c_str(), "rb"));
    if (!file_) {
      fail(path, fmt::format("cannot open: {}", std::generic_category().message(errno)));
    }
    gzbuffer(file_.get(), 1 << 17);
  }

  // Appends decompressed bytes to `bytes` until it holds `limit` bytes or the stream ends;
  // throws on corrupt, truncated or uncompressed data.
  void read_until(std::vector<std::uint8_t>& bytes, std::size_t limit) {
    while (!ended_ && bytes.size() < limit) {
      const std::size_t size = bytes.size();
      // Grow geometrically (from 1 MiB), never past the limit.
      const std::size_t step = std::min({limit - size, std::max<std::size_t>(size, 1 << 20),
                                         std::size_t{std::numeric_limits<int>::max()}});
      bytes.resize(size + step);
      const int got = gzread(file_.get(), bytes.data() + size, static_cast<unsigned>(step));
      bytes.resize(size + static_cast<std::size_t>(std::max(got, 0)));
      if (got < 0) fail_corrupt();
      // zlib reads files without a gzip header transparently; a dataset file must be compressed.
      if (!checked_direct_ && got > 0) {
        checked_direct_ = true;
        if (gzdirect(file_.get()) == 1) {
          fail(path_, "not a gzip file (the IDX files are expected gzip-compressed, as *.gz)");
        }
      }
      if (got == 0) {
        ended_ = true;
        // gzread reports a stream cut short as end of file on some zlib versions: ask.
        int code = Z_OK;
        gzerror(file_.get(), &code);
        if (code != Z_OK) fail_corrupt();
      }
    }
  }

 private:
  [[noreturn]] void fail_corrupt() {
    int code = Z_OK;
    const char* message = gzerror(file_.get(), &code);
    fail(path_, fmt::format("corrupt or truncated gzip data ({})",
                            message != nullptr ? message : "unknown zlib error"));
  }

  std::filesystem::path path_;
  GzFile file_;
  bool ended_ = false;
  bool checked_direct_ = false;
};

// The decompressed content of an IDX file: the header first, then at most the payload its sizes
// announce (bounded by kMaxDecompressedBytes) plus a few bytes to notice trailing data, so a
// bomb is refused by its size instead of being inflated. parse_header checks the rest.
std::vector<std::uint8_t> read_idx_bytes(const std::filesystem::path& path,
                                         std::uint32_t expected_magic, std::size_t dimensions) {
  constexpr std::size_t kTrailingProbe = 4096;
  GzipInput input(path);
  std::vector<std::uint8_t> bytes;
  const std::size_t header_size = 4 + 4 * dimensions;
  input.read_until(bytes, header_size);
  if (bytes.empty()) fail(path, "empty file");
  // A file of the wrong kind is left to parse_header, which names it as such.
  if (bytes.size() == header_size && read_big_endian_u32(bytes, 0) == expected_magic) {
    // Each size is < 2^32, so the product is checked against the cap factor by factor.
    std::vector<std::uint32_t> sizes;
    std::size_t announced = 1;
    bool too_large = false;
    for (std::size_t d = 0; d < dimensions; ++d) {
      sizes.push_back(read_big_endian_u32(bytes, 4 + 4 * d));
      if (sizes.back() != 0 && announced > kMaxDecompressedBytes / sizes.back()) too_large = true;
      announced *= too_large ? 1 : sizes.back();
    }
    if (too_large || announced > kMaxDecompressedBytes) {
      fail(path, fmt::format("the header announces {} bytes of data, more than the {} this reader "
                             "accepts (a corrupt file or a gzip bomb?)",
                             fmt::join(sizes, "x"), kMaxDecompressedBytes));
    }
    input.read_until(bytes, header_size + announced + kTrailingProbe);
  }
  return bytes;
}

void check_count(std::size_t count, std::optional<std::size_t> expected,
                 const std::filesystem::path& path, const char* what) {
  if (expected && count != *expected) {
    fail(path, fmt::format("holds {} {}, expected {}", count, what, *expected));
  }
}

}  // namespace

std::vector<std::uint8_t> read_gzip_file(const std::filesystem::path& path, std::size_t max_bytes) {
  GzipInput input(path);
  std::vector<std::uint8_t> bytes;
  // One byte beyond the limit tells "exactly the limit" from "more".
  input.read_until(
      bytes, max_bytes == std::numeric_limits<std::size_t>::max() ? max_bytes : max_bytes + 1);
  if (bytes.size() > max_bytes) {
    fail(path, fmt::format("decompresses to more than {} bytes, the limit (a corrupt file or a "
                           "gzip bomb?)",
                           max_bytes));
  }
  if (bytes.empty()) fail(path, "empty file");
  return bytes;
}

Images read_idx_images(const std::filesystem::path& path,
                       std::optional<std::size_t> expected_count) {
  auto bytes = read_idx_bytes(path, kImagesMagic, 3);
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
  auto bytes = read_idx_bytes(path, kLabelsMagic, 1);
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
