// ZeroRedundancyOptimizer: state dicts: the full optimizer state consolidated on one rank, and
// save and load (each rank loads the state of the parameters it owns); PyTorch's distributed
// checkpoint, in which each rank writes the state it owns.
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "ddp/error.h"
#include "ddp/torch/api/distributed_objects.h"
#include "ddp/torch/checkpoint/dcp_model_state.h"
#include "ddp/torch/zero/zero_redundancy_optimizer.h"
#include "torch/api/rank_agreement.h"
#include "torch/checkpoint/dcp_model_layout.h"
#include "torch/core/libtorch_compat.h"
#include "torch/formats/optimizer_values.h"
#include "torch/zero/optimizer_state_tensors.h"
#include "torch/zero/zero_redundancy_optimizer_internal.h"

namespace ddp {

namespace {

using libtorch_compat::optimizer_state_key;

// The archive entry that names the optimizer kind (a plain optimizer's load ignores it).
constexpr const char* kKindEntry = "ddp_zero_optimizer_kind";

using detail::shape_text;

}  // namespace

void ZeroRedundancyOptimizer::consolidate_state_dict(int to) {
  if (to < 0 || to >= group_->size()) {
    throw ConfigError(fmt::format(
        "ZeroRedundancyOptimizer::consolidate_state_dict: rank {} is not in the group of {} ranks",
        to, group_->size()));
  }
  std::ostringstream bytes;
  {
    torch::serialize::OutputArchive archive;
    local_->save(archive);
    archive.save_to(bytes);
  }
  std::vector<std::string> shards;
  gather_object(bytes.str(), shards, to, *group_);
  consolidated_.reset();
  if (group_->rank() != to) return;
  auto full = make_optimizer(-1);
  for (std::size_t r = 0; r < shards.size(); ++r) {
    const auto& shard = shard_order_[r];
    if (static_cast<int>(r) == to) {
      for (const std::size_t i : shard) {
        const auto key = optimizer_state_key(params_[i]);
        auto it = local_->state().find(key);
        if (it != local_->state().end()) full->state()[key] = it->second->clone();
      }
      continue;
    }
    // Rank r's archive loads, typed by the factory's optimizer, into an optimizer over the same
    // shard (libtorch matches saved state to parameters by position); then its states move over.
    auto part = make_optimizer(static_cast<int>(r));
    torch::serialize::InputArchive archive;
    archive.load_from(shards[r].data(), shards[r].size());
    part->load(archive);
    for (const std::size_t i : shard) {
      const auto key = optimizer_state_key(params_[i]);
      auto it = part->state().find(key);
      if (it != part->state().end()) full->state()[key] = std::move(it->second);
    }
  }
  consolidated_ = std::move(full);
}

const torch::optim::Optimizer& ZeroRedundancyOptimizer::state_dict() const {
  if (!consolidated_) {
    throw Error(fmt::format(
        "ZeroRedundancyOptimizer: rank {} holds no consolidated optimizer state; call "
        "consolidate_state_dict(to) on every rank first, then save or read it on rank `to`",
        group_->rank()));
  }
  return *consolidated_;
}

void ZeroRedundancyOptimizer::save(torch::serialize::OutputArchive& archive) const {
  state_dict().save(archive);
  archive.write(kKindEntry, c10::IValue(kind_));
}

void ZeroRedundancyOptimizer::load(torch::serialize::InputArchive& archive) {
  c10::IValue kind;
  if (archive.try_read(kKindEntry, kind) && kind.isString() && kind.toStringRef() != kind_) {
    throw Error(fmt::format(
        "ZeroRedundancyOptimizer: the optimizer state is of a {} but this optimizer is a {}",
        kind.toStringRef(), kind_));
  }
  // Everything is read into a fresh full optimizer and checked first: a state that does not fit
  // changes nothing here.
  auto full = make_optimizer(-1);
  try {
    full->load(archive);
  } catch (const c10::Error& e) {
    throw Error(fmt::format(
        "ZeroRedundancyOptimizer: the optimizer state does not fit this {} over {} parameters in "
        "{} groups: {}",
        kind_, params_.size(), param_groups_.size(), e.what_without_backtrace()));
  }
  detail::check_optimizer_values(*full, [](const std::string& why) {
    throw Error(
        fmt::format("ZeroRedundancyOptimizer: the optimizer state's {} (damaged or "
                    "hand-edited?); nothing was loaded",
                    why));
  });
  for (std::size_t i = 0; i < params_.size(); ++i) {
    auto it = full->state().find(optimizer_state_key(params_[i]));
    if (it == full->state().end()) continue;
    const auto tensors = detail::optimizer_state_tensors(*it->second);
    if (!tensors) continue;  // a state type ddp cannot look into
    for (const auto& t : *tensors) {
      if (t.sizes() != params_[i].sizes() || t.scalar_type() != params_[i].scalar_type()) {
        throw Error(fmt::format(
            "ZeroRedundancyOptimizer: the optimizer state does not fit: parameter {} is {} but its "
            "state holds a tensor {} (a state of another model?)",
            i, shape_text(params_[i]), shape_text(t)));
      }
    }
  }
  adopt_full_state(*full);
}

void ZeroRedundancyOptimizer::adopt_full_state(torch::optim::Optimizer& full) {
  for (std::size_t g = 0; g < param_groups_.size(); ++g) {
    param_groups_[g].set_options(full.param_groups()[g].options().clone());
    local_->param_groups()[g].set_options(full.param_groups()[g].options().clone());
  }
  local_->state().clear();
  for (const std::size_t i : shard_order_[static_cast<std::size_t>(group_->rank())]) {
    const auto key = optimizer_state_key(params_[i]);
    auto it = full.state().find(key);
    if (it != full.state().end()) local_->state()[key] = std::move(it->second);
  }
  consolidated_.reset();
}

DcpStateDict ZeroRedundancyOptimizer::dcp_state(const torch::nn::Module& model) const {
  // A fresh optimizer of the local kind over every parameter, with the current options, holding
  // copies of the states of the parameters this rank owns (their tensors shared, not copied):
  // what dcp_model_state lays out, the other parameters without state.
  auto full = make_optimizer(-1);
  for (const std::size_t i : shard_order_[static_cast<std::size_t>(group_->rank())]) {
    const auto key = optimizer_state_key(params_[i]);
    const auto it = local_->state().find(key);
    if (it != local_->state().end()) full->state()[key] = it->second->clone();
  }
  return dcp_model_state(model, full.get());
}

StateDictLoadReport ZeroRedundancyOptimizer::load_dcp_state(const std::filesystem::path& folder,
                                                            torch::nn::Module& model,
                                                            StateDictLoadOptions options) {
  // The model, and a full optimizer's groups and the state of the parameters this rank owns (the
  // only state entries it reads), are checked and loaded together (nothing changes on error);
  // then this rank keeps that state, which cannot fail.
  auto full = make_optimizer(-1);
  // Names in params_'s order (this optimizer's groups list every parameter in that order).
  const std::vector<std::string> names =
      detail::optimizer_parameter_names(model, *this, "ZeroRedundancyOptimizer::load_dcp_state");
  std::set<std::string> owned;
  for (const std::size_t i : shard_order_[static_cast<std::size_t>(group_->rank())])
    owned.insert(names.at(i));
  StateDictLoadReport report =
      detail::load_dcp_model_state_of(folder, model, full.get(), options, {}, &owned);
  adopt_full_state(*full);
  return report;
}

}  // namespace ddp
