// What ddp's torch layer does with a pickle of a state dict, without torch, for the fuzz
// harnesses of the archive layer: read it through the allowlist, bound its shape, then visit
// every node a converter would (each once, recursively: the depth is bounded by check_shape) and
// hand each persistent id's storage to `load(key, bytes)`. Aborts where the tree breaks a
// promise of pickle_reader.h (a node id out of range, a malformed call), which a correct reader
// never does whatever its input.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "archive/pickle_reader.h"

namespace ddp::fuzz {

inline bool torch_global(std::string_view name) {
  return name == "collections.OrderedDict" || name.starts_with("torch._utils._rebuild_") ||
         (name.starts_with("torch.") && name.ends_with("Storage"));
}

[[noreturn]] inline void broken(const char* what) {
  std::fprintf(stderr, "pytorch_archive_walk: %s\n", what);
  std::abort();
}

// Visits the tree under the root; `load(key, bytes)` for every well-formed storage id.
inline void walk_pickle(const archive::PickleTree& tree,
                        const std::function<void(const std::string&, std::uint64_t)>& load) {
  using Kind = archive::PickleNode::Kind;
  std::vector<bool> seen(tree.size(), false);
  std::function<void(archive::NodeId, std::size_t)> visit = [&](archive::NodeId id,
                                                                std::size_t depth) {
    if (id >= tree.size()) broken("a node id out of range");
    if (depth > 256) broken("deeper than check_shape allows");
    if (seen[id]) return;
    seen[id] = true;
    const auto& n = tree.node(id);
    switch (n.kind) {
      case Kind::kString:
      case Kind::kBytes:
      case Kind::kGlobal:
        (void)tree.text(n);
        break;
      case Kind::kDict:
        if (n.items.size() % 2 != 0) broken("a dict of an odd number of items");
        break;
      case Kind::kCall:
        if (n.items.size() != 2 || tree.node(n.items[0]).kind != Kind::kGlobal ||
            tree.node(n.items[1]).kind != Kind::kTuple) {
          broken("a call that is not {global, tuple}");
        }
        if (!torch_global(tree.text(tree.node(n.items[0])))) broken("a call of a refused global");
        break;
      case Kind::kPersistentId: {
        if (n.items.size() != 1) broken("a persistent id of other than one item");
        const auto& pid = tree.node(n.items[0]);
        if (pid.kind == Kind::kTuple && pid.items.size() >= 5 &&
            tree.node(pid.items[2]).kind == Kind::kString &&
            tree.node(pid.items[4]).kind == Kind::kInt && tree.node(pid.items[4]).integer >= 0) {
          load(tree.text(tree.node(pid.items[2])),
               static_cast<std::uint64_t>(tree.node(pid.items[4]).integer));
        }
        break;
      }
      default:
        break;
    }
    for (const auto item : n.items)
      visit(item, depth + 1);
  };
  visit(tree.root(), 1);
}

}  // namespace ddp::fuzz
