// The restricted unpickler: archive::read_pickle parses the bytes (linear time and memory, the
// allowlist checked as each global is read, nothing run), check_shape bounds what may be walked,
// and this file turns the tree into IValues, carrying out the few calls the allowlist admits.
// It is ddp's own rather than libtorch's Unpickler because libtorch 1.13's cannot read Python's
// state dicts (the OrderedDict's `_metadata`, a BUILD, fails an internal assert), and because
// checking each global as it is read is the allowlist itself: no name outside it is ever
// resolved, so no code from the file can run (weights_only=True's rule). What a global allowed
// here does is written below, not looked up.
//
// A node used twice (a tied weight, a shared tuple) becomes one IValue used twice, as Python's
// unpickler shares it; the conversion is recursive, which check_shape's depth limit makes safe.
#include <map>
#include <optional>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "archive/pickle_reader.h"
#include "ddp/torch/formats/state_dict.h"
#include "torch/formats/pytorch_archive.h"

namespace ddp::detail {
namespace {

using archive::NodeId;
using archive::PickleNode;
using Kind = PickleNode::Kind;

enum class Callable { kRebuildTensorV2, kRebuildTensor, kRebuildParameter };

const std::map<std::string, Callable, std::less<>>& callables() {
  static const std::map<std::string, Callable, std::less<>> names{
      {"torch._utils._rebuild_tensor_v2", Callable::kRebuildTensorV2},
      {"torch._utils._rebuild_tensor", Callable::kRebuildTensor},
      {"torch._utils._rebuild_parameter", Callable::kRebuildParameter}};
  return names;
}

const std::map<std::string, at::ScalarType, std::less<>>& storage_types() {
  static const std::map<std::string, at::ScalarType, std::less<>> types{
      {"torch.DoubleStorage", at::kDouble},
      {"torch.FloatStorage", at::kFloat},
      {"torch.HalfStorage", at::kHalf},
      {"torch.BFloat16Storage", at::kBFloat16},
      {"torch.LongStorage", at::kLong},
      {"torch.IntStorage", at::kInt},
      {"torch.ShortStorage", at::kShort},
      {"torch.CharStorage", at::kChar},
      {"torch.ByteStorage", at::kByte},
      {"torch.BoolStorage", at::kBool},
      {"torch.ComplexFloatStorage", at::kComplexFloat},
      {"torch.ComplexDoubleStorage", at::kComplexDouble}};
  return types;
}

bool allowed_global(std::string_view name) {
  return name == "collections.OrderedDict" || callables().contains(name) ||
         storage_types().contains(name);
}

class TreeConverter {
 public:
  TreeConverter(const archive::PickleTree& tree, const StorageLoader& load_storage,
                const std::string& source)
      : tree_(tree), load_storage_(load_storage), source_(source), values_(tree.size()) {}

  c10::IValue value(NodeId id) {
    if (values_[id]) return *values_[id];
    const PickleNode& n = tree_.node(id);
    c10::IValue v;
    switch (n.kind) {
      case Kind::kNone:
        break;
      case Kind::kBool:
        v = n.boolean;
        break;
      case Kind::kInt:
        v = n.integer;
        break;
      case Kind::kFloat:
        v = n.floating;
        break;
      case Kind::kString:
        v = tree_.text(n);
        break;
      case Kind::kBytes:
        fail("a bytes value, which a state dict never holds");
      case Kind::kTuple: {
        std::vector<c10::IValue> items;
        items.reserve(n.items.size());
        for (const NodeId item : n.items)
          items.push_back(value(item));
        v = c10::ivalue::Tuple::create(std::move(items));
        break;
      }
      case Kind::kList: {
        c10::impl::GenericList list(c10::AnyType::get());
        list.reserve(n.items.size());
        for (const NodeId item : n.items)
          list.push_back(value(item));
        v = std::move(list);
        break;
      }
      case Kind::kDict: {
        c10::impl::GenericDict dict(c10::AnyType::get(), c10::AnyType::get());
        for (std::size_t i = 0; i + 1 < n.items.size(); i += 2) {
          auto key = value(n.items[i]);
          if (!key.isString() && !key.isInt()) {
            fail("a dict key that is neither a string nor an integer");
          }
          dict.insert_or_assign(std::move(key), value(n.items[i + 1]));
        }
        v = std::move(dict);
        break;
      }
      case Kind::kCall:
        v = call(n);
        break;
      case Kind::kGlobal:
      case Kind::kPersistentId:
        fail("a storage or a global is used as a value");
      case Kind::kObject:  // not allowed by read_pickle's options here: a state dict holds none
        fail("an object of a pickled class");
    }
    values_[id] = v;
    return v;
  }

 private:
  template <class... Args>
  [[noreturn]] void fail(fmt::format_string<Args...> format, Args&&... args) const {
    throw StateDictFormatError(fmt::format("{}: not a state dict ddp can read: {}", source_,
                                           fmt::format(format, std::forward<Args>(args)...)));
  }

  std::int64_t as_int(NodeId id, const char* what) const {
    const PickleNode& n = tree_.node(id);
    if (n.kind != Kind::kInt) fail("{} is not an integer", what);
    return n.integer;
  }
  std::vector<std::int64_t> as_ints(NodeId id, const char* what) const {
    const PickleNode& n = tree_.node(id);
    if (n.kind != Kind::kTuple) fail("{} is not a tuple", what);
    std::vector<std::int64_t> ints;
    ints.reserve(n.items.size());
    for (const NodeId item : n.items)
      ints.push_back(as_int(item, what));
    return ints;
  }

  struct Storage {
    at::ScalarType dtype;
    at::Storage storage;
  };

  // A persistent id: ("storage", storage type, key, location, numel).
  Storage storage(NodeId id) {
    const PickleNode& n = tree_.node(id);
    if (n.kind != Kind::kPersistentId) fail("_rebuild_tensor called without a storage");
    const PickleNode& pid = tree_.node(n.items[0]);
    auto item = [&](std::size_t i) -> const PickleNode& { return tree_.node(pid.items[i]); };
    if (pid.kind != Kind::kTuple || pid.items.size() < 5 || item(0).kind != Kind::kString ||
        tree_.text(item(0)) != "storage" || item(1).kind != Kind::kGlobal ||
        !storage_types().contains(tree_.text(item(1))) || item(2).kind != Kind::kString) {
      fail("a persistent id that is not ('storage', type, key, location, numel)");
    }
    const at::ScalarType dtype = storage_types().find(tree_.text(item(1)))->second;
    const std::string& key = tree_.text(item(2));
    auto found = storages_.find(key);
    if (found == storages_.end()) {
      const std::int64_t numel = as_int(pid.items[4], "a storage's size");
      std::int64_t bytes = 0;
      if (numel < 0 || __builtin_mul_overflow(
                           numel, static_cast<std::int64_t>(c10::elementSize(dtype)), &bytes)) {
        fail("storage '{}' has an impossible size of {} elements", key, numel);
      }
      found = storages_.emplace(key, Storage{dtype, load_storage_({dtype, key, numel})}).first;
    } else if (found->second.dtype != dtype) {
      fail("storage '{}' is named with two types, {} and {}", key,
           c10::toString(found->second.dtype), c10::toString(dtype));
    }
    return found->second;
  }

  torch::Tensor rebuild_tensor(const std::vector<NodeId>& args) {
    if (args.size() < 4) fail("_rebuild_tensor called without (storage, offset, size, stride)");
    const Storage s = storage(args[0]);
    const std::int64_t offset = as_int(args[1], "a tensor's storage offset");
    const auto sizes = as_ints(args[2], "a tensor's size");
    const auto strides = as_ints(args[3], "a tensor's stride");
    const auto item_size = static_cast<std::int64_t>(c10::elementSize(s.dtype));
    const auto storage_numel = static_cast<std::int64_t>(s.storage.nbytes()) / item_size;
    if (sizes.size() != strides.size()) fail("a tensor's size and stride differ in length");
    // The last element the view reaches must lie inside the storage (set_ would grow it), and
    // neither it nor the element count may overflow (a wrapped sum passes any bound).
    if (offset < 0) fail("a tensor has a negative storage offset");
    std::int64_t last = offset, numel = 1;
    for (std::size_t d = 0; d < sizes.size(); ++d) {
      if (sizes[d] < 0 || strides[d] < 0) fail("a tensor has a negative size or stride");
      std::int64_t reach = 0;
      if (__builtin_mul_overflow(numel, sizes[d], &numel) ||
          (sizes[d] > 0 && (__builtin_mul_overflow(sizes[d] - 1, strides[d], &reach) ||
                            __builtin_add_overflow(last, reach, &last)))) {
        fail("a tensor of size {} and stride {} overflows 64-bit indexing", fmt::join(sizes, "x"),
             fmt::join(strides, "x"));
      }
    }
    if (numel > 0 && last >= storage_numel) {
      fail("a tensor of size {} (offset {}) reaches past its storage of {} elements",
           fmt::join(sizes, "x"), offset, storage_numel);
    }
    return at::empty({0}, at::TensorOptions().dtype(s.dtype))
        .set_(s.storage, offset, sizes, strides);
  }

  c10::IValue call(const PickleNode& n) {
    const auto found = callables().find(tree_.text(tree_.node(n.items[0])));
    if (found == callables().end()) {
      fail("a call of '{}', which builds no value of a state dict",
           tree_.text(tree_.node(n.items[0])));
    }
    const auto& args = tree_.node(n.items[1]).items;
    switch (found->second) {
      case Callable::kRebuildTensorV2:
      case Callable::kRebuildTensor:
        return rebuild_tensor(args);
      case Callable::kRebuildParameter: {
        if (args.empty()) fail("_rebuild_parameter called without a tensor");
        auto data = value(args[0]);
        if (!data.isTensor()) fail("_rebuild_parameter called without a tensor");
        return data;
      }
    }
    fail("an unknown call");
  }

  const archive::PickleTree& tree_;
  const StorageLoader& load_storage_;
  const std::string& source_;
  std::vector<std::optional<c10::IValue>> values_;
  std::map<std::string, Storage, std::less<>> storages_;
};

}  // namespace

c10::IValue unpickle_restricted(std::string_view pickle, const StorageLoader& load_storage,
                                const std::string& source) {
  archive::PickleTree tree;
  try {
    tree = archive::read_pickle(pickle, {.allow_global = allowed_global});
    tree.check_shape({});
  } catch (const archive::FormatError& e) {
    if (e.kind() != archive::FormatError::Kind::kUnsafe) {
      throw StateDictFormatError(
          fmt::format("{}: not a state dict ddp can read: {}", source, e.what()));
    }
    const std::string& full = e.global_name();
    if (full.empty()) {
      throw UnsafePickleError(
          fmt::format("{}: refused {}, which a state dict never holds", source, e.what()), "");
    }
    const bool object = full.starts_with("__main__.") || full.starts_with("torch.nn.");
    throw UnsafePickleError(
        fmt::format("{}: refused to load the pickled global '{}': a state dict holds only "
                    "dicts, lists, tuples, numbers, strings and tensors, and loading anything "
                    "else could run code from the file (as torch.load(weights_only=True) "
                    "refuses it){}",
                    source, full,
                    object ? "; this looks like a whole pickled model (torch.save(model)): save "
                             "model.state_dict() instead"
                           : ""),
        full);
  }
  return TreeConverter(tree, load_storage, source).value(tree.root());
}

}  // namespace ddp::detail
