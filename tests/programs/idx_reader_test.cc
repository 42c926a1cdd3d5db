// The Fashion-MNIST IDX reader on small files the tests write (valid and broken in every way the
// reader checks), and once on the dataset Debian installs.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <stdlib.h>
#include <zlib.h>

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "idx_reader.h"
#include "support/temp_dir.h"

namespace fmnist {
namespace {

using ::testing::HasSubstr;

using TempDir = ::ddp::test::TempDir;

void append_u32(std::vector<std::uint8_t>& out, std::uint32_t value) {
  for (int shift = 24; shift >= 0; shift -= 8)
    out.push_back(static_cast<std::uint8_t>(value >> shift));
}

// An IDX image file of `count` images of rows x cols; pixel values are a function of position.
std::vector<std::uint8_t> idx_images(std::uint32_t count, std::uint32_t rows = 28,
                                     std::uint32_t cols = 28, std::uint32_t magic = kImagesMagic) {
  std::vector<std::uint8_t> out;
  append_u32(out, magic);
  append_u32(out, count);
  append_u32(out, rows);
  append_u32(out, cols);
  for (std::size_t i = 0; i < std::size_t{count} * rows * cols; ++i) {
    out.push_back(static_cast<std::uint8_t>(i * 7 % 256));
  }
  return out;
}

std::vector<std::uint8_t> idx_labels(std::uint32_t count, std::uint32_t magic = kLabelsMagic) {
  std::vector<std::uint8_t> out;
  append_u32(out, magic);
  append_u32(out, count);
  for (std::uint32_t i = 0; i < count; ++i)
    out.push_back(static_cast<std::uint8_t>(i % 10));
  return out;
}

void write_gzip(const std::filesystem::path& path, const std::vector<std::uint8_t>& bytes) {
  gzFile file = gzopen(path.c_str(), "wb");
  ASSERT_NE(file, nullptr);
  if (!bytes.empty()) {
    ASSERT_EQ(gzwrite(file, bytes.data(), static_cast<unsigned>(bytes.size())),
              static_cast<int>(bytes.size()));
  }
  ASSERT_EQ(gzclose(file), Z_OK);
}

void write_plain(const std::filesystem::path& path, const std::vector<std::uint8_t>& bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(bytes.data()),
            static_cast<std::streamsize>(bytes.size()));
}

// The message of the DatasetError `fn` throws ("" and a test failure when it throws none).
template <typename Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const DatasetError& e) {
    return e.what();
  }
  ADD_FAILURE() << "no DatasetError was thrown";
  return "";
}

TEST(IdxReaderTest, ReadsValidImagesAndLabels) {
  TempDir dir;
  write_gzip(dir / "i.gz", idx_images(3));
  write_gzip(dir / "l.gz", idx_labels(3));
  const auto images = read_idx_images(dir / "i.gz", 3);
  EXPECT_EQ(images.count, 3u);
  EXPECT_EQ(images.rows, 28u);
  EXPECT_EQ(images.cols, 28u);
  const auto file = idx_images(3);
  EXPECT_EQ(images.pixels, std::vector<std::uint8_t>(file.begin() + 16, file.end()));
  EXPECT_EQ(read_idx_labels(dir / "l.gz"), (std::vector<std::uint8_t>{0, 1, 2}));
}

TEST(IdxReaderTest, LoadSplitPairsImagesWithLabels) {
  TempDir dir;
  write_gzip(dir / "train-images-idx3-ubyte.gz", idx_images(5));
  write_gzip(dir / "train-labels-idx1-ubyte.gz", idx_labels(5));
  const auto split = load_split(dir.path(), "train", 5);
  EXPECT_EQ(split.count, 5u);
  EXPECT_EQ(split.pixels.size(), 5u * 28 * 28);
  EXPECT_EQ(split.labels.size(), 5u);

  write_gzip(dir / "t10k-images-idx3-ubyte.gz", idx_images(4));
  write_gzip(dir / "t10k-labels-idx1-ubyte.gz", idx_labels(3));
  const auto message = error_of([&] { load_split(dir.path(), "t10k"); });
  EXPECT_THAT(message, HasSubstr("holds 4 images but"));
  EXPECT_THAT(message, HasSubstr("t10k-labels-idx1-ubyte.gz holds 3 labels"));
}

TEST(IdxReaderTest, MissingFileNamesThePath) {
  TempDir dir;
  const auto message = error_of([&] { read_idx_images(dir / "absent.gz"); });
  EXPECT_THAT(message, HasSubstr((dir / "absent.gz").string()));
  EXPECT_THAT(message, HasSubstr("no such file"));
}

TEST(IdxReaderTest, MissingFolderNamesThePath) {
  const auto message = error_of([] { load_dataset("/nonexistent/fashion-mnist-folder"); });
  EXPECT_THAT(message, HasSubstr("/nonexistent/fashion-mnist-folder"));
  EXPECT_THAT(message, HasSubstr("--data-dir"));
}

TEST(IdxReaderTest, FileThatIsNotGzipIsRejected) {
  TempDir dir;
  write_plain(dir / "plain.gz", idx_images(2));  // a valid IDX file, but not compressed
  const auto message = error_of([&] { read_idx_images(dir / "plain.gz"); });
  EXPECT_THAT(message, HasSubstr((dir / "plain.gz").string()));
  EXPECT_THAT(message, HasSubstr("not a gzip file"));
}

TEST(IdxReaderTest, TruncatedGzipStreamIsRejected) {
  TempDir dir;
  write_gzip(dir / "full.gz", idx_images(50));
  std::filesystem::copy_file(dir / "full.gz", dir / "cut.gz");
  std::filesystem::resize_file(dir / "cut.gz", std::filesystem::file_size(dir / "full.gz") / 2);
  const auto message = error_of([&] { read_idx_images(dir / "cut.gz"); });
  EXPECT_THAT(message, HasSubstr((dir / "cut.gz").string()));
  EXPECT_THAT(message, HasSubstr("truncated"));
}

TEST(IdxReaderTest, PayloadShorterOrLongerThanTheHeaderSaysIsRejected) {
  TempDir dir;
  auto short_payload = idx_images(3);
  short_payload.resize(short_payload.size() - 10);
  write_gzip(dir / "short.gz", short_payload);
  auto message = error_of([&] { read_idx_images(dir / "short.gz"); });
  EXPECT_THAT(message, HasSubstr("truncated: the header announces 2352 bytes of data but only "
                                 "2342 follow"));

  auto long_payload = idx_labels(3);
  long_payload.push_back(1);
  write_gzip(dir / "long.gz", long_payload);
  message = error_of([&] { read_idx_labels(dir / "long.gz"); });
  EXPECT_THAT(message, HasSubstr("1 unexpected bytes after the 3 bytes"));

  write_gzip(dir / "header.gz", {0, 0, 8, 3, 0});
  message = error_of([&] { read_idx_images(dir / "header.gz"); });
  EXPECT_THAT(message, HasSubstr("only 5 bytes"));

  write_gzip(dir / "empty.gz", {});
  message = error_of([&] { read_idx_images(dir / "empty.gz"); });
  EXPECT_THAT(message, HasSubstr("empty"));
}

// A gzip bomb: `header` (compressed), then `members` gzip members of 16 MiB of zeros each, so a
// file of about 16 KiB per member inflates a thousandfold (gzip readers join members).
void write_bomb(const std::filesystem::path& path, const std::vector<std::uint8_t>& header,
                int members) {
  write_gzip(path.string() + ".head", header);
  const std::vector<std::uint8_t> zeros(std::size_t{16} << 20, 0);
  write_gzip(path.string() + ".zeros", zeros);
  std::ofstream out(path, std::ios::binary);
  out << std::ifstream(path.string() + ".head", std::ios::binary).rdbuf();
  std::ifstream member(path.string() + ".zeros", std::ios::binary);
  const std::string zeros_member((std::istreambuf_iterator<char>(member)), {});
  for (int i = 0; i < members; ++i)
    out.write(zeros_member.data(), static_cast<std::streamsize>(zeros_member.size()));
}

TEST(IdxReaderTest, GzipBombIsRefusedNamingTheFileWithoutInflatingIt) {
  TempDir dir;
  // A valid header of 3 images, then 2 GiB of zeros: only what the header announces is read.
  const auto bomb = dir / "bomb-images.gz";
  write_bomb(bomb, idx_images(3), 128);
  ASSERT_LT(std::filesystem::file_size(bomb), std::size_t{8} << 20);
  const auto start = std::chrono::steady_clock::now();
  auto message = error_of([&] { read_idx_images(bomb); });
  EXPECT_THAT(message, HasSubstr(bomb.string()));
  EXPECT_THAT(message, HasSubstr("unexpected bytes after the 2352 bytes of data"));
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));

  // A header that announces 4 G images of 28x28: refused by its size before any data is read.
  std::vector<std::uint8_t> huge;
  append_u32(huge, kImagesMagic);
  append_u32(huge, 0xffffffffu);
  append_u32(huge, 28);
  append_u32(huge, 28);
  const auto liar = dir / "liar-images.gz";
  write_bomb(liar, huge, 4);
  message = error_of([&] { read_idx_images(liar); });
  EXPECT_THAT(message, HasSubstr(liar.string()));
  EXPECT_THAT(message, HasSubstr("the header announces 4294967295x28x28 bytes of data"));
  EXPECT_THAT(message, HasSubstr("gzip bomb"));

  // The same for labels, whose header has one size.
  std::vector<std::uint8_t> many_labels;
  append_u32(many_labels, kLabelsMagic);
  append_u32(many_labels, 0xffffffffu);
  const auto labels = dir / "liar-labels.gz";
  write_bomb(labels, many_labels, 1);
  message = error_of([&] { read_idx_labels(labels); });
  EXPECT_THAT(message, HasSubstr(labels.string()));
  EXPECT_THAT(message, HasSubstr("4294967295 bytes of data"));

  // Whole-file reads stop at their limit.
  const auto zeros = dir / "zeros.gz";
  write_bomb(zeros, {1}, 8);  // 128 MiB + 1 byte
  message = error_of([&] { read_gzip_file(zeros, std::size_t{64} << 20); });
  EXPECT_THAT(message, HasSubstr(zeros.string()));
  EXPECT_THAT(message, HasSubstr("decompresses to more than 67108864 bytes"));
}

TEST(IdxReaderTest, WrongMagicNumberIsRejected) {
  TempDir dir;
  // A label file where images are expected, and the other way round.
  write_gzip(dir / "labels.gz", idx_labels(3));
  auto message = error_of([&] { read_idx_images(dir / "labels.gz"); });
  EXPECT_THAT(message, HasSubstr("magic number is 0x00000801, expected 0x00000803"));
  write_gzip(dir / "images.gz", idx_images(1));
  message = error_of([&] { read_idx_labels(dir / "images.gz"); });
  EXPECT_THAT(message, HasSubstr("magic number is 0x00000803, expected 0x00000801"));
  write_gzip(dir / "floats.gz", idx_images(1, 28, 28, 0x00000d03));
  message = error_of([&] { read_idx_images(dir / "floats.gz"); });
  EXPECT_THAT(message, HasSubstr("0x00000d03"));
}

TEST(IdxReaderTest, WrongDimensionsOrCountsAreRejected) {
  TempDir dir;
  write_gzip(dir / "small.gz", idx_images(2, 14, 14));
  auto message = error_of([&] { read_idx_images(dir / "small.gz"); });
  EXPECT_THAT(message, HasSubstr("images are 14x14, expected 28x28"));

  write_gzip(dir / "few.gz", idx_images(2));
  message = error_of([&] { read_idx_images(dir / "few.gz", 60000); });
  EXPECT_THAT(message, HasSubstr("holds 2 images, expected 60000"));

  write_gzip(dir / "few-labels.gz", idx_labels(2));
  message = error_of([&] { read_idx_labels(dir / "few-labels.gz", 10000); });
  EXPECT_THAT(message, HasSubstr("holds 2 labels, expected 10000"));
}

TEST(IdxReaderTest, LabelOutsideTheTenClassesIsRejected) {
  TempDir dir;
  auto labels = idx_labels(4);
  labels.back() = 10;
  write_gzip(dir / "bad.gz", labels);
  const auto message = error_of([&] { read_idx_labels(dir / "bad.gz"); });
  EXPECT_THAT(message, HasSubstr("label 10 of sample 3 is outside 0..9"));
}

TEST(IdxReaderTest, ReadsTheInstalledDataset) {
  const std::filesystem::path dir = kDefaultDataDir;
  if (!std::filesystem::exists(dir / "train-images-idx3-ubyte.gz")) {
    GTEST_SKIP() << dir << " has no Fashion-MNIST files; install Debian's dataset-fashion-mnist";
  }
  const auto data = load_dataset(dir);
  EXPECT_EQ(data.train.count, 60000u);
  EXPECT_EQ(data.test.count, 10000u);
  EXPECT_EQ(data.train.pixels.size(), 60000u * 28 * 28);
  EXPECT_EQ(data.test.labels.size(), 10000u);
  // Fashion-MNIST is balanced: 6000 training and 1000 test images per class.
  std::vector<int> per_class(10, 0);
  for (auto label : data.train.labels)
    ++per_class[label];
  for (int c = 0; c < 10; ++c)
    EXPECT_EQ(per_class[c], 6000) << "class " << c;
  // The mean pixel the training program normalises with (0.2860).
  double sum = 0;
  for (auto p : data.train.pixels)
    sum += p;
  EXPECT_NEAR(sum / 255.0 / static_cast<double>(data.train.pixels.size()), 0.2860, 0.0005);
}

}  // namespace
}  // namespace fmnist
