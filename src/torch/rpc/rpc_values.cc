#include "torch/rpc/rpc_values.h"

#include <cstring>
#include <limits>

#include <fmt/format.h>

#include "ddp/error.h"
#include "torch/formats/pytorch_archive.h"

namespace ddp::rpc::detail {
namespace {

constexpr std::uint32_t kMagic = 0x56505244;  // "DRPV"
constexpr std::uint32_t kVersion = 1;
// More storages than this in one message is not a value anyone sends (and each costs a length).
constexpr std::uint32_t kMaxStorages = 1u << 20;

template <typename T>
void put(std::vector<std::uint8_t>& out, T value) {
  const auto* bytes = reinterpret_cast<const std::uint8_t*>(&value);
  out.insert(out.end(), bytes, bytes + sizeof value);
}

}  // namespace

std::vector<std::uint8_t> encode_value(const c10::IValue& value, const std::string& context) {
  std::vector<at::Storage> storages;
  const std::string pickle = ddp::detail::pickle_value(
      value, /*ordered_dict_at_top=*/false,
      [&](const std::string&, const at::Storage& storage) { storages.push_back(storage); },
      context);
  std::size_t total = 4 + 4 + 8 + 4 + 8 * storages.size() + pickle.size();
  for (const auto& s : storages)
    total += s.nbytes();
  std::vector<std::uint8_t> out;
  out.reserve(total);
  put(out, kMagic);
  put(out, kVersion);
  put(out, static_cast<std::uint64_t>(pickle.size()));
  put(out, static_cast<std::uint32_t>(storages.size()));
  for (const auto& s : storages)
    put(out, static_cast<std::uint64_t>(s.nbytes()));
  out.insert(out.end(), pickle.begin(), pickle.end());
  for (const auto& s : storages) {
    const auto* data = static_cast<const std::uint8_t*>(s.data_ptr().get());
    if (s.nbytes() > 0) out.insert(out.end(), data, data + s.nbytes());
  }
  return out;
}

c10::IValue decode_value(std::span<const std::uint8_t> bytes, const std::string& source) {
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
  std::uint32_t magic = 0, version = 0, count = 0;
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
    if (lengths[i] > left)
      throw fail(fmt::format("storage {} of {} bytes runs past its end", i, lengths[i]));
    left -= lengths[i];
    offsets[i] = offset;
    offset += lengths[i];
  }
  if (left != 0) throw fail(fmt::format("{} bytes follow its last storage", left));
  const std::string_view pickle(reinterpret_cast<const char*>(bytes.data() + at), pickle_bytes);
  std::vector<bool> used(count, false);
  return ddp::detail::unpickle_restricted(
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
        used[index] = true;
        auto tensor = at::empty({request.numel}, at::TensorOptions().dtype(request.dtype));
        if (lengths[index] > 0) {
          std::memcpy(tensor.data_ptr(), bytes.data() + offsets[index], lengths[index]);
        }
        return tensor.storage();
      },
      source);
}

}  // namespace ddp::rpc::detail
