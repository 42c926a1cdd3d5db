#include "rpc/frame.h"

#include <zlib.h>

#include <cstring>

#include <fmt/format.h>

#include "ddp/error.h"

namespace ddp::rpc::transport {
namespace {

template <typename T>
void put(std::uint8_t* at, T value) {
  std::memcpy(at, &value, sizeof value);
}

template <typename T>
T take(const std::uint8_t* at) {
  T value;
  std::memcpy(&value, at, sizeof value);
  return value;
}

std::uint32_t crc_of(const std::uint8_t* bytes, std::size_t size) {
  return static_cast<std::uint32_t>(::crc32(0L, bytes, static_cast<uInt>(size)));
}

// Offsets of the fields.
constexpr std::size_t kMagicAt = 0, kVersionAt = 4, kKindAt = 5, kFlagsAt = 6, kCallAt = 8,
                      kTimeoutAt = 16, kNameAt = 20, kPayloadAt = 24, kCrcAt = 32;
static_assert(kCrcAt + 4 == kFrameHeaderBytes);

}  // namespace

std::array<std::uint8_t, kFrameHeaderBytes> encode_frame_header(const FrameHeader& header) {
  std::array<std::uint8_t, kFrameHeaderBytes> out{};
  put(out.data() + kMagicAt, kFrameMagic);
  out[kVersionAt] = kFrameVersion;
  out[kKindAt] = static_cast<std::uint8_t>(header.kind);
  out[kFlagsAt] = header.payload_in_ring ? kFrameInRing : 0;
  put(out.data() + kCallAt, header.call_id);
  put(out.data() + kTimeoutAt, header.timeout_ms);
  put(out.data() + kNameAt, header.name_bytes);
  put(out.data() + kPayloadAt, header.payload_bytes);
  put(out.data() + kCrcAt, crc_of(out.data(), kCrcAt));
  return out;
}

FrameHeader decode_frame_header(const std::uint8_t* bytes, const FrameLimits& limits,
                                const std::string& peer) {
  auto refuse = [&](const std::string& what) {
    return ProtocolError(
        fmt::format("rpc: a frame from {} {}; the connection is closed", peer, what));
  };
  if (take<std::uint32_t>(bytes + kMagicAt) != kFrameMagic) {
    throw refuse(
        "does not start with ddp's RPC magic (not a ddp RPC peer, or the stream lost "
        "its place)");
  }
  if (take<std::uint32_t>(bytes + kCrcAt) != crc_of(bytes, kCrcAt)) {
    throw refuse("has a header whose CRC-32 does not match its bytes");
  }
  if (bytes[kVersionAt] != kFrameVersion) {
    throw refuse(
        fmt::format("is of version {}, this worker speaks {}: run one ddp build on "
                    "every worker",
                    bytes[kVersionAt], kFrameVersion));
  }
  FrameHeader header;
  const std::uint8_t kind = bytes[kKindAt];
  if (kind < 1 || kind > 5) throw refuse(fmt::format("has the unknown kind {}", kind));
  header.kind = static_cast<FrameKind>(kind);
  const std::uint8_t flags = bytes[kFlagsAt];
  if ((flags & ~kFrameInRing) != 0 || bytes[kFlagsAt + 1] != 0) {
    throw refuse(fmt::format("has the unknown flags {:#04x} {:#04x}", flags, bytes[kFlagsAt + 1]));
  }
  header.payload_in_ring = flags == kFrameInRing;
  if (header.payload_in_ring && kind != 1 && kind != 2) {
    throw refuse(fmt::format("of kind {} says its payload is in shared memory", kind));
  }
  header.call_id = take<std::uint64_t>(bytes + kCallAt);
  header.timeout_ms = take<std::uint32_t>(bytes + kTimeoutAt);
  header.name_bytes = take<std::uint32_t>(bytes + kNameAt);
  header.payload_bytes = take<std::uint64_t>(bytes + kPayloadAt);
  if (header.name_bytes > limits.max_name_bytes) {
    throw refuse(fmt::format("names {} bytes, more than the limit of {}", header.name_bytes,
                             limits.max_name_bytes));
  }
  if (header.payload_bytes > limits.max_payload_bytes) {
    throw refuse(
        fmt::format("carries {} bytes, more than this worker's limit of {} "
                    "(RpcOptions::max_message_bytes)",
                    header.payload_bytes, limits.max_payload_bytes));
  }
  return header;
}

}  // namespace ddp::rpc::transport
