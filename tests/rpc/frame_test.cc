// The RPC frame header (src/rpc/frame.h): what is encoded decodes to the same fields, and every
// field a stream can get wrong is refused by name before a length is trusted; worker names.
#include <gtest/gtest.h>

#include <zlib.h>

#include <cstring>
#include <string>

#include "ddp/error.h"
#include "rpc/frame.h"
#include "rpc/worker_directory.h"

namespace ddp::rpc::transport {
namespace {

std::string refusal(std::array<std::uint8_t, kFrameHeaderBytes> bytes, FrameLimits limits = {}) {
  try {
    decode_frame_header(bytes.data(), limits, "peer p");
  } catch (const ProtocolError& e) {
    return e.what();
  }
  return "accepted";
}

TEST(RpcFrame, RoundTripsEveryField) {
  const FrameHeader in{FrameKind::kFailure, 0x1122334455667788ull, 1234, 17, (1ull << 30)};
  const auto bytes = encode_frame_header(in);
  const FrameHeader out = decode_frame_header(bytes.data(), {}, "peer");
  EXPECT_EQ(out.kind, in.kind);
  EXPECT_EQ(out.call_id, in.call_id);
  EXPECT_EQ(out.timeout_ms, in.timeout_ms);
  EXPECT_EQ(out.name_bytes, in.name_bytes);
  EXPECT_EQ(out.payload_bytes, in.payload_bytes);
}

TEST(RpcFrame, EveryDamagedFieldIsNamed) {
  const auto good = encode_frame_header({FrameKind::kRequest, 7, 100, 4, 64});
  auto bytes = good;
  bytes[0] ^= 1;
  EXPECT_NE(refusal(bytes).find("magic"), std::string::npos) << refusal(bytes);
  // Any flipped bit after the magic is caught by the CRC before the field is read.
  for (std::size_t at = 4; at < kFrameHeaderBytes; ++at) {
    bytes = good;
    bytes[at] ^= 0x10;
    EXPECT_NE(refusal(bytes).find("CRC"), std::string::npos)
        << "byte " << at << ": " << refusal(bytes);
  }
  EXPECT_NE(refusal(good, {.max_name_bytes = 3}).find("names 4 bytes"), std::string::npos);
  EXPECT_NE(refusal(good, {.max_payload_bytes = 63}).find("carries 64 bytes"), std::string::npos);
  EXPECT_NE(refusal(good).find("accepted"), std::string::npos);
}

TEST(RpcFrame, AnUnknownKindIsRefusedEvenWithAGoodCrc) {
  FrameHeader header{FrameKind::kRequest, 1, 1, 0, 0};
  header.kind = static_cast<FrameKind>(9);
  const auto bytes = encode_frame_header(header);
  EXPECT_NE(refusal(bytes).find("unknown kind 9"), std::string::npos) << refusal(bytes);
}

TEST(RpcFrame, OnlyRequestsAndRepliesCarryTheirPayloadInSharedMemoryAndUnknownFlagsAreRefused) {
  FrameHeader header{FrameKind::kReply, 3, 0, 0, 1 << 20};
  header.payload_in_ring = true;
  EXPECT_TRUE(decode_frame_header(encode_frame_header(header).data(), {}, "p").payload_in_ring);
  header.kind = FrameKind::kRingOffer;
  const auto offer = encode_frame_header(header);
  EXPECT_NE(refusal(offer).find("of kind 4 says its payload is in shared memory"),
            std::string::npos)
      << refusal(offer);
  // A flag this build does not know, under a CRC that matches.
  auto bytes = encode_frame_header({FrameKind::kRequest, 1, 1, 0, 0});
  bytes[6] = 0x80;
  const std::uint32_t crc = static_cast<std::uint32_t>(::crc32(0L, bytes.data(), 32));
  std::memcpy(bytes.data() + 32, &crc, 4);
  EXPECT_NE(refusal(bytes).find("unknown flags 0x80"), std::string::npos) << refusal(bytes);
}

TEST(RpcWorkerName, LettersDigitsAndSomePunctuationOnly) {
  EXPECT_NO_THROW(check_worker_name("ps"));
  EXPECT_NO_THROW(check_worker_name("trainer_1.a:b-c"));
  EXPECT_THROW(check_worker_name(""), ConfigError);
  EXPECT_THROW(check_worker_name(std::string(129, 'a')), ConfigError);
  try {
    check_worker_name("bad name");
    FAIL() << "a space was accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("0x20 at 3"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace ddp::rpc::transport
