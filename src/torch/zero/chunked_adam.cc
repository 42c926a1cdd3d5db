#include "ddp/torch/zero/chunked_adam.h"

#include <cmath>
#include <memory>

#include "torch/core/libtorch_compat.h"

namespace ddp {
namespace {

using torch::Tensor;

// The moments of one parameter, or of a chunk of it (views).
struct AdamTensors {
  Tensor param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq;
};

// What one step applies to every element, with the step's scalars.
struct AdamUpdate {
  double beta1 = 0, beta2 = 0, eps = 0;
  double bias_correction2 = 0;
  double step_size = 0;
  double l2_weight_decay = 0;  // Adam's (added to the gradient); AdamW decays the weights apart
  bool amsgrad = false;
};

// libtorch's Adam/AdamW step for one parameter, operation for operation (adam.cpp, adamw.cpp),
// so that each element is computed by the same kernels as there.
void apply(const AdamUpdate& u, AdamTensors t) {
  if (u.l2_weight_decay != 0) t.grad = t.grad.add(t.param, u.l2_weight_decay);
  t.exp_avg.mul_(u.beta1).add_(t.grad, 1 - u.beta1);
  t.exp_avg_sq.mul_(u.beta2).addcmul_(t.grad, t.grad, 1 - u.beta2);
  Tensor denom;
  if (u.amsgrad) {
    torch::max_out(t.max_exp_avg_sq, t.exp_avg_sq, t.max_exp_avg_sq);
    denom = (t.max_exp_avg_sq.sqrt() / std::sqrt(u.bias_correction2)).add_(u.eps);
  } else {
    denom = (t.exp_avg_sq.sqrt() / std::sqrt(u.bias_correction2)).add_(u.eps);
  }
  t.param.addcdiv_(t.exp_avg, denom, -u.step_size);
}

bool contiguous_or_undefined(const Tensor& t) {
  return !t.defined() || t.is_contiguous();
}

// `body` on the whole tensors, or on aligned chunks of their flat views where all are contiguous
// and larger than a chunk (the chunks' temporaries then replace the parameter-sized ones).
template <class Body>
void in_chunks(const AdamTensors& whole, const Body& body) {
  const std::int64_t n = whole.param.numel();
  const bool chunkable = n > kChunkedAdamElements && whole.param.is_contiguous() &&
                         whole.grad.is_contiguous() && whole.exp_avg.is_contiguous() &&
                         whole.exp_avg_sq.is_contiguous() &&
                         contiguous_or_undefined(whole.max_exp_avg_sq) &&
                         whole.grad.scalar_type() == whole.param.scalar_type();
  if (!chunkable) {
    body(whole);
    return;
  }
  auto flat = [](const Tensor& t) { return t.defined() ? t.view({-1}) : t; };
  const AdamTensors flats{flat(whole.param), flat(whole.grad), flat(whole.exp_avg),
                          flat(whole.exp_avg_sq), flat(whole.max_exp_avg_sq)};
  auto part = [](const Tensor& t, std::int64_t start, std::int64_t length) {
    return t.defined() ? t.narrow(0, start, length) : t;
  };
  for (std::int64_t start = 0; start < n; start += kChunkedAdamElements) {
    const std::int64_t length = std::min(kChunkedAdamElements, n - start);
    body(AdamTensors{part(flats.param, start, length), part(flats.grad, start, length),
                     part(flats.exp_avg, start, length), part(flats.exp_avg_sq, start, length),
                     part(flats.max_exp_avg_sq, start, length)});
  }
}

// The state of `param`, made as libtorch makes it on the first step.
template <class StateT>
StateT& state_of(torch::optim::Optimizer& optimizer, const Tensor& param, bool amsgrad) {
  auto& states = optimizer.state();
  const auto key = libtorch_compat::optimizer_state_key(param);
  auto found = states.find(key);
  if (found == states.end()) {
    auto state = std::make_unique<StateT>();
    state->step(0);
    state->exp_avg(torch::zeros_like(param, torch::MemoryFormat::Preserve));
    state->exp_avg_sq(torch::zeros_like(param, torch::MemoryFormat::Preserve));
    if (amsgrad) state->max_exp_avg_sq(torch::zeros_like(param, torch::MemoryFormat::Preserve));
    found = states.emplace(key, std::move(state)).first;
  }
  return static_cast<StateT&>(*found->second);
}

// Both classes' step: OptionsT/StateT are Adam's or AdamW's; `decoupled`: AdamW's weight decay.
template <class OptionsT, class StateT>
Tensor chunked_step(torch::optim::Optimizer& optimizer,
                    const torch::optim::Optimizer::LossClosure& closure, bool decoupled) {
  torch::NoGradGuard no_grad;
  Tensor loss;
  if (closure != nullptr) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  for (auto& group : optimizer.param_groups()) {
    auto& options = static_cast<OptionsT&>(group.options());
    for (auto& param : group.params()) {
      if (!param.grad().defined()) continue;
      const Tensor grad = param.grad();
      TORCH_CHECK(!grad.is_sparse(), decoupled ? "AdamW" : "Adam",
                  " does not support sparse gradients");
      const double decay = options.weight_decay();
      const double lr = options.lr();
      AdamUpdate update{.beta1 = std::get<0>(options.betas()),
                        .beta2 = std::get<1>(options.betas()),
                        .eps = options.eps(),
                        .l2_weight_decay = decoupled ? 0.0 : decay,
                        .amsgrad = options.amsgrad()};
      if (decoupled && decay != 0) {
        in_chunks({param, grad, param, param, {}},
                  [&](const AdamTensors& t) { t.param.mul_(1 - lr * decay); });
      }
      auto& state = state_of<StateT>(optimizer, param, update.amsgrad);
      state.step(state.step() + 1);
      const double bias_correction1 = 1 - std::pow(update.beta1, state.step());
      update.bias_correction2 = 1 - std::pow(update.beta2, state.step());
      update.step_size = lr / bias_correction1;
      in_chunks({param, grad, state.exp_avg(), state.exp_avg_sq(), state.max_exp_avg_sq()},
                [&](const AdamTensors& t) { apply(update, t); });
    }
  }
  return loss;
}

}  // namespace

torch::Tensor ChunkedAdam::step(LossClosure closure) {
  return chunked_step<torch::optim::AdamOptions, torch::optim::AdamParamState>(*this, closure,
                                                                               false);
}

torch::Tensor ChunkedAdamW::step(LossClosure closure) {
  return chunked_step<torch::optim::AdamWOptions, torch::optim::AdamWParamState>(*this, closure,
                                                                                 true);
}

}  // namespace ddp
