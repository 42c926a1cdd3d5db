// dcp_model_state / load_dcp_model_state (ddp/torch/checkpoint/dcp_model_state.h): a model and
// its Adam state saved as a distributed checkpoint in get_state_dict's layout come back exactly
// (the next step equals the uninterrupted run's bit for bit); a model or optimizer that does not
// fit is refused by name with nothing changed. PyTorch's side of the crossing is in
// dcp_save_multiprocess_test.cc.
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "ddp/error.h"
#include "ddp/torch/checkpoint/dcp_model_state.h"
#include "ddp/torch/checkpoint/distributed_checkpoint.h"
#include "support/temp_dir.h"
#include "support/unity_namespace.h"

namespace ddp {
namespace {
namespace DDP_UNITY_ID {

using ::testing::AllOf;
using ::testing::HasSubstr;

torch::nn::Sequential mlp(std::int64_t hidden = 8) {
  return torch::nn::Sequential(torch::nn::Linear(4, hidden), torch::nn::ReLU(),
                               torch::nn::Linear(hidden, 2));
}

void adam_step(torch::nn::Sequential& model, torch::optim::Optimizer& optimizer) {
  const at::Tensor batch = torch::arange(12, torch::kFloat32).reshape({3, 4}) / 10;
  optimizer.zero_grad();
  model->forward(batch).square().sum().backward();
  optimizer.step();
}

bool same_parameters(torch::nn::Sequential& a, torch::nn::Sequential& b) {
  const auto pa = a->parameters(), pb = b->parameters();
  for (std::size_t i = 0; i < pa.size(); ++i) {
    if (!torch::equal(pa[i], pb[i])) return false;
  }
  return pa.size() == pb.size();
}

TEST(DcpModelState, AModelAndItsAdamStateComeBackAndTheNextStepIsTheSame) {
  test::TempDir dir("ddp-dcp-model");
  torch::manual_seed(1);
  auto model = mlp();
  torch::optim::Adam optimizer(model->parameters(), torch::optim::AdamOptions(0.01));
  adam_step(model, optimizer);
  adam_step(model, optimizer);
  const DcpCheckpointInfo info = save_dcp(dcp_model_state(*model, &optimizer), dir.path() / "c");
  // get_state_dict's names: the model's under "model.", the state by parameter name.
  EXPECT_TRUE(info.tensors.contains("model.0.weight"));
  EXPECT_TRUE(info.tensors.contains("optim.state.2.bias.exp_avg_sq"));
  EXPECT_TRUE(info.tensors.contains("optim.state.0.weight.step"));
  EXPECT_TRUE(info.values.contains("optim.param_groups.0.lr"));
  EXPECT_EQ(
      DcpReader(dir.path() / "c").read_value("optim.param_groups.0.params").toListRef().size(), 4u);

  torch::manual_seed(2);  // another initialisation, which the load replaces
  auto resumed = mlp();
  torch::optim::Adam resumed_optimizer(resumed->parameters(), torch::optim::AdamOptions(0.5));
  const StateDictLoadReport report =
      load_dcp_model_state(dir.path() / "c", *resumed, &resumed_optimizer);
  EXPECT_TRUE(report.complete());
  EXPECT_EQ(report.loaded.size(), 4u);
  EXPECT_TRUE(same_parameters(model, resumed));
  EXPECT_DOUBLE_EQ(resumed_optimizer.param_groups()[0].options().get_lr(), 0.01);
  adam_step(model, optimizer);
  adam_step(resumed, resumed_optimizer);
  EXPECT_TRUE(same_parameters(model, resumed));  // Adam's moments and step came back too
}

TEST(DcpModelState, AModelOrOptimizerThatDoesNotFitIsRefusedAndNothingChanges) {
  test::TempDir dir("ddp-dcp-model");
  torch::manual_seed(1);
  auto model = mlp();
  torch::optim::Adam optimizer(model->parameters(), torch::optim::AdamOptions(0.01));
  adam_step(model, optimizer);
  save_dcp(dcp_model_state(*model, &optimizer), dir.path() / "c");

  // Another width: the tensors that differ are named; neither the model nor its optimizer moves.
  auto wider = mlp(9);
  torch::optim::Adam wider_optimizer(wider->parameters(), torch::optim::AdamOptions(0.5));
  const at::Tensor before = wider->parameters()[0].clone();
  try {
    load_dcp_model_state(dir.path() / "c", *wider, &wider_optimizer);
    ADD_FAILURE() << "a model of another width was loaded";
  } catch (const StateDictMismatchError& e) {
    EXPECT_THAT(std::string(e.what()),
                AllOf(HasSubstr("mismatched: 0.weight: "), HasSubstr("Nothing was loaded")));
  }
  EXPECT_TRUE(torch::equal(wider->parameters()[0], before));
  EXPECT_DOUBLE_EQ(wider_optimizer.param_groups()[0].options().get_lr(), 0.5);

  // SGD into Adam's state: the optimizer's mismatch, and the model not loaded either.
  auto same_shape = mlp();
  const at::Tensor untouched = same_shape->parameters()[0].clone();
  torch::optim::SGD sgd(same_shape->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  EXPECT_THROW(load_dcp_model_state(dir.path() / "c", *same_shape, &sgd), OptimizerMismatchError);
  EXPECT_TRUE(torch::equal(same_shape->parameters()[0], untouched));

  // Without the optimizer the model alone loads; a checkpoint without one cannot fill one.
  EXPECT_TRUE(load_dcp_model_state(dir.path() / "c", *same_shape).complete());
  EXPECT_TRUE(same_parameters(model, same_shape));
  save_dcp(dcp_model_state(*model), dir.path() / "model_only");
  EXPECT_THAT([&] { load_dcp_model_state(dir.path() / "model_only", *same_shape, &optimizer); },
              ::testing::ThrowsMessage<StateDictFormatError>(HasSubstr("has no 'optim' entries")));

  // An optimizer over a tensor the model does not hold cannot be named.
  at::Tensor stray = torch::zeros({3}, torch::requires_grad());
  torch::optim::SGD stray_optimizer(std::vector<at::Tensor>{stray}, 0.1);
  EXPECT_THAT([&] { dcp_model_state(*model, &stray_optimizer); },
              ::testing::ThrowsMessage<ConfigError>(HasSubstr("is not one of the model's")));
}

// A checkpoint whose optimizer groups do not fit this optimizer's: each is a StateDictFormatError
// naming what is wrong, and neither the model nor the optimizer changes.
TEST(DcpModelState, OptimizerGroupsThatDoNotFitAreNamedAndNothingChanges) {
  test::TempDir dir("ddp-dcp-model");
  torch::manual_seed(1);
  auto model = mlp();
  torch::optim::Adam optimizer(model->parameters(), torch::optim::AdamOptions(0.01));
  adam_step(model, optimizer);
  using Edited = std::optional<c10::IValue>;
  // The checkpoint with `edit` applied to its values (nullopt drops the entry).
  int saves = 0;
  auto saved_with = [&](bool per_parameter,
                        const std::function<Edited(const DcpStateDict::Entry&)>& edit) {
    DcpModelLayout layout;
    layout.per_parameter_groups = per_parameter;
    DcpStateDict edited;
    const DcpStateDict original = dcp_model_state(*model, &optimizer, layout);
    for (DcpStateDict::Entry entry : original.entries()) {
      if (entry.kind == DcpStateDict::Entry::Kind::kValue) {
        const Edited value = edit(entry);
        if (!value) continue;
        entry.value = *value;
      }
      edited.add_entry(std::move(entry));
    }
    const auto path = dir.path() / std::to_string(saves++);
    save_dcp(edited, path);
    return path;
  };
  auto names = [](std::vector<std::string> list) {
    c10::List<std::string> out;
    for (const auto& name : list)
      out.push_back(name);
    return c10::IValue(out);
  };
  auto fresh = mlp();
  torch::optim::Adam fresh_optimizer(fresh->parameters(), torch::optim::AdamOptions(0.5));
  const at::Tensor before = fresh->parameters()[0].clone();
  auto expect_refused = [&](const std::filesystem::path& path, const std::string& words) {
    EXPECT_THAT([&] { load_dcp_model_state(path, *fresh, &fresh_optimizer); },
                ::testing::ThrowsMessage<StateDictFormatError>(HasSubstr(words)));
    EXPECT_TRUE(torch::equal(fresh->parameters()[0], before));
    EXPECT_DOUBLE_EQ(fresh_optimizer.param_groups()[0].options().get_lr(), 0.5);
    EXPECT_TRUE(fresh_optimizer.state().empty());
  };
  const auto keep = [](const DcpStateDict::Entry& e) { return Edited(e.value); };

  expect_refused(saved_with(false,
                            [&](const DcpStateDict::Entry& e) {
                              return Edited(e.name == "optim.param_groups.0.params"
                                                ? names({"0.weight", "0.bias", "2.weight"})
                                                : e.value);
                            }),
                 "holds '2.bias', which the checkpoint's group 0 does not list");
  expect_refused(saved_with(false,
                            [&](const DcpStateDict::Entry& e) {
                              return Edited(e.name == "optim.param_groups.0.params"
                                                ? names({"0.weight", "0.bias", "2.weight", "2.bias",
                                                         "4.weight"})
                                                : e.value);
                            }),
                 "the checkpoint's parameter group 0 lists 5 parameters, the optimizer's 4");
  expect_refused(saved_with(false,
                            [&](const DcpStateDict::Entry& e) {
                              return e.name == "optim.param_groups.0.params" ? Edited(e.value)
                                                                             : std::nullopt;
                            }),
                 "has no optimizer options under 'optim.param_groups.0.*'");
  expect_refused(saved_with(true,
                            [&](const DcpStateDict::Entry& e) {
                              return e.name == "optim.param_groups.2.bias.lr" ? std::nullopt
                                                                              : Edited(e.value);
                            }),
                 "has no options for the parameter '2.bias'");
  // The unedited per-parameter checkpoint loads.
  load_dcp_model_state(saved_with(true, keep), *fresh, &fresh_optimizer);
  EXPECT_TRUE(same_parameters(model, fresh));
  EXPECT_DOUBLE_EQ(fresh_optimizer.param_groups()[0].options().get_lr(), 0.01);
}

TEST(DcpModelState, CheckpointsOfAnotherShapeAreNamedErrors) {
  test::TempDir dir("ddp-dcp-model");
  auto model = mlp();
  torch::optim::Adam optimizer(model->parameters(), torch::optim::AdamOptions(0.01));
  auto refused = [&](const std::string& folder) -> std::string {
    try {
      load_dcp_model_state(dir.path() / folder, *model, &optimizer);
    } catch (const StateDictFormatError& e) {
      return e.what();
    }
    return "(loaded)";
  };
  // No "model" entries: a checkpoint of something else.
  DcpStateDict other;
  other.add_tensor("weights", torch::ones({2}));
  save_dcp(other, dir.path() / "other");
  EXPECT_THAT(refused("other"), HasSubstr("has no 'model' entries"));
  // "model" a value, and a model entry that is not a tensor.
  DcpStateDict value;
  value.add_value("model", 3);
  save_dcp(value, dir.path() / "value");
  EXPECT_THAT(refused("value"), HasSubstr("'model' is a Int, not a dict"));
  auto nested = [](const c10::IValue& model_entry, const c10::IValue& optim) {
    c10::impl::GenericDict top(c10::StringType::get(), c10::AnyType::get());
    c10::impl::GenericDict m(c10::StringType::get(), c10::AnyType::get());
    m.insert("0.weight", model_entry);
    top.insert("model", m);
    if (!optim.isNone()) top.insert("optim", optim);
    return DcpStateDict::flatten(top);
  };
  save_dcp(nested(std::string("text"), c10::IValue()), dir.path() / "text");
  EXPECT_THAT(refused("text"), HasSubstr("'model.0.weight' is a String, not a tensor"));
  // An optimizer state for a parameter this optimizer does not hold (the state of "0.weight"
  // saved under the name "9.weight").
  adam_step(model, optimizer);
  DcpStateDict saved = dcp_model_state(*model, &optimizer);
  DcpStateDict mixed;
  for (auto entry : saved.entries()) {
    const std::string prefix = "optim.state.0.weight.";
    if (entry.name.rfind(prefix, 0) == 0) {
      entry.name = "optim.state.9.weight." + entry.name.substr(prefix.size());
      entry.path[2].name = "9.weight";
    }
    mixed.add_entry(entry);
  }
  save_dcp(mixed, dir.path() / "renamed");
  EXPECT_THAT(refused("renamed"),
              HasSubstr("names the parameter '9.weight', which the optimizer does not hold"));
}

// A pipeline's two stages of mlp(): the children named as in the whole model ("0", "2").
torch::nn::Sequential stage(torch::nn::Sequential whole, std::size_t first, std::size_t last) {
  torch::nn::Sequential part;
  for (std::size_t i = first; i < last; ++i) {
    part->push_back(std::to_string(i), *(whole->begin() + static_cast<std::ptrdiff_t>(i)));
  }
  return part;
}

TEST(DcpModelState, PipelineStagesLoadTheirPartsWithPerParameterGroupsAndStepAsTheWholeDoes) {
  test::TempDir dir("ddp-dcp-model");
  torch::manual_seed(1);
  auto model = mlp();
  torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(0.01));
  adam_step(model, optimizer);
  const DcpModelLayout per_parameter{.per_parameter_groups = true};
  const DcpCheckpointInfo info =
      save_dcp(dcp_model_state(*model, &optimizer, per_parameter), dir.path() / "c");
  // PyTorch's flatten_optimizer_state_dict names: options per parameter, no "params" lists.
  EXPECT_TRUE(info.values.contains("optim.param_groups.2.bias.lr"));
  EXPECT_FALSE(info.values.contains("optim.param_groups.0.params"));
  EXPECT_TRUE(info.tensors.contains("optim.state.0.weight.exp_avg"));

  // Two stages of a fresh model, each loading its part (the other stage's entries are not
  // unexpected), then stepping with the whole model's gradients: the same parameters.
  torch::manual_seed(2);
  auto fresh = mlp();
  auto first = stage(fresh, 0, 2), second = stage(fresh, 2, 3);
  torch::optim::AdamW first_optimizer(first->parameters(), torch::optim::AdamWOptions(0.5));
  torch::optim::AdamW second_optimizer(second->parameters(), torch::optim::AdamWOptions(0.5));
  const DcpModelLayout part{.part_of_model = true, .per_parameter_groups = true};
  const auto report = load_dcp_model_state(dir.path() / "c", *first, &first_optimizer, {}, part);
  EXPECT_TRUE(report.complete());
  EXPECT_EQ(report.loaded, (std::vector<std::string>{"0.weight", "0.bias"}));
  load_dcp_model_state(dir.path() / "c", *second, &second_optimizer, {}, part);
  EXPECT_DOUBLE_EQ(second_optimizer.param_groups()[0].options().get_lr(), 0.01);
  EXPECT_TRUE(same_parameters(model, fresh));
  adam_step(model, optimizer);
  adam_step(fresh, first_optimizer);  // the stage's optimizers step what the whole model's
  second_optimizer.step();            // gradients say (fresh's backward filled both stages')
  EXPECT_TRUE(same_parameters(model, fresh));

  // The per-group layout loads into a stage too; without part_of_model a stage is missing
  // entries, and the whole model's others are unexpected.
  save_dcp(dcp_model_state(*model, &optimizer), dir.path() / "groups");
  auto again = stage(mlp(), 2, 3);
  torch::optim::AdamW again_optimizer(again->parameters(), torch::optim::AdamWOptions(0.5));
  load_dcp_model_state(dir.path() / "groups", *again, &again_optimizer, {}, part);
  EXPECT_TRUE(torch::equal(again[0]->as<torch::nn::Linear>()->weight,
                           model[2]->as<torch::nn::Linear>()->weight));
  EXPECT_THAT([&] { load_dcp_model_state(dir.path() / "groups", *again, &again_optimizer); },
              ::testing::ThrowsMessage<StateDictMismatchError>(HasSubstr("unexpected")));
}

TEST(DcpModelState, APartReadsItsRegionOfTheWholeTensorAndAnotherSplitIsNamed) {
  test::TempDir dir("ddp-dcp-model");
  torch::manual_seed(1);
  auto model = mlp();  // 0.weight [8, 4]
  save_dcp(dcp_model_state(*model), dir.path() / "c");
  // Rows 4..7 of 0.weight and of 0.bias (a column-parallel split at tp 2, rank 1), viewed as
  // [2, 2, 4] blocks of a [2, 4, 4] tensor to check views: the saved tensor is [8, 4] there.
  torch::nn::Linear half(4, 4);
  torch::nn::Sequential part;
  part->push_back("0", half);
  DcpModelLayout layout{.part_of_model = true};
  layout.shards["0.weight"] = {.offsets = {4, 0}, .global_shape = {8, 4}};
  layout.shards["0.bias"] = {.offsets = {4}, .global_shape = {8}};
  EXPECT_TRUE(load_dcp_model_state(dir.path() / "c", *part, nullptr, {}, layout).complete());
  const auto& whole = model[0]->as<torch::nn::Linear>();
  EXPECT_TRUE(torch::equal(half->weight, whole->weight.slice(0, 4, 8)));
  EXPECT_TRUE(torch::equal(half->bias, whole->bias.slice(0, 4, 8)));

  // A part saved by a process alone leaves the rest of its tensor unsaved: refused by name
  // (tensor_parallel_dcp_test.cc saves parts from every rank of a split).
  DcpModelLayout fused;
  fused.shards["0.weight"] = {
      .local_view = {2, 2, 4}, .offsets = {0, 2, 0}, .global_shape = {2, 4, 4}};
  EXPECT_THAT([&] { save_dcp(dcp_model_state(*part, nullptr, fused), dir.path() / "f"); },
              ::testing::ThrowsMessage<Error>(
                  HasSubstr("'model.0.weight' of shape [2, 4, 4] leave part of it unsaved")));

  // Another split of the whole tensor than the checkpoint's: named, with both shapes.
  DcpModelLayout other = layout;
  other.shards["0.weight"] = {.offsets = {0, 0}, .global_shape = {4, 4}};
  EXPECT_THAT([&] { load_dcp_model_state(dir.path() / "c", *part, nullptr, {}, other); },
              ::testing::ThrowsMessage<StateDictMismatchError>(
                  AllOf(HasSubstr("'model.0.weight' is [8, 4] in the checkpoint"),
                        HasSubstr("belongs to a tensor [4, 4]"))));
  // Not strict: the split that does not fit is reported mismatched, the bias loads.
  const auto report =
      load_dcp_model_state(dir.path() / "c", *part, nullptr, {.strict = false}, other);
  EXPECT_EQ(report.mismatched, (std::vector<std::string>{"0.weight"}));
  EXPECT_EQ(report.loaded, (std::vector<std::string>{"0.bias"}));
  EXPECT_TRUE(report.missing.empty());

  // Specs that cannot describe their tensor, and a name the model lacks: refused before anything.
  DcpModelLayout bad;
  bad.shards["0.weight"] = {.local_view = {3, 4}, .offsets = {0, 0}, .global_shape = {8, 4}};
  EXPECT_THAT([&] { dcp_model_state(*part, nullptr, bad); },
              ::testing::ThrowsMessage<ConfigError>(HasSubstr("part of '0.weight' does not fit")));
  bad.shards["0.weight"] = {.offsets = {6, 0}, .global_shape = {8, 4}};
  EXPECT_THAT([&] { load_dcp_model_state(dir.path() / "c", *part, nullptr, {}, bad); },
              ::testing::ThrowsMessage<ConfigError>(HasSubstr("does not fit")));
  DcpModelLayout stray;
  stray.shards["9.weight"] = {.offsets = {0}, .global_shape = {1}};
  EXPECT_THAT([&] { dcp_model_state(*part, nullptr, stray); },
              ::testing::ThrowsMessage<ConfigError>(HasSubstr("splits '9.weight'")));
}

}  // namespace DDP_UNITY_ID
}  // namespace
}  // namespace ddp
