// What the two sides of the mesh handshake share (internal to comm/ring/): the nonce and MAC sizes,
// and the hello's bytes and checks (mesh_handshake.cc; the acceptor side is mesh_acceptor.cc).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "auth/hmac.h"
#include "comm/ring/mesh_handshake.h"

namespace ddp::comm {

inline constexpr std::size_t kNonceBytes = auth::kNonceBytes;
inline constexpr std::size_t kMacBytes = auth::kMacBytes;

// What is wrong with a hello's magic and version, or "" when they are right.
std::string check_magic_and_version(const HandshakeParams& params, const Hello& hello);

// What is wrong with the group a hello describes, or "".
std::string check_group(const HandshakeParams& params, const Hello& hello, const std::string& name);

void append(std::vector<std::uint8_t>& out, const void* data, std::size_t len);

// The hello (and group name) this rank sends, as bytes.
std::vector<std::uint8_t> hello_bytes(const HandshakeParams& params, int to);

}  // namespace ddp::comm
