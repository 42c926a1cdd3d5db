// A restricted pickle reader: Python's pickle (protocols 2 to 5) for plain data, read into a
// tree that the caller interprets. It runs nothing: a global is only a name, checked against the
// caller's allowlist as it is read; REDUCE of an allowed global is recorded as a call for the
// caller to carry out (collections.OrderedDict() alone becomes a dict here, since SETITEMS fill
// it); NEWOBJ of a class the caller allows as an object (PickleOptions::allow_object, none by
// default) is recorded as an object for the caller to interpret, with BUILD's state; the other
// opcodes that build objects of a class (INST, OBJ, NEWOBJ_EX, EXT*) are refused.
//
// It holds as a server must against hostile bytes:
//   - linear time and memory in the pickle's length: every opcode adds at most one node, and a
//     value used twice (DUP, the memo's GET) is the same node, never a copy (as Python shares it);
//     the memo is a map, so an index costs what the file holds, not its value;
//   - check_shape bounds what a reader of the tree may then walk: a depth limit, no container
//     that holds itself, and a limit on the values the tree unfolds to when shared nodes are
//     counted once per use (a DAG of 26 DUPs unfolds to 2^26).
//
// Not thread-safe while reading; the tree is a plain value afterwards.
#pragma once

#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

#include "archive/archive_error.h"

namespace ddp::archive {

using NodeId = std::uint32_t;
inline constexpr NodeId kNoNode = std::numeric_limits<NodeId>::max();

struct PickleNode {
  enum class Kind : std::uint8_t {
    kNone,
    kBool,
    kInt,
    kFloat,
    kString,        // text: strings[text]
    kBytes,         // bytes: strings[text]
    kTuple,         // items
    kList,          // items
    kDict,          // items: key, value, key, value, ...
    kGlobal,        // strings[text]: "module.name", an allowed name
    kCall,          // items: {the global, the argument tuple} (REDUCE)
    kPersistentId,  // items: {the pid} (BINPERSID)
    kObject,        // items: {the class, a global; the argument tuple} (NEWOBJ); state: BUILD's
  };
  Kind kind = Kind::kNone;
  bool boolean = false;
  std::int64_t integer = 0;
  double floating = 0;
  std::uint32_t text = 0;
  NodeId state = kNoNode;  // BUILD's argument, kept uninterpreted
  std::vector<NodeId> items;
  // As the node was built (a container filled later raises its own, not its holders'): how deep
  // it nests and how many values it unfolds to.
  std::uint32_t depth = 1;
  std::uint64_t unfolded = 1;
};

// What a pickle may build: nesting deeper than max_depth, or values that unfold (a shared value
// counted once per use) to more than max(max_unfolded, 4 x the nodes read), are refused.
struct PickleLimits {
  std::size_t max_depth = 256;
  std::uint64_t max_unfolded = std::uint64_t{1} << 24;
};

class PickleTree {
 public:
  NodeId root() const { return root_; }
  const PickleNode& node(NodeId id) const { return nodes_[id]; }
  const std::string& text(const PickleNode& n) const { return strings_[n.text]; }
  std::size_t size() const { return nodes_.size(); }

  // Throws FormatError (kTooLarge, kDamaged) where the value under root (a node's items and its
  // BUILD state) is deeper than
  // max_depth, holds itself, or unfolds to more than max(max_unfolded, 4 x size()) values: the
  // exact check, which read_pickle's running one (as each node is built) cannot be once a
  // container is filled after something holds it. Iterative: safe on any tree the reader built.
  void check_shape(const PickleLimits& limits) const;

 private:
  friend class PickleParser;
  std::vector<PickleNode> nodes_;
  std::vector<std::string> strings_;
  NodeId root_ = kNoNode;
};

struct PickleOptions {
  // Whether a global ("collections.OrderedDict", "torch._utils._rebuild_tensor_v2") may be
  // named; anything else is a FormatError of kind kUnsafe that carries its name.
  std::function<bool(std::string_view)> allow_global;
  // Of the allowed globals, the classes NEWOBJ may build an object of (a dataclass pickled by
  // Python's default protocol: NEWOBJ with no arguments, then BUILD with its fields). Unset:
  // NEWOBJ is refused (kUnsafe), as for every reader of state dicts.
  std::function<bool(std::string_view)> allow_object;
  PickleLimits limits;
};

// Parses `pickle` up to its STOP. FormatError: kDamaged (truncated, malformed, a stack that does
// not end with one value), kUnsupported (an opcode outside the plain-data set), kUnsafe.
PickleTree read_pickle(std::string_view pickle, const PickleOptions& options);

}  // namespace ddp::archive
