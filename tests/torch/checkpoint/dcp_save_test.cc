// save_dcp (ddp/torch/checkpoint/distributed_checkpoint_save.h) in one process: what it writes
// reads back through DcpReader (every dtype, views saved compactly, nested dicts with PyTorch's
// names and paths), a failed save leaves the folder's previous checkpoint as it was and a later one
// replaces it, and every misuse is a named error. Saves at several ranks and against PyTorch's
// dcp.load: tests/torch/checkpoint/dcp_save_multiprocess_test.cc.
#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include "ddp/torch/checkpoint/distributed_checkpoint.h"
#include "ddp/torch/checkpoint/distributed_checkpoint_save.h"
#include "support/error_of.h"
#include "support/multiprocess.h"
#include "support/temp_dir.h"
#include "support/unity_namespace.h"
#include "torch/checkpoint/dcp_flat_range.h"

namespace ddp::test {
namespace {
namespace DDP_UNITY_ID {

using ::testing::AllOf;
using ::testing::HasSubstr;

std::set<std::string> files_in(const std::filesystem::path& folder) {
  std::set<std::string> names;
  for (const auto& f : std::filesystem::directory_iterator(folder))
    names.insert(f.path().filename().string());
  return names;
}

c10::impl::GenericDict new_dict() {
  return c10::impl::GenericDict(c10::AnyType::get(), c10::AnyType::get());
}

TEST(DcpSave, EveryDtypeAndViewReadsBackAsSaved) {
  TempDir dir("ddp-dcp-save");
  const std::vector<at::ScalarType> dtypes = {
      at::kFloat, at::kDouble, at::kHalf, at::kBFloat16, at::kLong,         at::kInt,
      at::kShort, at::kChar,   at::kByte, at::kBool,     at::kComplexFloat, at::kComplexDouble};
  DcpStateDict state;
  std::map<std::string, at::Tensor> saved;
  for (const auto dtype : dtypes) {
    const std::string name = std::string("t_") + c10::toString(dtype);
    saved[name] = (torch::arange(12, torch::kDouble).reshape({3, 4}) % 7).to(dtype);
    state.add_tensor(name, saved[name]);
  }
  // Views: a transposed tensor, and a narrow slice of a large one (its storage is not saved).
  const at::Tensor big = torch::arange(100000, torch::kFloat32);
  saved["slice"] = big.narrow(0, 500, 6);
  saved["transposed"] = torch::arange(6, torch::kFloat32).reshape({2, 3}).t();
  saved["scalar"] = torch::tensor(2.5, torch::kDouble);
  for (const char* name : {"slice", "transposed", "scalar"})
    state.add_tensor(name, saved[name]);
  state.add_value("step", 1234567890123);
  state.add_value("name", std::string("run-7"));

  const DcpCheckpointInfo info = save_dcp(state, dir.path() / "ckpt");
  EXPECT_EQ(info.version, "1.0.0");
  EXPECT_EQ(info.tensors.size(), saved.size());
  EXPECT_LT(info.tensors.at("slice").chunks.at(0).storage.length, 4096u)
      << "the slice was saved with its whole storage";
  EXPECT_EQ(files_in(dir.path() / "ckpt"), (std::set<std::string>{".metadata", "__0_0.distcp"}));

  const DcpReader checkpoint(dir.path() / "ckpt");
  for (const auto& [name, tensor] : saved) {
    const at::Tensor back = checkpoint.read(name);
    EXPECT_EQ(back.scalar_type(), tensor.scalar_type()) << name;
    EXPECT_TRUE(torch::equal(back, tensor)) << name;
  }
  EXPECT_EQ(checkpoint.read_value("step").toInt(), 1234567890123);
  EXPECT_EQ(checkpoint.read_value("name").toStringRef(), "run-7");
  EXPECT_EQ(checkpoint.verify(), [&] {
    std::uint64_t bytes = 0;
    for (const auto& [n, t] : info.tensors)
      bytes += t.chunks.at(0).storage.length;
    for (const auto& [n, v] : info.values)
      bytes += v.length;
    return bytes;
  }());
}

TEST(DcpSave, NestedStateDictsFlattenAsPyTorchNamesThemAndComeBackWhole) {
  TempDir dir("ddp-dcp-save");
  auto model = new_dict();
  model.insert("weight", torch::arange(6, torch::kFloat32).reshape({2, 3}));
  auto moments = new_dict();
  moments.insert("exp_avg", torch::ones({2, 3}));
  moments.insert("step", torch::tensor(3.0));
  auto optim_state = new_dict();
  optim_state.insert(int64_t{0}, moments);  // an integer key: "0" in the name
  auto group = new_dict();
  group.insert("lr", 0.5);
  c10::impl::GenericList groups(c10::AnyType::get());
  groups.push_back(group);  // a list holding a dict is descended into
  auto optim = new_dict();
  optim.insert("state", optim_state);
  optim.insert("param_groups", groups);
  c10::impl::GenericList plain(c10::AnyType::get());
  plain.push_back(1);
  plain.push_back(2);  // a list of plain values is one value
  auto root = new_dict();
  root.insert("model", model);
  root.insert("optim", optim);
  root.insert("lrs", plain);

  const DcpStateDict state = DcpStateDict::flatten(root);
  std::vector<std::string> names;
  for (const auto& e : state.entries())
    names.push_back(e.name);
  EXPECT_EQ(names,
            (std::vector<std::string>{"model.weight", "optim.state.0.exp_avg", "optim.state.0.step",
                                      "optim.param_groups.0.lr", "lrs"}));
  const auto& lr_path = state.entries()[3].path;
  ASSERT_EQ(lr_path.size(), 4u);
  EXPECT_EQ(lr_path[2].index, 0);  // a list position, not a name

  save_dcp(state, dir.path() / "ckpt");
  const c10::IValue back = DcpReader(dir.path() / "ckpt").read_state_dict();
  const auto top = back.toGenericDict();
  EXPECT_TRUE(torch::equal(top.at("model").toGenericDict().at("weight").toTensor(),
                           model.at("weight").toTensor()));
  const auto state0 = top.at("optim").toGenericDict().at("state").toGenericDict().at("0");
  EXPECT_TRUE(torch::equal(state0.toGenericDict().at("exp_avg").toTensor(), torch::ones({2, 3})));
  const auto groups_back = top.at("optim").toGenericDict().at("param_groups").toList();
  ASSERT_EQ(groups_back.size(), 1u);
  EXPECT_EQ(groups_back.get(0).toGenericDict().at("lr").toDouble(), 0.5);
  EXPECT_EQ(top.at("lrs").toList().size(), 2u);
}

TEST(DcpSave, AFailedSaveLeavesThePreviousCheckpointAndALaterOneReplacesIt) {
  TempDir dir("ddp-dcp-save");
  const auto folder = dir.path() / "ckpt";
  DcpStateDict first;
  first.add_tensor("w", torch::full({4}, 1.0));
  first.add_value("step", 1);
  save_dcp(first, folder);

  // A value torch.save cannot hold fails the write: nothing is committed, the failed save's file
  // is gone, and the first checkpoint reads as it was.
  DcpStateDict broken;
  broken.add_tensor("w", torch::full({4}, 2.0));
  broken.add_value("device", c10::IValue(c10::Device(c10::kCPU)));
  EXPECT_THAT(error_of([&] { save_dcp(broken, folder); }),
              AllOf(HasSubstr("not committed"), HasSubstr("rank 0"), HasSubstr("'device'"),
                    HasSubstr("previous checkpoint")));
  EXPECT_EQ(files_in(folder), (std::set<std::string>{".metadata", "__0_0.distcp"}));
  EXPECT_TRUE(torch::equal(DcpReader(folder).read("w"), torch::full({4}, 1.0)));

  // A later save writes new files (generation 1), commits, then removes the first's.
  DcpStateDict second;
  second.add_tensor("w", torch::full({4}, 3.0));
  second.add_value("step", 2);
  save_dcp(second, folder);
  EXPECT_EQ(files_in(folder), (std::set<std::string>{".metadata", "__0_1.distcp"}));
  const DcpReader checkpoint(folder);
  EXPECT_TRUE(torch::equal(checkpoint.read("w"), torch::full({4}, 3.0)));
  EXPECT_EQ(checkpoint.read_value("step").toInt(), 2);
}

TEST(DcpSave, ShardsThatDoNotCoverTheirTensorAreRefusedBeforeAnythingIsWritten) {
  TempDir dir("ddp-dcp-save");
  DcpStateDict state;
  state.add_shard("w", torch::ones({2, 3}), {0, 0}, {4, 3});  // alone: rows 2..3 are missing
  EXPECT_THAT(error_of([&] { save_dcp(state, dir.path() / "ckpt"); }),
              AllOf(HasSubstr("do not make a checkpoint"), HasSubstr("'w'"),
                    HasSubstr("nothing was written")));
  EXPECT_TRUE(files_in(dir.path() / "ckpt").empty());
}

// An FSDP flat shard that starts and ends inside rows is three chunks of its tensor: the end of
// a row, whole rows, the start of a row. One rank may add them all under one name.
TEST(DcpSave, ARankSavesSeveralChunksOfOneTensorAndTheyReadBackWhole) {
  TempDir dir("ddp-dcp-save");
  const at::Tensor whole = torch::arange(20, torch::kFloat32).reshape({4, 5});
  DcpStateDict state;
  state.add_shard("w", whole.narrow(0, 0, 1).narrow(1, 0, 2), {0, 0}, {4, 5});
  state.add_shard("w", whole.narrow(0, 0, 1).narrow(1, 2, 3), {0, 2}, {4, 5});
  state.add_shard("w", whole.narrow(0, 1, 2), {1, 0}, {4, 5});
  state.add_shard("w", whole.narrow(0, 3, 1), {3, 0}, {4, 5});
  const DcpCheckpointInfo info = save_dcp(state, dir.path() / "ckpt");
  ASSERT_EQ(info.tensors.at("w").chunks.size(), 4u);
  const DcpReader checkpoint(dir.path() / "ckpt");
  EXPECT_TRUE(torch::equal(checkpoint.read("w"), whole));

  // The same chunk twice, and chunks that disagree on their tensor, are named; overlapping
  // chunks do not make a checkpoint.
  EXPECT_THAT(error_of([&] {
                state.add_shard("w", torch::ones({1, 2}), {0, 0}, {4, 5});
              }),
              HasSubstr("the shard of 'w' at [0, 0] is added twice"));
  EXPECT_THAT(error_of([&] {
                state.add_shard("w", torch::ones({1, 2}), {0, 1}, {4, 6});
              }),
              AllOf(HasSubstr("the shards of 'w' disagree"), HasSubstr("[4, 6]")));
  EXPECT_THAT(error_of([&] {
                state.add_shard("w", torch::ones({1, 2}, torch::kDouble), {0, 1}, {4, 5});
              }),
              AllOf(HasSubstr("the shards of 'w' disagree"), HasSubstr("Double")));
  EXPECT_THAT(error_of([&] { state.add_tensor("w", whole); }),
              HasSubstr("only shards of one tensor may share a name"));
  state.add_shard("w", torch::ones({1, 2}), {0, 1}, {4, 5});  // over two chunks already added
  EXPECT_THAT(error_of([&] { save_dcp(state, dir.path() / "ckpt2"); }),
              AllOf(HasSubstr("'w'"), HasSubstr("nothing was written")));
}

// A flat range of a row-major tensor as checkpoint boxes (FSDP's shards): for every range of a
// [3, 4, 5] tensor, the boxes follow each other in flat order, each one the elements its offsets
// and sizes name, at most 2 * dims - 1 of them; read back from a checkpoint saved in other
// chunks, each range is the tensor's flat elements.
TEST(DcpFlatRange, EveryRangeIsTheFewestBoxesAndReadsBackFromOtherChunks) {
  const std::vector<std::int64_t> shape = {3, 4, 5};
  const at::Tensor whole = torch::arange(60, torch::kFloat32).reshape(shape);
  for (std::int64_t begin = 0; begin <= 60; ++begin) {
    for (std::int64_t end = begin; end <= 60; ++end) {
      const auto boxes = ddp::detail::dcp_flat_boxes(shape, begin, end);
      ASSERT_LE(boxes.size(), 5u) << begin << ".." << end;
      std::int64_t at = begin;
      for (const auto& box : boxes) {
        ASSERT_EQ(box.flat_begin, at) << begin << ".." << end;
        at::Tensor region = whole;
        for (std::size_t d = 0; d < shape.size(); ++d)
          region = region.narrow(static_cast<std::int64_t>(d), box.offsets[d], box.sizes[d]);
        ASSERT_EQ(region.numel(), box.numel);
        ASSERT_TRUE(torch::equal(
            region.reshape(-1),
            torch::arange(box.flat_begin, box.flat_begin + box.numel, torch::kFloat32)))
            << begin << ".." << end;
        at += box.numel;
      }
      ASSERT_EQ(at, end) << begin << ".." << end;
    }
  }
  EXPECT_EQ(ddp::detail::dcp_flat_boxes({}, 0, 1).size(), 1u);  // a 0-dim tensor's one element

  TempDir dir("ddp-dcp-save");
  DcpStateDict state;
  state.add_shard("w", whole.narrow(0, 0, 2), {0, 0, 0}, shape);
  state.add_shard("w", whole.narrow(0, 2, 1).narrow(1, 0, 3), {2, 0, 0}, shape);
  state.add_shard("w", whole.narrow(0, 2, 1).narrow(1, 3, 1), {2, 3, 0}, shape);
  save_dcp(state, dir.path() / "ckpt");
  const DcpReader checkpoint(dir.path() / "ckpt");
  for (const auto& [begin, end] : std::vector<std::pair<std::int64_t, std::int64_t>>{
           {0, 60}, {7, 8}, {13, 47}, {39, 60}, {40, 41}, {59, 60}, {21, 21}}) {
    EXPECT_TRUE(torch::equal(ddp::detail::read_dcp_flat_range(checkpoint, "w", shape, begin, end),
                             whole.reshape(-1).narrow(0, begin, end - begin)))
        << begin << ".." << end;
  }
}

TEST(DcpSave, MisusesAreNamedErrors) {
  DcpStateDict state;
  state.add_tensor("w", torch::ones({2}));
  EXPECT_THAT(error_of([&] { state.add_value("w", 1); }), HasSubstr("'w' is added twice"));
  EXPECT_THAT(error_of([&] { state.add_tensor("", torch::ones({1})); }),
              HasSubstr("non-empty name"));
  EXPECT_THAT(error_of([&] { state.add_tensor("u", at::Tensor()); }), HasSubstr("undefined"));
  EXPECT_THAT(error_of([&] {
                state.add_tensor("s", torch::ones({2, 2}).to_sparse());
              }),
              HasSubstr("not a dense strided tensor"));
  EXPECT_THAT(error_of([&] { state.add_value("t", torch::ones({1})); }),
              HasSubstr("add_tensor or add_shard"));
  EXPECT_THAT(error_of([&] { state.add_shard("x", torch::ones({3}), {2}, {4}); }),
              AllOf(HasSubstr("'x'"), HasSubstr("not inside its global shape [4]")));
  EXPECT_THAT(error_of([&] {
                state.add_shard("y", torch::ones({3}), {0, 0}, {4});
              }),
              HasSubstr("not inside"));

  EXPECT_THAT(error_of([] { DcpStateDict::flatten(c10::IValue(3)); }), HasSubstr("not a dict"));
  auto bad_key = new_dict();
  bad_key.insert(1.5, torch::ones({1}));
  EXPECT_THAT(error_of([&] { DcpStateDict::flatten(bad_key); }),
              HasSubstr("only strings and integers"));
  auto clash = new_dict();
  auto inner = new_dict();
  inner.insert("b", torch::ones({1}));
  clash.insert("a.b", torch::ones({1}));
  clash.insert("a", inner);
  EXPECT_THAT(error_of([&] { DcpStateDict::flatten(clash); }),
              HasSubstr("two entries flatten to 'a.b'"));

  TempDir dir("ddp-dcp-save");
  std::ofstream(dir.path() / "file") << "x";
  EXPECT_THAT(error_of([&] { save_dcp(state, dir.path() / "file" / "ckpt"); }),
              AllOf(HasSubstr("cannot use the folder"), HasSubstr("nothing was written")));
}

TEST(DcpSave, TorchSaveToDcpRefusesAFileThatIsNotAStateDict) {
  TempDir dir("ddp-dcp-save");
  EXPECT_THAT(error_of([&] { torch_save_to_dcp(dir.path() / "missing.pt", dir.path() / "c"); }),
              HasSubstr("missing.pt"));
  EXPECT_FALSE(std::filesystem::exists(dir.path() / "c"));
}

TEST(DcpSaveAsync, ReturnsWithACopySoTrainingMayChangeTheTensorsAndCommitsAtWait) {
  TempDir dir("ddp-dcp-async");
  const auto folder = dir.path() / "ckpt";
  at::Tensor weight = torch::arange(1 << 16, torch::kFloat32);
  const at::Tensor saved = weight.clone();
  auto group = new_dict();
  group.insert("lr", 0.25);
  DcpStateDict state;
  state.add_tensor("weight", weight);
  state.add_shard("rows", weight.view({256, 256}).slice(0, 0, 256), {0, 0}, {256, 256});
  state.add_value("group", group);
  DcpAsyncSave pending = save_dcp_async(state, folder);
  weight.mul_(-1);  // the next optimizer step, while the writer runs
  group.insert_or_assign("lr", 9.0);
  // Nothing is committed before wait(): a reader still sees no checkpoint here.
  EXPECT_FALSE(std::filesystem::exists(folder / ".metadata"));
  const DcpCheckpointInfo info = pending.wait();
  EXPECT_EQ(info.tensors.size(), 2u);
  EXPECT_EQ(pending.wait().order, info.order);  // again: the same answer
  const DcpReader checkpoint(folder);
  EXPECT_TRUE(torch::equal(checkpoint.read("weight"), saved));
  EXPECT_TRUE(torch::equal(checkpoint.read("rows"), saved.view({256, 256})));
  EXPECT_EQ(checkpoint.read_value("group").toGenericDict().at("lr").toDouble(), 0.25);
}

TEST(DcpSaveAsync, TheNextSaveFinishesThePendingOneFirst) {
  TempDir dir("ddp-dcp-async");
  DcpStateDict first;
  first.add_tensor("w", torch::full({3}, 1.0));
  DcpAsyncSave a = save_dcp_async(first, dir.path() / "a");
  DcpStateDict second;
  second.add_tensor("w", torch::full({3}, 2.0));
  DcpAsyncSave b = save_dcp_async(second, dir.path() / "b");  // commits a first
  EXPECT_TRUE(torch::equal(DcpReader(dir.path() / "a").read("w"), torch::full({3}, 1.0)));
  b.wait();
  EXPECT_TRUE(torch::equal(DcpReader(dir.path() / "b").read("w"), torch::full({3}, 2.0)));
  EXPECT_EQ(a.wait().order, std::vector<std::string>{"w"});
}

TEST(DcpSaveAsync, AFailedBackgroundWriteIsThrownAtWaitOrAtTheNextSaveNeverLost) {
  TempDir dir("ddp-dcp-async");
  DcpStateDict broken;
  broken.add_tensor("w", torch::ones({2}));
  broken.add_value("device", c10::IValue(c10::Device(c10::kCPU)));
  {
    DcpAsyncSave pending = save_dcp_async(broken, dir.path() / "one");
    EXPECT_THAT(error_of([&] { pending.wait(); }),
                AllOf(HasSubstr("not committed"), HasSubstr("'device'")));
    EXPECT_THAT(error_of([&] { pending.wait(); }), HasSubstr("not committed"));  // again
  }
  // A handle dropped without wait(): the next save finishes it, throws its failure, and does not
  // start; the save after that runs.
  { DcpAsyncSave dropped = save_dcp_async(broken, dir.path() / "two"); }
  DcpStateDict good;
  good.add_tensor("w", torch::ones({2}));
  EXPECT_THAT(error_of([&] { save_dcp(good, dir.path() / "three"); }),
              AllOf(HasSubstr("two"), HasSubstr("not committed")));
  EXPECT_FALSE(std::filesystem::exists(dir.path() / "three"));
  save_dcp(good, dir.path() / "three");
  EXPECT_TRUE(torch::equal(DcpReader(dir.path() / "three").read("w"), torch::ones({2})));
  EXPECT_EQ(files_in(dir.path() / "two"), std::set<std::string>{});  // its part removed
}

TEST(DcpSaveAsync, APlanThatIsWrongIsRefusedAtTheCallNotInTheBackground) {
  TempDir dir("ddp-dcp-async");
  DcpStateDict state;
  state.add_shard("w", torch::ones({2}), {0}, {4});
  EXPECT_THAT(error_of([&] { save_dcp_async(state, dir.path() / "ckpt"); }),
              HasSubstr("do not make a checkpoint"));
  DcpStateDict fine;
  fine.add_tensor("w", torch::ones({2}));
  save_dcp(fine, dir.path() / "ckpt");  // nothing was left pending
}

TEST(DcpSave, ASecondJobSavingIntoTheSameFolderIsRefusedNamingTheFirst) {
  TempDir dir("ddp-dcp-save");
  const auto folder = dir.path() / "ckpt";
  DcpStateDict state;
  state.add_tensor("w", torch::ones({2}));
  // A save in progress (here: an asynchronous one not yet finished) holds the folder.
  DcpAsyncSave pending = save_dcp_async(state, folder);
  EXPECT_TRUE(std::filesystem::exists(folder / ".dcp-save.lock"));
  // Another job: a process of its own (forked from this one, whose pending save is not its).
  const pid_t first = ::getpid();
  auto other = run_ranks(1, [&](int) {
    try {
      save_dcp(state, folder);
      ADD_FAILURE() << "a second save into the same folder ran";
    } catch (const ConfigError& e) {
      EXPECT_THAT(std::string(e.what()),
                  AllOf(HasSubstr("another save is writing this folder"),
                        HasSubstr(fmt::format("pid={}", first)), HasSubstr("nothing was written")));
    }
  });
  EXPECT_ALL_RANKS_OK(other);
  pending.wait();
  EXPECT_FALSE(std::filesystem::exists(folder / ".dcp-save.lock"));
  EXPECT_TRUE(torch::equal(DcpReader(folder).read("w"), torch::ones({2})));
}

TEST(DcpSave, ALockLeftByAProcessThatDiedMidSaveIsTakenOver) {
  TempDir dir("ddp-dcp-save");
  const auto folder = dir.path() / "ckpt";
  std::filesystem::create_directories(folder);
  // A pid that runs no process (a child that has exited and been reaped), on this host.
  const pid_t gone = ::fork();
  if (gone == 0) ::_exit(0);
  ASSERT_GT(gone, 0);
  ASSERT_EQ(::waitpid(gone, nullptr, 0), gone);
  char host[256] = {};
  ::gethostname(host, sizeof(host) - 1);
  std::ofstream(folder / ".dcp-save.lock") << "pid=" << gone << " host=" << host << "\n";
  DcpStateDict state;
  state.add_tensor("w", torch::ones({2}));
  save_dcp(state, folder);
  EXPECT_FALSE(std::filesystem::exists(folder / ".dcp-save.lock"));
  // One from another host is not taken over: it is named.
  std::ofstream(folder / ".dcp-save.lock") << "pid=1 host=elsewhere-node-7\n";
  EXPECT_THAT(error_of([&] { save_dcp(state, folder); }),
              AllOf(HasSubstr("pid=1 host=elsewhere-node-7"), HasSubstr("remove")));
}

}  // namespace DDP_UNITY_ID
}  // namespace
}  // namespace ddp::test
