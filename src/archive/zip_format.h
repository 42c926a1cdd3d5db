// The byte layout of a zip archive (PKWARE's APPNOTE 6.3) as the reader needs it: signatures,
// fixed sizes, little-endian fields, overflow-free bounds. Internal to the archive layer.
#pragma once

#include <cstdint>
#include <string>

#include "archive/archive_error.h"

namespace ddp::archive::zip {

inline constexpr std::uint32_t kLocalHeader = 0x04034b50;
inline constexpr std::uint32_t kCentralHeader = 0x02014b50;
inline constexpr std::uint32_t kEndRecord = 0x06054b50;
inline constexpr std::uint32_t kZip64EndRecord = 0x06064b50;
inline constexpr std::uint32_t kZip64Locator = 0x07064b50;
inline constexpr std::size_t kEndRecordBytes = 22;
inline constexpr std::size_t kZip64EndRecordBytes = 56;
inline constexpr std::size_t kZip64LocatorBytes = 20;
inline constexpr std::size_t kCentralHeaderBytes = 46;
inline constexpr std::size_t kLocalHeaderBytes = 30;
// Deflate's largest ratio: a block of 258-byte matches costs at least about 2 bits per match.
inline constexpr std::uint64_t kMaxDeflateRatio = 1032;

[[noreturn]] inline void damaged(const std::string& what) {
  throw FormatError(FormatError::Kind::kDamaged, what);
}

inline std::uint64_t le(const unsigned char* p, int bytes) {
  std::uint64_t v = 0;
  for (int i = 0; i < bytes; ++i)
    v |= std::uint64_t{p[i]} << (8 * i);
  return v;
}
inline std::uint16_t u16(const unsigned char* p) {
  return static_cast<std::uint16_t>(le(p, 2));
}
inline std::uint32_t u32(const unsigned char* p) {
  return static_cast<std::uint32_t>(le(p, 4));
}
inline std::uint64_t u64(const unsigned char* p) {
  return le(p, 8);
}

// a + b <= limit, without overflow.
inline bool fits(std::uint64_t a, std::uint64_t b, std::uint64_t limit) {
  return a <= limit && b <= limit - a;
}

}  // namespace ddp::archive::zip
