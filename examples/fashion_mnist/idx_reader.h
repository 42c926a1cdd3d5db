// Reading Fashion-MNIST (and MNIST) from their gzipped IDX files, without libtorch.
//
//   fmnist::Dataset data = fmnist::load_dataset("/usr/share/datasets/fashion-mnist");
//   data.train.count == 60000; data.train.pixels.size() == 60000 * 28 * 28;
//
// An IDX file is a big-endian header (a magic number: 0x00000803 for a rank-3 array of unsigned
// bytes, 0x00000801 for rank 1; then one 32-bit size per dimension) followed by exactly the
// product of the sizes in bytes. The files are gzip-compressed, as Debian's dataset-fashion-mnist
// installs them. Everything is checked: gzip framing, magic number, 28x28 images, the expected
// counts (60000 train, 10000 test), images and labels agreeing, labels in 0..9, and the exact
// payload length (no missing and no trailing bytes). The IDX readers decompress no more than the
// header announces (plus a few bytes to notice trailing data), and no header may announce more
// than kMaxDecompressedBytes.
//
// Functions are free of shared state and safe to call from any thread. Every failure throws
// DatasetError (a ddp::ConfigError) whose message names the file and what is wrong with it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "ddp/error.h"

namespace fmnist {

class DatasetError : public ddp::ConfigError {
 public:
  using ddp::ConfigError::ConfigError;
};

inline constexpr std::uint32_t kImagesMagic = 0x00000803;
inline constexpr std::uint32_t kLabelsMagic = 0x00000801;
inline constexpr std::size_t kRows = 28;
inline constexpr std::size_t kCols = 28;
inline constexpr std::size_t kClasses = 10;
inline constexpr std::size_t kTrainCount = 60000;
inline constexpr std::size_t kTestCount = 10000;
inline constexpr const char* kDefaultDataDir = "/usr/share/datasets/fashion-mnist";

struct Images {
  std::size_t count = 0;
  std::size_t rows = 0;
  std::size_t cols = 0;
  std::vector<std::uint8_t> pixels;  // count * rows * cols, image after image, row-major
};

// One split: images[i] has label labels[i].
struct Split {
  std::size_t count = 0;
  std::vector<std::uint8_t> pixels;  // count * kRows * kCols
  std::vector<std::uint8_t> labels;  // count, each < kClasses
};

struct Dataset {
  Split train;
  Split test;
};

// The most bytes a file may decompress to (Fashion-MNIST's largest holds 47 MB): a corrupt
// header or a gzip bomb is refused with an error naming the file, never by std::bad_alloc.
inline constexpr std::size_t kMaxDecompressedBytes = std::size_t{1} << 30;

// The whole decompressed content of a gzip file; more than `max_bytes` is an error.
std::vector<std::uint8_t> read_gzip_file(const std::filesystem::path& path,
                                         std::size_t max_bytes = kMaxDecompressedBytes);

// An IDX image file of 28x28 images; with `expected_count`, the count must be exactly that.
Images read_idx_images(const std::filesystem::path& path,
                       std::optional<std::size_t> expected_count = std::nullopt);

// An IDX label file; labels must lie in 0..9.
std::vector<std::uint8_t> read_idx_labels(const std::filesystem::path& path,
                                          std::optional<std::size_t> expected_count = std::nullopt);

// `prefix` is "train" or "t10k": reads PREFIX-images-idx3-ubyte.gz and PREFIX-labels-idx1-ubyte.gz
// from `dir` and checks that they hold the same number of samples.
Split load_split(const std::filesystem::path& dir, const std::string& prefix,
                 std::optional<std::size_t> expected_count = std::nullopt);

// Both splits, with the standard counts (60000 and 10000).
Dataset load_dataset(const std::filesystem::path& dir);

}  // namespace fmnist
