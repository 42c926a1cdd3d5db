// ZeroRedundancyOptimizer: construction (the parameters' assignment to their owning ranks, checked
// alike on every rank, the local optimizer over this rank's shard) and the accessors; the step and
// the shard broadcasts are in zero_step.cc, the state dicts in zero_state_dict.cc.
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
#include "ddp/torch/zero/chunked_adam.h"
#include "torch/api/rank_agreement.h"
#include "torch/core/host_values.h"
#include "torch/zero/optimizer_state_tensors.h"
#include "torch/zero/zero_redundancy_optimizer_internal.h"

namespace ddp {

namespace {

using torch::optim::OptimizerParamGroup;

using detail::shape_text;

}  // namespace

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

std::vector<torch::Tensor> ZeroRedundancyOptimizer::shard_parameters(int rank) const {
  std::vector<torch::Tensor> out;
  for (const std::size_t i : shard_order_.at(static_cast<std::size_t>(rank)))
    out.push_back(params_[i]);
  return out;
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
