// Optimizer state in Python's optimizer.state_dict() layout (optimizer_state_dict.h): libtorch's
// SGD, Adam and AdamW mapped to and from {"state": {index: ...}, "param_groups": [...]}.
#include "ddp/torch/formats/optimizer_state_dict.h"

#include <map>
#include <optional>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "torch/core/libtorch_compat.h"
#include "torch/formats/optimizer_state_value.h"
#include "torch/formats/optimizer_values.h"
#include "torch/formats/pytorch_archive.h"

namespace ddp {
namespace {

using c10::IValue;
using GenericDict = c10::impl::GenericDict;
using GenericList = c10::impl::GenericList;

enum class OptimizerKind { kSgd, kAdam, kAdamW };

const char* kind_name(OptimizerKind kind) {
  switch (kind) {
    case OptimizerKind::kSgd:
      return "SGD";
    case OptimizerKind::kAdam:
      return "Adam";
    case OptimizerKind::kAdamW:
      return "AdamW";
  }
  return "?";
}

OptimizerKind kind_of(const torch::optim::Optimizer& optimizer) {
  if (dynamic_cast<const torch::optim::SGD*>(&optimizer)) return OptimizerKind::kSgd;
  if (dynamic_cast<const torch::optim::AdamW*>(&optimizer)) return OptimizerKind::kAdamW;
  if (dynamic_cast<const torch::optim::Adam*>(&optimizer)) return OptimizerKind::kAdam;
  throw ConfigError(
      "optimizer state dict: only torch::optim SGD, Adam and AdamW map to Python's layout");
}

GenericDict any_dict() {
  return GenericDict(c10::AnyType::get(), c10::AnyType::get());
}

// The hyper-parameters of one group as Python's optimizer writes them (without "params"), with
// Python's flags at the values libtorch's optimizers implement.
GenericDict group_options(OptimizerKind kind, const torch::optim::OptimizerOptions& options) {
  GenericDict g = any_dict();
  if (kind == OptimizerKind::kSgd) {
    const auto& o = static_cast<const torch::optim::SGDOptions&>(options);
    g.insert("lr", o.lr());
    g.insert("momentum", o.momentum());
    g.insert("dampening", o.dampening());
    g.insert("weight_decay", o.weight_decay());
    g.insert("nesterov", o.nesterov());
    g.insert("maximize", false);
    g.insert("foreach", IValue());
    g.insert("differentiable", false);
    g.insert("fused", IValue());
    return g;
  }
  auto adam_like = [&](const auto& o) {
    g.insert("lr", o.lr());
    g.insert("betas", c10::ivalue::Tuple::create(std::get<0>(o.betas()), std::get<1>(o.betas())));
    g.insert("eps", o.eps());
    g.insert("weight_decay", o.weight_decay());
    g.insert("amsgrad", o.amsgrad());
  };
  if (kind == OptimizerKind::kAdam) {
    adam_like(static_cast<const torch::optim::AdamOptions&>(options));
  } else {
    adam_like(static_cast<const torch::optim::AdamWOptions&>(options));
  }
  g.insert("maximize", false);
  g.insert("foreach", IValue());
  g.insert("capturable", false);
  g.insert("differentiable", false);
  g.insert("fused", IValue());
  // PyTorch 2.x (2.6 and later) tells Adam from AdamW by this flag.
  g.insert("decoupled_weight_decay", kind == OptimizerKind::kAdamW);
  return g;
}

// One parameter's state; nullopt for a state of no known type.
std::optional<GenericDict> param_state(const torch::optim::OptimizerParamState& state) {
  GenericDict s = any_dict();
  if (const auto* sgd = dynamic_cast<const torch::optim::SGDParamState*>(&state)) {
    s.insert("momentum_buffer", sgd->momentum_buffer());
    return s;
  }
  auto adam_like = [&](const auto& a) {
    // A 0-dim float tensor, what PyTorch 1.13 and 2.x keep (1.13 also converts numbers).
    s.insert("step", torch::tensor(static_cast<double>(a.step()), torch::kFloat32));
    s.insert("exp_avg", a.exp_avg());
    s.insert("exp_avg_sq", a.exp_avg_sq());
    if (a.max_exp_avg_sq().defined()) s.insert("max_exp_avg_sq", a.max_exp_avg_sq());
  };
  if (const auto* adam = dynamic_cast<const torch::optim::AdamParamState*>(&state)) {
    adam_like(*adam);
  } else if (const auto* adamw = dynamic_cast<const torch::optim::AdamWParamState*>(&state)) {
    adam_like(*adamw);
  } else {
    return std::nullopt;
  }
  return s;
}

// --- reading ---

[[noreturn]] void format_error(const std::string& source, const std::string& what) {
  throw StateDictFormatError(
      fmt::format("{}: not an optimizer state dict ddp can read: {}", source, what));
}

// By value (a reference count): GCC 13 warns that a reference returned by a call given a temporary
// string may dangle (-Wdangling-reference), though it points into `d`.
IValue field(const GenericDict& d, const char* key, const std::string& source,
             const std::string& where) {
  const auto it = d.find(key);
  if (it == d.end()) format_error(source, fmt::format("{} has no '{}'", where, key));
  return it->value();
}

double number(const IValue& v, const std::string& source, const std::string& what) {
  if (v.isDouble()) return v.toDouble();
  if (v.isInt()) return static_cast<double>(v.toInt());
  if (v.isTensor() && v.toTensor().numel() == 1) return v.toTensor().item<double>();
  format_error(source, fmt::format("{} is a {}, expected a number", what, v.tagKind()));
}

bool flag(const GenericDict& d, const char* key, bool otherwise) {
  const auto it = d.find(key);
  if (it == d.end() || !it->value().isBool()) return otherwise;
  return it->value().toBool();
}

// The optimizer a file's groups describe: "momentum" is SGD's, "betas" Adam's and AdamW's, which
// only PyTorch 2.x's decoupled_weight_decay tells apart.
std::string stored_kind(const GenericDict& group, OptimizerKind wanted, bool* fits) {
  if (group.contains("momentum") && !group.contains("betas")) {
    *fits = wanted == OptimizerKind::kSgd;
    return flag(group, "maximize", false) ? "SGD with maximize=True" : "SGD";
  }
  if (group.contains("betas")) {
    std::string name = "Adam or AdamW";
    bool match = wanted != OptimizerKind::kSgd;
    if (const auto it = group.find("decoupled_weight_decay");
        it != group.end() && it->value().isBool()) {
      const bool adamw = it->value().toBool();
      name = adamw ? "AdamW" : "Adam";
      match = wanted == (adamw ? OptimizerKind::kAdamW : OptimizerKind::kAdam);
    }
    if (flag(group, "maximize", false)) {
      name += " with maximize=True";
      match = false;
    }
    *fits = match;
    return name;
  }
  *fits = false;
  return "an optimizer with neither momentum nor betas";
}

struct GroupUpdate {
  double lr = 0, momentum = 0, dampening = 0, weight_decay = 0, eps = 0, beta1 = 0, beta2 = 0;
  bool nesterov = false, amsgrad = false;
};

torch::Tensor state_tensor(const GenericDict& s, const char* key, const torch::Tensor& param,
                           std::int64_t index, const std::string& source) {
  const IValue& v = field(s, key, source, fmt::format("state[{}]", index));
  if (!v.isTensor()) {
    format_error(
        source, fmt::format("state[{}]['{}'] is a {}, expected a tensor", index, key, v.tagKind()));
  }
  const auto& t = v.toTensor();
  if (t.sizes() != param.sizes() || t.scalar_type() != param.scalar_type()) {
    StateDictLoadReport report;
    report.mismatched.push_back(
        fmt::format("state[{}]['{}']: [{}] {} in the file, parameter {} is [{}] {}", index, key,
                    fmt::join(t.sizes(), ", "), c10::toString(t.scalar_type()), index,
                    fmt::join(param.sizes(), ", "), c10::toString(param.scalar_type())));
    // The message first: an argument list that formats the report and moves it is unordered.
    std::string message = fmt::format(
        "load_optimizer_state_dict: {} does not fit the optimizer: {}; nothing was "
        "loaded",
        source, report.mismatched.front());
    throw StateDictMismatchError(message, std::move(report));
  }
  return t.to(param.device()).clone();
}

}  // namespace

namespace detail {

c10::IValue optimizer_state_value(const torch::optim::Optimizer& optimizer) {
  const OptimizerKind kind = kind_of(optimizer);
  GenericDict state = any_dict();
  GenericList groups(c10::AnyType::get());
  std::int64_t index = 0;
  for (const auto& group : optimizer.param_groups()) {
    GenericDict g = group_options(kind, group.options());
    GenericList params(c10::AnyType::get());
    for (const auto& p : group.params()) {
      params.push_back(index);
      const auto it = optimizer.state().find(libtorch_compat::optimizer_state_key(p));
      if (it != optimizer.state().end()) {
        auto s = param_state(*it->second);
        if (!s) throw ConfigError("optimizer state dict: a parameter state of an unknown type");
        state.insert(index, *s);
      }
      ++index;
    }
    g.insert("params", params);
    groups.push_back(g);
  }
  GenericDict top = any_dict();
  top.insert("state", state);
  top.insert("param_groups", groups);
  return top;
}

void load_optimizer_state_value(torch::optim::Optimizer& optimizer, const c10::IValue& file,
                                const std::string& source) {
  const OptimizerKind kind = kind_of(optimizer);
  if (!file.isGenericDict()) {
    format_error(source, fmt::format("the file holds a {}, expected a dict", file.tagKind()));
  }
  const GenericDict top = file.toGenericDict();
  const IValue& state_value = field(top, "state", source, "the file");
  const IValue& groups_value = field(top, "param_groups", source, "the file");
  if (!state_value.isGenericDict() || !groups_value.isList()) {
    format_error(source, "'state' is not a dict or 'param_groups' not a list");
  }
  const auto file_groups = groups_value.toList();
  auto& groups = optimizer.param_groups();
  auto count_of = [](const auto& sizes) {
    return fmt::format("{} parameter group(s) of {} parameter(s)", sizes.size(),
                       fmt::join(sizes, ", "));
  };
  const detail::ValueError value_error = [&](const std::string& what) {
    throw StateDictFormatError(fmt::format(
        "load_optimizer_state_dict: {}: {}; nothing was loaded (a damaged or hand-edited file?)",
        source, what));
  };
  std::vector<std::size_t> file_sizes, our_sizes;
  for (const auto& g : groups)
    our_sizes.push_back(g.params().size());

  // Validate everything into `updates` and `states` first; the optimizer changes at the end.
  std::vector<GroupUpdate> updates;
  std::map<std::int64_t, std::pair<std::size_t, torch::Tensor>> params_by_index;  // group, param
  std::vector<GenericDict> file_group_dicts;
  for (std::size_t i = 0; i < file_groups.size(); ++i) {
    const IValue g = file_groups.get(i);
    if (!g.isGenericDict()) format_error(source, fmt::format("param_groups[{}] is not a dict", i));
    file_group_dicts.push_back(g.toGenericDict());
    const IValue& params =
        field(file_group_dicts.back(), "params", source, fmt::format("param_groups[{}]", i));
    if (!params.isList()) format_error(source, fmt::format("param_groups[{}]['params']", i));
    file_sizes.push_back(params.toListRef().size());
  }
  for (std::size_t i = 0; i < file_group_dicts.size(); ++i) {
    bool fits = false;
    const std::string stored = stored_kind(file_group_dicts[i], kind, &fits);
    if (!fits) {
      throw OptimizerMismatchError(
          fmt::format("load_optimizer_state_dict: {} holds the state of {}, the optimizer is {}",
                      source, stored, kind_name(kind)),
          stored, kind_name(kind));
    }
  }
  if (file_sizes != our_sizes) {
    throw OptimizerMismatchError(
        fmt::format("load_optimizer_state_dict: {} holds the state of {} {}, the optimizer has {}",
                    source, kind_name(kind), count_of(file_sizes), count_of(our_sizes)),
        count_of(file_sizes), count_of(our_sizes));
  }
  for (std::size_t i = 0; i < file_group_dicts.size(); ++i) {
    const auto& g = file_group_dicts[i];
    const std::string where = fmt::format("param_groups[{}]", i);
    auto num = [&](const char* key) {
      return number(field(g, key, source, where), source, fmt::format("{}['{}']", where, key));
    };
    // Each value as the training loop will use it: a NaN or negative learning rate loads into
    // libtorch without complaint and trains to `loss -nan`.
    auto checked = [&](const char* key, detail::ValueRange range) {
      const double value = num(key);
      detail::check_value(value, range, fmt::format("{}['{}']", where, key), value_error);
      return value;
    };
    GroupUpdate u;
    u.lr = checked("lr", detail::ValueRange::kNonNegative);
    u.weight_decay = checked("weight_decay", detail::ValueRange::kNonNegative);
    if (kind == OptimizerKind::kSgd) {
      u.momentum = checked("momentum", detail::ValueRange::kNonNegative);
      u.dampening = checked("dampening", detail::ValueRange::kFinite);
      u.nesterov = flag(g, "nesterov", false);
    } else {
      const IValue& betas = field(g, "betas", source, where);
      std::vector<IValue> pair;
      if (betas.isTuple()) pair = betas.toTupleRef().elements().vec();
      if (betas.isList()) pair = betas.toListRef().vec();
      if (pair.size() != 2) format_error(source, where + "['betas'] is not a pair");
      u.beta1 = number(pair[0], source, where + "['betas']");
      u.beta2 = number(pair[1], source, where + "['betas']");
      detail::check_value(u.beta1, detail::ValueRange::kUnitInterval, where + "['betas'][0]",
                          value_error);
      detail::check_value(u.beta2, detail::ValueRange::kUnitInterval, where + "['betas'][1]",
                          value_error);
      u.eps = checked("eps", detail::ValueRange::kNonNegative);
      u.amsgrad = flag(g, "amsgrad", false);
    }
    updates.push_back(u);
    const auto indices = g.at("params").toListRef();
    for (std::size_t j = 0; j < indices.size(); ++j) {
      if (!indices[j].isInt()) format_error(source, where + "['params'] holds a non-integer");
      params_by_index[indices[j].toInt()] = {i, groups[i].params()[j]};
    }
  }

  std::vector<std::pair<torch::Tensor, std::unique_ptr<torch::optim::OptimizerParamState>>> states;
  for (const auto& entry : state_value.toGenericDict()) {
    if (!entry.key().isInt()) format_error(source, "a 'state' key is not a parameter index");
    const std::int64_t index = entry.key().toInt();
    const auto found = params_by_index.find(index);
    if (found == params_by_index.end()) {
      format_error(source, fmt::format("state[{}] is for a parameter no group lists", index));
    }
    const auto& [group_index, param] = found->second;
    if (!entry.value().isGenericDict()) {
      format_error(source, fmt::format("state[{}] is not a dict", index));
    }
    const GenericDict s = entry.value().toGenericDict();
    if (kind == OptimizerKind::kSgd) {
      const auto it = s.find("momentum_buffer");
      if (it == s.end() || it->value().isNone()) continue;  // 1.13 writes None without momentum
      auto st = std::make_unique<torch::optim::SGDParamState>();
      st->momentum_buffer(state_tensor(s, "momentum_buffer", param, index, source));
      states.emplace_back(param, std::move(st));
      continue;
    }
    auto fill = [&](auto& st) {
      const double step = number(field(s, "step", source, fmt::format("state[{}]", index)), source,
                                 fmt::format("state[{}]['step']", index));
      st->step(detail::checked_step(step, fmt::format("state[{}]['step']", index), value_error));
      st->exp_avg(state_tensor(s, "exp_avg", param, index, source));
      st->exp_avg_sq(state_tensor(s, "exp_avg_sq", param, index, source));
      if (updates[group_index].amsgrad) {
        st->max_exp_avg_sq(state_tensor(s, "max_exp_avg_sq", param, index, source));
      }
    };
    if (kind == OptimizerKind::kAdam) {
      auto st = std::make_unique<torch::optim::AdamParamState>();
      fill(st);
      states.emplace_back(param, std::move(st));
    } else {
      auto st = std::make_unique<torch::optim::AdamWParamState>();
      fill(st);
      states.emplace_back(param, std::move(st));
    }
  }

  // Everything is valid: replace the options and the state, as Python's load_state_dict does.
  for (std::size_t i = 0; i < groups.size(); ++i) {
    const auto& u = updates[i];
    auto& options = groups[i].options();
    if (kind == OptimizerKind::kSgd) {
      auto& o = static_cast<torch::optim::SGDOptions&>(options);
      o.lr(u.lr)
          .momentum(u.momentum)
          .dampening(u.dampening)
          .weight_decay(u.weight_decay)
          .nesterov(u.nesterov);
    } else if (kind == OptimizerKind::kAdam) {
      auto& o = static_cast<torch::optim::AdamOptions&>(options);
      o.lr(u.lr)
          .betas({u.beta1, u.beta2})
          .eps(u.eps)
          .weight_decay(u.weight_decay)
          .amsgrad(u.amsgrad);
    } else {
      auto& o = static_cast<torch::optim::AdamWOptions&>(options);
      o.lr(u.lr)
          .betas({u.beta1, u.beta2})
          .eps(u.eps)
          .weight_decay(u.weight_decay)
          .amsgrad(u.amsgrad);
    }
    for (const auto& p : groups[i].params()) {
      optimizer.state().erase(libtorch_compat::optimizer_state_key(p));
    }
  }
  for (auto& [param, st] : states) {
    optimizer.state()[libtorch_compat::optimizer_state_key(param)] = std::move(st);
  }
}

}  // namespace detail

void save_optimizer_state_dict(const torch::optim::Optimizer& optimizer,
                               const std::filesystem::path& path) {
  detail::write_pytorch_archive(path, detail::optimizer_state_value(optimizer),
                                /*ordered_dict_at_top=*/false);
}

void load_optimizer_state_dict(torch::optim::Optimizer& optimizer,
                               const std::filesystem::path& path) {
  detail::load_optimizer_state_value(optimizer, detail::read_pytorch_archive(path), path.string());
}

}  // namespace ddp
