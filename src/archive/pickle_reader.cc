// The restricted pickle reader (pickle_reader.h). Opcodes as Python's Lib/pickle.py and
// pickletools.py define them. The stack holds node ids (and MARKs), so DUP, GET and the
// tuple-building opcodes move ids, never values; MARK positions are kept on a stack of their
// own, so finding the topmost one is O(1).
#include "archive/pickle_reader.h"

#include <algorithm>
#include <bit>
#include <unordered_map>

#include <fmt/format.h>

namespace ddp::archive {

class PickleParser {
 public:
  PickleParser(std::string_view data, const PickleOptions& options)
      : data_(data), options_(options) {}

  PickleTree run() {
    for (;;) {
      const std::size_t at = pos_;
      const auto op = static_cast<unsigned char>(read(1)[0]);
      if (op == '.') break;  // STOP
      step(op, at);
    }
    if (!marks_.empty() || stack_.size() != 1) {
      damaged("the pickle ends with {} values on its stack{}, not 1", stack_.size(),
              marks_.empty() ? "" : " and an open MARK");
    }
    tree_.root_ = stack_.back();
    return std::move(tree_);
  }

 private:
  using Kind = PickleNode::Kind;

  template <class... Args>
  [[noreturn]] void damaged(fmt::format_string<Args...> format, Args&&... args) const {
    throw FormatError(FormatError::Kind::kDamaged,
                      fmt::format(format, std::forward<Args>(args)...));
  }

  std::string_view read(std::size_t n) {
    if (n > data_.size() - pos_) damaged("the pickle is truncated at byte {}", pos_);
    auto bytes = data_.substr(pos_, n);
    pos_ += n;
    return bytes;
  }
  std::uint64_t read_le(std::size_t bytes) {
    const auto b = read(bytes);
    std::uint64_t v = 0;
    for (std::size_t i = 0; i < bytes; ++i)
      v |= std::uint64_t{static_cast<unsigned char>(b[i])} << (8 * i);
    return v;
  }
  std::string_view read_line() {
    const auto end = data_.find('\n', pos_);
    if (end == std::string_view::npos) damaged("the pickle is truncated at byte {}", pos_);
    auto line = data_.substr(pos_, end - pos_);
    pos_ = end + 1;
    return line;
  }
  std::string_view read_sized(std::size_t length_bytes) {
    const std::uint64_t n = read_le(length_bytes);
    if (n > data_.size() - pos_) damaged("the pickle is truncated at byte {}", pos_);
    return read(static_cast<std::size_t>(n));
  }

  NodeId add(PickleNode node) {
    tree_.nodes_.push_back(std::move(node));
    return static_cast<NodeId>(tree_.nodes_.size() - 1);
  }
  NodeId add_text(Kind kind, std::string_view text) {
    tree_.strings_.emplace_back(text);
    PickleNode n;
    n.kind = kind;
    n.text = static_cast<std::uint32_t>(tree_.strings_.size() - 1);
    return add(std::move(n));
  }
  NodeId add_container(Kind kind, std::vector<NodeId> items = {}) {
    PickleNode n;
    n.kind = kind;
    n.items = std::move(items);
    for (const NodeId item : n.items)
      grow(n, node(item));
    return add(std::move(n));
  }
  // `child` is now inside `parent`: the running depth and unfolded-size checks.
  void grow(PickleNode& parent, const PickleNode& child) {
    const auto& limits = options_.limits;
    parent.depth = std::max(parent.depth, child.depth + 1);
    parent.unfolded = std::min(parent.unfolded + child.unfolded, std::uint64_t{1} << 62);
    if (parent.depth > limits.max_depth) {
      throw FormatError(FormatError::Kind::kTooLarge,
                        fmt::format("the pickle nests values deeper than {} levels (at byte {})",
                                    limits.max_depth, pos_));
    }
    const std::uint64_t max_unfolded =
        std::max<std::uint64_t>(limits.max_unfolded, 4 * std::uint64_t{tree_.nodes_.size()});
    if (parent.unfolded > max_unfolded) {
      throw FormatError(FormatError::Kind::kTooLarge,
                        fmt::format("the pickle shares values so that they unfold to more than "
                                    "{} values (at byte {}, from {} in the file so far)",
                                    max_unfolded, pos_, tree_.nodes_.size()));
    }
  }
  void fill(NodeId container, const std::vector<NodeId>& items) {
    for (const NodeId item : items) {
      node(container).items.push_back(item);
      grow(node(container), node(item));
    }
  }
  PickleNode& node(NodeId id) { return tree_.nodes_[id]; }

  void push(NodeId id) { stack_.push_back(id); }
  // The stack above the topmost MARK, which nothing may pop through.
  std::size_t floor() const { return marks_.empty() ? 0 : marks_.back(); }
  NodeId pop() {
    if (stack_.size() <= floor()) damaged("the pickle pops an empty stack at byte {}", pos_);
    const NodeId id = stack_.back();
    stack_.pop_back();
    return id;
  }
  NodeId top() const {
    if (stack_.size() <= floor()) damaged("the pickle reads an empty stack at byte {}", pos_);
    return stack_.back();
  }
  // The items above the topmost MARK, which is removed.
  std::vector<NodeId> pop_to_mark() {
    if (marks_.empty()) damaged("the pickle has no MARK for the opcode at byte {}", pos_);
    const std::size_t mark = marks_.back();
    marks_.pop_back();
    std::vector<NodeId> items(stack_.begin() + static_cast<std::ptrdiff_t>(mark), stack_.end());
    stack_.resize(mark);
    return items;
  }

  NodeId container_on_top(Kind kind, const char* opcode) {
    const NodeId id = top();
    if (node(id).kind != kind)
      damaged("{} on a value that is not a {} at byte {}", opcode,
              kind == Kind::kList ? "list" : "dict", pos_);
    return id;
  }

  void global(std::string_view module, std::string_view name) {
    const std::string full = fmt::format("{}.{}", module, name);
    if (!options_.allow_global || !options_.allow_global(full)) {
      throw FormatError(FormatError::Kind::kUnsafe, fmt::format("the global '{}'", full), full);
    }
    push(add_text(Kind::kGlobal, full));
  }

  void reduce() {
    const NodeId args = pop();
    const NodeId callable = pop();
    if (node(callable).kind != Kind::kGlobal || node(args).kind != Kind::kTuple) {
      damaged("REDUCE of something other than an allowed global at byte {}", pos_);
    }
    // The one callable whose result later opcodes fill: an empty dict, as Python's is one.
    if (tree_.strings_[node(callable).text] == "collections.OrderedDict") {
      if (!node(args).items.empty()) damaged("OrderedDict built with arguments at byte {}", pos_);
      push(add_container(Kind::kDict));
      return;
    }
    push(add_container(Kind::kCall, {callable, args}));
  }

  void new_object(std::size_t at) {
    const NodeId args = pop();
    const NodeId cls = pop();
    if (node(cls).kind != Kind::kGlobal || node(args).kind != Kind::kTuple) {
      damaged("NEWOBJ of something other than a global and a tuple at byte {}", at);
    }
    const std::string& name = tree_.strings_[node(cls).text];
    if (!options_.allow_object || !options_.allow_object(name)) {
      // An opcode's refusal, not a global's: the class was allowed as a name.
      throw FormatError(FormatError::Kind::kUnsafe,
                        fmt::format("the pickle opcode 0x81 (NEWOBJ) at byte {}: it builds an "
                                    "object of the class '{}'",
                                    at, name));
    }
    push(add_container(Kind::kObject, {cls, args}));
  }

  void push_long(std::string_view bytes) {  // little-endian two's complement
    if (bytes.size() > 8) damaged("an integer of {} bytes at byte {}", bytes.size(), pos_);
    std::uint64_t v = 0;
    for (std::size_t i = 0; i < bytes.size(); ++i)
      v |= std::uint64_t{static_cast<unsigned char>(bytes[i])} << (8 * i);
    if (!bytes.empty() && bytes.size() < 8 && (static_cast<unsigned char>(bytes.back()) & 0x80)) {
      v |= ~std::uint64_t{0} << (8 * bytes.size());
    }
    push_int(static_cast<std::int64_t>(v));
  }
  void push_int(std::int64_t v) {
    PickleNode n;
    n.kind = Kind::kInt;
    n.integer = v;
    push(add(std::move(n)));
  }
  void push_bool(bool v) {
    PickleNode n;
    n.kind = Kind::kBool;
    n.boolean = v;
    push(add(std::move(n)));
  }

  void memo_put(std::uint64_t index) { memo_[index] = top(); }
  void memo_get(std::uint64_t index) {
    const auto it = memo_.find(index);
    if (it == memo_.end()) damaged("a memo entry {} that was never set, at byte {}", index, pos_);
    push(it->second);
  }

  void set_items(NodeId dict, const std::vector<NodeId>& items) {
    if (items.size() % 2) damaged("SETITEMS with an odd number of items at byte {}", pos_);
    fill(dict, items);
  }

  void step(unsigned char op, std::size_t at) {
    switch (op) {
      case 0x80:  // PROTO
        if (read_le(1) > 5) damaged("pickle protocol above 5 at byte {}", at);
        break;
      case 0x95:  // FRAME: a length hint only
        read(8);
        break;
      case '(':
        marks_.push_back(stack_.size());
        break;
      case '0':
        pop();
        break;
      case '1':
        pop_to_mark();
        break;
      case '2':
        push(top());
        break;
      case 'N':
        push(add(PickleNode{}));
        break;
      case 0x88:
        push_bool(true);
        break;
      case 0x89:
        push_bool(false);
        break;
      case 'J':
        push_int(static_cast<std::int32_t>(read_le(4)));
        break;
      case 'K':
        push_int(static_cast<std::int64_t>(read_le(1)));
        break;
      case 'M':
        push_int(static_cast<std::int64_t>(read_le(2)));
        break;
      case 0x8a:  // LONG1
        push_long(read(static_cast<std::size_t>(read_le(1))));
        break;
      case 0x8b:  // LONG4
        push_long(read_sized(4));
        break;
      case 'G': {  // BINFLOAT, big-endian
        const auto bytes = read(8);
        std::uint64_t bits = 0;
        for (const char byte : bytes)
          bits = (bits << 8) | static_cast<unsigned char>(byte);
        PickleNode n;
        n.kind = Kind::kFloat;
        n.floating = std::bit_cast<double>(bits);
        push(add(std::move(n)));
        break;
      }
      case 'X':  // BINUNICODE
      case 'T':  // BINSTRING
        push(add_text(Kind::kString, read_sized(4)));
        break;
      case 0x8c:  // SHORT_BINUNICODE
      case 'U':   // SHORT_BINSTRING
        push(add_text(Kind::kString, read_sized(1)));
        break;
      case 0x8d:  // BINUNICODE8
        push(add_text(Kind::kString, read_sized(8)));
        break;
      case 'C':  // SHORT_BINBYTES
        push(add_text(Kind::kBytes, read_sized(1)));
        break;
      case 'B':  // BINBYTES
        push(add_text(Kind::kBytes, read_sized(4)));
        break;
      case 0x8e:  // BINBYTES8
        push(add_text(Kind::kBytes, read_sized(8)));
        break;
      case ')':
        push(add_container(Kind::kTuple));
        break;
      case 0x85: {
        const NodeId a = pop();
        push(add_container(Kind::kTuple, {a}));
        break;
      }
      case 0x86: {
        const NodeId b = pop(), a = pop();
        push(add_container(Kind::kTuple, {a, b}));
        break;
      }
      case 0x87: {
        const NodeId c = pop(), b = pop(), a = pop();
        push(add_container(Kind::kTuple, {a, b, c}));
        break;
      }
      case 't':
        push(add_container(Kind::kTuple, pop_to_mark()));
        break;
      case ']':
        push(add_container(Kind::kList));
        break;
      case 'l':
        push(add_container(Kind::kList, pop_to_mark()));
        break;
      case 'a': {
        const NodeId v = pop();
        fill(container_on_top(Kind::kList, "APPEND"), {v});
        break;
      }
      case 'e': {
        auto items = pop_to_mark();
        fill(container_on_top(Kind::kList, "APPENDS"), items);
        break;
      }
      case '}':
        push(add_container(Kind::kDict));
        break;
      case 'd': {
        auto items = pop_to_mark();
        if (items.size() % 2) damaged("DICT with an odd number of items at byte {}", at);
        push(add_container(Kind::kDict, std::move(items)));
        break;
      }
      case 's': {
        const NodeId v = pop(), k = pop();
        fill(container_on_top(Kind::kDict, "SETITEM"), {k, v});
        break;
      }
      case 'u': {
        auto items = pop_to_mark();
        set_items(container_on_top(Kind::kDict, "SETITEMS"), items);
        break;
      }
      case 'q':  // BINPUT
        memo_put(read_le(1));
        break;
      case 'r':  // LONG_BINPUT
        memo_put(read_le(4));
        break;
      case 0x94:  // MEMOIZE: the next index, as Python's len(memo)
        memo_put(memo_.size());
        break;
      case 'h':  // BINGET
        memo_get(read_le(1));
        break;
      case 'j':  // LONG_BINGET
        memo_get(read_le(4));
        break;
      case 'c': {  // GLOBAL
        const auto module = read_line();
        global(module, read_line());
        break;
      }
      case 0x93: {  // STACK_GLOBAL
        const NodeId name = pop(), module = pop();
        if (node(name).kind != Kind::kString || node(module).kind != Kind::kString) {
          damaged("STACK_GLOBAL without two strings at byte {}", at);
        }
        global(tree_.strings_[node(module).text], tree_.strings_[node(name).text]);
        break;
      }
      case 'Q': {  // BINPERSID
        const NodeId pid = pop();
        push(add_container(Kind::kPersistentId, {pid}));
        break;
      }
      case 'R':
        reduce();
        break;
      case 'b': {  // BUILD: the state is kept on the object, for the caller to use or drop
        const NodeId state = pop();
        const NodeId object = top();
        if (node(object).kind != Kind::kDict && node(object).kind != Kind::kCall &&
            node(object).kind != Kind::kObject) {
          damaged("BUILD on something other than a dict, a call or an object at byte {}", at);
        }
        node(object).state = state;
        break;
      }
      case 0x81:  // NEWOBJ: cls.__new__(cls, *args), of a class the caller allows
        new_object(at);
        break;
      case 'i':
      case 'o':
      case 0x92:
      case 0x82:
      case 0x83:
      case 0x84:
        // INST, OBJ, NEWOBJ_EX, EXT1/2/4: build objects of classes the pickle names.
        throw FormatError(FormatError::Kind::kUnsafe,
                          fmt::format("the pickle opcode 0x{:02x} at byte {}: it builds an object "
                                      "of a pickled class",
                                      op, at));
      default:
        throw FormatError(FormatError::Kind::kUnsupported,
                          fmt::format("unsupported pickle opcode 0x{:02x} at byte {}", op, at));
    }
  }

  std::string_view data_;
  const PickleOptions& options_;
  std::size_t pos_ = 0;
  PickleTree tree_;
  std::vector<NodeId> stack_;
  std::vector<std::size_t> marks_;
  std::unordered_map<std::uint64_t, NodeId> memo_;
};

PickleTree read_pickle(std::string_view pickle, const PickleOptions& options) {
  return PickleParser(pickle, options).run();
}

void PickleTree::check_shape(const PickleLimits& limits) const {
  if (root_ == kNoNode) return;
  // Depth-first, iteratively: a node is gray while its children are being visited (meeting a
  // gray node again is a cycle) and black once its depth and unfolded count are known, so each
  // node is finished once however often it is shared.
  enum : std::uint8_t { kWhite, kGray, kBlack };
  std::vector<std::uint8_t> color(nodes_.size(), kWhite);
  std::vector<std::uint32_t> depth(nodes_.size(), 0);
  std::vector<std::uint64_t> unfolded(nodes_.size(), 0);
  const std::uint64_t max_unfolded =
      std::max<std::uint64_t>(limits.max_unfolded, 4 * std::uint64_t{nodes_.size()});
  struct Frame {
    NodeId id;
    std::size_t next;
  };
  std::vector<Frame> frames{{root_, 0}};
  color[root_] = kGray;
  while (!frames.empty()) {
    Frame& f = frames.back();
    const PickleNode& n = nodes_[f.id];
    const auto& items = n.items;
    // The children: the items, then BUILD's state (what an object's fields are).
    const std::size_t children = items.size() + (n.state != kNoNode ? 1 : 0);
    if (f.next < children) {
      const NodeId child = f.next < items.size() ? items[f.next] : n.state;
      ++f.next;
      if (color[child] == kGray) {
        throw FormatError(FormatError::Kind::kDamaged,
                          "the pickle holds a container that contains itself");
      }
      if (color[child] == kWhite) {
        if (frames.size() >= limits.max_depth) {
          throw FormatError(
              FormatError::Kind::kTooLarge,
              fmt::format("the pickle nests values deeper than {} levels", limits.max_depth));
        }
        color[child] = kGray;
        frames.push_back({child, 0});
      }
      continue;
    }
    std::uint32_t d = 1;
    std::uint64_t count = 1;
    for (std::size_t i = 0; i < children; ++i) {
      const NodeId child = i < items.size() ? items[i] : n.state;
      d = std::max(d, depth[child] + 1);
      count += unfolded[child];
      if (count > max_unfolded) {
        throw FormatError(FormatError::Kind::kTooLarge,
                          fmt::format("the pickle shares values so that they unfold to more "
                                      "than {} values (from {} in the file)",
                                      max_unfolded, nodes_.size()));
      }
    }
    if (d > limits.max_depth) {
      throw FormatError(
          FormatError::Kind::kTooLarge,
          fmt::format("the pickle nests values deeper than {} levels", limits.max_depth));
    }
    depth[f.id] = d;
    unfolded[f.id] = count;
    color[f.id] = kBlack;
    frames.pop_back();
  }
}

}  // namespace ddp::archive
