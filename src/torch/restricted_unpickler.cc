// The restricted unpickler: a pickle reader that knows the opcodes Python's pickle emits at
// protocols 2 to 5 for dicts, lists, tuples, strings, numbers and torch.save's tensors, and
// resolves only an allowlist of globals. It is ddp's own rather than libtorch's Unpickler because
// libtorch 1.13's cannot read Python's state dicts (the OrderedDict's `_metadata`, a BUILD, fails
// an internal assert), and because checking each global as it is read is the allowlist itself:
// no name outside it is ever resolved, so no code from the file can run (weights_only=True's
// rule). What a global allowed here does is written below, not looked up.
#include <bit>
#include <cstdint>
#include <map>
#include <optional>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "ddp/torch/state_dict.h"
#include "pytorch_archive.h"

namespace ddp::detail {
namespace {

enum class Callable { kOrderedDict, kRebuildTensorV2, kRebuildTensor, kRebuildParameter };

// A stack or memo entry: a value, a MARK, an allowed callable, a storage type (as it appears in a
// persistent id), a storage, or a tuple that may hold any of these (a persistent id, REDUCE's
// arguments) and becomes a value when it holds only values.
struct Item {
  enum class Kind { kValue, kMark, kCallable, kStorageType, kStorage, kTuple } kind = Kind::kValue;
  c10::IValue value;
  Callable callable = Callable::kOrderedDict;
  at::ScalarType dtype = at::kFloat;
  at::Storage storage;
  std::vector<Item> tuple;
};

Item value_item(c10::IValue v) {
  Item item;
  item.value = std::move(v);
  return item;
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

class RestrictedUnpickler {
 public:
  RestrictedUnpickler(std::string_view data, const StorageLoader& load_storage,
                      const std::string& source)
      : data_(data), load_storage_(load_storage), source_(source) {}

  c10::IValue run() {
    for (;;) {
      const std::size_t at = pos_;
      const auto op = static_cast<unsigned char>(read(1)[0]);
      if (op == '.') break;  // STOP
      step(op, at);
    }
    if (stack_.size() != 1)
      fail("the pickle ends with {} values on its stack, not 1", stack_.size());
    return as_value(stack_.back());
  }

 private:
  template <class... Args>
  [[noreturn]] void fail(fmt::format_string<Args...> format, Args&&... args) const {
    throw StateDictFormatError(fmt::format("{}: not a state dict ddp can read: {}", source_,
                                           fmt::format(format, std::forward<Args>(args)...)));
  }

  std::string_view read(std::size_t n) {
    if (n > data_.size() - pos_) fail("the pickle is truncated at byte {}", pos_);
    auto bytes = data_.substr(pos_, n);
    pos_ += n;
    return bytes;
  }
  template <class T>
  T read_le() {
    const auto bytes = read(sizeof(T));
    std::uint64_t v = 0;
    for (std::size_t i = 0; i < sizeof(T); ++i) {
      v |= std::uint64_t{static_cast<unsigned char>(bytes[i])} << (8 * i);
    }
    return static_cast<T>(v);
  }
  std::string_view read_line() {
    const auto end = data_.find('\n', pos_);
    if (end == std::string_view::npos) fail("the pickle is truncated at byte {}", pos_);
    auto line = data_.substr(pos_, end - pos_);
    pos_ = end + 1;
    return line;
  }

  Item pop() {
    if (stack_.empty() || stack_.back().kind == Item::Kind::kMark) {
      fail("the pickle pops an empty stack at byte {}", pos_);
    }
    Item item = std::move(stack_.back());
    stack_.pop_back();
    return item;
  }
  Item& top() {
    if (stack_.empty() || stack_.back().kind == Item::Kind::kMark) {
      fail("the pickle reads an empty stack at byte {}", pos_);
    }
    return stack_.back();
  }
  // The items above the topmost MARK, which is removed.
  std::vector<Item> pop_to_mark() {
    std::size_t mark = stack_.size();
    while (mark > 0 && stack_[mark - 1].kind != Item::Kind::kMark)
      --mark;
    if (mark == 0) fail("the pickle has no MARK for the opcode at byte {}", pos_);
    std::vector<Item> items(std::make_move_iterator(stack_.begin() + static_cast<long>(mark)),
                            std::make_move_iterator(stack_.end()));
    stack_.resize(mark - 1);
    return items;
  }

  c10::IValue as_value(const Item& item) const {
    switch (item.kind) {
      case Item::Kind::kValue:
        return item.value;
      case Item::Kind::kTuple: {
        std::vector<c10::IValue> values;
        values.reserve(item.tuple.size());
        for (const auto& element : item.tuple)
          values.push_back(as_value(element));
        return c10::ivalue::Tuple::create(std::move(values));
      }
      default:
        fail("a storage or a global is used as a value");
    }
  }
  std::int64_t as_int(const Item& item, const char* what) const {
    if (item.kind != Item::Kind::kValue || !item.value.isInt()) fail("{} is not an integer", what);
    return item.value.toInt();
  }
  std::vector<std::int64_t> as_ints(const Item& item, const char* what) const {
    if (item.kind != Item::Kind::kTuple) fail("{} is not a tuple", what);
    std::vector<std::int64_t> ints;
    for (const auto& element : item.tuple)
      ints.push_back(as_int(element, what));
    return ints;
  }

  void push_global(std::string_view module, std::string_view name) {
    const std::string full = fmt::format("{}.{}", module, name);
    static const std::map<std::string, Callable, std::less<>> callables{
        {"collections.OrderedDict", Callable::kOrderedDict},
        {"torch._utils._rebuild_tensor_v2", Callable::kRebuildTensorV2},
        {"torch._utils._rebuild_tensor", Callable::kRebuildTensor},
        {"torch._utils._rebuild_parameter", Callable::kRebuildParameter}};
    Item item;
    if (const auto it = callables.find(full); it != callables.end()) {
      item.kind = Item::Kind::kCallable;
      item.callable = it->second;
    } else if (const auto st = storage_types().find(full); st != storage_types().end()) {
      item.kind = Item::Kind::kStorageType;
      item.dtype = st->second;
    } else {
      const bool object = module == "__main__" || module.starts_with("torch.nn.");
      throw UnsafePickleError(
          fmt::format("{}: refused to load the pickled global '{}': a state dict holds only "
                      "dicts, lists, tuples, numbers, strings and tensors, and loading anything "
                      "else could run code from the file (as torch.load(weights_only=True) "
                      "refuses it){}",
                      source_, full,
                      object ? "; this looks like a whole pickled model (torch.save(model)): save "
                               "model.state_dict() instead"
                             : ""),
          full);
    }
    stack_.push_back(std::move(item));
  }

  // A persistent id: ("storage", storage type, key, location, numel).
  void push_storage(const Item& pid) {
    if (pid.kind != Item::Kind::kTuple || pid.tuple.size() < 5 ||
        pid.tuple[0].kind != Item::Kind::kValue || !pid.tuple[0].value.isString() ||
        pid.tuple[0].value.toStringRef() != "storage" ||
        pid.tuple[1].kind != Item::Kind::kStorageType || pid.tuple[2].kind != Item::Kind::kValue ||
        !pid.tuple[2].value.isString()) {
      fail("a persistent id that is not ('storage', type, key, location, numel)");
    }
    const std::string key = pid.tuple[2].value.toStringRef();
    auto found = storages_.find(key);
    if (found == storages_.end()) {
      const std::int64_t numel = as_int(pid.tuple[4], "a storage's size");
      if (numel < 0) fail("storage '{}' has a negative size", key);
      found = storages_.emplace(key, load_storage_({pid.tuple[1].dtype, key, numel})).first;
    }
    Item item;
    item.kind = Item::Kind::kStorage;
    item.dtype = pid.tuple[1].dtype;
    item.storage = found->second;
    stack_.push_back(std::move(item));
  }

  torch::Tensor rebuild_tensor(const std::vector<Item>& args) {
    if (args.size() < 4 || args[0].kind != Item::Kind::kStorage) {
      fail("_rebuild_tensor called without (storage, offset, size, stride)");
    }
    const auto& storage = args[0];
    const std::int64_t offset = as_int(args[1], "a tensor's storage offset");
    const auto sizes = as_ints(args[2], "a tensor's size");
    const auto strides = as_ints(args[3], "a tensor's stride");
    const auto item_size = static_cast<std::int64_t>(c10::elementSize(storage.dtype));
    const auto storage_numel = static_cast<std::int64_t>(storage.storage.nbytes()) / item_size;
    if (sizes.size() != strides.size()) fail("a tensor's size and stride differ in length");
    // The last element the view reaches must lie inside the storage (set_ would grow it).
    std::int64_t last = offset;
    bool empty = false;
    for (std::size_t d = 0; d < sizes.size(); ++d) {
      if (sizes[d] < 0 || strides[d] < 0) fail("a tensor has a negative size or stride");
      if (sizes[d] == 0)
        empty = true;
      else
        last += (sizes[d] - 1) * strides[d];
    }
    if (offset < 0 || (!empty && last >= storage_numel)) {
      fail("a tensor of size {} (offset {}) reaches past its storage of {} elements",
           fmt::join(sizes, "x"), offset, storage_numel);
    }
    return at::empty({0}, at::TensorOptions().dtype(storage.dtype))
        .set_(storage.storage, offset, sizes, strides);
  }

  void reduce() {
    Item args = pop();
    Item& function = top();
    if (function.kind != Item::Kind::kCallable || args.kind != Item::Kind::kTuple) {
      fail("REDUCE of something other than an allowed function at byte {}", pos_);
    }
    c10::IValue result;
    switch (function.callable) {
      case Callable::kOrderedDict:
        if (!args.tuple.empty()) fail("OrderedDict built with arguments");
        result = c10::impl::GenericDict(c10::AnyType::get(), c10::AnyType::get());
        break;
      case Callable::kRebuildTensorV2:
      case Callable::kRebuildTensor:
        result = rebuild_tensor(args.tuple);
        break;
      case Callable::kRebuildParameter: {
        if (args.tuple.empty()) fail("_rebuild_parameter called without a tensor");
        auto data = as_value(args.tuple[0]);
        if (!data.isTensor()) fail("_rebuild_parameter called without a tensor");
        result = data;
        break;
      }
    }
    function = value_item(std::move(result));
  }

  c10::impl::GenericDict dict_on_top() {
    Item& d = top();
    if (d.kind != Item::Kind::kValue || !d.value.isGenericDict()) fail("SETITEM on a non-dict");
    return d.value.toGenericDict();
  }
  void set_item(c10::impl::GenericDict& dict, const Item& key, const Item& value) {
    auto k = as_value(key);
    if (!k.isString() && !k.isInt()) fail("a dict key that is neither a string nor an integer");
    dict.insert_or_assign(std::move(k), as_value(value));
  }
  void append(const Item& value) {
    Item& l = top();
    if (l.kind != Item::Kind::kValue || !l.value.isList()) fail("APPEND to a non-list");
    l.value.toList().push_back(as_value(value));
  }

  void memo_put(std::size_t index) {
    if (stack_.empty() || stack_.back().kind == Item::Kind::kMark) fail("memoizing a MARK");
    if (memo_.size() <= index) memo_.resize(index + 1);
    memo_[index] = stack_.back();
  }
  void memo_get(std::size_t index) {
    if (index >= memo_.size() || !memo_[index]) fail("a memo entry {} that was never set", index);
    stack_.push_back(*memo_[index]);
  }

  void push_tuple(std::vector<Item> items) {
    Item tuple;
    tuple.kind = Item::Kind::kTuple;
    tuple.tuple = std::move(items);
    stack_.push_back(std::move(tuple));
  }
  void push_string(std::string_view s) { stack_.push_back(value_item(std::string(s))); }
  void push_long(std::string_view bytes) {  // little-endian two's complement
    if (bytes.size() > 8) fail("an integer of {} bytes", bytes.size());
    std::uint64_t v = 0;
    for (std::size_t i = 0; i < bytes.size(); ++i) {
      v |= std::uint64_t{static_cast<unsigned char>(bytes[i])} << (8 * i);
    }
    if (!bytes.empty() && bytes.size() < 8 && (bytes.back() & 0x80)) {
      v |= ~std::uint64_t{0} << (8 * bytes.size());
    }
    stack_.push_back(value_item(static_cast<std::int64_t>(v)));
  }

  void step(unsigned char op, std::size_t at) {
    switch (op) {
      case 0x80:
        read(1);
        break;  // PROTO
      case 0x95:
        read(8);
        break;  // FRAME
      case '(':
        stack_.push_back(Item{.kind = Item::Kind::kMark});
        break;
      case '0':
        pop();
        break;  // POP
      case '1':
        pop_to_mark();
        break;  // POP_MARK
      case '2':
        stack_.push_back(top());
        break;  // DUP
      case 'N':
        stack_.push_back(value_item(c10::IValue()));
        break;
      case 0x88:
        stack_.push_back(value_item(true));
        break;
      case 0x89:
        stack_.push_back(value_item(false));
        break;
      case 'J':
        stack_.push_back(value_item(std::int64_t{read_le<std::int32_t>()}));
        break;
      case 'K':
        stack_.push_back(value_item(std::int64_t{read_le<std::uint8_t>()}));
        break;
      case 'M':
        stack_.push_back(value_item(std::int64_t{read_le<std::uint16_t>()}));
        break;
      case 0x8a:
        push_long(read(read_le<std::uint8_t>()));
        break;  // LONG1
      case 0x8b:
        push_long(read(read_le<std::uint32_t>()));
        break;     // LONG4
      case 'G': {  // BINFLOAT: big-endian
        const auto bytes = read(8);
        std::uint64_t bits = 0;
        for (const char byte : bytes)
          bits = (bits << 8) | static_cast<unsigned char>(byte);
        stack_.push_back(value_item(std::bit_cast<double>(bits)));
        break;
      }
      case 'X':
        push_string(read(read_le<std::uint32_t>()));
        break;  // BINUNICODE
      case 0x8c:
        push_string(read(read_le<std::uint8_t>()));
        break;  // SHORT_BINUNICODE
      case 0x8d:
        push_string(read(read_le<std::uint64_t>()));
        break;  // BINUNICODE8
      case 'T':
        push_string(read(read_le<std::uint32_t>()));
        break;  // BINSTRING
      case 'U':
        push_string(read(read_le<std::uint8_t>()));
        break;  // SHORT_BINSTRING
      case ')':
        push_tuple({});
        break;
      case 0x85: {
        auto a = pop();
        push_tuple({std::move(a)});
        break;
      }
      case 0x86: {
        auto b = pop();
        auto a = pop();
        push_tuple({std::move(a), std::move(b)});
        break;
      }
      case 0x87: {
        auto c = pop();
        auto b = pop();
        auto a = pop();
        push_tuple({std::move(a), std::move(b), std::move(c)});
        break;
      }
      case 't':
        push_tuple(pop_to_mark());
        break;
      case ']':
        stack_.push_back(value_item(c10::impl::GenericList(c10::AnyType::get())));
        break;
      case 'l': {  // LIST
        c10::impl::GenericList list(c10::AnyType::get());
        for (const auto& item : pop_to_mark())
          list.push_back(as_value(item));
        stack_.push_back(value_item(std::move(list)));
        break;
      }
      case 'a': {
        auto v = pop();
        append(v);
        break;
      }
      case 'e': {
        for (const auto& v : pop_to_mark())
          append(v);
        break;
      }
      case '}':
        stack_.push_back(
            value_item(c10::impl::GenericDict(c10::AnyType::get(), c10::AnyType::get())));
        break;
      case 'd': {  // DICT
        auto items = pop_to_mark();
        if (items.size() % 2) fail("DICT with an odd number of items");
        c10::impl::GenericDict dict(c10::AnyType::get(), c10::AnyType::get());
        for (std::size_t i = 0; i < items.size(); i += 2)
          set_item(dict, items[i], items[i + 1]);
        stack_.push_back(value_item(std::move(dict)));
        break;
      }
      case 's': {
        auto v = pop();
        auto k = pop();
        auto dict = dict_on_top();
        set_item(dict, k, v);
        break;
      }
      case 'u': {
        auto items = pop_to_mark();
        if (items.size() % 2) fail("SETITEMS with an odd number of items");
        auto dict = dict_on_top();
        for (std::size_t i = 0; i < items.size(); i += 2)
          set_item(dict, items[i], items[i + 1]);
        break;
      }
      case 'q':
        memo_put(read_le<std::uint8_t>());
        break;  // BINPUT
      case 'r':
        memo_put(read_le<std::uint32_t>());
        break;  // LONG_BINPUT
      case 0x94:
        memo_put(memo_.size());
        break;  // MEMOIZE
      case 'h':
        memo_get(read_le<std::uint8_t>());
        break;  // BINGET
      case 'j':
        memo_get(read_le<std::uint32_t>());
        break;     // LONG_BINGET
      case 'c': {  // GLOBAL
        const auto module = read_line();
        push_global(module, read_line());
        break;
      }
      case 0x93: {  // STACK_GLOBAL
        auto name = as_value(pop());
        auto module = as_value(pop());
        if (!name.isString() || !module.isString()) fail("STACK_GLOBAL without two strings");
        push_global(module.toStringRef(), name.toStringRef());
        break;
      }
      case 'Q': {
        auto pid = pop();
        push_storage(pid);
        break;
      }  // BINPERSID
      case 'R':
        reduce();
        break;
      case 'b': {  // BUILD: an OrderedDict's _metadata, a parameter's attributes: dropped
        pop();
        const Item& object = top();
        if (object.kind != Item::Kind::kValue ||
            !(object.value.isGenericDict() || object.value.isTensor())) {
          fail("BUILD on something other than a dict or a tensor at byte {}", at);
        }
        break;
      }
      case 'i':
      case 'o':
      case 0x81:
      case 0x92:
      case 0x82:
      case 0x83:
      case 0x84:
        // INST, OBJ, NEWOBJ, NEWOBJ_EX, EXT1/2/4: build objects of classes the pickle names.
        throw UnsafePickleError(
            fmt::format("{}: refused the pickle opcode 0x{:02x} at byte {}: it builds an object "
                        "of a pickled class, which a state dict never holds",
                        source_, op, at),
            "");
      default:
        fail("unsupported pickle opcode 0x{:02x} at byte {}", op, at);
    }
  }

  std::string_view data_;
  std::size_t pos_ = 0;
  const StorageLoader& load_storage_;
  const std::string& source_;
  std::vector<Item> stack_;
  std::vector<std::optional<Item>> memo_;
  std::map<std::string, at::Storage> storages_;
};

}  // namespace

c10::IValue unpickle_restricted(std::string_view pickle, const StorageLoader& load_storage,
                                const std::string& source) {
  return RestrictedUnpickler(pickle, load_storage, source).run();
}

}  // namespace ddp::detail
