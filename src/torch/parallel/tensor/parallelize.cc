// parallelize_module over a tree of Sequentials (parallelize.h): match the plan, check it, then
// rebuild the Sequentials with the named Linear and Embedding modules replaced.
#include "ddp/torch/parallel/tensor/parallelize.h"

#include <algorithm>
#include <cstddef>
#include <map>
#include <optional>
#include <set>
#include <sstream>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "ddp/error.h"
#include "ddp/torch/parallel/tensor/gpt_block.h"
#include "torch/parallel/tensor/tensor_parallel_internal.h"

namespace ddp {

namespace {

const char* style_text(ParallelStyle style) {
  switch (style) {
    case ParallelStyle::kColwise:
      return "colwise";
    case ParallelStyle::kRowwise:
      return "rowwise";
    case ParallelStyle::kVocab:
      return "vocab";
  }
  return "unknown";
}

// Modules that act on each element alone: a split activation may pass through them.
bool is_elementwise(const torch::nn::Module& module) {
  static const std::set<std::string> names = {
      "torch::nn::ReLUImpl",     "torch::nn::ReLU6Impl",     "torch::nn::GELUImpl",
      "torch::nn::SiLUImpl",     "torch::nn::MishImpl",      "torch::nn::TanhImpl",
      "torch::nn::SigmoidImpl",  "torch::nn::ELUImpl",       "torch::nn::SELUImpl",
      "torch::nn::CELUImpl",     "torch::nn::LeakyReLUImpl", "torch::nn::SoftplusImpl",
      "torch::nn::HardtanhImpl", "torch::nn::IdentityImpl"};
  return names.contains(module.name());
}

// Whether `key` (a path, a pattern with whole-segment '*', or "type:<name>") names the module at
// `path`.
bool matches(const std::string& key, const std::string& path, const torch::nn::Module& module) {
  constexpr std::string_view kType = "type:";
  if (key.starts_with(kType)) return module.name() == key.substr(kType.size());
  const auto split = [](const std::string& text) {
    std::vector<std::string> parts;
    std::stringstream in(text);
    for (std::string part; std::getline(in, part, '.');)
      parts.push_back(part);
    return parts;
  };
  const auto want = split(key);
  const auto have = split(path);
  if (want.size() != have.size()) return false;
  for (std::size_t i = 0; i < want.size(); ++i) {
    if (want[i] != "*" && want[i] != have[i]) return false;
  }
  return true;
}

struct Match {
  ParallelStyle style;
  std::size_t key;  // index in the plan
};

// The first problem of the plan for this model ("" when none), and the matches by path.
std::string check_plan(const torch::nn::Sequential& model, const ModuleParallelizePlan& plan,
                       std::map<std::string, Match>& matched, std::string& description) {
  const auto modules = model->named_modules("", /*include_self=*/false);
  std::vector<std::size_t> hits(plan.size(), 0);
  std::vector<std::string> paths;
  for (const auto& item : modules) {
    const std::string& path = item.key();
    const auto& module = *item.value();
    paths.push_back(path);
    for (std::size_t k = 0; k < plan.size(); ++k) {
      if (!matches(plan[k].first, path, module)) continue;
      ++hits[k];
      const auto [it, fresh] = matched.emplace(path, Match{plan[k].second, k});
      if (!fresh) {
        return fmt::format(
            "parallelize_module: \"{}\" is matched by the plan's keys \"{}\" and \"{}\"; each "
            "module may be split one way only",
            path, plan[it->second.key].first, plan[k].first);
      }
    }
  }
  for (std::size_t k = 0; k < plan.size(); ++k) {
    if (hits[k] > 0) continue;
    const std::size_t shown = std::min<std::size_t>(paths.size(), 24);
    return fmt::format(
        "parallelize_module: the plan's key \"{}\" matches no module of the model; its modules "
        "are {}{} (keys: a path, a path with '*' for one segment, or \"type:\" and a module type "
        "such as \"type:torch::nn::LinearImpl\")",
        plan[k].first,
        fmt::join(paths.begin(), paths.begin() + static_cast<std::ptrdiff_t>(shown), ", "),
        shown < paths.size() ? fmt::format(" and {} more", paths.size() - shown) : "");
  }
  std::ostringstream text;
  for (const auto& [path, match] : matched) {
    const auto& module = modules[path];
    const bool linear = module->as<torch::nn::LinearImpl>() != nullptr;
    const auto* embedding = module->as<torch::nn::EmbeddingImpl>();
    const bool fits = match.style == ParallelStyle::kVocab ? embedding != nullptr : linear;
    if (!fits) {
      return fmt::format(
          "parallelize_module: \"{}\" is a {}, which {} cannot split ({} takes a "
          "torch::nn::{}; the plan's key \"{}\")",
          path, module->name(), style_text(match.style), style_text(match.style),
          match.style == ParallelStyle::kVocab ? "Embedding" : "Linear", plan[match.key].first);
    }
    if (embedding != nullptr) {
      const auto& o = embedding->options;
      if (o.padding_idx() || o.max_norm() || o.sparse()) {
        return fmt::format(
            "parallelize_module: \"{}\" is an Embedding with padding_idx, max_norm or sparse "
            "gradients, which VocabParallelEmbedding does not have; build it without them",
            path);
      }
    }
    // A child of the Sequential is replaced; a part of a GptBlock child is split by the block.
    if (const auto dot = path.find('.'); dot != std::string::npos) {
      const std::string parent_path = path.substr(0, path.rfind('.'));
      const auto& parent = modules[parent_path];
      if (parent_path.find('.') != std::string::npos || parent->as<GptBlockImpl>() == nullptr) {
        return fmt::format(
            "parallelize_module: \"{}\" is held by \"{}\", a {}, whose fields libtorch cannot "
            "swap; only the Sequential's own children (and a GptBlock child's parts) are "
            "replaced (give {} tensor-parallel layers itself, as GptBlock does, or make the "
            "layer a child of the Sequential)",
            path, parent_path, parent->name(), parent->name());
      }
    }
    text << path << " " << style_text(match.style);
    for (const auto& p : module->parameters(/*recurse=*/false))
      text << " [" << fmt::format("{}", fmt::join(p.sizes(), "x")) << "]";
    text << "\n";
  }
  description = text.str();
  return "";
}

LinearParameters full_linear(const torch::nn::Module& module) {
  const auto* linear = module.as<torch::nn::LinearImpl>();
  return {linear->weight.detach(),
          linear->bias.defined() ? linear->bias.detach() : torch::Tensor()};
}

// The Sequential rebuilt: the matched children replaced, each GptBlock with matched parts split
// by its own parallelize_module (in place), every other child shared.
torch::nn::Sequential rebuild(const torch::nn::Sequential& sequential,
                              const std::map<std::string, Match>& matched,
                              const std::shared_ptr<ProcessGroup>& tp) {
  const auto children = sequential->named_children();
  const auto style_at = [&](std::size_t i) -> std::optional<ParallelStyle> {
    const auto it = matched.find(children[i].key());
    if (it == matched.end()) return std::nullopt;
    return it->second.style;
  };
  // A colwise child's output stays split when only elementwise children lead from it to a
  // rowwise one, which then takes it split.
  std::vector<bool> split_output(children.size(), false), split_input(children.size(), false);
  for (std::size_t i = 0; i < children.size(); ++i) {
    if (style_at(i) != ParallelStyle::kColwise) continue;
    std::size_t j = i + 1;
    while (j < children.size() && !style_at(j) && is_elementwise(*children[j].value()))
      ++j;
    if (j < children.size() && style_at(j) == ParallelStyle::kRowwise) {
      split_output[i] = true;
      split_input[j] = true;
    }
  }
  torch::nn::Sequential out;
  std::size_t i = 0;
  for (auto it = sequential->begin(); it != sequential->end(); ++it, ++i) {
    std::string name = children[i].key();
    const auto& child = children[i].value();
    const auto style = style_at(i);
    if (style == ParallelStyle::kColwise) {
      const auto full = full_linear(*child);
      ColumnParallelLinear layer(ColumnParallelLinearOptions{.in_features = full.weight.size(1),
                                                             .out_features = full.weight.size(0),
                                                             .bias = full.bias.defined(),
                                                             .gather_output = !split_output[i]},
                                 tp, full);
      layer->train(child->is_training());
      out->push_back(std::move(name), layer);
    } else if (style == ParallelStyle::kRowwise) {
      const auto full = full_linear(*child);
      RowParallelLinear layer(RowParallelLinearOptions{.in_features = full.weight.size(1),
                                                       .out_features = full.weight.size(0),
                                                       .bias = full.bias.defined(),
                                                       .input_is_parallel = split_input[i]},
                              tp, full);
      layer->train(child->is_training());
      out->push_back(std::move(name), layer);
    } else if (style == ParallelStyle::kVocab) {
      const auto& weight = child->as<torch::nn::EmbeddingImpl>()->weight;
      VocabParallelEmbedding layer(VocabParallelEmbeddingOptions{.num_embeddings = weight.size(0),
                                                                 .embedding_dim = weight.size(1)},
                                   tp, weight.detach());
      layer->train(child->is_training());
      out->push_back(std::move(name), layer);
    } else {
      if (child->as<GptBlockImpl>() != nullptr) {
        // Its parts the plan names, by their names in the block (GptBlock checks the pairs).
        ParallelizePlan parts;
        for (const auto& [path, match] : matched) {
          if (path.starts_with(name + "."))
            parts.emplace_back(path.substr(name.size() + 1), match.style);
        }
        if (!parts.empty()) {
          GptBlock block(std::dynamic_pointer_cast<GptBlockImpl>(child));
          parallelize_module(block, tp, parts);
        }
      }
      out->push_back(std::move(name), *it);
    }
  }
  out->train(sequential->is_training());
  return out;
}

}  // namespace

torch::nn::Sequential parallelize_module(const torch::nn::Sequential& model,
                                         std::shared_ptr<ProcessGroup> tp,
                                         const ModuleParallelizePlan& plan) {
  auto& group = detail::tp_group_or_throw(tp, "parallelize_module");
  std::map<std::string, Match> matched;
  std::string description, error;
  if (!model) {
    error = "parallelize_module: the model is an empty Sequential holder (nullptr)";
  } else {
    try {
      error = check_plan(model, plan, matched, description);
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  // Every rank learns of any rank's problem, and ranks given different plans or models are named
  // here, before any layer starts a collective the others would not.
  detail::agree_on_layer(group, "parallelize_module", description, error);
  return rebuild(model, matched, tp);
}

}  // namespace ddp
