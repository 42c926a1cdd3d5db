#include "ddp/torch/ddp/sync_batch_norm.h"

#include <fmt/format.h>

#include <utility>
#include <vector>

#include "ddp/comm/comm_error.h"
#include "ddp/error.h"
#include "ddp/runtime/init.h"
#include "ddp/torch/core/tensor_collectives.h"

namespace ddp {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// What the backward pass needs besides tensors, carried through the autograd context.
struct BackwardContext : torch::CustomClassHolder {
  std::shared_ptr<ProcessGroup> group;
  std::string layer;
  double total = 0;  // samples per channel over the group
};

// Every dimension but the channel one (1): the dimensions a channel's statistics reduce over.
std::vector<int64_t> reduce_dims(const torch::Tensor& x) {
  std::vector<int64_t> dims{0};
  for (int64_t d = 2; d < x.dim(); ++d)
    dims.push_back(d);
  return dims;
}

// Shape (1, C, 1, ...) to broadcast a per-channel vector against `x`.
std::vector<int64_t> channel_shape(const torch::Tensor& x) {
  std::vector<int64_t> shape(static_cast<std::size_t>(x.dim()), 1);
  shape[1] = x.size(1);
  return shape;
}

// Reduced-precision inputs are normalised in float32 (as torch's CPU kernels accumulate).
torch::ScalarType compute_type(const torch::Tensor& x) {
  const auto type = x.scalar_type();
  return type == torch::kHalf || type == torch::kBFloat16 ? torch::kFloat : type;
}

// Rethrows a collective's failure with the layer and the phase named; the group stays poisoned.
[[noreturn]] void rethrow_comm_error(const CommError& error, const std::string& layer,
                                     const std::string& phase, int64_t num_features,
                                     const std::string& hint) {
  throw CommError(error.kind(),
                  fmt::format("{} (num_features {} on this rank), {}: {}{}", layer, num_features,
                              phase, error.what(), hint),
                  error.group(), error.op(), error.sequence(), error.peer());
}

// grad_input of batch norm from the group's sums, exactly as one BatchNorm over the concatenated
// batch (PyTorch's batch_norm_backward_elemt); grad_weight and grad_bias are this rank's share.
struct SyncBatchNormFunction : torch::autograd::Function<SyncBatchNormFunction> {
  // mean, var and invstd are the group's statistics, in the compute type of `input`.
  static torch::Tensor forward(AutogradContext* ctx, torch::Tensor input, torch::Tensor weight,
                               torch::Tensor bias, torch::Tensor mean, torch::Tensor var,
                               torch::Tensor invstd, double eps,
                               c10::intrusive_ptr<BackwardContext> backward_context) {
    ctx->save_for_backward({input, weight, mean, invstd});
    ctx->saved_data["context"] = c10::IValue::make_capsule(std::move(backward_context));
    // The fused eval kernel applies (x - mean) / sqrt(var + eps) * weight + bias in one pass.
    const auto type = compute_type(input);
    return torch::batch_norm(input.to(type), weight.defined() ? weight.to(type) : weight,
                             bias.defined() ? bias.to(type) : bias, mean, var,
                             /*training=*/false, 0.0, eps, /*cudnn_enabled=*/true)
        .to(input.dtype());
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    const auto& input = saved[0];
    const auto& weight = saved[1];
    const auto type = compute_type(input);
    const auto x = input.to(type);
    const int64_t channels = x.size(1);
    const auto shape = channel_shape(x);
    const auto& mean = saved[2];    // [C], the group's
    const auto& invstd = saved[3];  // [C]
    auto context =
        c10::static_intrusive_pointer_cast<BackwardContext>(ctx->saved_data["context"].toCapsule());
    const auto dy = grad_outputs[0].to(type);

    // This rank's per-channel sums of dy and dy * (x - mean) in one fused pass: given the group's
    // mean and invstd, the training-mode batch-norm backward kernel returns them as grad_bias and
    // grad_weight = sum(dy * (x - mean)) * invstd.
    torch::Tensor sum_dy, dotp_invstd;
    if (x.numel() == 0) {
      sum_dy = torch::zeros({channels}, x.options());
      dotp_invstd = torch::zeros({channels}, x.options());
    } else {
      auto sums = torch::native_batch_norm_backward(
          dy, x, weight.defined() ? weight.to(type) : torch::ones({channels}, x.options()), {}, {},
          mean, invstd,
          /*train=*/true, /*eps=*/0.0, {false, true, true});
      dotp_invstd = std::get<1>(sums);
      sum_dy = std::get<2>(sums);
    }

    torch::Tensor grad_input, grad_weight, grad_bias;
    if (ctx->needs_input_grad(1)) grad_weight = dotp_invstd.to(weight.dtype());
    if (ctx->needs_input_grad(2)) grad_bias = sum_dy.to(weight.dtype());
    if (ctx->needs_input_grad(0)) {
      auto packed =
          torch::cat({sum_dy, dotp_invstd / invstd}).to(torch::kCPU, torch::kDouble).contiguous();
      try {
        allreduce_tensor(*context->group, packed, ReduceOp::kSum)->wait();
      } catch (const TimeoutError& error) {
        throw TimeoutError(
            fmt::format("{}, backward gradient sums: {}", context->layer, error.what()));
      } catch (const CommError& error) {
        rethrow_comm_error(error, context->layer, "backward gradient sums", channels, "");
      }
      packed = packed.div_(context->total).to(x.device(), type);
      const auto mean_dy = packed.narrow(0, 0, channels);
      const auto mean_dy_xmu = packed.narrow(0, channels, channels);
      // grad_input = (dy - mean_dy - (x - mean) * invstd^2 * mean_dy_xmu) * invstd * weight, as
      // per-channel factors applied in place: (x - mean) * k + dy * a - mean_dy * a. (x * k + a
      // constant would save a pass but cancels badly when a channel's spread is small.)
      const auto a = weight.defined() ? invstd * weight.to(type) : invstd;
      const auto k = -(invstd * invstd * mean_dy_xmu * a);
      grad_input = (x - mean.view(shape))
                       .mul_(k.view(shape))
                       .addcmul_(dy, a.view(shape))
                       .sub_((mean_dy * a).view(shape))
                       .to(input.dtype());
    }
    return {grad_input, grad_weight, grad_bias, {}, {}, {}, {}, {}};
  }
};

}  // namespace

SyncBatchNormImpl::SyncBatchNormImpl(SyncBatchNormOptions options_) : options(std::move(options_)) {
  reset();
}

SyncBatchNormImpl::SyncBatchNormImpl(SyncBatchNormOptions options_, AdoptedState state)
    : options(std::move(options_)), adopt_(std::move(state)) {
  reset();
}

void SyncBatchNormImpl::reset() {
  if (options.num_features() <= 0) {
    throw ConfigError(
        fmt::format("SyncBatchNorm needs num_features > 0, got {}", options.num_features()));
  }
  // An adopted state is used once: a clone() of this module must get tensors of its own.
  auto adopted = std::exchange(adopt_, std::nullopt);
  const int64_t c = options.num_features();
  if (options.affine()) {
    weight = register_parameter("weight", adopted ? adopted->weight : torch::ones({c}));
    bias = register_parameter("bias", adopted ? adopted->bias : torch::zeros({c}));
  } else {
    weight = register_parameter("weight", torch::Tensor(), /*requires_grad=*/false);
    bias = register_parameter("bias", torch::Tensor(), /*requires_grad=*/false);
  }
  if (options.track_running_stats()) {
    running_mean =
        register_buffer("running_mean", adopted ? adopted->running_mean : torch::zeros({c}));
    running_var = register_buffer("running_var", adopted ? adopted->running_var : torch::ones({c}));
    num_batches_tracked =
        register_buffer("num_batches_tracked",
                        adopted ? adopted->num_batches_tracked : torch::tensor(0, torch::kLong));
  } else {
    running_mean = register_buffer("running_mean", torch::Tensor());
    running_var = register_buffer("running_var", torch::Tensor());
    num_batches_tracked = register_buffer("num_batches_tracked", torch::Tensor());
  }
}

void SyncBatchNormImpl::reset_running_stats() {
  if (!options.track_running_stats()) return;
  torch::NoGradGuard no_grad;
  running_mean.zero_();
  running_var.fill_(1);
  num_batches_tracked.zero_();
}

void SyncBatchNormImpl::reset_parameters() {
  reset_running_stats();
  if (!options.affine()) return;
  torch::NoGradGuard no_grad;
  weight.fill_(1);
  bias.zero_();
}

void SyncBatchNormImpl::pretty_print(std::ostream& stream) const {
  stream << "ddp::SyncBatchNorm(" << options.num_features() << ", eps=" << options.eps()
         << ", momentum=";
  if (options.momentum()) {
    stream << *options.momentum();
  } else {
    stream << "None";
  }
  stream << ", affine=" << options.affine()
         << ", track_running_stats=" << options.track_running_stats() << ")";
}

std::string SyncBatchNormImpl::layer_name() const {
  return options.name().empty() ? fmt::format("SyncBatchNorm({})", options.num_features())
                                : fmt::format("SyncBatchNorm '{}'", options.name());
}

torch::Tensor SyncBatchNormImpl::forward(const torch::Tensor& input) {
  const int64_t c = options.num_features();
  std::string local_error;
  if (!input.defined()) {
    local_error = "the input is an undefined tensor";
  } else if (input.dim() < 2) {
    local_error = fmt::format("expected an input of shape (N, C) or (N, C, *), got {}D input {}",
                              input.dim(), fmt::join(input.sizes(), "x"));
  } else if (input.size(1) != c) {
    local_error = fmt::format("expected {} channels (num_features) in dimension 1, got input {}", c,
                              fmt::join(input.sizes(), "x"));
  }
  const auto local_failure = [&] {
    return ConfigError(fmt::format("{}: {}", layer_name(), local_error));
  };

  // Eval: running statistics, or (without them) this rank's batch statistics; nothing to share.
  if (!is_training()) {
    if (!local_error.empty()) throw local_failure();
    return torch::batch_norm(input, weight, bias, running_mean, running_var,
                             /*training=*/!options.track_running_stats(), 0.0, options.eps(),
                             /*cudnn_enabled=*/true);
  }

  // Training: the factor of the running-statistics update, exactly as torch::nn::BatchNorm.
  double factor = options.momentum().value_or(0.0);
  if (options.track_running_stats()) {
    torch::NoGradGuard no_grad;
    num_batches_tracked += 1;
    if (!options.momentum()) factor = 1.0 / num_batches_tracked.item<double>();
  }
  if (!options.process_group()) options.process_group(default_process_group());
  auto& group = *options.process_group();

  if (group.size() == 1) {
    if (!local_error.empty()) throw local_failure();
    if (input.numel() / c <= 1) {
      throw ConfigError(
          fmt::format("{}: expected more than 1 value per channel when training, got input {}",
                      layer_name(), fmt::join(input.sizes(), "x")));
    }
    return torch::batch_norm(input, weight, bias, running_mean, running_var, /*training=*/true,
                             factor, options.eps(), /*cudnn_enabled=*/true);
  }

  // This rank's (count, C, mean[C], M2[C]) in float64; count -1 marks an invalid input, which
  // still takes part so that every rank learns of it instead of waiting.
  const auto cpu_double = torch::TensorOptions().dtype(torch::kDouble);
  const int64_t per_rank = 2 + 2 * c;
  auto mine = torch::zeros({per_rank}, cpu_double);
  mine[1] = static_cast<double>(c);
  const auto type = local_error.empty() ? compute_type(input) : torch::kFloat;
  torch::Tensor x;
  if (!local_error.empty()) {
    mine[0] = -1.0;
  } else {
    x = input.detach().to(type);
    const int64_t n = x.numel() / c;
    mine[0] = static_cast<double>(n);
    if (n > 0) {
      torch::NoGradGuard no_grad;
      auto [var, mean] = torch::var_mean(x, reduce_dims(x), /*unbiased=*/false);
      mine.narrow(0, 2, c).copy_(mean.to(torch::kCPU, torch::kDouble));
      mine.narrow(0, 2 + c, c).copy_(var.to(torch::kCPU, torch::kDouble) * static_cast<double>(n));
    }
  }
  auto all = torch::empty({group.size(), per_rank}, cpu_double);
  try {
    group
        .allgather(mine.data_ptr(), all.data_ptr(), static_cast<std::size_t>(per_rank),
                   DType::kFloat64)
        ->wait();
  } catch (const TimeoutError& error) {
    throw TimeoutError(
        fmt::format("{}, forward statistics allgather: {} (did every rank of the "
                    "group run this training-mode forward?)",
                    layer_name(), error.what()));
  } catch (const CommError& error) {
    rethrow_comm_error(error, layer_name(), "forward statistics allgather", c,
                       fmt::format(" (the allgather carries 2 + 2 x num_features = {} values per "
                                   "rank: a count that differs means the ranks disagree on "
                                   "num_features; build the same model on every rank)",
                                   per_rank));
  }
  if (!local_error.empty()) throw local_failure();

  const auto counts = all.select(1, 0);
  std::vector<int> invalid;
  for (int r = 0; r < group.size(); ++r) {
    if (counts[r].item<double>() < 0) invalid.push_back(r);
  }
  if (!invalid.empty()) {
    throw Error(
        fmt::format("{}: the input of rank(s) {} of the group was invalid (see the error "
                    "on those ranks), so this forward cannot normalise",
                    layer_name(), fmt::join(invalid, ", ")));
  }
  const double total = counts.sum().item<double>();
  if (total <= 1) {
    throw ConfigError(fmt::format(
        "{}: expected more than 1 value per channel when training, got {} across the {} ranks of "
        "the group (this rank's input {})",
        layer_name(), total, group.size(), fmt::join(input.sizes(), "x")));
  }

  // Parallel variance (Chan et al.): M2 = sum_r M2_r + sum_r n_r (mean_r - mean)^2.
  const auto means = all.narrow(1, 2, c);
  const auto m2s = all.narrow(1, 2 + c, c);
  const auto weights = counts.unsqueeze(1);
  const auto global_mean = (weights * means).sum(0) / total;
  const auto deviation = means - global_mean;
  const auto global_var = (m2s.sum(0) + (weights * deviation * deviation).sum(0)) / total;

  const auto device = input.device();
  const auto mean = global_mean.to(device, type);
  const auto var = global_var.to(device, type);
  if (options.track_running_stats()) {
    torch::NoGradGuard no_grad;
    const auto unbiased = (global_var * (total / (total - 1))).to(device, running_var.dtype());
    running_mean.mul_(1 - factor).add_(global_mean.to(device, running_mean.dtype()), factor);
    running_var.mul_(1 - factor).add_(unbiased, factor);
  }
  const auto invstd = (global_var + options.eps()).rsqrt().to(device, type);

  auto context = c10::make_intrusive<BackwardContext>();
  context->group = options.process_group();
  context->layer = layer_name();
  context->total = total;
  // libtorch 1.13's custom functions take no undefined tensors: without affine, pass the
  // identity transform (it needs no gradient).
  const auto scale = weight.defined() ? weight : torch::ones({c}, input.options().dtype(type));
  const auto shift = bias.defined() ? bias : torch::zeros({c}, input.options().dtype(type));
  return SyncBatchNormFunction::apply(input, scale, shift, mean, var, invstd, options.eps(),
                                      std::move(context));
}

namespace {

struct Site {
  std::shared_ptr<torch::nn::Module> parent;
  std::size_t index = 0;  // among the parent's children
  std::string name;
  std::shared_ptr<torch::nn::Module> batch_norm;
  std::string path;
};

template <typename Impl>
bool is(const std::shared_ptr<torch::nn::Module>& module) {
  return std::dynamic_pointer_cast<Impl>(module) != nullptr;
}

bool is_batch_norm(const std::shared_ptr<torch::nn::Module>& module) {
  return is<torch::nn::BatchNorm1dImpl>(module) || is<torch::nn::BatchNorm2dImpl>(module) ||
         is<torch::nn::BatchNorm3dImpl>(module);
}

template <typename Impl>
std::shared_ptr<SyncBatchNormImpl> make_sync(const Impl& bn, std::shared_ptr<ProcessGroup> group,
                                             const std::string& path) {
  auto options = SyncBatchNormOptions(bn.options.num_features())
                     .eps(bn.options.eps())
                     .momentum(bn.options.momentum())
                     .affine(bn.options.affine())
                     .track_running_stats(bn.options.track_running_stats())
                     .process_group(std::move(group))
                     .name(path);
  auto sync = std::make_shared<SyncBatchNormImpl>(
      std::move(options), SyncBatchNormImpl::AdoptedState{bn.weight, bn.bias, bn.running_mean,
                                                          bn.running_var, bn.num_batches_tracked});
  sync->train(bn.is_training());
  return sync;
}

std::shared_ptr<SyncBatchNormImpl> convert_one(const std::shared_ptr<torch::nn::Module>& module,
                                               std::shared_ptr<ProcessGroup> group,
                                               const std::string& path) {
  if (auto bn = std::dynamic_pointer_cast<torch::nn::BatchNorm1dImpl>(module)) {
    return make_sync(*bn, std::move(group), path);
  }
  if (auto bn = std::dynamic_pointer_cast<torch::nn::BatchNorm2dImpl>(module)) {
    return make_sync(*bn, std::move(group), path);
  }
  auto bn = std::dynamic_pointer_cast<torch::nn::BatchNorm3dImpl>(module);
  return make_sync(*bn, std::move(group), path);
}

void collect(const std::shared_ptr<torch::nn::Module>& module, const std::string& prefix,
             std::vector<Site>& sites) {
  std::size_t index = 0;
  for (const auto& item : module->named_children()) {
    const auto path = prefix.empty() ? item.key() : prefix + "." + item.key();
    if (is_batch_norm(item.value())) {
      sites.push_back({module, index, item.key(), item.value(), path});
    } else {
      collect(item.value(), path, sites);
    }
    ++index;
  }
}

}  // namespace

std::shared_ptr<torch::nn::Module> convert_sync_batchnorm(std::shared_ptr<torch::nn::Module> module,
                                                          std::shared_ptr<ProcessGroup> group) {
  if (!module) throw ConfigError("convert_sync_batchnorm: the module is null");
  if (is_batch_norm(module)) return convert_one(module, std::move(group), "");

  std::vector<Site> sites;
  collect(module, "", sites);
  // Check every site before changing anything. The references we know of: the parent's child
  // entry, our Site, and the element of a Sequential or ModuleList parent (which calls it). Any
  // other holder, typically a typed member of the parent, would keep calling the local BatchNorm.
  for (const auto& site : sites) {
    const bool container =
        is<torch::nn::SequentialImpl>(site.parent) || is<torch::nn::ModuleListImpl>(site.parent);
    const long known = 2 + (container ? 1 : 0);
    if (site.batch_norm.use_count() != known) {
      throw ConfigError(fmt::format(
          "convert_sync_batchnorm: the BatchNorm '{}' is also held outside the module tree "
          "(e.g. a torch::nn::BatchNorm member of its parent, a ModuleDict, or the same layer in "
          "two places), and that holder would keep calling the local BatchNorm; declare it as "
          "ddp::SyncBatchNorm, or keep it in a Sequential or ModuleList. Nothing was converted.",
          site.path));
    }
  }
  for (const auto& site : sites) {
    auto sync = convert_one(site.batch_norm, group, site.path);
    if (auto sequential = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(site.parent)) {
      *(sequential->begin() + static_cast<std::ptrdiff_t>(site.index)) =
          torch::nn::AnyModule(SyncBatchNorm(sync));
    } else if (auto list = std::dynamic_pointer_cast<torch::nn::ModuleListImpl>(site.parent)) {
      *(list->begin() + static_cast<std::ptrdiff_t>(site.index)) = sync;
    }
    site.parent->replace_module(site.name, sync);
  }
  return module;
}

}  // namespace ddp
