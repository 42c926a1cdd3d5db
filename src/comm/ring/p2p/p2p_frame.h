// Wire format of the ring backend's point-to-point connections (internal; see p2p_engine.h).
//
// Every frame starts with a 32-byte P2pFrame. A message travels either eagerly (kEager: the
// header and its payload at once, buffered by the receiver when no receive is posted yet; only
// while the sender holds enough credit, see p2p_engine.h) or by rendezvous (kRequest: the header
// alone; the receiver answers kClearToSend once a matching receive is posted, and the sender
// then streams kData with the payload straight into the receive buffer). kCredit returns eager
// buffer space to the sender; kReject tells the sender its message met a receive with another
// count or dtype (the frame carries the receive's call, so both ranks can name both calls).
// Both ends share byte order (the handshake checks it).
#pragma once

#include <cstdint>

namespace ddp::comm::p2p {

inline constexpr std::uint32_t kFrameMagic = 0x50504444;  // "DDPP"

enum class FrameType : std::uint8_t {
  kEager = 1,        // message header + payload
  kRequest = 2,      // message header; payload follows kData once cleared
  kClearToSend = 3,  // receiver -> sender: send the payload of `message`
  kData = 4,         // payload of `message` (count elements of dtype)
  kCredit = 5,       // receiver -> sender: `count` bytes of eager buffer are free again
  kReject = 6,       // receiver -> sender: `message` met a receive of (dtype, count, tag, aux);
                     // followed by the message's own frame (so a send that already completed
                     // can still be named)
};

struct P2pFrame {
  std::uint32_t magic = kFrameMagic;
  FrameType type = FrameType::kEager;
  std::uint8_t dtype = 0;
  std::uint16_t reserved = 0;
  std::int32_t tag = 0;
  std::uint32_t aux = 0;      // kReject: the receive's number (low 32 bits)
  std::uint64_t message = 0;  // the sender's number of the message, per (sender, receiver)
  std::uint64_t count = 0;    // elements; kCredit: bytes
};
static_assert(sizeof(P2pFrame) == 32);

}  // namespace ddp::comm::p2p
