// The distributed checkpoint's metadata (src/archive/dcp_metadata.h) as PyTorch 2.15 writes it
// (tests/data/dcp/sharded_w4: DTensors sharded over a 2 x 2 mesh and over 4 ranks, unevenly,
// replicated, nested, and non-tensor values), and each hostile variant of it
// (tests/data/dcp/hostile, made by make_dcp_fixtures.py) refused with an error that names it.
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include <gtest/gtest.h>

#include "archive/dcp_metadata.h"
#include "archive/pickle_reader.h"
#include "support/test_paths.h"
#include "support/unity_namespace.h"

namespace ddp::archive {
namespace {
namespace DDP_UNITY_ID {

using Offsets = std::vector<std::int64_t>;

std::string slurp(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(in) << path;
  std::stringstream bytes;
  bytes << in.rdbuf();
  return bytes.str();
}

std::filesystem::path fixtures() {
  return test::paths::dcp_fixtures;
}

DcpMetadata parse_fixture(const std::string& relative) {
  return parse_dcp_metadata(slurp(fixtures() / relative));
}

TEST(DcpMetadata, ReadsWhatPyTorchSavedAtWorldFour) {
  const DcpMetadata m = parse_fixture("sharded_w4/.metadata");
  EXPECT_EQ(m.version, "1.0.0");
  ASSERT_EQ(m.tensors.size(), 5u);
  ASSERT_EQ(m.values.size(), 3u);
  for (const char* value : {"step", "name", "lrs"})
    EXPECT_TRUE(m.values.contains(value)) << value;

  const DcpTensorEntry& grid = m.tensors.at("grid");
  EXPECT_EQ(grid.dtype, "float32");
  EXPECT_EQ(grid.shape, (Offsets{6, 8}));
  ASSERT_EQ(grid.chunks.size(), 4u);
  std::set<Offsets> starts;
  for (const DcpChunk& c : grid.chunks) {
    EXPECT_EQ(c.sizes, (Offsets{3, 4}));
    starts.insert(c.offsets);
    EXPECT_TRUE(c.storage.file.starts_with("__") && c.storage.file.ends_with(".distcp"))
        << c.storage.file;
    EXPECT_GT(c.storage.length, 0u);
  }
  EXPECT_EQ(starts, (std::set<Offsets>{{0, 0}, {0, 4}, {3, 0}, {3, 4}}));

  const DcpTensorEntry& rows = m.tensors.at("rows");
  EXPECT_EQ(rows.dtype, "float64");
  ASSERT_EQ(rows.chunks.size(), 4u);
  const DcpTensorEntry& uneven = m.tensors.at("uneven");
  EXPECT_EQ(uneven.dtype, "bfloat16");
  std::int64_t covered = 0;
  for (const DcpChunk& c : uneven.chunks)
    covered += c.sizes[0];
  EXPECT_EQ(covered, 5);                                    // 2 + 2 + 1 + an empty chunk at the end
  EXPECT_EQ(m.tensors.at("replicated").chunks.size(), 1u);  // saved once, not per rank
  EXPECT_EQ(m.tensors.at("nested.scale").dtype, "float16");
  const auto& path = m.paths.at("nested.scale");
  ASSERT_EQ(path.size(), 2u);
  EXPECT_EQ(path[0].name, "nested");
  EXPECT_EQ(path[1].name, "scale");
  EXPECT_EQ(path[1].index, -1);
  EXPECT_EQ(m.order, (std::vector<std::string>{"grid", "rows", "uneven", "replicated",
                                               "nested.scale", "step", "name", "lrs"}));
}

struct HostileCase {
  const char* file;
  FormatError::Kind kind;
  const char* words;  // in the message (make_dcp_fixtures.py's HOSTILE)
};

class DcpMetadataHostile : public ::testing::TestWithParam<HostileCase> {};

TEST_P(DcpMetadataHostile, IsRefusedByName) {
  const HostileCase& c = GetParam();
  try {
    parse_fixture(std::string("hostile/") + c.file + ".metadata");
    FAIL() << c.file << " was read";
  } catch (const FormatError& e) {
    EXPECT_EQ(e.kind(), c.kind) << e.what();
    EXPECT_NE(std::string(e.what()).find(c.words), std::string::npos) << e.what();
  }
}

INSTANTIATE_TEST_SUITE_P(
    Cases, DcpMetadataHostile,
    ::testing::Values(
        HostileCase{"overlap", FormatError::Kind::kDamaged, "'grid' has chunks that overlap"},
        HostileCase{"hole", FormatError::Kind::kDamaged, "'rows' of shape [10, 3] leave part"},
        HostileCase{"outside", FormatError::Kind::kDamaged, "outside it"},
        HostileCase{"missing_record", FormatError::Kind::kDamaged,
                    "the chunk of 'uneven' at [2] has no storage record"},
        HostileCase{"stray_record", FormatError::Kind::kDamaged, "belongs to no chunk"},
        HostileCase{"path_outside", FormatError::Kind::kDamaged,
                    "'../elsewhere.distcp', which is not a plain file name"},
        HostileCase{"transform", FormatError::Kind::kUnsupported, "storage transforms"},
        HostileCase{"sparse", FormatError::Kind::kUnsupported, "not a strided"},
        HostileCase{"evil_global", FormatError::Kind::kUnsafe, "posix.system"},
        HostileCase{"not_dcp", FormatError::Kind::kDamaged, "not an object"}),
    [](const auto& info) { return std::string(info.param.file); });

TEST(DcpMetadata, TruncatedAnywhereIsANamedErrorNeverACrash) {
  const std::string bytes = slurp(fixtures() / "sharded_w4/.metadata");
  for (std::size_t n = 0; n < bytes.size(); n += 7) {
    EXPECT_THROW(parse_dcp_metadata(bytes.substr(0, n)), FormatError) << n;
  }
}

TEST(DcpMetadata, ChunkGridsOverTheLimitAreRefusedBeforeTheyAreChecked) {
  const std::string bytes = slurp(fixtures() / "sharded_w4/.metadata");
  try {
    parse_dcp_metadata(bytes, {.max_grid_cells = 3});
    FAIL() << "read with a grid limit of 3 cells";
  } catch (const FormatError& e) {
    EXPECT_EQ(e.kind(), FormatError::Kind::kTooLarge) << e.what();
  }
  EXPECT_THROW(parse_dcp_metadata(bytes, {.max_entries = 4}), FormatError);
}

TEST(DcpMetadata, NewObjectIsRefusedWhereTheCallerAllowsNone) {
  // The state-dict readers' options: NEWOBJ builds an object, which they never accept.
  const std::string bytes = slurp(fixtures() / "sharded_w4/.metadata");
  try {
    read_pickle(bytes, {.allow_global = [](std::string_view) { return true; }});
    FAIL() << "NEWOBJ was read without allow_object";
  } catch (const FormatError& e) {
    EXPECT_EQ(e.kind(), FormatError::Kind::kUnsafe);
    EXPECT_NE(std::string(e.what()).find("opcode 0x81 (NEWOBJ)"), std::string::npos) << e.what();
    EXPECT_EQ(e.global_name(), "");
  }
}

namespace writing {

bool same_storage(const DcpStorage& a, const DcpStorage& b) {
  return a.file == b.file && a.offset == b.offset && a.length == b.length;
}

// What a ddp writer hands encode_dcp_metadata: equal to what parse_dcp_metadata returns for the
// bytes, field by field.
void expect_same(const DcpMetadata& a, const DcpMetadata& b) {
  EXPECT_EQ(a.version, b.version);
  EXPECT_EQ(a.order, b.order);
  ASSERT_EQ(a.tensors.size(), b.tensors.size());
  for (const auto& [name, t] : a.tensors) {
    ASSERT_TRUE(b.tensors.contains(name)) << name;
    const DcpTensorEntry& u = b.tensors.at(name);
    EXPECT_EQ(t.dtype, u.dtype) << name;
    EXPECT_EQ(t.shape, u.shape) << name;
    ASSERT_EQ(t.chunks.size(), u.chunks.size()) << name;
    for (std::size_t i = 0; i < t.chunks.size(); ++i) {
      EXPECT_EQ(t.chunks[i].offsets, u.chunks[i].offsets) << name;
      EXPECT_EQ(t.chunks[i].sizes, u.chunks[i].sizes) << name;
      EXPECT_TRUE(same_storage(t.chunks[i].storage, u.chunks[i].storage)) << name;
    }
  }
  ASSERT_EQ(a.values.size(), b.values.size());
  for (const auto& [name, s] : a.values) {
    ASSERT_TRUE(b.values.contains(name)) << name;
    EXPECT_TRUE(same_storage(s, b.values.at(name))) << name;
  }
  ASSERT_EQ(a.paths.size(), b.paths.size());
  for (const auto& [name, path] : a.paths) {
    const auto& other = b.paths.at(name);
    ASSERT_EQ(path.size(), other.size()) << name;
    for (std::size_t i = 0; i < path.size(); ++i) {
      EXPECT_EQ(path[i].name, other[i].name) << name;
      EXPECT_EQ(path[i].index, other[i].index) << name;
    }
  }
}

TEST(DcpMetadataWriting, WhatPyTorchSavedIsWrittenBackAsTheSameMetadata) {
  const DcpMetadata saved = parse_fixture("sharded_w4/.metadata");
  const std::string bytes = encode_dcp_metadata(saved);
  expect_same(saved, parse_dcp_metadata(bytes));
  // Written once more from what was read back: the same bytes (nothing depends on map order or
  // on anything but the description).
  EXPECT_EQ(encode_dcp_metadata(parse_dcp_metadata(bytes)), bytes);
}

TEST(DcpMetadataWriting, ScalarsEmptyChunksLargeOffsetsAndListPathsRoundTrip) {
  DcpMetadata m;
  m.order = {"scalar", "big", "optim.state.0.exp_avg", "lrs"};
  m.tensors["scalar"] = {"float64", {}, {{{}, {}, {"__0_0.distcp", 0, 800}}}};
  // A [2^33] tensor in two chunks, one of them empty: offsets past 32 bits, a zero-size chunk.
  const std::int64_t n = std::int64_t{1} << 33;
  m.tensors["big"] = {"bfloat16",
                      {n},
                      {{{0}, {n}, {"__1_7.distcp", std::uint64_t{5} << 32, 99}},
                       {{n}, {0}, {"__1_7.distcp", 12, 34}}}};
  m.tensors["optim.state.0.exp_avg"] = {
      "float32", {2, 3}, {{{0, 0}, {2, 3}, {"__0_0.distcp", 800, 900}}}};
  m.values["lrs"] = {"__0_0.distcp", 1700, 600};
  m.paths["optim.state.0.exp_avg"] = {{"optim", -1}, {"state", -1}, {"0", -1}, {"exp_avg", -1}};
  m.paths["lrs"] = {{"groups", -1}, {"", 2}};
  DcpMetadata expected = m;
  expected.version = "1.0.0";  // written where none is given
  expected.paths["scalar"] = {{"scalar", -1}};
  expected.paths["big"] = {{"big", -1}};
  expect_same(expected, parse_dcp_metadata(encode_dcp_metadata(m)));
}

TEST(DcpMetadataWriting, ChunksThatDoNotTileAreRefusedWhenParsedBack) {
  DcpMetadata m;
  m.order = {"w"};
  m.tensors["w"] = {
      "float32", {4}, {{{0}, {3}, {"__0_0.distcp", 0, 1}}, {{2}, {2}, {"__1_0.distcp", 0, 1}}}};
  try {
    parse_dcp_metadata(encode_dcp_metadata(m));
    FAIL() << "overlapping chunks were accepted";
  } catch (const FormatError& e) {
    EXPECT_EQ(e.kind(), FormatError::Kind::kDamaged);
    EXPECT_NE(std::string(e.what()).find("'w'"), std::string::npos) << e.what();
  }
}

TEST(DcpMetadataWriting, AnOrderThatDoesNotMatchTheEntriesIsRefused) {
  DcpMetadata m;
  m.tensors["w"] = {"float32", {1}, {{{0}, {1}, {"__0_0.distcp", 0, 1}}}};
  m.order = {};
  EXPECT_THROW(encode_dcp_metadata(m), FormatError);
  m.order = {"w", "w"};
  EXPECT_THROW(encode_dcp_metadata(m), FormatError);
  m.order = {"w", "v"};
  EXPECT_THROW(encode_dcp_metadata(m), FormatError);
}

}  // namespace writing

}  // namespace DDP_UNITY_ID
}  // namespace
}  // namespace ddp::archive
