// The bytes of a value in an RPC message (internal; rpc.h): libtorch's pickle, as torch.save
// writes it (formats/pytorch_archive.h), with the tensors' storages beside it instead of in a zip:
//
//   "DRPV" | version (u32) | pickle bytes (u64) | storages (u32) | each storage's bytes (u64) |
//   the pickle | the storages' bytes, in order
//
// Reading checks that the lengths add up to exactly the message, that every storage the pickle
// names exists and has the bytes its dtype and element count need, and reads the pickle through
// the allowlist unpickler (nothing in it is executed; depth and size limits). Storages are copied
// out of the message, so tensors are aligned and own their memory.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include <ATen/core/ivalue.h>

namespace ddp::rpc::detail {

// Throws ddp::Error, starting with `context`, for a value of a kind RPC does not carry.
std::vector<std::uint8_t> encode_value(const c10::IValue& value, const std::string& context);

// Throws ProtocolError (the lengths, magic or version are wrong; a storage is missing or of the
// wrong size) or the unpickler's StateDictFormatError and UnsafePickleError, naming `source`.
c10::IValue decode_value(std::span<const std::uint8_t> bytes, const std::string& source);

}  // namespace ddp::rpc::detail
