// libFuzzer harness: the ring backend's 32-byte operation header as read off the wire
// (src/comm/wire.h). A receiver that finds a header other than the one it expects names the
// peer's call with describe(); whatever the peer sent, that must produce a message, not crash
// (enum values out of range, a corrupt magic, any dtype or reduce op byte).
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "comm/wire.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using ddp::comm::OpHeader;
  if (size < sizeof(OpHeader)) return 0;
  OpHeader header;
  std::memcpy(&header, data, sizeof header);
  const int peer = size > sizeof header ? static_cast<std::int8_t>(data[sizeof header]) : -1;
  for (const bool as_receiver : {false, true}) {
    const std::string text = ddp::comm::describe(header, peer, as_receiver);
    if (text.empty()) {
      std::fprintf(stderr, "describe() returned nothing\n");
      std::abort();
    }
  }
  OpHeader copy;
  std::memcpy(&copy, &header, sizeof copy);
  if (!(copy == header)) {
    std::fprintf(stderr, "a header differs from its own copy\n");
    std::abort();
  }
  return 0;
}
