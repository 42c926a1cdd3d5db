// The frames of ddp's RPC connections (internal; agent.h): a fixed header, then the function (or
// exception type) name, then the payload.
//
//   magic "DRPC" | version | kind | flags | reserved | call id | timeout ms | name bytes
//   | payload bytes | CRC-32 of the 32 bytes before it
//
// Flag 1 (kInRing): the payload is not on the connection but in the sender's shared-memory ring
// (shared_ring.h), which the receiver copies it out of; only requests and replies carry it.
//
// All fields little-endian, as the hosts ddp runs on. The header's CRC catches a stream that
// lost its place (a peer that is not ddp, a torn write) before any length in it is trusted; the
// lengths are then checked against the receiver's limits before a byte is allocated. The payload
// is not checksummed: TCP does that, and a CRC over a 1 MiB tensor would cost more than the call.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

namespace ddp::rpc::transport {

inline constexpr std::uint32_t kFrameMagic = 0x43505244;  // "DRPC"
inline constexpr std::uint8_t kFrameVersion = 2;
inline constexpr std::size_t kFrameHeaderBytes = 36;

enum class FrameKind : std::uint8_t {
  kRequest = 1,     // name: the function; payload: its arguments
  kReply = 2,       // payload: the result
  kFailure = 3,     // name: the failure kind's text and the exception type; payload: the message
  kRingOffer = 4,   // payload: a RingOffer (shared_ring.h); either side, once per connection
  kRingAnswer = 5,  // payload: a RingAnswer to the other side's offer
};
inline constexpr std::uint8_t kFrameInRing = 1;

struct FrameHeader {
  FrameKind kind = FrameKind::kRequest;
  std::uint64_t call_id = 0;
  std::uint32_t timeout_ms = 0;  // a request's time left when sent (0 for replies)
  std::uint32_t name_bytes = 0;
  std::uint64_t payload_bytes = 0;
  bool payload_in_ring = false;  // kFrameInRing
};

struct FrameLimits {
  std::uint32_t max_name_bytes = 1024;
  std::uint64_t max_payload_bytes = std::uint64_t{1} << 30;
};

std::array<std::uint8_t, kFrameHeaderBytes> encode_frame_header(const FrameHeader& header);

// Decodes and checks a header: magic, version, kind, CRC, and the lengths against `limits`.
// Throws ProtocolError naming the field that is wrong (and `peer`).
FrameHeader decode_frame_header(const std::uint8_t* bytes, const FrameLimits& limits,
                                const std::string& peer);

}  // namespace ddp::rpc::transport
