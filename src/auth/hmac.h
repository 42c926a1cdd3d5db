// The shared-secret primitives of the job's authentication: random nonces and HMAC-SHA256 proofs,
// compared in constant time. The store's handshake (store/auth.h) and the ring's mesh handshake
// (comm/ring/mesh_handshake.cc) build their challenge-response on these, each with role strings
// of its own so that a proof for one can never answer the other (docs/security.md).
//
// Needs OpenSSL at build time (DDP_AUTH_HAVE_OPENSSL); without it auth_available() is false and
// the other functions throw ConfigError. Thread-safe.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

namespace ddp::auth {

inline constexpr std::size_t kNonceBytes = 32;
inline constexpr std::size_t kMacBytes = 32;
using Nonce = std::array<std::uint8_t, kNonceBytes>;
using Mac = std::array<std::uint8_t, kMacBytes>;

bool auth_available();
// Throws ConfigError (with what to do) when auth_available() is false.
void require_auth();
// 32 fresh random bytes (getrandom(2), OpenSSL's generator if that fails).
Nonce random_nonce();
// HMAC-SHA256(secret, role || nonce): the proof that the side playing `role` knows the secret.
Mac auth_mac(std::string_view secret, std::string_view role, std::span<const std::uint8_t> nonce);
// Constant-time comparison, so a wrong answer does not leak how much of it was right.
bool macs_equal(std::span<const std::uint8_t> a, std::span<const std::uint8_t> b);

}  // namespace ddp::auth
