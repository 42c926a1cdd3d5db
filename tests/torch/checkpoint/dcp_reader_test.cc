// DcpReader (ddp/torch/checkpoint/distributed_checkpoint.h) on the distributed checkpoint PyTorch
// 2.15 saved at world 4 (tests/data/dcp/sharded_w4, make_dcp_fixtures.py): every tensor whole and
// in regions across its chunks (resharding to other splits), the non-tensor values, and the
// damaged folders a reader meets (a truncated or missing data file, a flipped byte, a chunk of
// another dtype than the metadata says): named errors, nothing returned.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "ddp/torch/checkpoint/distributed_checkpoint.h"
#include "support/temp_dir.h"
#include "support/test_paths.h"
#include "support/unity_namespace.h"

namespace ddp::test {
namespace {
namespace DDP_UNITY_ID {

using ::testing::AllOf;
using ::testing::HasSubstr;

std::filesystem::path fixture() {
  return std::filesystem::path(paths::dcp_fixtures) / "sharded_w4";
}

// What make_dcp_fixtures.py saved: each element its index.
at::Tensor expected(const std::string& name) {
  if (name == "grid") return torch::arange(48, torch::kFloat32).reshape({6, 8});
  if (name == "rows") return torch::arange(30, torch::kFloat64).reshape({10, 3});
  if (name == "uneven") return torch::arange(5, torch::kBFloat16);
  if (name == "replicated") return torch::arange(4, torch::kInt64).reshape({2, 2});
  if (name == "nested.scale") return torch::arange(3, torch::kFloat16);
  ADD_FAILURE() << "no tensor " << name;
  return {};
}

TEST(DcpReader, ReadsEveryTensorPyTorchSavedAtWorldFour) {
  const DcpReader checkpoint(fixture());
  ASSERT_EQ(checkpoint.info().tensors.size(), 5u);
  for (const auto& [name, info] : checkpoint.info().tensors) {
    const at::Tensor t = checkpoint.read(name);
    EXPECT_EQ(t.scalar_type(), info.dtype) << name;
    EXPECT_TRUE(torch::equal(t, expected(name))) << name << ":\n" << t;
  }
}

TEST(DcpReader, ReadsRegionsAcrossChunksAsAnotherLayoutWould) {
  const DcpReader checkpoint(fixture());
  // grid was saved as a 2 x 2 grid of [3, 4] chunks: rows 2..4 and columns 3..6 take a part of
  // each of the four.
  EXPECT_TRUE(torch::equal(checkpoint.read("grid", {2, 3}, {3, 4}),
                           expected("grid").slice(0, 2, 5).slice(1, 3, 7)));
  // rows was saved in 4 row chunks (3, 3, 3, 1); read as 3 ranks would hold it (4, 4, 2).
  for (const auto& [start, count] :
       std::vector<std::pair<std::int64_t, std::int64_t>>{{0, 4}, {4, 4}, {8, 2}}) {
    EXPECT_TRUE(torch::equal(checkpoint.read("rows", {start, 0}, {count, 3}),
                             expected("rows").slice(0, start, start + count)))
        << start;
  }
  EXPECT_EQ(checkpoint.read("uneven", {5}, {0}).numel(), 0);
  EXPECT_TRUE(torch::equal(checkpoint.read("uneven", {1}, {4}), expected("uneven").slice(0, 1)));
}

TEST(DcpReader, ReadsTheNonTensorValues) {
  const DcpReader checkpoint(fixture());
  EXPECT_EQ(checkpoint.read_value("step").toInt(), 7);
  EXPECT_EQ(checkpoint.read_value("name").toStringRef(), "dcp fixture");
  const auto lrs = checkpoint.read_value("lrs").toList();
  ASSERT_EQ(lrs.size(), 2u);
  EXPECT_EQ(lrs.get(0).toDouble(), 0.5);
  EXPECT_EQ(checkpoint.info().paths.at("nested.scale").at(0).name, "nested");
  EXPECT_GT(checkpoint.verify(), 0u);
}

TEST(DcpReader, RebuildsTheNestedStateDictThatWasSaved) {
  const c10::IValue state = DcpReader(fixture()).read_state_dict();
  ASSERT_TRUE(state.isGenericDict());
  const auto top = state.toGenericDict();
  EXPECT_EQ(top.size(), 8u);  // grid, rows, uneven, replicated, nested, step, name, lrs
  EXPECT_TRUE(torch::equal(top.at("grid").toTensor(), expected("grid")));
  const auto nested = top.at("nested").toGenericDict();
  EXPECT_TRUE(torch::equal(nested.at("scale").toTensor(), expected("nested.scale")));
  EXPECT_EQ(top.at("step").toInt(), 7);
}

TEST(DcpReader, NamesWhatIsNotThere) {
  const DcpReader checkpoint(fixture());
  EXPECT_THAT([&] { checkpoint.read("fc.weight"); },
              ::testing::ThrowsMessage<ConfigError>(HasSubstr("has no tensor 'fc.weight'")));
  EXPECT_THAT([&] { checkpoint.read("step"); },
              ::testing::ThrowsMessage<ConfigError>(HasSubstr("a non-tensor value")));
  EXPECT_THAT(
      [&] {
        checkpoint.read("grid", {4, 0}, {3, 8});
      },
      ::testing::ThrowsMessage<ConfigError>(HasSubstr("not inside 'grid'")));
  EXPECT_THAT([&] { checkpoint.read("grid", {0}, {6}); },
              ::testing::ThrowsMessage<ConfigError>(HasSubstr("of shape [6, 8]")));
  EXPECT_THAT([] { DcpReader("/nonexistent/checkpoint"); },
              ::testing::ThrowsMessage<ConfigError>(HasSubstr("not a folder")));
}

// A copy of the fixture to damage; `metadata` replaces its .metadata (a hostile variant).
std::filesystem::path copy_fixture(const TempDir& dir, const std::string& metadata = "") {
  const std::filesystem::path to = dir.path() / "ckpt";
  std::filesystem::copy(fixture(), to);
  if (!metadata.empty()) {
    std::filesystem::copy_file(
        std::filesystem::path(paths::dcp_fixtures) / "hostile" / (metadata + ".metadata"),
        to / ".metadata", std::filesystem::copy_options::overwrite_existing);
  }
  return to;
}

TEST(DcpReader, ATruncatedDataFileIsNamed) {
  TempDir dir("ddp-dcp-test");
  const auto folder = copy_fixture(dir);
  std::filesystem::resize_file(folder / "__3_0.distcp", 4000);
  const DcpReader checkpoint(folder);
  EXPECT_TRUE(torch::equal(checkpoint.read("grid", {0, 0}, {3, 4}),
                           expected("grid").slice(0, 0, 3).slice(1, 0, 4)));
  EXPECT_THAT([&] { checkpoint.read("rows"); },
              ::testing::ThrowsMessage<StateDictFormatError>(
                  AllOf(HasSubstr("the chunk of 'rows' at [9, 0]"), HasSubstr("__3_0.distcp"),
                        HasSubstr("past the end"))));
  EXPECT_THROW(checkpoint.verify(), StateDictFormatError);
}

TEST(DcpReader, AMissingDataFileIsNamed) {
  TempDir dir("ddp-dcp-test");
  const auto folder = copy_fixture(dir);
  std::filesystem::remove(folder / "__1_0.distcp");
  const DcpReader checkpoint(folder);
  EXPECT_THAT([&] { checkpoint.read("replicated"); },
              ::testing::ThrowsMessage<ConfigError>(
                  AllOf(HasSubstr("__1_0.distcp"), HasSubstr("data file is missing"))));
}

TEST(DcpReader, AFlippedByteInAChunkFailsItsCrc) {
  TempDir dir("ddp-dcp-test");
  const auto folder = copy_fixture(dir);
  const DcpChunkInfo& chunk = DcpReader(folder).info().tensors.at("rows").chunks.at(1);
  // The last 24 bytes of the chunk's tensor data sit just before its zip's trailing records; flip
  // one inside the data record (found by its content: 3.0 as a little-endian double).
  std::fstream f(folder / chunk.storage.file, std::ios::in | std::ios::out | std::ios::binary);
  std::string bytes(chunk.storage.length, '\0');
  f.seekg(static_cast<std::streamoff>(chunk.storage.offset));
  f.read(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  const double nine = 9.0;  // rows[3][0]: the chunk at [3, 0] starts 9, 10, 11, ...
  const std::string needle(reinterpret_cast<const char*>(&nine), sizeof nine);
  const auto at = bytes.find(needle);
  ASSERT_NE(at, std::string::npos);
  f.seekp(static_cast<std::streamoff>(chunk.storage.offset + at + 7));
  f.put(static_cast<char>(bytes[at + 7] ^ 0x10));
  f.close();
  const DcpReader checkpoint(folder);
  EXPECT_THAT(
      [&] {
        checkpoint.read("rows", {3, 0}, {1, 3});
      },
      ::testing::ThrowsMessage<StateDictFormatError>(
          AllOf(HasSubstr("the chunk of 'rows' at [3, 0]"), HasSubstr("CRC"))));
  // Rows in other chunks still read.
  EXPECT_TRUE(
      torch::equal(checkpoint.read("rows", {0, 0}, {3, 3}), expected("rows").slice(0, 0, 3)));
}

TEST(DcpReader, AChunkOfAnotherDtypeThanTheMetadataIsNamed) {
  TempDir dir("ddp-dcp-test");
  const DcpReader checkpoint(copy_fixture(dir, "dtype"));
  EXPECT_THAT(
      [&] { checkpoint.read("grid"); },
      ::testing::ThrowsMessage<StateDictFormatError>(AllOf(
          HasSubstr("holds a Float tensor of [3, 4]"), HasSubstr("the metadata records Double"))));
}

TEST(DcpReader, NamesAValueItLacksAndAFolderWithoutMetadata) {
  const DcpReader checkpoint(fixture());
  EXPECT_THAT([&] { checkpoint.read_value("epoch"); },
              ::testing::ThrowsMessage<ConfigError>(HasSubstr("has no value 'epoch'")));
  EXPECT_THAT([&] { checkpoint.read_value("grid"); },
              ::testing::ThrowsMessage<ConfigError>(HasSubstr("(it is a tensor: read)")));
  TempDir dir("ddp-dcp-test");
  EXPECT_THAT(
      [&] { DcpReader{dir.path()}; },
      ::testing::ThrowsMessage<ConfigError>(HasSubstr("cannot read the checkpoint's metadata")));
}

TEST(DcpReader, ADtypeThisLibtorchLacksAndCrossingPathsAreNamed) {
  TempDir dir("ddp-dcp-test");
  EXPECT_THAT([&] { DcpReader{copy_fixture(dir, "float8")}; },
              ::testing::ThrowsMessage<StateDictFormatError>(
                  AllOf(HasSubstr("'grid'"), HasSubstr("torch.float8_e4m3fn is not one ddp "
                                                       "reads"))));
  TempDir dir2("ddp-dcp-test");
  const DcpReader crossing(copy_fixture(dir2, "crossing_paths"));
  EXPECT_THAT([&] { crossing.read_state_dict(); },
              ::testing::ThrowsMessage<StateDictFormatError>(
                  AllOf(HasSubstr("'nested.scale'"), HasSubstr("crosses another entry"))));
}

TEST(DcpReader, HostileMetadataIsRefusedBeforeAnyDataIsRead) {
  TempDir dir("ddp-dcp-test");
  EXPECT_THAT([&] { DcpReader{copy_fixture(dir, "evil_global")}; },
              ::testing::ThrowsMessage<UnsafePickleError>(HasSubstr("posix.system")));
  TempDir dir2("ddp-dcp-test");
  EXPECT_THAT([&] { DcpReader{copy_fixture(dir2, "path_outside")}; },
              ::testing::ThrowsMessage<StateDictFormatError>(
                  AllOf(HasSubstr(".metadata"), HasSubstr("../elsewhere.distcp"))));
}

}  // namespace DDP_UNITY_ID
}  // namespace
}  // namespace ddp::test
