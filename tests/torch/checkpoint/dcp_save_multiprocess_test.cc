// save_dcp (ddp/torch/checkpoint/distributed_checkpoint_save.h) at world 3, in real processes:
// row and column shards of uneven sizes, a replicated tensor, a shard two ranks both hold (as
// HYBRID_SHARD's replicas: written once), values on every rank and on one, read back whole and
// at world 2's layout by DcpReader and by PyTorch 2.x's dcp.load at worlds 2 (DTensors split
// another way) and 1. A plan the ranks disagree on, a rank that fails to write, and replicas
// whose bytes differ fail the save on every rank, naming the rank, with the previous checkpoint
// left as it was.
#include <chrono>
#include <filesystem>
#include <set>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "ddp/error.h"
#include "ddp/torch/checkpoint/dcp_model_state.h"
#include "ddp/torch/checkpoint/distributed_checkpoint.h"
#include "ddp/torch/checkpoint/distributed_checkpoint_save.h"
#include "ddp/torch/formats/state_dict.h"
#include "ddp/torch/fsdp/fully_sharded_data_parallel.h"
#include "ddp/torch/parallel/tensor/tensor_parallel.h"
#include "ddp/torch/parallel/tensor/tensor_parallel_dcp_layout.h"
#include "support/multiprocess.h"
#include "support/subprocess.h"
#include "support/temp_dir.h"
#include "support/test_paths.h"
#include "support/torch/ddp_test_util.h"
#include "support/unity_namespace.h"

namespace ddp {
namespace {
namespace DDP_UNITY_ID {

using namespace std::chrono_literals;
using test::join_group;
using test::run_ranks;
using ::testing::AllOf;
using ::testing::HasSubstr;

constexpr int kWorld = 3;

// The whole tensors, in closed form (pytorch_dcp_load.py computes the same).
at::Tensor rows() {
  return torch::arange(40, torch::kFloat64).reshape({10, 4});
}
at::Tensor cols() {
  return torch::arange(21, torch::kFloat32).reshape({3, 7});
}
at::Tensor emb() {
  return torch::arange(10, torch::kInt64).reshape({5, 2});
}
at::Tensor hybrid() {
  return torch::arange(4, torch::kFloat32) * 10;
}

// Rank `rank`'s part, as FSDP (rows: 4, 3, 3), tensor parallelism (cols: 3, 2, 2) and
// HYBRID_SHARD (hybrid: ranks 0 and 2 hold the first half, rank 1 the second) would hold it.
DcpStateDict part_of(int rank) {
  const std::vector<std::int64_t> row_start = {0, 4, 7, 10}, col_start = {0, 3, 5, 7};
  DcpStateDict state;
  state.add_shard("rows", rows().slice(0, row_start[rank], row_start[rank + 1]),
                  {row_start[rank], 0}, {10, 4});
  state.add_shard("cols", cols().slice(1, col_start[rank], col_start[rank + 1]),
                  {0, col_start[rank]}, {3, 7});
  state.add_tensor("emb", emb());
  const std::int64_t half = rank == 1 ? 2 : 0;
  state.add_shard("hybrid", hybrid().slice(0, half, half + 2), {half}, {4});
  state.add_value("step", 42);
  if (rank == 1) state.add_value("only_on_rank1", std::string("one"));
  return state;
}

std::set<std::string> files_in(const std::filesystem::path& folder) {
  std::set<std::string> names;
  for (const auto& f : std::filesystem::directory_iterator(folder))
    names.insert(f.path().filename().string());
  return names;
}

// Saves part_of(rank) at world 3 into `folder`; every rank checks the description it returns.
void save_at_world_three(const std::filesystem::path& folder) {
  const int port = test::free_port();
  EXPECT_ALL_RANKS_OK(run_ranks(kWorld, [&](int rank) {
    auto pg = join_group(rank, kWorld, port);
    const DcpCheckpointInfo info = save_dcp(part_of(rank), folder, {.group = pg});
    EXPECT_EQ(info.order,
              (std::vector<std::string>{"rows", "cols", "emb", "hybrid", "step", "only_on_rank1"}));
    EXPECT_EQ(info.tensors.at("rows").chunks.size(), 3u);
    EXPECT_EQ(info.tensors.at("emb").chunks.size(), 1u);     // replicated: written once
    EXPECT_EQ(info.tensors.at("hybrid").chunks.size(), 2u);  // replicas: once each
  }));
}

TEST(DcpSaveMultiprocess, SavedAtThreeReadsBackWholeAndAtWorldTwosLayout) {
  test::TempDir dir("ddp-dcp-save-mp");
  const auto folder = dir.path() / "ckpt";
  save_at_world_three(folder);
  // Every rank holds shards, so every rank wrote a data file; none other is there.
  EXPECT_EQ(files_in(folder),
            (std::set<std::string>{".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp"}));
  auto results = run_ranks(1, [&](int) {
    const DcpReader checkpoint(folder);
    EXPECT_TRUE(torch::equal(checkpoint.read("rows"), rows()));
    EXPECT_TRUE(torch::equal(checkpoint.read("cols"), cols()));
    EXPECT_TRUE(torch::equal(checkpoint.read("emb"), emb()));
    EXPECT_TRUE(torch::equal(checkpoint.read("hybrid"), hybrid()));
    // World 2's halves of rows (5 + 5 across the saved 4 + 3 + 3) and of cols by rows.
    EXPECT_TRUE(torch::equal(checkpoint.read("rows", {5, 0}, {5, 4}), rows().slice(0, 5, 10)));
    EXPECT_TRUE(torch::equal(checkpoint.read("cols", {1, 0}, {2, 7}), cols().slice(0, 1, 3)));
    EXPECT_EQ(checkpoint.read_value("step").toInt(), 42);
    EXPECT_EQ(checkpoint.read_value("only_on_rank1").toStringRef(), "one");
    checkpoint.verify();
  });
  EXPECT_ALL_RANKS_OK(results);
}

// Why PyTorch 2.x with DCP and DTensor cannot be run through scripts/pytorch-python, or "".
std::string pytorch_dcp_missing() {
  auto probe = test::Subprocess::start(
      {test::paths::pytorch_python, "-c",
       "import torch, torch.distributed.checkpoint, torch.distributed.tensor; "
       "assert int(torch.__version__.split('.')[0]) >= 2"});
  const auto probed = probe.wait(60s);
  if (probed.exit_code == 0) return "";
  return "PyTorch 2.x with torch.distributed.tensor is not available through "
         "scripts/pytorch-python (run scripts/install-deps.sh): " +
         probed.output;
}

// Whether PyTorch's Python ran `code` (with `folder` as sys.argv[1]) and exited 0; says why not.
::testing::AssertionResult pytorch_ran(const std::string& code,
                                       const std::filesystem::path& folder) {
  auto python = test::Subprocess::start({test::paths::pytorch_python, "-c", code, folder.string()});
  const auto ran = python.wait(120s);
  if (ran.exit_code == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "exit " << ran.exit_code << ": " << ran.output;
}

TEST(DcpSaveMultiprocess, PyTorchLoadsWhatDdpSavedAtWorldThreeAtWorldsTwoAndOne) {
  if (const std::string missing = pytorch_dcp_missing(); !missing.empty()) GTEST_SKIP() << missing;
  const std::string python = test::paths::pytorch_python;
  test::TempDir dir("ddp-dcp-save-pytorch");
  const auto folder = dir.path() / "ckpt";
  save_at_world_three(folder);
  auto load = test::Subprocess::start(
      {python, test::paths::pytorch_dcp_load_script, folder.string(), dir.path().string()});
  const auto loaded = load.wait(240s);
  EXPECT_EQ(loaded.exit_code, 0) << loaded.output;
  EXPECT_THAT(loaded.output, HasSubstr("pytorch loaded ddp's checkpoint at worlds 2 and 1"));
}

// PyTorch's dcp.save keeps a tensor's strides where its storage is compact (a transposed
// matrix): DcpReader reads its rows in part (the window read cannot serve: the saved bytes are
// not in row order, so the chunk is read whole) and whole.
TEST(DcpReaderOfPyTorch, AChunkSavedTransposedReadsInPartAndWhole) {
  if (const std::string missing = pytorch_dcp_missing(); !missing.empty()) GTEST_SKIP() << missing;
  test::TempDir dir("ddp-dcp-transposed");
  const auto folder = dir.path() / "ckpt";
  ASSERT_TRUE(
      pytorch_ran("import sys, torch, torch.distributed.checkpoint as dcp\n"
                  "w = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()\n"
                  "assert not w.is_contiguous()\n"
                  "dcp.save({'w': w}, checkpoint_id=sys.argv[1], no_dist=True)\n",
                  folder));
  auto results = run_ranks(1, [&](int) {
    const at::Tensor w = torch::arange(12, torch::kFloat32).reshape({3, 4}).t();
    const DcpReader checkpoint(folder);
    EXPECT_TRUE(torch::equal(checkpoint.read("w"), w));
    EXPECT_TRUE(torch::equal(checkpoint.read("w", {1, 0}, {2, 3}), w.slice(0, 1, 3)));
    EXPECT_TRUE(torch::equal(checkpoint.read("w", {0, 0}, {4, 3}), w));
    EXPECT_TRUE(
        torch::equal(checkpoint.read("w", {3, 1}, {1, 2}), w.slice(0, 3, 4).slice(1, 1, 3)));
  });
  EXPECT_ALL_RANKS_OK(results);
}

// A writer other than dcp.save may leave a chunk's whole storage behind it: torch.save of a view
// (PyTorch's dcp.save clones such a view first). The folder is made with PyTorch's own classes,
// and its dcp.load reads it. DcpReader reads each chunk whole, in rows (the window read finds the
// storage offset and falls back to the chunk read whole), and in columns (the array window finds
// the storage larger than the chunk and takes the overlap from the chunk read whole), for a view
// that is contiguous and one that is not.
TEST(DcpReaderOfPyTorch, AChunkWhoseStorageIsLargerThanItReadsInRowsColumnsAndWhole) {
  if (const std::string missing = pytorch_dcp_missing(); !missing.empty()) GTEST_SKIP() << missing;
  test::TempDir dir("ddp-dcp-views");
  const auto folder = dir.path() / "ckpt";
  ASSERT_TRUE(pytorch_ran(
      "import io, os, pickle, sys, torch\n"
      "import torch.distributed.checkpoint as dcp\n"
      "from torch.distributed.checkpoint.metadata import (Metadata, TensorStorageMetadata,\n"
      "    TensorProperties, ChunkStorageMetadata, MetadataIndex)\n"
      "from torch.distributed.checkpoint.filesystem import _StorageInfo\n"
      "folder = sys.argv[1]\n"
      "os.makedirs(folder)\n"
      "big = torch.arange(30, dtype=torch.float32).reshape(6, 5)\n"
      "views = {'rows': big[1:5], 'block': big[1:5, 1:4]}\n"
      "data, md, storage = io.BytesIO(), {}, {}\n"
      "for name, v in views.items():\n"
      "    start = data.tell()\n"
      "    torch.save(v, data)\n"
      "    md[name] = TensorStorageMetadata(properties=TensorProperties(dtype=v.dtype),\n"
      "        size=v.size(), chunks=[ChunkStorageMetadata(offsets=torch.Size([0, 0]),\n"
      "        sizes=v.size())])\n"
      "    storage[MetadataIndex(name, torch.Size([0, 0]))] = _StorageInfo('__0_0.distcp',\n"
      "        start, data.tell() - start)\n"
      "open(os.path.join(folder, '__0_0.distcp'), 'wb').write(data.getvalue())\n"
      "with open(os.path.join(folder, '.metadata'), 'wb') as f:\n"
      "    pickle.dump(Metadata(state_dict_metadata=md, storage_data=storage), f)\n"
      "out = {'rows': torch.zeros(4, 5), 'block': torch.zeros(4, 3)}\n"
      "dcp.load(out, checkpoint_id=folder, no_dist=True)\n"
      "assert all(torch.equal(out[k], v) for k, v in views.items())\n",
      folder));
  auto results = run_ranks(1, [&](int) {
    const at::Tensor big = torch::arange(30, torch::kFloat32).reshape({6, 5});
    const DcpReader checkpoint(folder);
    for (const auto& [name, view] : {std::pair{"rows", big.slice(0, 1, 5)},
                                     std::pair{"block", big.slice(0, 1, 5).slice(1, 1, 4)}}) {
      EXPECT_TRUE(torch::equal(checkpoint.read(name), view)) << name;
      EXPECT_TRUE(
          torch::equal(checkpoint.read(name, {1, 0}, {2, view.size(1)}), view.slice(0, 1, 3)))
          << name;
      EXPECT_TRUE(torch::equal(checkpoint.read(name, {0, 1}, {4, 2}), view.slice(1, 1, 3))) << name;
      EXPECT_TRUE(
          torch::equal(checkpoint.read(name, {2, 2}, {2, 1}), view.slice(0, 2, 4).slice(1, 2, 3)))
          << name;
    }
    checkpoint.verify();
  });
  EXPECT_ALL_RANKS_OK(results);
}

// dcp_model_state's layout is get_state_dict's: PyTorch resumes a model and its Adam state that
// C++ saved (and checks them against reference files C++ wrote), takes a step, saves with
// dcp.save, and C++ resumes that, equal to PyTorch's own reference files.
// C++'s reference files of a model and its optimizer (save_state_dict, save_optimizer_state_dict)
// in DIR/cpp_refs, then pytorch_dcp_model_state.py over DIR's cpp, cpp_refs, py and py_refs
// (with "flattened" when the options are saved per parameter): it must say it resumed and saved.
void pytorch_resumes_and_saves(const std::filesystem::path& dir, torch::nn::Module& model,
                               const torch::optim::Optimizer& optimizer, bool flattened,
                               bool qkv = false) {
  std::filesystem::create_directories(dir / "cpp_refs");
  save_state_dict(model, dir / "cpp_refs" / "model.pt");
  save_optimizer_state_dict(optimizer, dir / "cpp_refs" / "optim.pt");
  std::vector<std::string> command = {
      test::paths::pytorch_python, test::paths::pytorch_dcp_model_state_script,
      (dir / "cpp").string(),      (dir / "cpp_refs").string(),
      (dir / "py").string(),       (dir / "py_refs").string()};
  if (flattened) command.push_back("flattened");
  if (qkv) command.push_back("qkv");
  auto python = test::Subprocess::start(command);
  const auto ran = python.wait(240s);
  if (ran.exit_code != 0 ||
      ran.output.find("pytorch resumed ddp's model and optimizer, and saved its own") ==
          std::string::npos) {
    throw std::runtime_error("PyTorch's side failed: " + ran.output);
  }
}

TEST(DcpModelStateOfPyTorch, APythonJobAndACppJobResumeFromEachOthersCheckpoints) {
  if (const std::string missing = pytorch_dcp_missing(); !missing.empty()) GTEST_SKIP() << missing;
  test::TempDir dir("ddp-dcp-model-pytorch");
  auto mlp = [] {
    return torch::nn::Sequential(torch::nn::Linear(4, 8), torch::nn::ReLU(),
                                 torch::nn::Linear(8, 2));
  };
  const at::Tensor batch = torch::arange(12, torch::kFloat32).reshape({3, 4}) / 10;
  auto results = run_ranks(1, [&](int) {
    torch::manual_seed(3);
    auto model = mlp();
    torch::optim::Adam optimizer(model->parameters(), torch::optim::AdamOptions(0.01));
    for (int step = 0; step < 2; ++step) {
      optimizer.zero_grad();
      model->forward(batch).square().sum().backward();
      optimizer.step();
    }
    save_dcp(dcp_model_state(*model, &optimizer), dir.path() / "cpp");
    pytorch_resumes_and_saves(dir.path(), *model, optimizer, false);
  });
  ASSERT_TRUE(results[0].ok()) << test::describe(results);
  results = run_ranks(1, [&](int) {
    auto model = mlp();
    torch::optim::Adam optimizer(model->parameters(), torch::optim::AdamOptions(0.5));
    EXPECT_TRUE(load_dcp_model_state(dir.path() / "py", *model, &optimizer).complete());
    auto reference = mlp();
    load_state_dict(*reference, dir.path() / "py_refs" / "model.pt");
    const auto got = model->parameters(), want = reference->parameters();
    for (std::size_t i = 0; i < got.size(); ++i)
      EXPECT_TRUE(torch::equal(got[i], want[i])) << i;
    torch::optim::Adam reference_optimizer(reference->parameters(), torch::optim::AdamOptions(0.5));
    load_optimizer_state_dict(reference_optimizer, dir.path() / "py_refs" / "optim.pt");
    // The next step from each is the same: Adam's moments and step count came across.
    for (auto* pair : {&optimizer, &reference_optimizer}) {
      auto& net = pair == &optimizer ? model : reference;
      pair->zero_grad();
      net->forward(batch).square().sum().backward();
      pair->step();
    }
    const auto after = model->parameters(), reference_after = reference->parameters();
    for (std::size_t i = 0; i < after.size(); ++i)
      EXPECT_TRUE(torch::equal(after[i], reference_after[i])) << i;
    EXPECT_DOUBLE_EQ(optimizer.param_groups()[0].options().get_lr(), 0.01);
  });
  EXPECT_ALL_RANKS_OK(results);
}

// FullyShardedDataParallel's dcp_state at world 2 (two units of two parameters each, shards that
// end inside a weight) crosses to PyTorch, which loads it into a plain model and Adam through
// get_state_dict with flatten_optimizer_state_dict (FSDP's optimizer options are per parameter),
// equal to what ddp's plain loader reads from the same folder; and what PyTorch then saves in
// get_state_dict's default layout (options per group) loads into FSDP at world 2, equal to
// PyTorch's reference files, and the next step from each is the same.
TEST(DcpModelStateOfPyTorch, FsdpAtWorldTwoAndAPythonJobResumeFromEachOthersCheckpoints) {
  if (const std::string missing = pytorch_dcp_missing(); !missing.empty()) GTEST_SKIP() << missing;
  test::TempDir dir("ddp-dcp-fsdp-pytorch");
  auto mlp = [] {
    return torch::nn::Sequential(torch::nn::Linear(4, 8), torch::nn::ReLU(),
                                 torch::nn::Linear(8, 2));
  };
  const FsdpOptions two_units{.sharding_strategy = ShardingStrategy::kFullShard,
                              .min_num_params = 30};
  // Every rank steps on the same batch: the averaged gradient is each rank's, so FSDP's step is
  // a plain model's (to the rounding of Adam's kernels over a shard against the whole tensor).
  const at::Tensor batch = torch::arange(12, torch::kFloat32).reshape({3, 4}) / 10;
  const int port_save = test::free_port();
  EXPECT_ALL_RANKS_OK(run_ranks(2, [&](int rank) {
    auto pg = join_group(rank, 2, port_save);
    torch::manual_seed(3);
    FullyShardedDataParallel model(mlp(), pg, two_units);
    torch::optim::Adam optimizer(model->parameters(), torch::optim::AdamOptions(0.01));
    for (int step = 0; step < 2; ++step) {
      optimizer.zero_grad();
      model->forward(batch).square().sum().backward();
      optimizer.step();
    }
    save_dcp(model->dcp_state(&optimizer), dir.path() / "cpp");
  }));
  auto results = run_ranks(1, [&](int) {
    auto model = mlp();
    torch::optim::Adam optimizer(model->parameters(), torch::optim::AdamOptions(0.5));
    if (!load_dcp_model_state(dir.path() / "cpp", *model, &optimizer).complete())
      throw std::runtime_error("ddp's plain loader did not load all of FSDP's checkpoint");
    pytorch_resumes_and_saves(dir.path(), *model, optimizer, true);
  });
  ASSERT_TRUE(results[0].ok()) << test::describe(results);

  const int port_load = test::free_port();
  EXPECT_ALL_RANKS_OK(run_ranks(2, [&](int rank) {
    auto pg = join_group(rank, 2, port_load);
    torch::manual_seed(11);  // not the saved values: a part left unread would show
    FullyShardedDataParallel model(mlp(), pg, two_units);
    torch::optim::Adam optimizer(model->parameters(), torch::optim::AdamOptions(0.5));
    if (!model->load_dcp_state(dir.path() / "py", &optimizer).complete())
      throw std::runtime_error("FSDP did not load all of PyTorch's checkpoint");
    if (optimizer.param_groups()[0].options().get_lr() != 0.01)
      throw std::runtime_error("the learning rate did not come across");
    auto reference = mlp();
    load_state_dict(*reference, dir.path() / "py_refs" / "model.pt");
    torch::optim::Adam reference_optimizer(reference->parameters(), torch::optim::AdamOptions(0.5));
    load_optimizer_state_dict(reference_optimizer, dir.path() / "py_refs" / "optim.pt");
    const StateDict loaded = model->full_state_dict(0);
    if (rank == 0) {
      for (const auto& item : state_dict(*reference))
        if (!torch::equal(*loaded.find(item.key()), item.value()))
          throw std::runtime_error("FSDP loaded another " + item.key() + " than PyTorch saved");
    }
    // The next step from each is the same: Adam's moments and step count came across.
    optimizer.zero_grad();
    model->forward(batch).square().sum().backward();
    optimizer.step();
    reference_optimizer.zero_grad();
    reference->forward(batch).square().sum().backward();
    reference_optimizer.step();
    const StateDict after = model->full_state_dict(0);
    if (rank == 0) {
      for (const auto& item : state_dict(*reference))
        if (!torch::allclose(*after.find(item.key()), item.value(), 1e-6, 1e-7))
          throw std::runtime_error("after one more step, FSDP's " + item.key() +
                                   " differs from the plain model's");
    }
  }));
}

TEST(DcpSaveMultiprocess, ARankThatDisagreesFailsTheSaveOnEveryRankBeforeAnythingIsWritten) {
  test::TempDir dir("ddp-dcp-save-mp");
  const auto folder = dir.path() / "ckpt";
  const int port = test::free_port();
  EXPECT_ALL_RANKS_OK(run_ranks(kWorld, [&](int rank) {
    auto pg = join_group(rank, kWorld, port);
    DcpStateDict state;
    // Rank 1 holds the replicated tensor in float64, the others in float32.
    state.add_tensor("w", torch::ones({2, 2}, rank == 1 ? torch::kFloat64 : torch::kFloat32));
    try {
      save_dcp(state, folder, {.group = pg});
      ADD_FAILURE() << "rank " << rank << ": the save succeeded";
    } catch (const ConfigError& e) {
      EXPECT_THAT(std::string(e.what()),
                  AllOf(HasSubstr("'w' is float32 [2, 2] on rank 0 and float64 [2, 2] on rank 1"),
                        HasSubstr("nothing was written")));
    }
    // Shards that overlap (ranks 0 and 1 both claim row 2): refused alike.
    DcpStateDict overlapping;
    const std::int64_t start = rank == 0 ? 0 : rank == 1 ? 2 : 4;
    const std::int64_t count = rank == 0 ? 3 : 2;
    overlapping.add_shard("v", torch::ones({count}), {start}, {6});
    try {
      save_dcp(overlapping, folder, {.group = pg});
      ADD_FAILURE() << "rank " << rank << ": overlapping shards were saved";
    } catch (const ConfigError& e) {
      EXPECT_THAT(std::string(e.what()),
                  AllOf(HasSubstr("do not make a checkpoint"), HasSubstr("'v'")));
    }
  }));
  EXPECT_TRUE(files_in(folder).empty());
}

TEST(DcpSaveMultiprocess, ARankThatFailsToWriteFailsTheSaveEverywhereAndThePreviousStays) {
  test::TempDir dir("ddp-dcp-save-mp");
  const auto folder = dir.path() / "ckpt";
  save_at_world_three(folder);
  const int port = test::free_port();
  EXPECT_ALL_RANKS_OK(run_ranks(kWorld, [&](int rank) {
    auto pg = join_group(rank, kWorld, port);
    DcpStateDict state;
    state.add_shard("rows", torch::zeros({1, 4}, torch::kFloat64), {rank, 0}, {3, 4});
    // Only rank 2 holds a value torch.save cannot hold: its write fails.
    if (rank == 2) state.add_value("device", c10::IValue(c10::Device(c10::kCPU)));
    try {
      save_dcp(state, folder, {.group = pg});
      ADD_FAILURE() << "rank " << rank << ": the save succeeded";
    } catch (const ConfigError& e) {
      EXPECT_THAT(std::string(e.what()),
                  AllOf(HasSubstr("not committed"), HasSubstr("rank 2:"), HasSubstr("'device'"),
                        HasSubstr("previous checkpoint")));
    }
  }));
  // The first save's files, and none of the failed one's.
  EXPECT_EQ(files_in(folder),
            (std::set<std::string>{".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp"}));
  auto results =
      run_ranks(1, [&](int) { EXPECT_TRUE(torch::equal(DcpReader(folder).read("rows"), rows())); });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(DcpSaveMultiprocess, ReplicasThatDifferAreRefusedOnEveryRankAndThePreviousStays) {
  test::TempDir dir("ddp-dcp-save-mp");
  const auto folder = dir.path() / "ckpt";
  save_at_world_three(folder);
  const int port = test::free_port();
  // What a rank whose replicas drifted holds: rank 2's emb and its half of hybrid (shared with
  // rank 0), rank 1's step.
  auto drifted = [](int rank) {
    DcpStateDict state;
    state.add_tensor("emb", rank == 2 ? emb() + 1 : emb());
    const std::int64_t half = rank == 1 ? 2 : 0;
    at::Tensor mine = hybrid().slice(0, half, half + 2).clone();
    if (rank == 2) mine[1] = -1;  // one element of one replica
    state.add_shard("hybrid", mine, {half}, {4});
    state.add_value("step", rank == 1 ? 43 : 42);
    return state;
  };
  EXPECT_ALL_RANKS_OK(run_ranks(kWorld, [&](int rank) {
    auto pg = join_group(rank, kWorld, port);
    for (const bool async : {false, true}) {
      try {
        if (async) {
          save_dcp_async(drifted(rank), folder, {.group = pg}).wait();
        } else {
          save_dcp(drifted(rank), folder, {.group = pg});
        }
        ADD_FAILURE() << "rank " << rank << ": replicas that differ were saved (async " << async
                      << ")";
      } catch (const ConfigError& e) {
        EXPECT_THAT(
            std::string(e.what()),
            AllOf(HasSubstr("not committed"),
                  HasSubstr("the tensor 'emb' differs across the ranks that hold it: ranks 0, 1 "
                            "(CRC-32 "),
                  HasSubstr(") against rank 2 (CRC-32 "),
                  HasSubstr("the chunk [2] at [0] of 'hybrid' differs across the ranks that hold "
                            "it: rank 0 (CRC-32 "),
                  HasSubstr("the value 'step' differs across the ranks that hold it: ranks 0, 2"),
                  HasSubstr("check_replicas"), HasSubstr("previous checkpoint")));
      }
    }
    // Unchecked, the plan's writer's copy is written (dcp.save's behaviour).
    const DcpCheckpointInfo info =
        save_dcp(drifted(rank), dir.path() / "unchecked", {.group = pg, .check_replicas = false});
    EXPECT_EQ(info.tensors.at("emb").chunks.size(), 1u);
  }));
  // The first save is what the folder holds.
  EXPECT_EQ(files_in(folder),
            (std::set<std::string>{".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp"}));
  auto results = run_ranks(1, [&](int) {
    EXPECT_TRUE(torch::equal(DcpReader(folder).read("emb"), emb()));
    EXPECT_EQ(DcpReader(folder).read_value("step").toInt(), 42);
    EXPECT_EQ(DcpReader(dir.path() / "unchecked").read("emb").sizes(), emb().sizes());
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(DcpSaveMultiprocess, AnAsyncSaveAtThreeWritesInTheBackgroundAndCommitsAtWait) {
  test::TempDir dir("ddp-dcp-save-mp");
  const auto folder = dir.path() / "ckpt";
  const int port = test::free_port();
  EXPECT_ALL_RANKS_OK(run_ranks(kWorld, [&](int rank) {
    auto pg = join_group(rank, kWorld, port);
    DcpStateDict state = part_of(rank);
    DcpAsyncSave pending = save_dcp_async(state, folder, {.group = pg});
    for (const auto& entry : state.entries()) {
      if (entry.tensor.defined()) entry.tensor.zero_();  // training goes on
    }
    const DcpCheckpointInfo info = pending.wait();
    EXPECT_EQ(info.tensors.at("hybrid").chunks.size(), 2u);
    // A second async save into the same folder, finished by the sync save after it.
    DcpAsyncSave second = save_dcp_async(part_of(rank), folder, {.group = pg});
    DcpStateDict other;
    other.add_tensor("x", torch::ones({2}));
    save_dcp(other, dir.path() / "other", {.group = pg});
    EXPECT_EQ(second.wait().order.size(), 6u);
  }));
  auto results = run_ranks(1, [&](int) {
    const DcpReader checkpoint(folder);
    EXPECT_TRUE(torch::equal(checkpoint.read("rows"), rows()));
    EXPECT_TRUE(torch::equal(checkpoint.read("hybrid"), hybrid()));
    EXPECT_EQ(checkpoint.read_value("only_on_rank1").toStringRef(), "one");
  });
  EXPECT_ALL_RANKS_OK(results);
  // The second save's files replaced the first's.
  EXPECT_EQ(files_in(folder),
            (std::set<std::string>{".metadata", "__0_1.distcp", "__1_1.distcp", "__2_1.distcp"}));
}

// A fused q|k|v split across tensor-parallel ranks is one nn.Linear(in, 3h) to PyTorch: ddp's
// column-parallel layer with fused_blocks 3 at tp 2 saves it as [12, 6] (each rank's rows of each
// block a chunk); ddp's plain loader reads it into a torch::nn::Linear that computes what the
// split model computed; PyTorch loads it into its own nn.Linear through get_state_dict, equal to
// that and to the same output, takes a step and saves; the split model loads that at tp 2, each
// rank its rows of each block, and the next step from each is the same.
struct FusedQkvModel : torch::nn::Module {
  explicit FusedQkvModel(const std::shared_ptr<ProcessGroup>& tp) {
    qkv = register_module(
        "qkv", ColumnParallelLinear(ColumnParallelLinearOptions{.in_features = 6,
                                                                .out_features = 12,
                                                                .gather_output = true,
                                                                .fused_blocks = 3,
                                                                .seed = 5,
                                                                .dtype = torch::kFloat64},
                                    tp));
    head = register_module("head", torch::nn::Linear(12, 2));
    head->to(torch::kFloat64);
  }
  torch::Tensor forward(const torch::Tensor& x) { return head(qkv(x).tanh()); }
  ColumnParallelLinear qkv{nullptr};
  torch::nn::Linear head{nullptr};
};

struct PlainQkvModel : torch::nn::Module {
  PlainQkvModel() {
    qkv = register_module("qkv", torch::nn::Linear(6, 12));
    head = register_module("head", torch::nn::Linear(12, 2));
    to(torch::kFloat64);
  }
  torch::Tensor forward(const torch::Tensor& x) { return head(qkv(x).tanh()); }
  torch::nn::Linear qkv{nullptr}, head{nullptr};
};

TEST(DcpModelStateOfPyTorch,
     AFusedQkvSplitAtTpTwoAndAPythonNnLinearResumeFromEachOthersCheckpoints) {
  if (const std::string missing = pytorch_dcp_missing(); !missing.empty()) GTEST_SKIP() << missing;
  test::TempDir dir("ddp-dcp-qkv-pytorch");
  const at::Tensor batch = torch::arange(18, torch::kFloat64).reshape({3, 6}) / 10;
  auto step = [&](torch::nn::Module& model, auto& forward, torch::optim::Optimizer& optimizer) {
    optimizer.zero_grad();
    forward(model).square().sum().backward();
    optimizer.step();
  };
  const int port_save = test::free_port();
  EXPECT_ALL_RANKS_OK(run_ranks(2, [&](int rank) {
    auto tp = join_group(rank, 2, port_save);
    torch::manual_seed(3);  // the head, replicated: the same on both ranks
    FusedQkvModel model(tp);
    torch::optim::Adam optimizer(model.parameters(), torch::optim::AdamOptions(0.01));
    auto forward = [&](torch::nn::Module&) { return model.forward(batch); };
    for (int i = 0; i < 2; ++i)
      step(model, forward, optimizer);
    save_dcp(dcp_model_state(model, &optimizer, tensor_parallel_dcp_layout(model)),
             dir.path() / "cpp", {.group = tp});
    const torch::Tensor computed = model.forward(batch).detach();  // collective: every rank
    if (rank == 0) {
      StateDict output;
      output.insert("output", computed);
      std::filesystem::create_directories(dir.path() / "cpp_refs");
      save_state_dict(output, dir.path() / "cpp_refs" / "output.pt");
    }
  }));
  auto results = run_ranks(1, [&](int) {
    const DcpReader saved(dir.path() / "cpp");
    if (saved.info().tensors.at("model.qkv.weight").shape != std::vector<std::int64_t>{12, 6})
      throw std::runtime_error("the fused q|k|v was not saved as nn.Linear's [12, 6]");
    PlainQkvModel model;
    torch::optim::Adam optimizer(model.parameters(), torch::optim::AdamOptions(0.5));
    if (!load_dcp_model_state(dir.path() / "cpp", model, &optimizer).complete())
      throw std::runtime_error("ddp's plain loader did not load all of the split checkpoint");
    const StateDict output = read_state_dict(dir.path() / "cpp_refs" / "output.pt");
    if (!torch::allclose(model.forward(batch), *output.find("output"), 0, 1e-12))
      throw std::runtime_error("the plain nn.Linear computes another output than the split model");
    pytorch_resumes_and_saves(dir.path(), model, optimizer, false, /*qkv=*/true);
  });
  ASSERT_TRUE(results[0].ok()) << test::describe(results);

  const int port_load = test::free_port();
  EXPECT_ALL_RANKS_OK(run_ranks(2, [&](int rank) {
    auto tp = join_group(rank, 2, port_load);
    torch::manual_seed(11);  // not the saved values: a part left unread would show
    FusedQkvModel model(tp);
    torch::optim::Adam optimizer(model.parameters(), torch::optim::AdamOptions(0.5));
    if (!load_dcp_model_state(dir.path() / "py", model, &optimizer, {},
                              tensor_parallel_dcp_layout(model))
             .complete()) {
      throw std::runtime_error("the split model did not load all of PyTorch's checkpoint");
    }
    PlainQkvModel reference;
    load_state_dict(reference, dir.path() / "py_refs" / "model.pt");
    torch::optim::Adam reference_optimizer(reference.parameters(), torch::optim::AdamOptions(0.5));
    load_optimizer_state_dict(reference_optimizer, dir.path() / "py_refs" / "optim.pt");
    // This rank's rows of each of the three blocks.
    auto mine = [&](const torch::Tensor& whole) {
      return whole.reshape({3, 4, -1}).narrow(1, 2 * rank, 2).reshape({6, -1}).squeeze(-1);
    };
    if (!torch::equal(model.qkv->weight, mine(reference.qkv->weight)) ||
        !torch::equal(model.qkv->bias, mine(reference.qkv->bias)) ||
        !torch::equal(model.head->weight, reference.head->weight)) {
      throw std::runtime_error("the split model loaded other values than PyTorch saved");
    }
    auto forward = [&](torch::nn::Module&) { return model.forward(batch); };
    auto reference_forward = [&](torch::nn::Module&) { return reference.forward(batch); };
    step(model, forward, optimizer);
    step(reference, reference_forward, reference_optimizer);
    if (!torch::allclose(model.qkv->weight, mine(reference.qkv->weight), 0, 1e-12) ||
        !torch::allclose(model.head->weight, reference.head->weight, 0, 1e-12)) {
      throw std::runtime_error("after one more step, the split model differs from the plain one");
    }
  }));
}

}  // namespace DDP_UNITY_ID
}  // namespace
}  // namespace ddp
