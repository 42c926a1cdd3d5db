// MoeLayer (mixture_of_experts.h): route, dispatch to the ranks holding the experts, compute,
// return and combine.
#include "ddp/torch/parallel/expert/mixture_of_experts.h"

#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "ddp/error.h"
#include "ddp/torch/api/distributed.h"
#include "torch/api/rank_agreement.h"
#include "torch/core/split_parameters.h"
#include "torch/parallel/expert/moe_routing.h"

namespace ddp {

namespace {

std::string options_error(const MoeOptions& o, int ep_size) {
  if (o.hidden < 1 || o.ffn_hidden < 1)
    return fmt::format("MoeLayer: hidden {} and ffn_hidden {} must be at least 1", o.hidden,
                       o.ffn_hidden);
  if (o.experts < 1) return fmt::format("MoeLayer: experts {} must be at least 1", o.experts);
  if (o.top_k < 1 || o.top_k > o.experts)
    return fmt::format("MoeLayer: top_k {} must be between 1 and the expert count {}", o.top_k,
                       o.experts);
  if (o.experts % ep_size != 0)
    return fmt::format(
        "MoeLayer: the expert count {} is not divisible by the ep group's {} ranks; use a "
        "multiple of {} experts or another ep size",
        o.experts, ep_size, ep_size);
  if (!(o.aux_loss_weight >= 0.0) || !std::isfinite(o.aux_loss_weight))
    return fmt::format("MoeLayer: aux_loss_weight {} must be finite and at least 0",
                       o.aux_loss_weight);
  if (!(o.capacity_factor >= 0.0) || !std::isfinite(o.capacity_factor))
    return fmt::format("MoeLayer: capacity_factor {} must be finite and at least 0 (0: none)",
                       o.capacity_factor);
  if (o.dtype != torch::kFloat32 && o.dtype != torch::kFloat64)
    return fmt::format("MoeLayer: dtype {} is not float32 or float64", c10::toString(o.dtype));
  return {};
}

// uniform(-1/sqrt(fan_in), 1/sqrt(fan_in)), torch::nn::Linear's distribution.
torch::Tensor uniform(std::vector<std::int64_t> shape, std::int64_t fan_in,
                      at::Generator& generator, torch::Dtype dtype) {
  const double bound = 1.0 / std::sqrt(static_cast<double>(fan_in));
  return torch::empty(shape, torch::dtype(dtype)).uniform_(-bound, bound, generator);
}

// Identity forward; in backward, weight x d(aux) joins the gradient: the auxiliary loss enters the
// backward pass where the layer's output does.
struct AttachAuxLoss : torch::autograd::Function<AttachAuxLoss> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& output,
                               const torch::Tensor& aux, double weight) {
    ctx->saved_data["weight"] = weight;
    ctx->saved_data["aux_options"] = aux.scalar_type();
    return output.clone();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto weight = ctx->saved_data["weight"].toDouble();
    const auto dtype = ctx->saved_data["aux_options"].toScalarType();
    return {grads[0], torch::full({}, weight, torch::dtype(dtype)), torch::Tensor()};
  }
};

std::vector<std::int64_t> to_vector(const torch::Tensor& counts) {
  auto c = counts.contiguous();
  return {c.data_ptr<std::int64_t>(), c.data_ptr<std::int64_t>() + c.numel()};
}

}  // namespace

MoeLayerImpl::MoeLayerImpl(MoeOptions options, MoeGroups groups)
    : options_(options), ep_(std::move(groups.ep)), tokens_(std::move(groups.tokens)) {
  if (!tokens_) tokens_ = ep_;
  if (options_.ffn_hidden == 0) options_.ffn_hidden = 4 * options_.hidden;
  const int ep_size = ep_ ? ep_->size() : 1;
  const auto error = options_error(options_, ep_size);
  const auto description = fmt::format(
      "hidden {}\nffn_hidden {}\nexperts {}\ntop_k {}\ncapacity_factor {}\n"
      "normalize_top_k {}\naux_loss_weight {}\nseed {}\ndtype {}\nep {}\ntokens {}\n",
      options_.hidden, options_.ffn_hidden, options_.experts, options_.top_k,
      options_.capacity_factor, options_.normalize_top_k, options_.aux_loss_weight, options_.seed,
      static_cast<int>(options_.dtype), ep_size, tokens_ ? tokens_->size() : 1);
  const detail::AgreementWording wording{
      .wrapper = "MoeLayer",
      .requirement = "Every rank of the ep and token groups must pass the same MoeOptions"};
  if (ep_) detail::agree_or_throw(*ep_, description, error, wording);
  if (tokens_ && tokens_ != ep_) detail::agree_or_throw(*tokens_, description, error, wording);
  if (!error.empty()) throw ConfigError(error);

  const auto local = options_.experts / ep_size;
  first_expert_ = (ep_ ? ep_->rank() : 0) * local;
  auto generator = at::detail::createCPUGenerator(options_.seed);
  router = register_parameter("router", uniform({options_.experts, options_.hidden},
                                                options_.hidden, generator, options_.dtype));
  std::vector<torch::Tensor> w1s, b1s, w2s, b2s;
  for (std::int64_t e = first_expert_; e < first_expert_ + local; ++e) {
    auto g = at::detail::createCPUGenerator(options_.seed + 1 + static_cast<std::uint64_t>(e));
    w1s.push_back(
        uniform({options_.ffn_hidden, options_.hidden}, options_.hidden, g, options_.dtype));
    b1s.push_back(uniform({options_.ffn_hidden}, options_.hidden, g, options_.dtype));
    w2s.push_back(
        uniform({options_.hidden, options_.ffn_hidden}, options_.ffn_hidden, g, options_.dtype));
    b2s.push_back(uniform({options_.hidden}, options_.ffn_hidden, g, options_.dtype));
  }
  w1 = register_parameter("w1", torch::stack(w1s));
  b1 = register_parameter("b1", torch::stack(b1s));
  w2 = register_parameter("w2", torch::stack(w2s));
  b2 = register_parameter("b2", torch::stack(b2s));
  const int rows = tokens_ ? tokens_->size() : 1;
  if (rows > 1) {
    // The router learns from every token rank's rows and the experts from their replicas' (the
    // gradients are scaled for exactly those averages): a wrapper averaging over other ranks
    // names it.
    for (const auto& p : replicated_parameters()) {
      detail::note_gradient_ranks(
          p, {.ranks = rows, .what = "a MoeLayer's router, trained on its token group's rows"});
    }
    for (const auto& p : expert_parameters()) {
      detail::note_gradient_ranks(
          p,
          {.ranks = rows / ep_size,
           .what = "a MoeLayer's expert, replicated over its token group's ranks of its ep rank"});
    }
  }
  if (ep_size > 1) {
    // Other experts on each ep rank: a wrapper that would average them over ep names it.
    for (const auto& p : expert_parameters()) {
      detail::note_split_parameter(
          p, {.part = ep_->rank(), .parts = static_cast<int>(ep_size), .kind = "expert-parallel"});
    }
    // Each expert's gradient sums the losses of every ep rank's tokens: scaled to their mean, as
    // averaging the replicated parameters over the ranks makes theirs.
    const double scale = 1.0 / ep_size;
    for (auto* p : {&w1, &b1, &w2, &b2})
      p->register_hook([scale](const torch::Tensor& grad) { return grad * scale; });
  }
}

void MoeLayerImpl::set_capacity_factor(double factor) {
  if (!(factor >= 0.0) || !std::isfinite(factor))
    throw ConfigError(fmt::format(
        "MoeLayer::set_capacity_factor: {} must be finite and at least 0 (0: none)", factor));
  options_.capacity_factor = factor;
}

torch::Tensor MoeLayerImpl::aux_loss() const {
  if (!aux_loss_.defined())
    throw ConfigError("MoeLayer::aux_loss: no forward has run yet; call it after forward");
  return aux_loss_;
}

torch::Tensor MoeLayerImpl::forward(const torch::Tensor& x) {
  const auto E = options_.experts, K = options_.top_k, H = options_.hidden;
  detail::MoeInputCheck check;
  if (x.dim() < 1 || x.size(-1) != H) {
    check = {detail::MoeInputCheck::Kind::kLastDimension, x.dim() < 1 ? -1 : x.size(-1)};
  } else if (x.scalar_type() != router.scalar_type()) {
    check = {detail::MoeInputCheck::Kind::kDtype, static_cast<std::int64_t>(x.scalar_type())};
  } else if (!x.device().is_cpu()) {
    check = {detail::MoeInputCheck::Kind::kDevice, 0};
  }
  const bool ok = check.kind == detail::MoeInputCheck::Kind::kNone;
  const auto flat = ok ? x.reshape({-1, H}) : torch::zeros({0, H}, router.options());

  const auto probs = torch::softmax(torch::nn::functional::linear(flat, router), -1);  // [T, E]
  auto [top_probs, top_experts] = probs.topk(K, -1);
  const auto gates =
      options_.normalize_top_k ? top_probs / top_probs.sum(-1, /*keepdim=*/true) : top_probs;
  const auto assignment = detail::assign_tokens(top_experts, probs.detach().sum(0), E, H,
                                                options_.capacity_factor, check, tokens_.get());
  routing_ = assignment.routing;

  // The kept slots (token t's choice k is slot t*K + k), grouped by expert.
  const auto kept_slots = assignment.kept.reshape(-1).nonzero().squeeze(1);
  const auto kept_experts = top_experts.reshape(-1).index_select(0, kept_slots);
  const auto by_expert = std::get<1>(kept_experts.sort(/*stable=*/true, 0, false));
  const auto slots = kept_slots.index_select(0, by_expert);
  const auto slot_experts = kept_experts.index_select(0, by_expert);
  const auto slot_tokens = torch::div(slots, K, "floor");
  const auto sent = flat.index_select(0, slot_tokens);
  const auto per_expert = torch::bincount(slot_experts, {}, E);

  // To the ranks holding the experts: counts first, then the rows.
  const int ep_size = ep_ ? ep_->size() : 1;
  const auto local = E / ep_size;
  torch::Tensor received = sent, received_experts = slot_experts - first_expert_;
  std::vector<std::int64_t> send_rows, receive_rows;
  if (ep_size > 1) {
    const auto send_counts = per_expert.reshape({ep_size, local}).contiguous();
    auto receive_counts = torch::empty_like(send_counts);
    all_to_all_single(receive_counts, send_counts, {}, {}, *ep_);
    send_rows = to_vector(send_counts.sum(1));
    receive_rows = to_vector(receive_counts.sum(1));
    received = all_to_all_rows(sent, receive_rows, send_rows, ep_);
    // Each source sends its rows grouped by expert: local expert j's, receive_counts[s][j] rows.
    received_experts = torch::arange(local, torch::kInt64)
                           .repeat({ep_size})
                           .repeat_interleave(receive_counts.reshape(-1));
  }

  // Each local expert on its rows.
  const auto order = std::get<1>(received_experts.sort(/*stable=*/true, 0, false));
  const auto grouped = received.index_select(0, order);
  const auto counts = to_vector(torch::bincount(received_experts, {}, local));
  std::vector<torch::Tensor> outputs;
  std::int64_t offset = 0;
  for (std::int64_t j = 0; j < local; ++j) {
    const auto rows = grouped.narrow(0, offset, counts[j]);
    offset += counts[j];
    const auto inner = torch::gelu(torch::nn::functional::linear(rows, w1[j], b1[j]));
    outputs.push_back(torch::nn::functional::linear(inner, w2[j], b2[j]));
  }
  auto computed = torch::cat(outputs).index_select(0, torch::argsort(order));
  if (ep_size > 1) computed = all_to_all_rows(computed, send_rows, receive_rows, ep_);

  // Combine: each kept slot's output weighted by its gate, added into its token's row.
  const auto slot_gates = gates.reshape(-1).index_select(0, slots).unsqueeze(1);
  const auto y = torch::zeros_like(flat).index_add(0, slot_tokens, computed * slot_gates);

  // Switch's load-balancing loss over the batch (mixture_of_experts.h).
  const auto batch_tokens = static_cast<double>(std::max<std::int64_t>(routing_.tokens, 1));
  auto share = torch::tensor(routing_.per_expert).to(torch::kFloat64) / (batch_tokens * K);
  const auto mine =
      static_cast<double>(E) * (share.to(probs.scalar_type()) * probs.sum(0) / batch_tokens).sum();
  const auto whole = static_cast<double>(E) *
                     (share * assignment.probability_sums / batch_tokens).sum().item<double>();
  const double ranks = tokens_ ? tokens_->size() : 1;
  aux_loss_ = mine * ranks + (whole - mine.detach() * ranks);
  if (options_.aux_loss_weight > 0.0 && y.requires_grad())
    return AttachAuxLoss::apply(y, aux_loss_, options_.aux_loss_weight).view(x.sizes());
  return y.view(x.sizes());
}

}  // namespace ddp

namespace ddp {

std::vector<std::pair<std::string, torch::Tensor>> MoeLayerImpl::full_named_parameters() const {
  std::vector<std::pair<std::string, torch::Tensor>> out = {{"router", router.detach().clone()}};
  const std::pair<const char*, const torch::Tensor*> experts[] = {
      {"w1", &w1}, {"b1", &b1}, {"w2", &w2}, {"b2", &b2}};
  for (const auto& [name, local] : experts) {
    auto mine = local->detach().contiguous();
    if (!ep_ || ep_->size() == 1) {
      out.emplace_back(name, mine.clone());
      continue;
    }
    auto sizes = mine.sizes().vec();
    sizes[0] *= ep_->size();
    auto whole = torch::empty(sizes, mine.options());
    all_gather_into_tensor(whole, mine, *ep_);
    out.emplace_back(name, whole);
  }
  return out;
}

}  // namespace ddp
