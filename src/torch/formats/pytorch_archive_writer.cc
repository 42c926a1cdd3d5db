// Writing PyTorch's zip archive: the pickle is ddp's own (protocol 2, the opcodes Python's
// torch.save emits and PyTorch 1.13's weights_only unpickler knows), the zip layer libtorch's
// PyTorchStreamWriter. Storages go into the zip as the pickler reaches them, straight from the
// tensors' memory, so a save costs one pass over the bytes as torch::save does. libtorch's
// torch::pickle_save is not used: it builds the whole archive in memory first, and its dicts are
// not Python's OrderedDict.
#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>

#include <caffe2/serialize/inline_container.h>
#include <fmt/format.h>

#include "ddp/torch/formats/state_dict.h"
#include "torch/formats/pytorch_archive.h"

namespace ddp::detail {
namespace {

const char* storage_type_name(at::ScalarType dtype, const std::string& context) {
  switch (dtype) {
    case at::kDouble:
      return "DoubleStorage";
    case at::kFloat:
      return "FloatStorage";
    case at::kHalf:
      return "HalfStorage";
    case at::kBFloat16:
      return "BFloat16Storage";
    case at::kLong:
      return "LongStorage";
    case at::kInt:
      return "IntStorage";
    case at::kShort:
      return "ShortStorage";
    case at::kChar:
      return "CharStorage";
    case at::kByte:
      return "ByteStorage";
    case at::kBool:
      return "BoolStorage";
    case at::kComplexFloat:
      return "ComplexFloatStorage";
    case at::kComplexDouble:
      return "ComplexDoubleStorage";
    default:
      throw Error(fmt::format("{}: tensors of dtype {} cannot be saved", context,
                              c10::toString(dtype)));
  }
}

class Pickler {
 public:
  Pickler(const StorageSink& sink, std::string context)
      : sink_(sink), context_(std::move(context)) {}

  std::string finish(const c10::IValue& value, bool ordered_dict_at_top) {
    out_ += "\x80\x02";  // PROTO 2
    write(value, ordered_dict_at_top);
    out_ += '.';  // STOP
    return std::move(out_);
  }

 private:
  void u32(std::uint32_t v) {
    for (int i = 0; i < 4; ++i)
      out_ += static_cast<char>((v >> (8 * i)) & 0xff);
  }
  void string(const std::string& s) {
    out_ += 'X';  // BINUNICODE
    u32(static_cast<std::uint32_t>(s.size()));
    out_ += s;
  }
  void integer(std::int64_t v) {
    if (v >= 0 && v < 256) {
      out_ += 'K';
      out_ += static_cast<char>(v);
    } else if (v >= 0 && v < 65536) {
      out_ += 'M';
      out_ += static_cast<char>(v & 0xff);
      out_ += static_cast<char>(v >> 8);
    } else if (v >= INT32_MIN && v <= INT32_MAX) {
      out_ += 'J';
      u32(static_cast<std::uint32_t>(static_cast<std::int32_t>(v)));
    } else {
      out_ += "\x8a\x08";  // LONG1, 8 bytes little-endian two's complement
      const auto bits = static_cast<std::uint64_t>(v);
      for (int i = 0; i < 8; ++i)
        out_ += static_cast<char>((bits >> (8 * i)) & 0xff);
    }
  }
  void floating(double v) {
    out_ += 'G';  // BINFLOAT, big-endian
    const auto bits = std::bit_cast<std::uint64_t>(v);
    for (int i = 7; i >= 0; --i)
      out_ += static_cast<char>((bits >> (8 * i)) & 0xff);
  }
  void global(const char* module, const char* name) {
    out_ += fmt::format("c{}\n{}\n", module, name);
  }
  void ints_tuple(c10::IntArrayRef values) {
    out_ += '(';
    for (const auto v : values)
      integer(v);
    out_ += 't';
  }

  // As Python's Tensor.__reduce_ex__ writes a plain tensor: _rebuild_tensor_v2(storage, offset,
  // size, stride, requires_grad=False, OrderedDict()).
  void tensor(const torch::Tensor& given) {
    if (given.layout() != at::kStrided || given.is_quantized()) {
      throw Error(context_ + ": only dense tensors can be saved");
    }
    const torch::Tensor t = given.is_cpu() ? given.resolve_conj().resolve_neg() : given.cpu();
    const auto dtype = t.scalar_type();
    const char* type_name = storage_type_name(dtype, context_);
    const auto& storage = t.storage();
    auto [it, fresh] = keys_.try_emplace(storage.unsafeGetStorageImpl(), "");
    if (fresh) {
      it->second = std::to_string(keys_.size() - 1);
      sink_(it->second, storage);
      alive_.push_back(t);  // a copy's storage must outlive the map key that names it
    }
    const auto numel = static_cast<std::int64_t>(storage.nbytes() / t.element_size());
    global("torch._utils", "_rebuild_tensor_v2");
    out_ += "((";
    string("storage");
    global("torch", type_name);
    string(it->second);
    string("cpu");
    integer(numel);
    out_ += "tQ";  // TUPLE, BINPERSID
    integer(t.storage_offset());
    ints_tuple(t.sizes());
    ints_tuple(t.strides());
    out_ += '\x89';  // requires_grad False
    global("collections", "OrderedDict");
    out_ += ")R";  // backward hooks: OrderedDict()
    out_ += "tR";
  }

  void write(const c10::IValue& v, bool ordered_dict = false) {
    if (v.isNone()) {
      out_ += 'N';
    } else if (v.isBool()) {
      out_ += v.toBool() ? '\x88' : '\x89';
    } else if (v.isInt()) {
      integer(v.toInt());
    } else if (v.isDouble()) {
      floating(v.toDouble());
    } else if (v.isString()) {
      string(v.toStringRef());
    } else if (v.isTensor()) {
      tensor(v.toTensor());
    } else if (v.isTuple()) {
      out_ += '(';
      for (const auto& e : v.toTupleRef().elements())
        write(e);
      out_ += 't';
    } else if (v.isList()) {
      out_ += "](";
      for (const auto& e : v.toListRef())
        write(e);
      out_ += 'e';  // APPENDS
    } else if (v.isGenericDict()) {
      if (ordered_dict) {
        global("collections", "OrderedDict");
        out_ += ")R";
      } else {
        out_ += '}';
      }
      out_ += '(';
      for (const auto& entry : v.toGenericDict()) {
        write(entry.key());
        write(entry.value());
      }
      out_ += 'u';  // SETITEMS
    } else {
      throw Error(fmt::format("{}: a value of kind {} cannot be saved", context_, v.tagKind()));
    }
  }

  const StorageSink& sink_;
  std::string context_;
  std::string out_;
  std::map<const void*, std::string> keys_;
  std::vector<torch::Tensor> alive_;
};

}  // namespace

std::string pickle_value(const c10::IValue& value, bool ordered_dict_at_top,
                         const StorageSink& sink, const std::string& context) {
  return Pickler(sink, context).finish(value, ordered_dict_at_top);
}

void write_pytorch_archive(const std::filesystem::path& path, const c10::IValue& value,
                           bool ordered_dict_at_top) {
  auto temporary = path;
  temporary += ".tmp";
  std::unique_ptr<FILE, int (*)(FILE*)> file(std::fopen(temporary.c_str(), "wb"), &std::fclose);
  if (!file) {
    throw ConfigError(
        fmt::format("{}: cannot open to write: {}", temporary.string(), std::strerror(errno)));
  }
  std::setvbuf(file.get(), nullptr, _IOFBF, 1 << 20);
  bool write_failed = false;
  try {
    {
      caffe2::serialize::PyTorchStreamWriter zip([&](const void* data, std::size_t size) {
        if (std::fwrite(data, 1, size, file.get()) != size) write_failed = true;
        return size;
      });
      const std::string pickle =
          pickle_value(value, ordered_dict_at_top,
                       [&](const std::string& key, const at::Storage& storage) {
                         zip.writeRecord("data/" + key, storage.data_ptr().get(), storage.nbytes());
                       },
                       "save_state_dict");
      zip.writeRecord("data.pkl", pickle.data(), pickle.size());
      zip.writeRecord("byteorder", "little", 6);
      zip.writeEndOfFile();
    }
    if (std::fflush(file.get()) != 0) write_failed = true;
    if (write_failed) {
      throw ConfigError(
          fmt::format("{}: write failed: {}", temporary.string(), std::strerror(errno)));
    }
    file.reset();
    std::filesystem::rename(temporary, path);
  } catch (...) {
    file.reset();
    std::error_code ignored;
    std::filesystem::remove(temporary, ignored);
    throw;
  }
}

}  // namespace ddp::detail
