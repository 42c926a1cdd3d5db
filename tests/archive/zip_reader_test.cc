// The zip reader (src/archive/zip_reader.h) against archives made here: every record read back,
// every CRC-32 checked, declared sizes that lie refused before they cost memory or time, and
// broken structure refused by name, never a crash (each test would crash or pass a damaged
// byte on a reader without the check it names).
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>

#include <gtest/gtest.h>

#include "archive/zip_reader.h"
#include "support/hostile_archives.h"
#include "support/resident_memory.h"
#include "support/temp_dir.h"
#include "support/unity_namespace.h"

namespace ddp::archive {
namespace {
namespace DDP_UNITY_ID {

using test::make_zip;
using test::ZipRecord;

std::string read_all(const ZipReader& zip, const std::string& name) {
  const ZipEntry* entry = zip.find(name);
  if (entry == nullptr) throw std::runtime_error("no record " + name);
  return zip.read_string(*entry, std::uint64_t{1} << 30);
}

// The FormatError `call` throws (failing the test where it throws nothing or something else).
template <class Call>
FormatError error_of(Call&& call) {
  try {
    call();
  } catch (const FormatError& e) {
    return e;
  }
  ADD_FAILURE() << "no FormatError";
  return FormatError(FormatError::Kind::kDamaged, "(none)");
}

bool says(const FormatError& e, const std::string& text) {
  return std::string(e.what()).find(text) != std::string::npos;
}

TEST(ZipReader, ReadsStoredDeflatedAndZip64Records) {
  const std::string text(5000, 'x');
  std::string binary;
  for (int i = 0; i < 70000; ++i)
    binary += static_cast<char>(i * 7919 % 251);
  for (const bool zip64 : {false, true}) {
    const auto zip =
        ZipReader::from_bytes(make_zip({{.name = "a/text", .data = text},
                                        {.name = "a/binary", .data = binary},
                                        {.name = "a/deflated", .data = binary, .deflate = true},
                                        {.name = "a/empty", .data = ""}},
                                       zip64));
    ASSERT_EQ(zip.entries().size(), 4u);
    EXPECT_EQ(read_all(zip, "a/text"), text);
    EXPECT_EQ(read_all(zip, "a/binary"), binary);
    EXPECT_EQ(read_all(zip, "a/deflated"), binary);
    EXPECT_EQ(zip.find("a/deflated")->method, 8);
    EXPECT_EQ(read_all(zip, "a/empty"), "");
    EXPECT_EQ(zip.find("a/missing"), nullptr);
    EXPECT_EQ(pytorch_record_prefix(zip), "a/");
    zip.verify_unread();
  }
}

// One flipped bit anywhere in a record's bytes is a named CRC failure, whether the record is
// read or only verified at the end.
TEST(ZipReader, EveryRecordsCrcIsVerified) {
  const std::string data = "0123456789abcdefghijklmnopqrstuvwxyz";
  const std::string good = make_zip(
      {{.name = "a/read", .data = data}, {.name = "a/unread", .data = data, .deflate = true}});
  const auto at = good.find(data);
  for (std::size_t i = 0; i < data.size(); ++i) {
    std::string bad = good;
    bad[at + i] ^= 0x01;
    const auto zip = ZipReader::from_bytes(bad);
    const auto e = error_of([&] { read_all(zip, "a/read"); });
    EXPECT_EQ(e.kind(), FormatError::Kind::kDamaged);
    EXPECT_TRUE(says(e, "record 'a/read' fails its CRC-32 check")) << e.what();
  }
  // The unread record is deflated: damage to its compressed bytes fails inflate or the CRC.
  const auto deflated = ZipReader::from_bytes(good).find("a/unread")->data_offset;
  // (A flip in the padding bits after the final block changes nothing: the record must then
  // read back intact, never damaged.)
  std::size_t caught = 0;
  const auto compressed = ZipReader::from_bytes(good).find("a/unread")->compressed_size;
  for (std::size_t i = 0; i < compressed; ++i) {
    std::string bad = good;
    bad[deflated + i] ^= 0x04;
    const auto zip = ZipReader::from_bytes(bad);
    EXPECT_EQ(read_all(zip, "a/read"), data);
    try {
      zip.verify_unread();
      EXPECT_EQ(read_all(ZipReader::from_bytes(bad), "a/unread"), data) << i;
    } catch (const FormatError& e) {
      EXPECT_TRUE(says(e, "a/unread")) << e.what();
      ++caught;
    }
  }
  EXPECT_GT(caught, compressed / 2);
  // A recorded CRC that is wrong though the bytes are intact is damage too.
  const auto zip = ZipReader::from_bytes(make_zip({{.name = "a/x", .data = data, .crc = 1234}}));
  EXPECT_TRUE(says(error_of([&] { zip.verify_unread(); }), "recorded 000004d2"));
  // Every CRC 0: PyTorch's torch.save with compute_crc32 = False, named as such.
  const auto unchecked = ZipReader::from_bytes(
      make_zip({{.name = "a/x", .data = data, .crc = 0}, {.name = "a/y", .data = "y", .crc = 0}}));
  EXPECT_TRUE(says(error_of([&] { unchecked.verify_unread(); }), "compute_crc32 = False"));
}

// A zip bomb costs neither memory nor time: a record that declares more than deflate can
// produce from its bytes is refused on opening, one that inflates past what it declares stops
// at its declared size, and verify_unread inflates no unread record over its limit.
TEST(ZipReader, DeclaredSizesAreCheckedBeforeAnythingIsInflated) {
  const auto start = std::chrono::steady_clock::now();
  const double added = test::peak_added_mib([&] {
    // 4 GiB of zeros in about 4 MB, declared as 40 bytes: inflation stops at byte 41.
    const std::string bomb = make_zip({{.name = "a/x", .declared = 40, .zeros = 4ull << 30}});
    const auto zip = ZipReader::from_bytes(bomb);
    const auto e = error_of([&] { read_all(zip, "a/x"); });
    EXPECT_TRUE(says(e, "inflates to more than its declared 40 bytes")) << e.what();
    // The same bomb declared honestly: verify_unread refuses to inflate 4 GiB to check it.
    const auto honest = ZipReader::from_bytes(make_zip({{.name = "a/y", .zeros = 4ull << 30}}));
    const auto too_large = error_of([&] { honest.verify_unread(); });
    EXPECT_EQ(too_large.kind(), FormatError::Kind::kTooLarge);
    EXPECT_TRUE(says(too_large, "4294967296 bytes")) << too_large.what();
  });
  EXPECT_LT(added, 64.0 * test::kSanitizerMemoryFactor) << "MiB added reading a 4 GiB zip bomb";
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));

  // A declared size deflate cannot reach from the compressed bytes: refused on opening.
  const auto impossible = error_of([&] {
    ZipReader::from_bytes(make_zip(
        {{.name = "a/x", .data = "tiny", .deflate = true, .declared = std::int64_t{1} << 40}}));
  });
  EXPECT_TRUE(says(impossible, "more than its")) << impossible.what();
  // Shorter than declared: named, not zero-filled.
  const auto shorter = ZipReader::from_bytes(
      make_zip({{.name = "a/x", .data = std::string(100, 'q'), .deflate = true, .declared = 200}}));
  EXPECT_TRUE(says(error_of([&] { read_all(shorter, "a/x"); }), "inflates to 100 bytes"));
  // A stored record whose sizes disagree.
  EXPECT_TRUE(says(error_of([&] {
                     ZipReader::from_bytes(
                         make_zip({{.name = "a/x", .data = "abcd", .declared = 3}}));
                   }),
                   "declares 3 bytes but holds 4"));
  // read_string's own limit, before anything is read.
  const auto big =
      ZipReader::from_bytes(make_zip({{.name = "a/x", .data = std::string(100, 'q')}}));
  EXPECT_EQ(error_of([&] { big.read_string(big.entries()[0], 99); }).kind(),
            FormatError::Kind::kTooLarge);
}

// Every prefix of an archive, and every byte of its directory and headers damaged, fails by
// name or reads correctly: never a crash, never a record read from outside its bytes.
TEST(ZipReader, DamagedStructureIsRefusedByName) {
  const std::string good = make_zip({{.name = "a/one", .data = "first record"},
                                     {.name = "a/two", .data = "second", .deflate = true}});
  for (std::size_t n = 0; n < good.size(); ++n) {
    EXPECT_THROW(ZipReader::from_bytes(good.substr(0, n)), FormatError) << n;
  }
  const auto directory = good.find("PK\x01\x02");
  for (std::size_t i = 0; i < good.size(); ++i) {
    if (i >= good.find("first record") && i < good.find("first record") + 12) continue;
    std::string bad = good;
    bad[i] ^= 0x55;
    try {
      const auto zip = ZipReader::from_bytes(bad);
      for (const auto& e : zip.entries()) {
        std::string bytes(static_cast<std::size_t>(std::min<std::uint64_t>(e.size, 1 << 20)), 0);
        if (e.size <= bytes.size()) zip.read(e, bytes.data());
      }
    } catch (const FormatError&) {
    }
  }
  EXPECT_NE(directory, std::string::npos);

  // Two records of one name: which one a reader takes would be up to it.
  std::string overlapping =
      make_zip({{.name = "a/one", .data = "x"}, {.name = "a/one", .data = "y"}});
  EXPECT_TRUE(says(error_of([&] { ZipReader::from_bytes(overlapping); }), "two records are named"));
  // A record outside the folder of the first.
  EXPECT_TRUE(says(error_of([&] {
                     pytorch_record_prefix(ZipReader::from_bytes(
                         make_zip({{.name = "a/x", .data = "1"}, {.name = "b/y", .data = "2"}})));
                   }),
                   "outside the archive's folder"));
  // Not zip at all.
  EXPECT_TRUE(says(error_of([&] { ZipReader::from_bytes(std::string(100, 'z')); }),
                   "no end-of-central-directory record"));
}

TEST(ZipReader, OverlappingRecordsAreRefused) {
  // Two entries pointing at the same bytes, as an overlap bomb's are: the second central entry is
  // rewritten to the first one's local header offset (names differ, so the local name check
  // fails first); and a record extended over the next one.
  std::string zip = make_zip({{.name = "a/aa", .data = std::string(64, 'p')},
                              {.name = "a/bb", .data = std::string(64, 'q')}});
  const auto second = zip.rfind("PK\x01\x02");
  std::string pointing = zip;
  for (int i = 0; i < 4; ++i)
    pointing[second + 42 + i] = 0;  // local header offset -> 0
  EXPECT_TRUE(says(error_of([&] { ZipReader::from_bytes(pointing); }), "does not match"));
  std::string longer = zip;
  const auto first = zip.find("PK\x01\x02");
  longer[first + 20] = static_cast<char>(100);  // compressed size 64 -> 100
  longer[first + 24] = static_cast<char>(100);  // and size
  EXPECT_TRUE(says(error_of([&] { ZipReader::from_bytes(longer); }), "overlap"));
}

// A large stored record is read by several threads, each a part, and their CRCs combined: the
// bytes are the record's, and a flipped byte in any part (the last one too) fails the CRC.
TEST(ZipReader, LargeRecordsReadInPartsKeepTheirBytesAndTheirCrc) {
  std::string data(40u << 20, '\0');
  std::uint64_t x = 88172645463325252ull;
  for (auto& c : data) {  // xorshift: bytes that no part could fake
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    c = static_cast<char>(x);
  }
  test::TempDir dir("ddp-zip-large");
  const auto path = dir.path() / "large.zip";
  std::string zip = make_zip({{.name = "a/large", .data = data}});
  std::ofstream(path, std::ios::binary) << zip;
  {
    const auto reader = ZipReader::open(path);
    std::string back(data.size(), '\0');
    reader.read(reader.entries()[0], back.data());
    EXPECT_TRUE(back == data);
  }
  const auto at = zip.find(data.substr(0, 64));
  for (const std::size_t offset : {std::size_t{0}, data.size() / 3, data.size() - 1}) {
    std::string bad = zip;
    bad[at + offset] ^= 0x08;
    std::ofstream(path, std::ios::binary | std::ios::trunc) << bad;
    const auto reader = ZipReader::open(path);
    std::string back(data.size(), '\0');
    EXPECT_TRUE(says(error_of([&] { reader.read(reader.entries()[0], back.data()); }),
                     "fails its CRC-32 check"))
        << offset;
  }
}

TEST(ZipReader, AWindowKeepsItsBytesAndTheWholeRecordIsStillVerified) {
  // Records of every path: small stored and deflated (streamed in 64 KiB pieces) and a stored
  // one over 16 MiB (read by several threads); windows that start and end inside pieces, span
  // them, and cover the record.
  std::string data(40u << 20, '\0');
  std::uint64_t x = 88172645463325252ull;
  for (auto& c : data) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    c = static_cast<char>(x);
  }
  const std::string small = data.substr(0, 300000);
  test::TempDir dir("ddp-zip-window");
  const auto path = dir.path() / "window.zip";
  const std::string zip = make_zip({{.name = "a/small", .data = small},
                                    {.name = "a/deflated", .data = small, .deflate = true},
                                    {.name = "a/large", .data = data}});
  std::ofstream(path, std::ios::binary) << zip;
  const auto reader = ZipReader::open(path);
  struct Window {
    std::uint64_t begin, length;
  };
  for (const std::string name : {"a/small", "a/deflated", "a/large"}) {
    const std::string& whole = name == "a/large" ? data : small;
    const ZipEntry& entry = *reader.find(name);
    for (const Window w :
         {Window{0, whole.size()}, Window{1, 10}, Window{65535, 2}, Window{100000, 150000},
          Window{whole.size() - 7, 7}, Window{whole.size() / 3, whole.size() / 2}, Window{5, 0}}) {
      std::string back(w.length, '\0');
      reader.read_window(entry, w.begin, w.length, back.data());
      EXPECT_TRUE(back == whole.substr(w.begin, w.length)) << name << " " << w.begin;
    }
    std::string one(1, '\0');
    EXPECT_THROW(reader.read_window(entry, whole.size(), 1, one.data()), Error) << name;
  }
  // A damaged byte outside the window fails the record's CRC-32: nothing read is trusted
  // unverified.
  const auto at = zip.find(data.substr(0, 64), zip.find("a/large"));
  std::string bad = zip;
  bad[at + data.size() - 10] ^= 0x08;
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bad;
  const auto damaged_reader = ZipReader::open(path);
  std::string back(1000, '\0');
  EXPECT_TRUE(says(error_of([&] {
                     damaged_reader.read_window(*damaged_reader.find("a/large"), 0, 1000,
                                                back.data());
                   }),
                   "fails its CRC-32 check"));
}

TEST(ZipReader, AnArrayWindowKeepsItsRegionsElementsWhereverTheyGo) {
  // A record that is a [5, 300, 70] array of 4-byte elements (about 410 KiB: several 64 KiB
  // pieces, so runs cross them), stored and deflated; regions that split the last dimension, the
  // middle one, whole trailing dimensions (merged into longer runs), one element, none; the
  // destination with room around each row (its strides not the region's), checked element by
  // element, and its gaps untouched.
  const std::vector<std::uint64_t> shape = {5, 300, 70};
  std::string data(5 * 300 * 70 * 4, '\0');
  for (std::size_t i = 0; i < data.size(); ++i)
    data[i] = static_cast<char>((i * 2654435761u) >> 13);
  test::TempDir dir("ddp-zip-array-window");
  const auto path = dir.path() / "array.zip";
  std::ofstream(path, std::ios::binary) << make_zip(
      {{.name = "a/stored", .data = data}, {.name = "a/deflated", .data = data, .deflate = true}});
  const auto reader = ZipReader::open(path);
  struct Region {
    std::vector<std::uint64_t> begin, count;
  };
  for (const std::string name : {"a/stored", "a/deflated"}) {
    for (const Region& r : {Region{{0, 0, 35}, {5, 300, 35}}, Region{{1, 17, 3}, {3, 250, 60}},
                            Region{{2, 100, 0}, {2, 150, 70}}, Region{{0, 0, 0}, {5, 300, 70}},
                            Region{{4, 299, 69}, {1, 1, 1}}, Region{{1, 2, 3}, {0, 4, 5}}}) {
      // Destination planes padded by one row, and rows by 3 elements where the region splits them
      // (nothing is contiguous by luck); whole rows are not padded, so they merge into runs.
      const std::uint64_t pad = r.count[2] == 70 ? 0 : 3;
      const std::uint64_t row = (r.count[2] + pad) * 4, plane = (r.count[1] + 1) * row;
      std::string out(std::max<std::uint64_t>(r.count[0] * plane, 1), '\x5a');
      reader.read_array_window(*reader.find(name),
                               {.shape = shape,
                                .element_bytes = 4,
                                .begin = r.begin,
                                .count = r.count,
                                .out = reinterpret_cast<unsigned char*>(out.data()),
                                .out_strides = {plane, row, 4}});
      std::string want(out.size(), '\x5a');
      for (std::uint64_t i = 0; i < r.count[0]; ++i)
        for (std::uint64_t j = 0; j < r.count[1]; ++j)
          for (std::uint64_t k = 0; k < r.count[2]; ++k)
            want.replace(
                i * plane + j * row + k * 4, 4,
                data.substr((((r.begin[0] + i) * 300 + r.begin[1] + j) * 70 + r.begin[2] + k) * 4,
                            4));
      EXPECT_TRUE(out == want) << name << " at " << r.begin[0] << "," << r.begin[1] << ","
                               << r.begin[2];
    }
    // A window that does not describe the record is the caller's bug.
    std::string out(64, '\0');
    auto window = [&](std::vector<std::uint64_t> array, std::vector<std::uint64_t> begin) {
      return ZipArrayWindow{.shape = std::move(array),
                            .element_bytes = 4,
                            .begin = std::move(begin),
                            .count = {1, 1, 1},
                            .out = reinterpret_cast<unsigned char*>(out.data()),
                            .out_strides = {4, 4, 4}};
    };
    EXPECT_THROW(reader.read_array_window(*reader.find(name), window({5, 300, 69}, {0, 0, 0})),
                 Error);
    EXPECT_THROW(reader.read_array_window(*reader.find(name), window(shape, {0, 0, 70})), Error);
  }
  // A damaged byte outside the region fails the record's CRC-32.
  std::string bad = make_zip({{.name = "a/stored", .data = data}});
  bad[bad.find(data.substr(0, 64)) + data.size() - 1] ^= 0x08;
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bad;
  const auto damaged = ZipReader::open(path);
  std::string out(4, '\0');
  EXPECT_TRUE(says(error_of([&] {
                     damaged.read_array_window(*damaged.find("a/stored"),
                                               {.shape = shape,
                                                .element_bytes = 4,
                                                .begin = {0, 0, 0},
                                                .count = {1, 1, 1},
                                                .out = reinterpret_cast<unsigned char*>(out.data()),
                                                .out_strides = {4, 4, 4}});
                   }),
                   "fails its CRC-32 check"));
}

TEST(ZipReader, AFileThatShrinksWhileReadIsAnErrorNotAShortRecord) {
  test::TempDir dir("ddp-zip-shrink");
  const auto path = dir.path() / "a.zip";
  {
    std::ofstream out(path, std::ios::binary);
    out << make_zip({{.name = "a/x", .data = std::string(1 << 20, 'q')}});
  }
  const auto zip = ZipReader::open(path);
  ASSERT_EQ(::truncate(path.c_str(), 1000), 0);
  std::string bytes(1 << 20, '\0');
  EXPECT_TRUE(says(error_of([&] { zip.read(zip.entries()[0], bytes.data()); }), "ended at byte"));
  EXPECT_THROW(ZipReader::open(dir.path() / "absent.zip"), ConfigError);
  EXPECT_THROW(ZipReader::open(dir.path()), ConfigError);
}

TEST(ZipReader, EncryptedAndOtherMethodsAreUnsupportedByName) {
  std::string encrypted = make_zip({{.name = "a/x", .data = "secret"}});
  encrypted[encrypted.find("PK\x01\x02") + 8] = 1;  // general purpose flag: encrypted
  const auto e = error_of([&] { ZipReader::from_bytes(encrypted); });
  EXPECT_EQ(e.kind(), FormatError::Kind::kUnsupported);
  EXPECT_TRUE(says(e, "encrypted"));
  std::string bzip2 = make_zip({{.name = "a/x", .data = "text"}});
  bzip2[bzip2.find("PK\x01\x02") + 10] = 12;
  bzip2[bzip2.find("PK\x03\x04") + 8] = 12;
  EXPECT_TRUE(says(error_of([&] { ZipReader::from_bytes(bzip2); }), "method 12"));
}

}  // namespace DDP_UNITY_ID
}  // namespace
}  // namespace ddp::archive
