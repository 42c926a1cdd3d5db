// Shared-secret authentication of store connections: an HMAC-SHA256 challenge in each direction.
//
// The server sends a random nonce; the client answers with HMAC(secret, "ddp-store client" ||
// nonce) and a nonce of its own; the server answers that with HMAC(secret, "ddp-store server" ||
// client nonce). Each side thus proves it knows the secret without sending it. This keeps other
// jobs and strangers on the network off a store; it does not encrypt or sign later frames.
//
// The primitives (nonces, MACs, their constant-time comparison) are the auth module's
// (auth/hmac.h), shared with the ring's mesh handshake; what is the store's is its two roles.
// Thread-safe.
#pragma once

#include <string_view>

#include "auth/hmac.h"

namespace ddp::store {

// The roles of the store's handshake: a MAC for one never answers the other (nor the mesh's).
inline constexpr std::string_view kClientRole = "ddp-store client";
inline constexpr std::string_view kServerRole = "ddp-store server";

}  // namespace ddp::store
