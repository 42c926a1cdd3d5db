// The bytes of a value in an RPC message (internal; rpc.h): libtorch's pickle, as torch.save
// writes it (formats/pytorch_archive.h), with the tensors' storages beside it instead of in a zip:
//
//   "DRPV" | version (u32, 2) | flags (u32) | pickle bytes (u64) | storages (u32) |
//   each storage's bytes (u64) | the pickle | the storages' bytes, in order, each from an offset
//   that is a multiple of 64 (zeros between)
//
// An RRef cannot be pickled: the writer's `rrefs` hook turns each into a marker tuple
// ("__ddp_rref__", five ints; flag bit 0 says the message has some), and the reader's turns the
// markers back (rref.cc: the ints name the owner, the RRef and the receiver's fork).
//
// Reading checks that the lengths add up to exactly the message, that every storage the pickle
// names exists and has the bytes its dtype and element count need, and reads the pickle through
// the allowlist unpickler (nothing in it is executed; depth and size limits). Small storages are
// copied out of the message; large ones, given the message itself, stay where it was received.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include <ATen/core/ivalue.h>

#include "rpc/call_future.h"

namespace ddp::rpc::detail {

using RRefToMarker = std::function<c10::IValue(const c10::intrusive_ptr<c10::RRefInterface>&)>;
using MarkerToRRef = std::function<c10::IValue(const c10::ivalue::Tuple& marker)>;
inline constexpr const char* kRRefMarker = "__ddp_rref__";

// Throws ddp::Error, starting with `context`, for a value of a kind RPC does not carry (an RRef
// without `rrefs`).
transport::Bytes encode_value(const c10::IValue& value, const std::string& context,
                              const RRefToMarker& rrefs = {});
// The same bytes, with the storages from the first of kAliasedStorageBytes or more on sent from
// the tensors' own memory (attachments), not copied into the message.
transport::Outgoing encode_value_attached(const c10::IValue& value, const std::string& context,
                                          const RRefToMarker& rrefs = {});

// Throws ProtocolError (the lengths, magic or version are wrong; a storage is missing or of the
// wrong size) or the unpickler's StateDictFormatError and UnsafePickleError, naming `source`.
c10::IValue decode_value(std::span<const std::uint8_t> bytes, const std::string& source,
                         const MarkerToRRef& rrefs = {});
// The same, taking the message: its storages of kAliasedStorageBytes or more become tensors that
// live in the message's own memory (kept alive by them; not resizable), the rest are copied.
inline constexpr std::size_t kAliasedStorageBytes = 64 << 10;
c10::IValue decode_value(transport::Bytes&& bytes, const std::string& source,
                         const MarkerToRRef& rrefs = {});

}  // namespace ddp::rpc::detail
