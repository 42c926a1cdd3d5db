#include "torch/rpc/rpc_values.h"

#include <cstring>
#include <limits>
#include <memory>

#include <fmt/format.h>

#include "ddp/error.h"
#include "torch/formats/pytorch_archive.h"

namespace ddp::rpc::detail {
namespace {

constexpr std::uint32_t kMagic = 0x56505244;  // "DRPV"
constexpr std::uint32_t kVersion = 2;
// Storages start at multiples of this in the message: a tensor left in the message's memory is as
// aligned as the allocator's (16) allows, and vector loads do not straddle lines.
constexpr std::size_t kStorageAlignment = 64;

std::size_t aligned(std::size_t offset) {
  return (offset + kStorageAlignment - 1) / kStorageAlignment * kStorageAlignment;
}
// More storages than this in one message is not a value anyone sends (and each costs a length).
constexpr std::uint32_t kMaxStorages = 1u << 20;

constexpr std::uint32_t kHasRRefs = 1;
// Deeper than this, a value is not one a call carries (and the walk below recurses).
constexpr int kMaxDepth = 200;

bool contains_rref(const c10::IValue& v, int depth) {
  if (depth > kMaxDepth) return false;  // the pickler refuses it later, by name
  if (v.isRRef()) return true;
  if (v.isTuple()) {
    for (const auto& e : v.toTupleRef().elements()) {
      if (contains_rref(e, depth + 1)) return true;
    }
  } else if (v.isList()) {
    for (const auto& e : v.toListRef()) {
      if (contains_rref(e, depth + 1)) return true;
    }
  } else if (v.isGenericDict()) {
    for (const auto& entry : v.toGenericDict()) {
      if (contains_rref(entry.value(), depth + 1)) return true;
    }
  }
  return false;
}

// `v` with each RRef replaced by `rref(it)` and, when `marker` is set, each marker tuple by
// `marker(it)`. Containers are rebuilt as generic ones (the pickle does not keep element types).
c10::IValue map_value(const c10::IValue& v, const RRefToMarker& rref, const MarkerToRRef& marker,
                      int depth) {
  if (depth > kMaxDepth) throw ProtocolError("rpc: a value nested deeper than 200 levels");
  if (rref && v.isRRef()) return rref(v.toRRef());
  if (v.isTuple()) {
    const auto& tuple = v.toTupleRef();
    const auto& elements = tuple.elements();
    if (marker && elements.size() == 6 && elements[0].isString() &&
        elements[0].toStringRef() == kRRefMarker) {
      return marker(tuple);
    }
    std::vector<c10::IValue> out;
    out.reserve(elements.size());
    for (const auto& e : elements)
      out.push_back(map_value(e, rref, marker, depth + 1));
    return c10::ivalue::Tuple::create(std::move(out));
  }
  if (v.isList()) {
    c10::impl::GenericList out(c10::AnyType::get());
    for (const auto& e : v.toListRef())
      out.push_back(map_value(e, rref, marker, depth + 1));
    return out;
  }
  if (v.isGenericDict()) {
    const auto dict = v.toGenericDict();
    c10::impl::GenericDict out(dict.keyType(), c10::AnyType::get());
    for (const auto& entry : dict) {
      out.insert(entry.key(), map_value(entry.value(), rref, marker, depth + 1));
    }
    return out;
  }
  return v;
}

// Appends with memcpy: transport::Bytes' allocator constructs element by element otherwise.
void append(transport::Bytes& out, const void* data, std::size_t size) {
  const std::size_t at = out.size();
  out.resize(at + size);
  if (size > 0) std::memcpy(out.data() + at, data, size);
}

template <typename T>
void put(transport::Bytes& out, T value) {
  append(out, &value, sizeof value);
}

}  // namespace

namespace {

transport::Outgoing encode(const c10::IValue& value, const std::string& context,
                           const RRefToMarker& rrefs, bool attach) {
  std::uint32_t flags = 0;
  c10::IValue mapped = value;
  if (rrefs && contains_rref(value, 0)) {
    mapped = map_value(value, rrefs, {}, 0);
    flags |= kHasRRefs;
  }
  std::vector<at::Storage> storages;
  const std::string pickle = ddp::detail::pickle_value(
      mapped, /*ordered_dict_at_top=*/false,
      [&](const std::string&, const at::Storage& storage) { storages.push_back(storage); },
      context);
  std::size_t total = 4 + 4 + 4 + 8 + 4 + 8 * storages.size() + pickle.size();
  for (const auto& s : storages)
    total = aligned(total) + s.nbytes();
  transport::Outgoing message;
  transport::Bytes& out = message.bytes;
  put(out, kMagic);
  put(out, kVersion);
  put(out, flags);
  put(out, static_cast<std::uint64_t>(pickle.size()));
  put(out, static_cast<std::uint32_t>(storages.size()));
  for (const auto& s : storages)
    put(out, static_cast<std::uint64_t>(s.nbytes()));
  static constexpr std::uint8_t kZeros[kStorageAlignment] = {};
  std::size_t attached = 0;  // the attachments' bytes so far
  std::size_t first_attached = storages.size();
  if (attach) {
    for (std::size_t i = 0; i < storages.size(); ++i) {
      if (storages[i].nbytes() >= kAliasedStorageBytes) {
        first_attached = i;
        break;
      }
    }
  }
  std::size_t copied = total;
  if (first_attached < storages.size()) {
    copied = out.size() + pickle.size();
    for (std::size_t i = 0; i < first_attached; ++i)
      copied = aligned(copied) + storages[i].nbytes();
  }
  out.reserve(copied + kStorageAlignment);
  append(out, pickle.data(), pickle.size());
  for (std::size_t i = 0; i < storages.size(); ++i) {
    const at::Storage& s = storages[i];
    const std::size_t at = out.size() + attached;
    const std::size_t padding = aligned(at) - at;
    if (i < first_attached) {
      append(out, kZeros, padding);
      append(out, s.data_ptr().get(), s.nbytes());
      continue;
    }
    attached += padding + s.nbytes();
    if (padding > 0) message.attachments.push_back({kZeros, padding, nullptr});
    if (s.nbytes() > 0) {
      message.attachments.push_back({static_cast<const std::uint8_t*>(s.data_ptr().get()),
                                     s.nbytes(), std::make_shared<at::Storage>(s)});
    }
  }
  return message;
}

}  // namespace

transport::Bytes encode_value(const c10::IValue& value, const std::string& context,
                              const RRefToMarker& rrefs) {
  return encode(value, context, rrefs, /*attach=*/false).bytes;
}

transport::Outgoing encode_value_attached(const c10::IValue& value, const std::string& context,
                                          const RRefToMarker& rrefs) {
  return encode(value, context, rrefs, /*attach=*/true);
}

namespace {

// The storage of `length` bytes at `offset` of the message `owner` holds, left where it is.
at::Storage aliased_storage(const std::shared_ptr<transport::Bytes>& owner, std::size_t offset,
                            std::size_t length) {
  auto* keep = new std::shared_ptr<transport::Bytes>(owner);
  c10::DataPtr data(
      owner->data() + offset, keep,
      [](void* context) { delete static_cast<std::shared_ptr<transport::Bytes>*>(context); },
      c10::Device(c10::kCPU));
  return at::Storage(at::Storage::use_byte_size_t(), static_cast<std::int64_t>(length),
                     std::move(data), /*allocator=*/nullptr, /*resizable=*/false);
}

c10::IValue decode(std::span<const std::uint8_t> bytes,
                   const std::shared_ptr<transport::Bytes>& owner, const std::string& source,
                   const MarkerToRRef& rrefs);

}  // namespace

c10::IValue decode_value(std::span<const std::uint8_t> bytes, const std::string& source,
                         const MarkerToRRef& rrefs) {
  return decode(bytes, nullptr, source, rrefs);
}

c10::IValue decode_value(transport::Bytes&& bytes, const std::string& source,
                         const MarkerToRRef& rrefs) {
  auto owner = std::make_shared<transport::Bytes>(std::move(bytes));
  return decode(std::span<const std::uint8_t>(owner->data(), owner->size()), owner, source, rrefs);
}

namespace {

c10::IValue decode(std::span<const std::uint8_t> bytes,
                   const std::shared_ptr<transport::Bytes>& owner, const std::string& source,
                   const MarkerToRRef& rrefs) {
  std::size_t at = 0;
  auto fail = [&](const std::string& what) {
    return ProtocolError(
        fmt::format("{}: {} (the message has {} bytes)", source, what, bytes.size()));
  };
  auto take = [&]<typename T>(T& value, const char* what) {
    if (bytes.size() - at < sizeof value) throw fail(fmt::format("it ends before its {}", what));
    std::memcpy(&value, bytes.data() + at, sizeof value);
    at += sizeof value;
  };
  std::uint32_t magic = 0, version = 0, flags = 0, count = 0;
  std::uint64_t pickle_bytes = 0;
  take(magic, "magic");
  if (magic != kMagic) throw fail("it is not a ddp RPC value (wrong magic)");
  take(version, "version");
  if (version != kVersion) {
    throw fail(
        fmt::format("it is of version {}, this worker reads {}: run one ddp build on every "
                    "worker",
                    version, kVersion));
  }
  take(flags, "flags");
  if ((flags & ~kHasRRefs) != 0) throw fail(fmt::format("it has unknown flags {:#x}", flags));
  if ((flags & kHasRRefs) != 0 && !rrefs) throw fail("it carries RRefs where none can be");
  take(pickle_bytes, "pickle length");
  take(count, "storage count");
  if (count > kMaxStorages) throw fail(fmt::format("it claims {} storages", count));
  std::vector<std::uint64_t> lengths(count);
  for (auto& length : lengths)
    take(length, "storage lengths");
  std::uint64_t left = bytes.size() - at;
  if (pickle_bytes > left)
    throw fail(fmt::format("its pickle of {} bytes runs past its end", pickle_bytes));
  left -= pickle_bytes;
  std::vector<std::size_t> offsets(count);
  std::size_t offset = at + pickle_bytes;
  for (std::uint32_t i = 0; i < count; ++i) {
    const std::size_t padding = aligned(offset) - offset;
    if (padding > left || lengths[i] > left - padding)
      throw fail(fmt::format("storage {} of {} bytes runs past its end", i, lengths[i]));
    left -= padding + lengths[i];
    offsets[i] = offset + padding;
    offset += padding + lengths[i];
  }
  if (left != 0) throw fail(fmt::format("{} bytes follow its last storage", left));
  const std::string_view pickle(reinterpret_cast<const char*>(bytes.data() + at), pickle_bytes);
  c10::IValue value = ddp::detail::unpickle_restricted(
      pickle,
      [&](const ddp::detail::StorageRequest& request) {
        std::uint32_t index = 0;
        try {
          std::size_t parsed = 0;
          const unsigned long value = std::stoul(request.key, &parsed);
          if (parsed != request.key.size() || value >= count) throw std::out_of_range("key");
          index = static_cast<std::uint32_t>(value);
        } catch (const std::logic_error&) {
          throw fail(fmt::format("its pickle names a storage '{}' it does not carry",
                                 request.key.substr(0, 40)));
        }
        const auto element = static_cast<std::uint64_t>(c10::elementSize(request.dtype));
        if (request.numel < 0 ||
            static_cast<std::uint64_t>(request.numel) >
                std::numeric_limits<std::uint64_t>::max() / element ||
            static_cast<std::uint64_t>(request.numel) * element != lengths[index]) {
          throw fail(
              fmt::format("storage {} has {} bytes, not the {} elements of {} its pickle "
                          "says",
                          index, lengths[index], request.numel, c10::toString(request.dtype)));
        }
        if (owner != nullptr && lengths[index] >= kAliasedStorageBytes) {
          return aliased_storage(owner, offsets[index], lengths[index]);
        }
        auto tensor = at::empty({request.numel}, at::TensorOptions().dtype(request.dtype));
        if (lengths[index] > 0) {
          std::memcpy(tensor.data_ptr(), bytes.data() + offsets[index], lengths[index]);
        }
        return tensor.storage();
      },
      source);
  if ((flags & kHasRRefs) != 0) value = map_value(value, {}, rrefs, 0);
  return value;
}

}  // namespace

}  // namespace ddp::rpc::detail
