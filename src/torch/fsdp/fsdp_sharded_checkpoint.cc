// FullyShardedDataParallel's sharded checkpoint: every rank writes the elements it owns of each
// unit's flat parameter, with their optimizer state, so that saving moves nothing between ranks
// and a checkpoint loads at any world size (each rank reads the element ranges it now holds from
// whichever files have them).
//
// Layout. DIR/shard-<r>-of-<W>.pt (one per saving rank, written by save_archive_atomically, so
// checksummed and never torn) holds per unit u: "unit_<u>_range" = int64 [begin, end) of flat
// elements (padding excluded; empty on a rank that owns only padding), "unit_<u>_param" = those
// elements, and when the optimizer has state for the shard: "unit_<u>_step" (int64 [1]) and one
// entry per state tensor ("unit_<u>_exp_avg", ...), sliced the same way. DIR/manifest.pt, written
// by rank 0 after a barrier: "world_size", "unit_numels" (int64 [units]) and "optimizer" (the
// kind: SGD, Adam or AdamW).
#include <algorithm>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "ddp/error.h"
#include "ddp/torch/api/distributed.h"
#include "ddp/torch/checkpoint/checkpoint.h"
#include "ddp/torch/fsdp/fully_sharded_data_parallel.h"
#include "torch/api/rank_agreement.h"
#include "torch/core/libtorch_compat.h"
#include "torch/fsdp/fsdp_unit.h"

namespace ddp {

namespace {

using libtorch_compat::optimizer_state_key;

// The per-parameter state tensors of the kinds the sharded checkpoint knows, by name.
std::string optimizer_kind(const torch::optim::Optimizer& optimizer) {
  if (dynamic_cast<const torch::optim::SGD*>(&optimizer) != nullptr) return "SGD";
  if (dynamic_cast<const torch::optim::AdamW*>(&optimizer) != nullptr) return "AdamW";
  if (dynamic_cast<const torch::optim::Adam*>(&optimizer) != nullptr) return "Adam";
  throw ConfigError(
      "FullyShardedDataParallel sharded checkpoint: the optimizer must be torch::optim::SGD, Adam "
      "or AdamW (the state of other kinds is opaque to ddp); use full_state_dict() instead");
}

struct ShardState {
  std::int64_t step = 0;
  std::map<std::string, torch::Tensor> tensors;  // defined tensors only
};

std::optional<ShardState> read_state(const torch::optim::Optimizer& optimizer,
                                     const torch::Tensor& shard) {
  const auto& states = optimizer.state();
  const auto it = states.find(optimizer_state_key(shard));
  if (it == states.end()) return std::nullopt;
  ShardState out;
  auto keep = [&](const char* name, const torch::Tensor& t) {
    if (t.defined()) out.tensors.emplace(name, t);
  };
  if (const auto* s = dynamic_cast<const torch::optim::SGDParamState*>(it->second.get())) {
    keep("momentum_buffer", s->momentum_buffer());
  } else if (const auto* s = dynamic_cast<const torch::optim::AdamParamState*>(it->second.get())) {
    out.step = s->step();
    keep("exp_avg", s->exp_avg());
    keep("exp_avg_sq", s->exp_avg_sq());
    keep("max_exp_avg_sq", s->max_exp_avg_sq());
  } else if (const auto* s = dynamic_cast<const torch::optim::AdamWParamState*>(it->second.get())) {
    out.step = s->step();
    keep("exp_avg", s->exp_avg());
    keep("exp_avg_sq", s->exp_avg_sq());
    keep("max_exp_avg_sq", s->max_exp_avg_sq());
  }
  return out;
}

std::unique_ptr<torch::optim::OptimizerParamState> make_state(const std::string& kind,
                                                              const ShardState& state) {
  auto get = [&](const char* name) {
    const auto it = state.tensors.find(name);
    return it == state.tensors.end() ? torch::Tensor() : it->second;
  };
  if (kind == "SGD") {
    auto s = std::make_unique<torch::optim::SGDParamState>();
    s->momentum_buffer(get("momentum_buffer"));
    return s;
  }
  if (kind == "AdamW") {
    auto s = std::make_unique<torch::optim::AdamWParamState>();
    s->step(state.step);
    s->exp_avg(get("exp_avg"));
    s->exp_avg_sq(get("exp_avg_sq"));
    s->max_exp_avg_sq(get("max_exp_avg_sq"));
    return s;
  }
  auto s = std::make_unique<torch::optim::AdamParamState>();
  s->step(state.step);
  s->exp_avg(get("exp_avg"));
  s->exp_avg_sq(get("exp_avg_sq"));
  s->max_exp_avg_sq(get("max_exp_avg_sq"));
  return s;
}

std::filesystem::path shard_file(const std::filesystem::path& dir, int rank, int world) {
  return dir / fmt::format("shard-{}-of-{}.pt", rank, world);
}

std::int64_t read_int(torch::serialize::InputArchive& archive, const std::string& key) {
  torch::Tensor t;
  archive.read(key, t);
  return t.item<std::int64_t>();
}

}  // namespace

std::vector<FullyShardedDataParallelImpl::Unit*> FullyShardedDataParallelImpl::checkpoint_units()
    const {
  std::vector<Unit*> units;
  for (const auto& unit : units_)
    units.push_back(unit.get());
  for (const auto& [path, wrapper] : nested_) {
    if (wrapper->options_.sharding_strategy != options_.sharding_strategy ||
        wrapper->group_->size() != group_->size() || wrapper->group_->rank() != group_->rank()) {
      throw ConfigError(fmt::format(
          "FullyShardedDataParallel: a sharded checkpoint takes one strategy and group for the "
          "whole tree; the nested wrapper at '{}' is {} over {} ranks, this one {} over {}; save "
          "full_state_dict() instead",
          path, to_string(wrapper->options_.sharding_strategy), wrapper->group_->size(),
          to_string(options_.sharding_strategy), group_->size()));
    }
    const auto below = wrapper->checkpoint_units();  // in the tree's order, as parameters()
    units.insert(units.end(), below.begin(), below.end());
  }
  return units;
}

void FullyShardedDataParallelImpl::save_sharded_checkpoint(
    const std::filesystem::path& dir, const torch::optim::Optimizer& optimizer) const {
  if (options_.sharding_strategy == ShardingStrategy::kHybridShard) {
    throw ConfigError(
        "FullyShardedDataParallel: sharded checkpoints of kHybridShard are not built (each shard "
        "has replicas); save full_state_dict() instead");
  }
  const auto units = checkpoint_units();
  // Every rank checks the optimizer before anything collective: the same on every rank.
  const std::string kind = optimizer_kind(optimizer);
  const int rank = group_->rank();
  const int world = group_->size();
  // A manifest names a complete checkpoint: rank 0 removes an old one before any shard file of
  // this save replaces an old shard file, so that a save into the same folder that fails part-way
  // leaves no manifest (load refuses it) rather than an old manifest over a mix of shards.
  std::string failure;
  if (rank == 0) {
    try {
      std::filesystem::create_directories(dir);
      std::filesystem::remove(dir / "manifest.pt");
    } catch (const std::exception& e) {
      failure = e.what();
    }
  }
  detail::raise_if_any_rank_failed(*group_, failure,
                                   "FullyShardedDataParallel: preparing " + dir.string());
  try {
    write_shard_file(dir, optimizer);
  } catch (const std::exception& e) {  // ddp::Error, std::filesystem_error, c10::Error
    failure = e.what();
  }
  // Every shard file is complete before the manifest names them; a rank that could not write
  // its own makes every rank throw.
  detail::raise_if_any_rank_failed(
      *group_, failure, "FullyShardedDataParallel: writing the shard files of " + dir.string());
  if (rank == 0) {
    try {
      std::vector<std::int64_t> numels;
      for (const auto* unit : units)
        numels.push_back(unit->numel);
      torch::serialize::OutputArchive manifest;
      manifest.write("world_size", torch::tensor({static_cast<std::int64_t>(world)}));
      manifest.write("unit_numels", torch::tensor(numels, torch::kInt64));
      manifest.write("optimizer", c10::IValue(kind));
      save_archive_atomically(manifest, dir / "manifest.pt");
    } catch (const std::exception& e) {
      failure = e.what();
    }
  }
  // The checkpoint is complete when save returns on any rank.
  detail::raise_if_any_rank_failed(
      *group_, failure, "FullyShardedDataParallel: writing " + (dir / "manifest.pt").string());
}

void FullyShardedDataParallelImpl::write_shard_file(
    const std::filesystem::path& dir, const torch::optim::Optimizer& optimizer) const {
  torch::NoGradGuard no_grad;
  const int rank = group_->rank();
  const int world = group_->size();
  const bool no_shard = options_.sharding_strategy == ShardingStrategy::kNoShard;
  torch::serialize::OutputArchive archive;
  const auto units = checkpoint_units();
  for (std::size_t u = 0; u < units.size(); ++u) {
    const auto& unit = *units[u];
    // The flat elements this rank owns; under kNoShard rank 0 writes everything.
    std::int64_t begin = no_shard ? (rank == 0 ? 0 : unit.numel) : rank * unit.shard_numel;
    std::int64_t end = no_shard ? unit.numel : (rank + 1) * unit.shard_numel;
    begin = std::min(begin, unit.numel);
    end = std::min(end, unit.numel);
    const std::int64_t first = no_shard ? begin : begin - rank * unit.shard_numel;
    const std::string prefix = fmt::format("unit_{}_", u);
    archive.write(prefix + "range", torch::tensor({begin, end}, torch::kInt64));
    archive.write(prefix + "param", unit.shard.detach().narrow(0, first, end - begin).clone());
    if (const auto state = read_state(optimizer, unit.shard)) {
      archive.write(prefix + "step", torch::tensor({state->step}, torch::kInt64));
      for (const auto& [name, t] : state->tensors)
        archive.write(prefix + name, t.reshape(-1).narrow(0, first, end - begin).clone());
    }
  }
  save_archive_atomically(archive, shard_file(dir, rank, world));
}

void FullyShardedDataParallelImpl::load_sharded_checkpoint(const std::filesystem::path& dir,
                                                           torch::optim::Optimizer& optimizer) {
  if (options_.sharding_strategy == ShardingStrategy::kHybridShard) {
    throw ConfigError(
        "FullyShardedDataParallel: sharded checkpoints of kHybridShard are not built (each shard "
        "has replicas); save full_state_dict() instead");
  }
  const auto units = checkpoint_units();
  const std::string kind = optimizer_kind(optimizer);
  const auto manifest_path = dir / "manifest.pt";
  if (!std::filesystem::exists(manifest_path)) {
    throw Error(fmt::format(
        "FullyShardedDataParallel: {} has no manifest.pt: not a sharded checkpoint, or its save "
        "did not complete",
        dir.string()));
  }
  auto manifest = load_archive(manifest_path);
  // What the files record is checked before it is used: a checksummed file can still be one that
  // save_sharded_checkpoint did not write (hostile, or of another build), and a world size of 0
  // would read no shard file and load zeros.
  const auto damaged = [&](const std::filesystem::path& file, const std::string& what) {
    return Error(
        fmt::format("FullyShardedDataParallel: {}: {}; the file is damaged or was not written by "
                    "save_sharded_checkpoint (nothing was loaded)",
                    file.string(), what));
  };
  const auto saved_world = read_int(manifest, "world_size");
  constexpr std::int64_t kMaxWorld = std::int64_t{1} << 20;
  if (saved_world < 1 || saved_world > kMaxWorld) {
    throw damaged(manifest_path, fmt::format("it records a world size of {} (valid: 1 to {})",
                                             saved_world, kMaxWorld));
  }
  torch::Tensor numels_tensor;
  manifest.read("unit_numels", numels_tensor);
  if (numels_tensor.scalar_type() != torch::kInt64 || numels_tensor.dim() != 1) {
    throw damaged(manifest_path, "its unit_numels is not a list of int64 counts");
  }
  const auto saved_numels =
      std::vector<std::int64_t>(numels_tensor.data_ptr<std::int64_t>(),
                                numels_tensor.data_ptr<std::int64_t>() + numels_tensor.numel());
  std::vector<std::int64_t> numels;
  for (const auto* unit : units)
    numels.push_back(unit->numel);
  if (saved_numels != numels) {
    throw Error(fmt::format(
        "FullyShardedDataParallel: the sharded checkpoint {} holds units of [{}] parameters but "
        "this model's units hold [{}]; load it into the model (and units) it was saved from",
        dir.string(), fmt::join(saved_numels, ", "), fmt::join(numels, ", ")));
  }
  c10::IValue saved_kind;
  manifest.read("optimizer", saved_kind);
  if (saved_kind.toStringRef() != kind) {
    throw Error(fmt::format(
        "FullyShardedDataParallel: the sharded checkpoint {} holds {} state but the optimizer is "
        "{}",
        dir.string(), saved_kind.toStringRef(), kind));
  }

  // Build every new value first, so a damaged or missing file changes nothing.
  torch::NoGradGuard no_grad;
  const int rank = group_->rank();
  const bool no_shard = options_.sharding_strategy == ShardingStrategy::kNoShard;
  std::vector<torch::Tensor> params;
  std::vector<std::optional<ShardState>> states(units.size());
  std::vector<std::pair<std::int64_t, std::int64_t>> held;  // this rank's flat range per unit
  for (const auto* unit : units) {
    params.push_back(torch::zeros({unit->shard_numel}, unit->shard.scalar_type()));
    const std::int64_t begin = no_shard ? 0 : rank * unit->shard_numel;
    held.emplace_back(begin, begin + unit->shard_numel);
  }
  for (int r = 0; r < saved_world; ++r) {
    const auto file = shard_file(dir, r, static_cast<int>(saved_world));
    auto archive = load_archive(file);
    for (std::size_t u = 0; u < units.size(); ++u) {
      const std::string prefix = fmt::format("unit_{}_", u);
      torch::Tensor range;
      archive.read(prefix + "range", range);
      if (range.scalar_type() != torch::kInt64 || range.numel() != 2) {
        throw damaged(file, prefix + "range is not two int64 offsets");
      }
      const auto saved_begin = range[0].item<std::int64_t>();
      const auto saved_end = range[1].item<std::int64_t>();
      if (saved_begin < 0 || saved_begin > saved_end || saved_end > units[u]->numel) {
        throw damaged(file, fmt::format("{}range is [{}, {}), outside unit {}'s {} elements",
                                        prefix, saved_begin, saved_end, u, units[u]->numel));
      }
      // Each saved tensor holds exactly the range's elements.
      const auto check_length = [&](const std::string& key, const torch::Tensor& t) {
        if (t.dim() != 1 || t.numel() != saved_end - saved_begin) {
          throw damaged(file, fmt::format("{} has {} elements in {} dimensions, but its range "
                                          "holds {}",
                                          key, t.numel(), t.dim(), saved_end - saved_begin));
        }
      };
      const auto lo = std::max(saved_begin, held[u].first);
      const auto hi = std::min(saved_end, held[u].second);
      if (lo >= hi) continue;
      auto copy = [&](const torch::Tensor& from, const torch::Tensor& to) {
        to.narrow(0, lo - held[u].first, hi - lo).copy_(from.narrow(0, lo - saved_begin, hi - lo));
      };
      torch::Tensor param;
      archive.read(prefix + "param", param);
      check_length(prefix + "param", param);
      // A checkpoint of the fp32 model loaded into the fp64 one (or back) would round or widen
      // every value silently.
      if (param.scalar_type() != params[u].scalar_type()) {
        throw Error(fmt::format(
            "FullyShardedDataParallel: the sharded checkpoint {} holds unit {}'s parameters in "
            "{}, but this model's are {}; convert the model to {} before loading, or load it "
            "into the model it was saved from",
            dir.string(), u, c10::toString(param.scalar_type()),
            c10::toString(params[u].scalar_type()), c10::toString(param.scalar_type())));
      }
      copy(param, params[u]);
      torch::Tensor step;
      if (!archive.try_read(prefix + "step", step)) continue;
      if (step.scalar_type() != torch::kInt64 || step.numel() != 1) {
        throw damaged(file, prefix + "step is not one int64 count");
      }
      if (!states[u]) states[u] = ShardState{.step = step.item<std::int64_t>(), .tensors = {}};
      for (const char* name : {"momentum_buffer", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"}) {
        torch::Tensor saved;
        if (!archive.try_read(prefix + name, saved)) continue;
        check_length(prefix + name, saved);
        auto& mine = states[u]->tensors[name];
        if (!mine.defined()) mine = torch::zeros({units[u]->shard_numel}, params[u].scalar_type());
        copy(saved, mine);
      }
    }
  }
  for (std::size_t u = 0; u < units.size(); ++u) {
    auto& unit = *units[u];
    unit.shard.detach().copy_(params[u]);
    auto& all = optimizer.state();
    const auto key = optimizer_state_key(unit.shard);
    all.erase(key);
    if (states[u]) all[key] = make_state(kind, *states[u]);
  }
  // kShardGradOp keeps the full parameters: the next forward gathers the loaded shards.
}

}  // namespace ddp
