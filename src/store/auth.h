// Shared-secret authentication of store connections: an HMAC-SHA256 challenge in each direction.
//
// The server sends a random nonce; the client answers with HMAC(secret, "ddp-store client" ||
// nonce) and a nonce of its own; the server answers that with HMAC(secret, "ddp-store server" ||
// client nonce). Each side thus proves it knows the secret without sending it. This keeps other
// jobs and strangers on the network off a store; it does not encrypt or sign later frames.
//
// Needs OpenSSL at build time (DDP_STORE_HAVE_OPENSSL); without it auth_available() is false and
// the other functions throw ConfigError. Thread-safe.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

namespace ddp::store {

inline constexpr std::size_t kNonceBytes = 32;
inline constexpr std::size_t kMacBytes = 32;
using Nonce = std::array<std::uint8_t, kNonceBytes>;
using Mac = std::array<std::uint8_t, kMacBytes>;

inline constexpr std::string_view kClientRole = "ddp-store client";
inline constexpr std::string_view kServerRole = "ddp-store server";

bool auth_available();
// Throws ConfigError (with what to do) when auth_available() is false.
void require_auth();
Nonce random_nonce();
Mac auth_mac(std::string_view secret, std::string_view role, std::span<const std::uint8_t> nonce);
// Constant-time comparison, so a wrong answer does not leak how much of it was right.
bool macs_equal(std::span<const std::uint8_t> a, std::span<const std::uint8_t> b);

}  // namespace ddp::store
