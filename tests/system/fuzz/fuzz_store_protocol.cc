// libFuzzer harness: the store protocol's frame codec (src/store/protocol.{h,cc}) without sockets.
//
// The input is a stream of frames ([u32 length][u8 code][fields]). Each frame is decoded with
// FrameReader following the field layout of its opcode (docs/store.md), as the server does. A
// frame that decodes completely must encode back, through FrameWriter, to exactly its own bytes;
// one that does not must fail with ProtocolError only. printable() of every decoded key must be
// printable ASCII of bounded length (it goes into log lines and error messages).
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <span>
#include <string>
#include <vector>

#include "ddp/error.h"
#include "store/protocol.h"

namespace {

using ddp::store::FrameReader;
using ddp::store::FrameWriter;
using ddp::store::Opcode;

void check_printable(const std::string& text) {
  constexpr std::size_t kMax = 40;
  const std::string shown = ddp::store::printable(text, kMax);
  // At most kMax characters, plus one escape started at the limit, plus "...".
  if (shown.size() > kMax + 3 + 3) {
    std::fprintf(stderr, "printable(): %zu characters for a limit of %zu\n", shown.size(), kMax);
    std::abort();
  }
  for (const char c : shown) {
    if (static_cast<unsigned char>(c) < 0x20 || static_cast<unsigned char>(c) >= 0x7f) {
      std::fprintf(stderr, "printable(): byte 0x%02x left unescaped\n", c & 0xff);
      std::abort();
    }
  }
}

// Decodes one request body as the server would and re-encodes it; returns the re-encoded frame.
std::vector<std::uint8_t> round_trip(std::span<const std::uint8_t> body) {
  const std::uint8_t code = body[0];
  FrameReader in(body.subspan(1));
  FrameWriter out(code);
  auto key = [&] {
    std::string k = in.string("key", ddp::store::kMaxKeyBytes);
    check_printable(k);
    out.bytes(k);
  };
  auto value = [&](const char* field) { out.bytes(in.bytes(field, ddp::store::kMaxValueBytes)); };
  switch (static_cast<Opcode>(code)) {
    case Opcode::kSet:
      key();
      value("value");
      break;
    case Opcode::kGet:
    case Opcode::kDelete:
      key();
      break;
    case Opcode::kAdd:
      key();
      out.i64(in.i64("delta"));
      break;
    case Opcode::kCompareSet:
      key();
      value("expected");
      value("desired");
      break;
    case Opcode::kCheck:
    case Opcode::kWait: {
      const std::uint32_t count = in.u32("key count");
      if (count > ddp::store::kMaxKeysPerRequest) return {};
      out.u32(count);
      for (std::uint32_t i = 0; i < count; ++i)
        key();
      break;
    }
    case Opcode::kNumKeys:
    case Opcode::kCancel:
      break;
    default:
      return {};  // unknown opcode: the server drops the connection before reading fields
  }
  in.expect_end(ddp::store::opcode_name(static_cast<Opcode>(code)));
  return out.finish();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::span<const std::uint8_t> rest(data, size);
  while (rest.size() >= 4) {
    const std::uint32_t length = ddp::store::get_u32(rest.data());
    if (length == 0 || length > rest.size() - 4) break;
    const auto frame = rest.first(4 + std::size_t{length});
    rest = rest.subspan(frame.size());
    try {
      const auto encoded = round_trip(frame.subspan(4));
      if (!encoded.empty() &&
          !std::equal(encoded.begin(), encoded.end(), frame.begin(), frame.end())) {
        std::fprintf(stderr, "store frame of %u bytes does not re-encode to itself\n", length);
        std::abort();
      }
    } catch (const ddp::ProtocolError&) {
      // A malformed frame, refused as the server would.
    }
  }
  return 0;
}
