// FNV-1a fingerprints of bytes, the same on every rank and build (std::hash is not specified to
// be): what the agreement checks (rank_agreement.h, Join, the tensor-parallel layers) compare
// across ranks instead of the texts or tensors themselves.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace ddp::detail {

inline std::uint64_t fingerprint(const void* data, std::size_t size) {
  const auto* bytes = static_cast<const unsigned char*>(data);
  std::uint64_t hash = 14695981039346656037ull;
  for (std::size_t i = 0; i < size; ++i) {
    hash ^= bytes[i];
    hash *= 1099511628211ull;
  }
  return hash;
}

inline std::uint64_t fingerprint(std::string_view text) {
  return fingerprint(text.data(), text.size());
}

}  // namespace ddp::detail
