// The value of a call or a reply as a message: (autograd record, value), RRefs as forks.
#include <fmt/format.h>

#include "ddp/error.h"
#include "torch/rpc/rpc_internal.h"
#include "torch/rpc/rpc_values.h"

namespace ddp::rpc::detail {

transport::Outgoing encode_message(const c10::IValue& value, const std::string& context,
                                   int to_rank) {
  const c10::IValue record = record_send(value, to_rank);
  return encode_value_attached(c10::ivalue::Tuple::create({record, value}), context,
                               fork_for_message);
}

Decoded decode_message(transport::Bytes&& bytes, const std::string& source, int from_rank) {
  const c10::IValue outer = decode_value(std::move(bytes), source, rref_from_marker);
  if (!outer.isTuple() || outer.toTupleRef().elements().size() != 2) {
    throw ProtocolError(fmt::format("{}: not a ddp RPC message (a pair)", source));
  }
  const auto& elements = outer.toTupleRef().elements();
  Decoded decoded{elements[1], 0};
  if (!elements[0].isNone()) {
    decoded.autograd_context = record_receive(elements[0], decoded.value, from_rank);
  }
  return decoded;
}

}  // namespace ddp::rpc::detail
