// Writing PyTorch's zip archive: the pickle is ddp's own (protocol 2, the opcodes Python's
// torch.save emits and PyTorch 1.13's weights_only unpickler knows), the zip layer libtorch's
// PyTorchStreamWriter. Storages go into the zip as the pickler reaches them, straight from the
// tensors' memory, so a save costs one pass over the bytes as torch::save does. libtorch's
// torch::pickle_save is not used: it builds the whole archive in memory first, and its dicts are
// not Python's OrderedDict.
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>

#include <caffe2/serialize/inline_container.h>
#include <fmt/format.h>

#include "archive/pickle_writer.h"
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
      throw Error(
          fmt::format("{}: tensors of dtype {} cannot be saved", context, c10::toString(dtype)));
  }
}

class Pickler {
 public:
  Pickler(const StorageSink& sink, std::string context)
      : sink_(sink), context_(std::move(context)) {}

  std::string finish(const c10::IValue& value, bool ordered_dict_at_top) {
    write(value, ordered_dict_at_top);
    return out_.finish();
  }

 private:
  void ints_tuple(c10::IntArrayRef values) {
    out_.mark();
    for (const auto v : values)
      out_.integer(v);
    out_.tuple();
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
    out_.global("torch._utils", "_rebuild_tensor_v2");
    out_.mark();
    out_.mark();
    out_.string("storage");
    out_.global("torch", type_name);
    out_.string(it->second);
    out_.string("cpu");
    out_.integer(numel);
    out_.tuple();
    out_.binpersid();
    out_.integer(t.storage_offset());
    ints_tuple(t.sizes());
    ints_tuple(t.strides());
    out_.boolean(false);  // requires_grad
    out_.global("collections", "OrderedDict");
    out_.empty_tuple();
    out_.reduce();  // backward hooks: OrderedDict()
    out_.tuple();
    out_.reduce();
  }

  void write(const c10::IValue& v, bool ordered_dict = false) {
    if (v.isNone()) {
      out_.none();
    } else if (v.isBool()) {
      out_.boolean(v.toBool());
    } else if (v.isInt()) {
      out_.integer(v.toInt());
    } else if (v.isDouble()) {
      out_.floating(v.toDouble());
    } else if (v.isString()) {
      out_.string(v.toStringRef());
    } else if (v.isTensor()) {
      tensor(v.toTensor());
    } else if (v.isTuple()) {
      out_.mark();
      for (const auto& e : v.toTupleRef().elements())
        write(e);
      out_.tuple();
    } else if (v.isList()) {
      out_.empty_list();
      out_.mark();
      for (const auto& e : v.toListRef())
        write(e);
      out_.appends();
    } else if (v.isGenericDict()) {
      if (ordered_dict) {
        out_.global("collections", "OrderedDict");
        out_.empty_tuple();
        out_.reduce();
      } else {
        out_.empty_dict();
      }
      out_.mark();
      for (const auto& entry : v.toGenericDict()) {
        write(entry.key());
        write(entry.value());
      }
      out_.setitems();
    } else {
      throw Error(fmt::format("{}: a value of kind {} cannot be saved", context_, v.tagKind()));
    }
  }

  const StorageSink& sink_;
  std::string context_;
  archive::PickleWriter out_;
  std::map<const void*, std::string> keys_;
  std::vector<torch::Tensor> alive_;
};

}  // namespace

std::string pickle_value(const c10::IValue& value, bool ordered_dict_at_top,
                         const StorageSink& sink, const std::string& context) {
  return Pickler(sink, context).finish(value, ordered_dict_at_top);
}

std::uint64_t append_pytorch_archive(std::FILE* file, const std::string& name,
                                     const c10::IValue& value, bool ordered_dict_at_top,
                                     const std::string& context) {
  std::uint64_t written = 0;
  bool write_failed = false;
  int write_errno = 0;
  {
    caffe2::serialize::PyTorchStreamWriter zip([&](const void* data, std::size_t size) {
      if (!write_failed && std::fwrite(data, 1, size, file) != size) {
        write_failed = true;
        write_errno = errno;
      }
      written += size;
      return size;
    });
    const std::string pickle = pickle_value(
        value, ordered_dict_at_top,
        [&](const std::string& key, const at::Storage& storage) {
          zip.writeRecord("data/" + key, storage.data_ptr().get(), storage.nbytes());
        },
        context);
    zip.writeRecord("data.pkl", pickle.data(), pickle.size());
    zip.writeRecord("byteorder", "little", 6);
    zip.writeEndOfFile();
  }
  if (write_failed) {
    throw ConfigError(fmt::format("{}: write failed: {}", name, std::strerror(write_errno)));
  }
  return written;
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
  try {
    append_pytorch_archive(file.get(), temporary.string(), value, ordered_dict_at_top,
                           "save_state_dict");
    if (std::fflush(file.get()) != 0) {
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
