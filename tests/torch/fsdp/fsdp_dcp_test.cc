// FullyShardedDataParallel in PyTorch's distributed checkpoint format (dcp_state,
// load_dcp_state): saved at one world size and strategy, it loads at another, into a plain
// model and its optimizer (load_dcp_model_state), and what a plain model saves loads into FSDP;
// the training that follows ends where an uninterrupted run ends. Real ranks (run_ranks). The
// model is the FSDP suite's (113 parameters in three units whose shards start and end inside
// rows, so a rank saves several chunks of a weight).
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "ddp/error.h"
#include "ddp/torch/api/distributed.h"
#include "ddp/torch/checkpoint/dcp_model_state.h"
#include "ddp/torch/checkpoint/distributed_checkpoint.h"
#include "ddp/torch/checkpoint/distributed_checkpoint_save.h"
#include "ddp/torch/formats/state_dict.h"
#include "ddp/torch/fsdp/fully_sharded_data_parallel.h"
#include "support/error_of.h"
#include "support/multiprocess.h"
#include "support/temp_dir.h"
#include "support/torch/ddp_test_util.h"
#include "support/torch/deterministic_models.h"
#include "support/unity_namespace.h"

namespace ddp {
namespace {
namespace DDP_UNITY_ID {

using test::join_group;
using test::run_ranks;

constexpr int kSaveAt = 3, kSteps = 6;

FsdpOptions three_units(ShardingStrategy strategy) {
  return {.sharding_strategy = strategy, .min_num_params = 30};
}

std::unique_ptr<torch::optim::Adam> adam(std::vector<torch::Tensor> params) {
  return std::make_unique<torch::optim::Adam>(std::move(params), torch::optim::AdamOptions(0.01));
}

// Steps [from, to) of the suite's batches, split over the group's ranks.
template <class Model>
void train(Model& model, torch::optim::Optimizer& opt, int rank, int world, int from, int to) {
  for (int step = from; step < to; ++step) {
    auto [x, y] = test::sharded_suite_batch(rank, world, step);
    opt.zero_grad();
    torch::mse_loss(model->forward(x), y).backward();
    opt.step();
  }
}

void expect_state_equal(const StateDict& got, const StateDict& want, const std::string& what,
                        double tolerance) {
  if (got.size() != want.size()) {
    throw std::runtime_error(
        fmt::format("{}: {} entries, expected {}", what, got.size(), want.size()));
  }
  for (const auto& item : want) {
    const auto* g = got.find(item.key());
    if (g == nullptr) throw std::runtime_error(fmt::format("{}: no '{}'", what, item.key()));
    test::expect_close(*g, item.value(), what + " " + item.key(), tolerance, tolerance);
  }
}

// FULL_SHARD at world 3 saves after 3 Adam steps. At world 2, SHARD_GRAD_OP loads it and so does
// a plain model with its Adam: both hold exactly the saved parameters, and after 3 more steps
// both end where 6 uninterrupted steps end (float32, 1e-5). The plain model saves its own
// checkpoint, which FSDP loads back bit for bit.
TEST(FsdpDcp, SavedAtThreeLoadsAtTwoIntoFsdpAndAPlainModelAndTrainingEndsAlike) {
  test::TempDir dir;
  const auto path = dir.path() / "fsdp";
  const int port_save = test::free_port();
  EXPECT_ALL_RANKS_OK(run_ranks(kSaveAt, [&](int rank) {
    auto pg = join_group(rank, kSaveAt, port_save);
    FullyShardedDataParallel model(test::sharded_suite_model(), pg,
                                   three_units(ShardingStrategy::kFullShard));
    auto opt = adam(model->parameters());
    train(model, *opt, rank, kSaveAt, 0, kSaveAt);
    const DcpStateDict state = model->dcp_state(opt.get());
    // A shard that starts inside a row is several chunks of that weight.
    int chunks = 0;
    for (const auto& entry : state.entries())
      chunks += entry.name == "model.0.weight" ? 1 : 0;
    if (rank == 1 && chunks < 2) {
      throw std::runtime_error(fmt::format("rank 1 holds {} chunks of 0.weight", chunks));
    }
    save_dcp(state, path);
  }));
  const DcpCheckpointInfo info = DcpReader(path).info();
  EXPECT_EQ(info.tensors.at("model.0.weight").shape,
            (std::vector<std::int64_t>{9, test::kShardedIn}));
  EXPECT_TRUE(info.tensors.contains("optim.state.4.bias.exp_avg_sq"));
  EXPECT_TRUE(info.values.contains("optim.param_groups.2.weight.lr"));

  const int port_load = test::free_port();
  EXPECT_ALL_RANKS_OK(run_ranks(2, [&](int rank) {
    auto pg = join_group(rank, 2, port_load);
    // Uninterrupted, at world 2.
    FullyShardedDataParallel straight(test::sharded_suite_model(), pg,
                                      three_units(ShardingStrategy::kFullShard));
    auto straight_opt = adam(straight->parameters());
    train(straight, *straight_opt, rank, 2, 0, kSaveAt);
    const StateDict at_save = straight->full_state_dict(0);
    train(straight, *straight_opt, rank, 2, kSaveAt, kSteps);
    const StateDict at_end = straight->full_state_dict(0);

    FullyShardedDataParallel resumed(test::sharded_suite_model(), pg,
                                     three_units(ShardingStrategy::kShardGradOp));
    // The initial values differ from the checkpoint's, so a part left unread would show.
    for (auto& p : resumed->parameters())
      p.detach().fill_(0.5);
    auto resumed_opt = adam(resumed->parameters());
    const StateDictLoadReport report = resumed->load_dcp_state(path, resumed_opt.get());
    if (!report.complete() || report.loaded.size() != 6) {
      throw std::runtime_error(fmt::format("the load loaded {} entries", report.loaded.size()));
    }
    const StateDict loaded = resumed->full_state_dict(0);
    if (rank == 0) expect_state_equal(loaded, at_save, "FSDP loaded at world 2", 1e-5);
    train(resumed, *resumed_opt, rank, 2, kSaveAt, kSteps);
    const StateDict resumed_end = resumed->full_state_dict(0);
    if (rank == 0) expect_state_equal(resumed_end, at_end, "FSDP resumed at world 2", 1e-5);

    // A plain model and its Adam, on each rank alone (the whole batch): the saved values exactly,
    // then the same end.
    auto plain = test::sharded_suite_model();
    auto plain_opt = adam(plain->parameters());
    load_dcp_model_state(path, *plain, plain_opt.get());
    if (rank == 0) {
      const StateDict plain_loaded = state_dict(*plain);
      for (const auto& item : loaded) {
        if (!torch::equal(*plain_loaded.find(item.key()), item.value())) {
          throw std::runtime_error("the plain model's " + item.key() + " is not FSDP's");
        }
      }
    }
    train(plain, *plain_opt, 0, 1, kSaveAt, kSteps);
    if (rank == 0) expect_state_equal(state_dict(*plain), at_end, "plain model resumed", 1e-5);

    // The plain model's checkpoint (one process, every tensor whole) loads into FSDP exactly.
    const auto plain_path = dir.path() / fmt::format("plain-{}", rank);
    save_dcp(dcp_model_state(*plain, plain_opt.get()), plain_path, {.no_dist = true});
    FullyShardedDataParallel back(test::sharded_suite_model(), pg,
                                  three_units(ShardingStrategy::kFullShard));
    auto back_opt = adam(back->parameters());
    back->load_dcp_state(plain_path, back_opt.get());
    const StateDict back_state = back->full_state_dict(0);
    if (rank == 0) expect_state_equal(back_state, state_dict(*plain), "plain into FSDP", 0.0);
    // And its optimizer state: the next step from either ends alike.
    train(back, *back_opt, rank, 2, kSteps, kSteps + 1);
    train(plain, *plain_opt, 0, 1, kSteps, kSteps + 1);
    const StateDict back_next = back->full_state_dict(0);
    if (rank == 0) expect_state_equal(back_next, state_dict(*plain), "next step", 1e-5);
  }));
}

// HYBRID_SHARD at world 4 (sharded over {0, 1} and {2, 3}, replicated over {0, 2} and {1, 3}):
// the replicas' equal chunks are written once (after the replica check), and FULL_SHARD at world
// 2 loads exactly the model the saving ranks held.
TEST(FsdpDcp, HybridShardWritesEachShardOnceAndLoadsAtAnotherWorld) {
  test::TempDir dir;
  const auto path = dir.path() / "hybrid";
  const auto expected = dir.path() / "expected.pt";
  const int port_save = test::free_port();
  EXPECT_ALL_RANKS_OK(run_ranks(4, [&](int rank) {
    auto pg = join_group(rank, 4, port_save);
    FsdpOptions options = three_units(ShardingStrategy::kHybridShard);
    options.shard_group = split_group({{0, 1}, {2, 3}}, pg);
    options.replicate_group = split_group({{0, 2}, {1, 3}}, pg);
    FullyShardedDataParallel model(test::sharded_suite_model(), pg, options);
    auto opt = adam(model->parameters());
    train(model, *opt, rank, 4, 0, 2);
    save_dcp(model->dcp_state(opt.get()), path);
    const StateDict saved = model->full_state_dict(0);
    if (rank != 0) return;
    torch::serialize::OutputArchive archive;
    for (const auto& item : saved)
      archive.write(item.key(), item.value());
    archive.save_to(expected.string());
  }));
  const DcpTensorInfo weight = DcpReader(path).info().tensors.at("model.0.weight");
  std::int64_t elements = 0;
  for (const auto& chunk : weight.chunks)
    elements += c10::multiply_integers(chunk.sizes);
  EXPECT_EQ(elements, 9 * test::kShardedIn) << "a replica's chunk was written twice";

  const int port_load = test::free_port();
  EXPECT_ALL_RANKS_OK(run_ranks(2, [&](int rank) {
    auto pg = join_group(rank, 2, port_load);
    FullyShardedDataParallel model(test::sharded_suite_model(), pg,
                                   three_units(ShardingStrategy::kFullShard));
    auto opt = adam(model->parameters());
    model->load_dcp_state(path, opt.get());
    const StateDict loaded = model->full_state_dict(0);
    if (rank != 0) return;
    torch::serialize::InputArchive archive;
    archive.load_from(expected.string());
    StateDict want;
    for (const auto& item : loaded) {
      torch::Tensor t;
      archive.read(item.key(), t);
      want.insert(item.key(), t);
    }
    expect_state_equal(loaded, want, "HYBRID_SHARD's checkpoint loaded at world 2", 0.0);
  }));
}

// A checkpoint of another model is named with both shapes, and nothing changes; so is an
// optimizer over other parameters, a checkpoint without the optimizer's state, and a
// tensor-parallel layout that does not fit the model.
TEST(FsdpDcp, ACheckpointOfAnotherModelIsNamedAndNothingChanges) {
  test::TempDir dir;
  const int port = test::free_port();
  EXPECT_ALL_RANKS_OK(run_ranks(2, [&](int rank) {
    auto pg = join_group(rank, 2, port);
    const auto other = dir.path() / fmt::format("other-{}", rank);
    auto wider = test::sharded_suite_model(1);
    save_dcp(dcp_model_state(*wider), other, {.no_dist = true});

    FullyShardedDataParallel model(test::sharded_suite_model(), pg,
                                   three_units(ShardingStrategy::kFullShard));
    auto opt = adam(model->parameters());
    const StateDict before = model->full_state_dict(0);
    const std::string mismatch = test::error_of([&] { model->load_dcp_state(other); });
    if (mismatch.find("2.weight") == std::string::npos ||
        mismatch.find("[5, 9]") == std::string::npos ||
        mismatch.find("[4, 9]") == std::string::npos) {
      throw std::runtime_error("the mismatch was named as: " + mismatch);
    }
    const std::string no_optimizer =
        test::error_of([&] { model->load_dcp_state(other, opt.get(), {.strict = false}); });
    if (no_optimizer.find("no 'optim' entries") == std::string::npos) {
      throw std::runtime_error("a checkpoint without the optimizer was named as: " + no_optimizer);
    }
    auto stranger = adam(test::sharded_suite_model()->parameters());
    const std::string foreign = test::error_of([&] { model->dcp_state(stranger.get()); });
    if (foreign.find("not one of this FullyShardedDataParallel's shards") == std::string::npos) {
      throw std::runtime_error("an optimizer over other parameters was named as: " + foreign);
    }
    // A tensor-parallel layout whose part does not fit its parameter, or names none, is named
    // before anything is read or cut.
    DcpModelLayout too_small;
    too_small.shards["2.weight"] = {.offsets = {0, 0}, .global_shape = {2, 9}};
    const std::string outside = test::error_of([&] { model->dcp_state(opt.get(), too_small); });
    if (outside.find("the layout's part of '2.weight' does not fit") == std::string::npos) {
      throw std::runtime_error("a part outside its global shape was named as: " + outside);
    }
    DcpModelLayout unknown;
    unknown.shards["9.weight"] = {.offsets = {0, 0}, .global_shape = {4, 9}};
    const std::string missing =
        test::error_of([&] { model->load_dcp_state(other, opt.get(), {}, unknown); });
    if (missing.find("the layout splits '9.weight', which the model has no parameter") ==
        std::string::npos) {
      throw std::runtime_error("a layout of no parameter was named as: " + missing);
    }
    const StateDict after = model->full_state_dict(0);
    if (rank == 0) expect_state_equal(after, before, "after the refused loads", 0.0);
  }));
}

// A copy of `from` with each entry passed through `edit`, which may change it or drop it
// (nullopt).
DcpStateDict edited(
    const DcpStateDict& from,
    const std::function<std::optional<DcpStateDict::Entry>(DcpStateDict::Entry)>& edit) {
  DcpStateDict out;
  for (const auto& entry : from.entries()) {
    if (auto kept = edit(entry)) out.add_entry(std::move(*kept));
  }
  return out;
}

// Hand-made checkpoints that do not fit a unit of FSDP (its first unit holds 0.weight and
// 0.bias): each is named, and neither the model nor the optimizer changes. The unedited
// checkpoint loads, so each refusal comes from its edit.
TEST(FsdpDcp, AHandMadeCheckpointThatDoesNotFitAUnitIsNamedAndNothingChanges) {
  test::TempDir dir;
  const int port = test::free_port();
  EXPECT_ALL_RANKS_OK(run_ranks(2, [&](int rank) {
    auto pg = join_group(rank, 2, port);
    auto plain = test::sharded_suite_model();
    auto plain_opt = adam(plain->parameters());
    train(plain, *plain_opt, 0, 1, 0, 1);
    const DcpStateDict whole = dcp_model_state(*plain, plain_opt.get());
    int saved = 0;
    const auto save = [&](const DcpStateDict& state) {
      const auto folder = dir.path() / fmt::format("case-{}-{}", saved++, rank);
      save_dcp(state, folder, {.no_dist = true});
      return folder;
    };
    const auto drop = [](const std::function<bool(const std::string&)>& dropped) {
      return [dropped](DcpStateDict::Entry e) -> std::optional<DcpStateDict::Entry> {
        if (dropped(e.name)) return std::nullopt;
        return e;
      };
    };
    const auto replace = [](const std::string& name, DcpStateDict::Entry with) {
      return [name, with](DcpStateDict::Entry e) -> std::optional<DcpStateDict::Entry> {
        return e.name == name ? with : e;
      };
    };
    const auto entry_of = [&](const std::string& name) {
      for (const auto& e : whole.entries())
        if (e.name == name) return e;
      throw std::runtime_error("the plain model's checkpoint has no " + name);
    };
    DcpStateDict::Entry bias_as_value = entry_of("model.0.bias");
    bias_as_value.kind = DcpStateDict::Entry::Kind::kValue;
    bias_as_value.tensor = torch::Tensor();
    bias_as_value.value = c10::IValue(std::int64_t{3});
    DcpStateDict::Entry short_bias_state = entry_of("optim.state.0.bias.exp_avg");
    short_bias_state.tensor = torch::zeros({3});
    DcpStateDict::Entry short_weight_state = entry_of("optim.state.0.weight.exp_avg");
    short_weight_state.tensor = torch::zeros({9});
    DcpStateDict::Entry other_step = entry_of("optim.state.0.bias.step");
    if (other_step.kind == DcpStateDict::Entry::Kind::kValue) {
      other_step.value = c10::IValue(other_step.value.toInt() + 1);
    } else {
      other_step.tensor = other_step.tensor + 1;
    }

    struct Case {
      const char* what;
      std::filesystem::path folder;
      std::vector<std::string> named;
    };
    const std::vector<Case> cases = {
        {"a parameter saved as a value",
         save(edited(whole, replace("model.0.bias", bias_as_value))),
         {"'model.0.bias' is a Int, not a tensor"}},
        {"no model entries",
         save(edited(whole, drop([](const std::string& n) { return n.starts_with("model."); }))),
         {"no 'model' entries"}},
        {"state of one parameter of a unit only",
         save(edited(whole,
                     drop([](const std::string& n) { return n == "optim.state.0.bias.exp_avg"; }))),
         {"'exp_avg' of some of the parameters", "but not of '0.bias'"}},
        {"a per-element state of another shape",
         save(edited(whole, replace("optim.state.0.bias.exp_avg", short_bias_state))),
         {"'optim.state.0.bias.exp_avg' is not a tensor of the parameter's shape [9]"}},
        {"the unit's first parameter's state of another shape",
         save(edited(whole, replace("optim.state.0.weight.exp_avg", short_weight_state))),
         {fmt::format("'optim.state.0.weight.exp_avg' is not a tensor of the parameter's "
                      "shape [9, {}]",
                      test::kShardedIn)}},
        {"steps that differ within a unit",
         save(edited(whole, replace("optim.state.0.bias.step", other_step))),
         {"'optim.state.0.weight.step' and 'optim.state.0.bias.step' differ"}},
        {"no options",
         save(edited(whole, drop([](const std::string& n) {
                       return n.starts_with("optim.param_groups.");
                     }))),
         {"no optimizer options for the parameter"}},
    };

    FullyShardedDataParallel model(test::sharded_suite_model(), pg,
                                   three_units(ShardingStrategy::kFullShard));
    auto opt = adam(model->parameters());
    const StateDict before = model->full_state_dict(0);
    for (const auto& c : cases) {
      const std::string error = test::error_of([&] { model->load_dcp_state(c.folder, opt.get()); });
      for (const auto& part : c.named) {
        if (error.find(part) == std::string::npos) {
          throw std::runtime_error(
              fmt::format("{}: expected \"{}\" in the error, got: {}", c.what, part, error));
        }
      }
      if (!opt->state().empty()) throw std::runtime_error(std::string(c.what) + ": Adam changed");
    }
    const StateDict after = model->full_state_dict(0);
    if (rank == 0) expect_state_equal(after, before, "after the refused loads", 0.0);
    model->load_dcp_state(save(whole), opt.get());
    if (opt->state().empty()) throw std::runtime_error("the unedited checkpoint loaded no state");
    const StateDict loaded = model->full_state_dict(0);
    if (rank == 0) expect_state_equal(loaded, state_dict(*plain), "the unedited checkpoint", 0.0);
  }));
}

}  // namespace DDP_UNITY_ID
}  // namespace
}  // namespace ddp
