#include "ddp/torch/zero/zero_redundancy_optimizer.h"

#include <algorithm>
#include <functional>
#include <numeric>
#include <sstream>
#include <unordered_set>

#include <c10/util/Type.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "ddp/error.h"
#include "ddp/torch/api/distributed_objects.h"
#include "ddp/torch/zero/chunked_adam.h"
#include "torch/api/rank_agreement.h"
#include "torch/core/host_values.h"
#include "torch/core/libtorch_compat.h"
#include "torch/core/wrapper_phase.h"
#include "torch/formats/optimizer_values.h"
#include "torch/zero/optimizer_state_tensors.h"

namespace ddp {

namespace {

using libtorch_compat::optimizer_state_key;
using torch::optim::OptimizerParamGroup;

// The archive entry that names the optimizer kind (a plain optimizer's load ignores it).
constexpr const char* kKindEntry = "ddp_zero_optimizer_kind";

using detail::shape_text;

}  // namespace

// Parameters of one owner and one dtype broadcast together: a slice of the owner's flat buffer
// (parameters_as_bucket_view), a parameter broadcast in place, or several packed into staging.
struct ZeroRedundancyOptimizer::Bucket {
  int owner = 0;
  torch::ScalarType dtype = torch::kFloat;
  std::vector<torch::Tensor> params;
  std::int64_t numel = 0;
  torch::Tensor direct;     // defined: broadcast this tensor itself (no packing)
  std::size_t staging = 0;  // else: index of the first of this dtype's two staging buffers
};

ZeroRedundancyOptimizer::ZeroRedundancyOptimizer(std::vector<OptimizerParamGroup> param_groups,
                                                 OptimizerFactory factory, GroupRef group,
                                                 ZeroOptions options)
    : torch::optim::Optimizer(std::vector<OptimizerParamGroup>{},
                              std::make_unique<torch::optim::OptimizerOptions>()),
      group_ref_(std::move(group)),
      factory_(std::move(factory)),
      options_(options) {
  group_ = &group_ref_.get();
  build(std::move(param_groups));
}

ZeroRedundancyOptimizer::ZeroRedundancyOptimizer(std::vector<torch::Tensor> params,
                                                 OptimizerFactory factory, GroupRef group,
                                                 ZeroOptions options)
    : ZeroRedundancyOptimizer(std::vector<OptimizerParamGroup>{OptimizerParamGroup(params)},
                              std::move(factory), std::move(group), options) {}

ZeroRedundancyOptimizer::ZeroRedundancyOptimizer(std::vector<torch::Tensor> params,
                                                 torch::optim::SGDOptions defaults, GroupRef group,
                                                 ZeroOptions options)
    : ZeroRedundancyOptimizer(std::move(params),
                              optimizer_factory<torch::optim::SGD>(std::move(defaults)),
                              std::move(group), options) {}

ZeroRedundancyOptimizer::ZeroRedundancyOptimizer(std::vector<torch::Tensor> params,
                                                 torch::optim::AdamOptions defaults, GroupRef group,
                                                 ZeroOptions options)
    : ZeroRedundancyOptimizer(std::move(params),
                              optimizer_factory<ChunkedAdam>(std::move(defaults)), std::move(group),
                              options) {}

ZeroRedundancyOptimizer::ZeroRedundancyOptimizer(std::vector<torch::Tensor> params,
                                                 torch::optim::AdamWOptions defaults,
                                                 GroupRef group, ZeroOptions options)
    : ZeroRedundancyOptimizer(std::move(params),
                              optimizer_factory<ChunkedAdamW>(std::move(defaults)),
                              std::move(group), options) {}

ZeroRedundancyOptimizer::~ZeroRedundancyOptimizer() = default;

void ZeroRedundancyOptimizer::build(std::vector<OptimizerParamGroup> param_groups) {
  const int world = group_->size();
  std::string local_error;
  std::ostringstream description;
  // A local problem must not leave the other ranks waiting in the check below: it travels with
  // this rank's description and every rank throws it.
  try {
    if (!factory_) throw ConfigError("ZeroRedundancyOptimizer: the optimizer factory is empty");
    // At most 1 TiB: 1e300 MiB converted to a byte count is undefined.
    if (!(options_.bucket_cap_mb > 0) || !(options_.bucket_cap_mb <= 1024.0 * 1024.0)) {
      throw ConfigError(
          fmt::format("ZeroRedundancyOptimizer: bucket_cap_mb must be a positive number of MiB, "
                      "at most 1048576 (1 TiB), got {}",
                      options_.bucket_cap_mb));
    }
    std::unordered_set<const void*> seen;
    for (std::size_t g = 0; g < param_groups.size(); ++g) {
      for (const auto& p : param_groups[g].params()) {
        const std::size_t index = params_.size();
        if (!p.defined() || !p.is_leaf() || p.is_sparse() ||
            !(p.device().is_cpu() || p.is_cuda())) {
          throw ConfigError(fmt::format(
              "ZeroRedundancyOptimizer: parameter {} (group {}) must be a dense CPU or CUDA leaf "
              "tensor{}",
              index, g, p.defined() ? fmt::format(" (it is on {})", p.device().str()) : ""));
        }
        if (params_.empty()) device_ = p.device();
        if (p.device() != device_) {
          throw ConfigError(fmt::format(
              "ZeroRedundancyOptimizer: parameter {} (group {}) is on {} but parameter 0 is on "
              "{}; the parameters must be on one device (move the model with .to(device))",
              index, g, p.device().str(), device_.str()));
        }
        // A host group stages CUDA parameters' broadcasts through host copies (the tensor API);
        // a CUDA group takes device memory only.
        if (group_->memory_space() == MemorySpace::kCuda &&
            !detail::takes_as_is(*group_, p.device())) {
          throw ConfigError(fmt::format(
              "ZeroRedundancyOptimizer: parameter {} (group {}) is on {}, but the process group "
              "({}) takes CUDA memory only; move the model to this process's GPU or use a host "
              "group (ring, mpi)",
              index, g, p.device().str(), group_->backend()));
        }
        if (!seen.insert(p.unsafeGetTensorImpl()).second) {
          throw ConfigError(fmt::format(
              "ZeroRedundancyOptimizer: parameter {} (group {}) appears more than once", index, g));
        }
        params_.push_back(p);
        group_of_.push_back(g);
      }
    }
    if (params_.empty()) {
      throw ConfigError("ZeroRedundancyOptimizer: got an empty parameter list");
    }

    // PyTorch's partition: per group, largest first (a stable sort keeps registration order
    // among equals), each to the rank with the fewest elements so far (the lowest such rank).
    owner_.assign(params_.size(), 0);
    shard_order_.assign(static_cast<std::size_t>(world), {});
    std::vector<std::int64_t> sizes(static_cast<std::size_t>(world), 0);
    std::vector<std::vector<std::vector<torch::Tensor>>> shard_groups(
        static_cast<std::size_t>(world),
        std::vector<std::vector<torch::Tensor>>(param_groups.size()));
    std::size_t first = 0;
    for (std::size_t g = 0; g < param_groups.size(); ++g) {
      std::vector<std::size_t> order(param_groups[g].params().size());
      std::iota(order.begin(), order.end(), first);
      first += order.size();
      std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
        return params_[a].numel() > params_[b].numel();
      });
      for (const std::size_t i : order) {
        const auto rank =
            static_cast<std::size_t>(std::min_element(sizes.begin(), sizes.end()) - sizes.begin());
        owner_[i] = static_cast<int>(rank);
        sizes[rank] += params_[i].numel();
        shard_order_[rank].push_back(i);
        shard_groups[rank][g].push_back(params_[i]);
      }
    }

    std::vector<OptimizerParamGroup> local_groups;
    for (std::size_t g = 0; g < param_groups.size(); ++g) {
      auto& mine = shard_groups[static_cast<std::size_t>(group_->rank())][g];
      if (param_groups[g].has_options()) {
        local_groups.emplace_back(mine, param_groups[g].options().clone());
      } else {
        local_groups.emplace_back(mine);
      }
    }
    local_ = factory_(std::move(local_groups));
    if (!local_) throw ConfigError("ZeroRedundancyOptimizer: the optimizer factory returned null");
    const auto& local = *local_;
    // ChunkedAdam(W) keeps libtorch's state: its states and checkpoints are Adam(W)'s.
    kind_ = dynamic_cast<const ChunkedAdamW*>(&local) != nullptr ? "torch::optim::AdamW"
            : dynamic_cast<const ChunkedAdam*>(&local) != nullptr
                ? "torch::optim::Adam"
                : c10::demangle(typeid(local).name());
    if (dynamic_cast<const torch::optim::LBFGS*>(&local) != nullptr) {
      throw ConfigError(
          "ZeroRedundancyOptimizer: LBFGS cannot be sharded (its step is a line search over "
          "every parameter); use it without ZeroRedundancyOptimizer");
    }
    if (local_->param_groups().size() != param_groups.size()) {
      throw ConfigError(
          fmt::format("ZeroRedundancyOptimizer: the factory's {} made {} parameter groups from {}",
                      kind_, local_->param_groups().size(), param_groups.size()));
    }
    description << "optimizer " << kind_ << "\n"
                << "parameter groups " << param_groups.size() << "\n";
    for (std::size_t g = 0; g < param_groups.size(); ++g) {
      description << "group " << g << ": " << param_groups[g].params().size() << " parameters\n";
    }
    for (std::size_t i = 0; i < params_.size(); ++i) {
      description << "parameter " << i << ": " << shape_text(params_[i]) << "\n";
    }
  } catch (const std::exception& e) {
    local_error = e.what();
  }
  check_across_ranks(description.str(), local_error);

  // The full groups carry the local groups' concrete options (defaults filled in), so that
  // schedulers and save() see them; step() copies them back.
  defaults_ = local_->defaults().clone();
  std::size_t first = 0;
  for (std::size_t g = 0; g < param_groups.size(); ++g) {
    const std::size_t n = param_groups[g].params().size();
    std::vector<torch::Tensor> group_params(
        params_.begin() + static_cast<std::ptrdiff_t>(first),
        params_.begin() + static_cast<std::ptrdiff_t>(first + n));
    first += n;
    add_param_group(OptimizerParamGroup(group_params, local_->param_groups()[g].options().clone()));
  }
  build_buckets();
}

void ZeroRedundancyOptimizer::check_across_ranks(const std::string& description,
                                                 const std::string& local_error) {
  detail::agree_or_throw(*group_, description, local_error,
                         {.wrapper = "ZeroRedundancyOptimizer",
                          .requirement = "Every rank must pass the same parameters (count, "
                                         "shapes, dtypes, groups) and an optimizer of the "
                                         "same kind"});
}

void ZeroRedundancyOptimizer::build_buckets() {
  torch::NoGradGuard no_grad;
  const auto cap = std::max<std::int64_t>(
      1, static_cast<std::int64_t>(options_.bucket_cap_mb * 1024.0 * 1024.0));
  std::vector<std::pair<torch::ScalarType, std::int64_t>> staging_sizes;  // dtype, elements
  for (int owner = 0; owner < group_->size(); ++owner) {
    // Dtypes in order of first appearance in the shard.
    std::vector<torch::ScalarType> dtypes;
    for (const std::size_t i : shard_order_[static_cast<std::size_t>(owner)]) {
      if (std::find(dtypes.begin(), dtypes.end(), params_[i].scalar_type()) == dtypes.end()) {
        dtypes.push_back(params_[i].scalar_type());
      }
    }
    for (const auto dtype : dtypes) {
      std::vector<torch::Tensor> mine;
      for (const std::size_t i : shard_order_[static_cast<std::size_t>(owner)]) {
        if (params_[i].scalar_type() == dtype) mine.push_back(params_[i]);
      }
      torch::Tensor flat;
      if (options_.parameters_as_bucket_view) {
        std::int64_t total = 0;
        for (const auto& p : mine)
          total += p.numel();
        flat = torch::empty({total}, torch::TensorOptions().dtype(dtype).device(device_));
        std::int64_t offset = 0;
        for (auto& p : mine) {
          auto view = flat.narrow(0, offset, p.numel()).view(p.sizes());
          view.copy_(p.detach());
          p.set_data(view);
          offset += p.numel();
        }
        flat_.push_back(flat);
      }
      const std::int64_t element = static_cast<std::int64_t>(c10::elementSize(dtype));
      std::int64_t offset = 0;
      for (std::size_t i = 0; i < mine.size();) {
        Bucket bucket;
        bucket.owner = owner;
        bucket.dtype = dtype;
        do {
          bucket.params.push_back(mine[i]);
          bucket.numel += mine[i].numel();
          ++i;
        } while (i < mine.size() && (bucket.numel + mine[i].numel()) * element <= cap);
        if (flat.defined()) {
          bucket.direct = flat.narrow(0, offset, bucket.numel);
        } else if (bucket.params.size() == 1 && bucket.params[0].is_contiguous()) {
          bucket.direct = bucket.params[0].detach();
        } else {
          auto it = std::find_if(staging_sizes.begin(), staging_sizes.end(),
                                 [&](const auto& s) { return s.first == dtype; });
          if (it == staging_sizes.end()) {
            staging_sizes.emplace_back(dtype, 0);
            it = staging_sizes.end() - 1;
          }
          it->second = std::max(it->second, bucket.numel);
          bucket.staging = 2 * static_cast<std::size_t>(it - staging_sizes.begin());
        }
        offset += bucket.numel;
        buckets_.push_back(std::move(bucket));
      }
    }
  }
  for (const auto& [dtype, numel] : staging_sizes) {
    for (int copy = 0; copy < 2; ++copy) {
      staging_.push_back(
          torch::empty({numel}, torch::TensorOptions().dtype(dtype).device(device_)));
    }
  }
}

torch::Tensor ZeroRedundancyOptimizer::step(LossClosure closure) {
  if (options_.overlap_with_ddp) {
    if (closure) {
      throw ConfigError(
          "ZeroRedundancyOptimizer with overlap_with_ddp: step() takes no closure (the step ran "
          "in DDP's comm hook during backward)");
    }
    if (join_state()) {
      throw ConfigError(
          "ZeroRedundancyOptimizer with overlap_with_ddp cannot run under ddp::Join (a joined "
          "rank has no backward to step in); construct it without overlap_with_ddp");
    }
    if (!overlap_stepped_) {
      throw ConfigError(
          "ZeroRedundancyOptimizer with overlap_with_ddp: no backward ran hook_with_zero_step "
          "since the last step(); register it on the DDP model (model->register_comm_hook("
          "ddp::hook_with_zero_step(ddp::allreduce_hook(), optimizer))) and run backward first");
    }
    detail::in_phase(
        detail::kZeroCauses, [] { return std::string("shard broadcast of the overlapped step"); },
        [&] { finish_overlap_broadcasts(/*all=*/true); });
    overlap_stepped_ = false;
    return {};
  }
  // A no-op unless this optimizer is the first joinable of a Join (with DDP, DDP's forward
  // announced this rank's step already).
  Join::notify_join_context(*this);
  return step_shard(std::move(closure));
}

torch::Tensor ZeroRedundancyOptimizer::step_shard(LossClosure closure) {
  // Options changed on the full groups (a scheduler's lr) reach the local optimizer.
  for (std::size_t g = 0; g < param_groups_.size(); ++g) {
    local_->param_groups()[g].set_options(param_groups_[g].options().clone());
  }
  torch::Tensor loss = local_->step(std::move(closure));
  detail::in_phase(
      detail::kZeroCauses, [] { return std::string("shard broadcast after step()"); },
      [&] { broadcast_shards(); });
  return loss;
}

// The ranks still training step and broadcast; this joined rank does the same with the gradients
// the shadowed backward left in its parameters (DistributedDataParallel's join_main_hook, which
// runs first), so the shards it owns are updated exactly as if it were still training.
void ZeroRedundancyOptimizer::join_main_hook() {
  step_shard(nullptr);
}

// Every step broadcast every shard, so the parameters agree already.
void ZeroRedundancyOptimizer::join_post_hook(bool /*is_last_joiner*/) {}

std::string ZeroRedundancyOptimizer::join_description() const {
  return fmt::format("ZeroRedundancyOptimizer({}, {} parameters)", kind_, params_.size());
}

// Each bucket is one broadcast from its owner. Buckets that need packing alternate between two
// staging buffers of their dtype: bucket k+1 is packed while bucket k is on the wire, and a
// buffer is reused only once the broadcast that used it has completed (and been unpacked).
void ZeroRedundancyOptimizer::broadcast_shards() {
  torch::NoGradGuard no_grad;
  const int rank = group_->rank();
  struct Pending {
    const Bucket* bucket;
    torch::Tensor buffer;  // the staging slice, or undefined
    std::shared_ptr<Work> work;
  };
  std::vector<Pending> pending;
  std::size_t done = 0;
  std::vector<std::size_t> last_user(staging_.size(), SIZE_MAX);  // slot -> pending index
  std::vector<int> next_copy(staging_.size() / 2 + 1, 0);
  auto finish = [&](std::size_t upto) {
    for (; done < upto; ++done) {
      auto& p = pending[done];
      p.work->wait();
      if (p.buffer.defined() && p.bucket->owner != rank) {
        std::int64_t offset = 0;
        for (const auto& param : p.bucket->params) {
          param.detach().copy_(p.buffer.narrow(0, offset, param.numel()).view(param.sizes()));
          offset += param.numel();
        }
      }
    }
  };
  if (group_->size() == 1) return;
  for (const auto& bucket : buckets_) {
    if (bucket.direct.defined()) {
      pending.push_back({&bucket, {}, broadcast_async(bucket.direct, bucket.owner, *group_)});
      continue;
    }
    const std::size_t slot =
        bucket.staging + static_cast<std::size_t>(next_copy[bucket.staging / 2]);
    next_copy[bucket.staging / 2] ^= 1;
    if (last_user[slot] != SIZE_MAX) finish(last_user[slot] + 1);
    auto buffer = staging_[slot].narrow(0, 0, bucket.numel);
    if (bucket.owner == rank) {
      std::int64_t offset = 0;
      for (const auto& param : bucket.params) {
        buffer.narrow(0, offset, param.numel()).view(param.sizes()).copy_(param.detach());
        offset += param.numel();
      }
    }
    last_user[slot] = pending.size();
    pending.push_back({&bucket, buffer, broadcast_async(buffer, bucket.owner, *group_)});
  }
  finish(pending.size());
}

std::unique_ptr<torch::optim::Optimizer> ZeroRedundancyOptimizer::make_optimizer(int rank) const {
  std::vector<std::vector<torch::Tensor>> groups(param_groups_.size());
  for (std::size_t r = 0; r < shard_order_.size(); ++r) {
    if (rank >= 0 && static_cast<int>(r) != rank) continue;
    for (const std::size_t i : shard_order_[r])
      groups[group_of_[i]].push_back(params_[i]);
  }
  if (rank < 0) {  // the full optimizer lists each group's parameters in their given order
    for (auto& g : groups)
      g.clear();
    for (std::size_t i = 0; i < params_.size(); ++i)
      groups[group_of_[i]].push_back(params_[i]);
  }
  std::vector<OptimizerParamGroup> with_options;
  for (std::size_t g = 0; g < groups.size(); ++g) {
    with_options.emplace_back(groups[g], param_groups_[g].options().clone());
  }
  auto made = factory_(std::move(with_options));
  if (!made) throw ConfigError("ZeroRedundancyOptimizer: the optimizer factory returned null");
  return made;
}

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
  for (std::size_t g = 0; g < param_groups_.size(); ++g) {
    param_groups_[g].set_options(full->param_groups()[g].options().clone());
    local_->param_groups()[g].set_options(full->param_groups()[g].options().clone());
  }
  local_->state().clear();
  for (const std::size_t i : shard_order_[static_cast<std::size_t>(group_->rank())]) {
    const auto key = optimizer_state_key(params_[i]);
    auto it = full->state().find(key);
    if (it != full->state().end()) local_->state()[key] = std::move(it->second);
  }
  consolidated_.reset();
}

std::vector<torch::Tensor> ZeroRedundancyOptimizer::shard_parameters(int rank) const {
  std::vector<torch::Tensor> out;
  for (const std::size_t i : shard_order_.at(static_cast<std::size_t>(rank)))
    out.push_back(params_[i]);
  return out;
}

std::size_t ZeroRedundancyOptimizer::bucket_count() const {
  return buckets_.size();
}

std::int64_t ZeroRedundancyOptimizer::local_state_bytes() const {
  std::int64_t bytes = 0;
  for (const auto& [key, state] : local_->state()) {
    const auto tensors = detail::optimizer_state_tensors(*state);
    if (!tensors) {
      throw Error(fmt::format(
          "ZeroRedundancyOptimizer::local_state_bytes: cannot look into the state of a {}", kind_));
    }
    for (const auto& t : *tensors)
      bytes += static_cast<std::int64_t>(t.nbytes());
  }
  return bytes;
}

}  // namespace ddp
