#include "comm/wire.h"

#include <fmt/format.h>

namespace ddp::comm {

std::string_view to_string(Algorithm algorithm) {
  switch (algorithm) {
    case Algorithm::kNone:
      return "none";
    case Algorithm::kRing:
      return "ring";
    case Algorithm::kRecursiveDoubling:
      return "recursive-doubling";
    case Algorithm::kChain:
      return "chain";
    case Algorithm::kBinomialTree:
      return "binomial-tree";
    case Algorithm::kDirect:
      return "direct";
    case Algorithm::kSharedMemory:
      return "shared-memory";
    case Algorithm::kHierarchical:
      return "hierarchical";
  }
  return "unknown-algorithm";
}

std::string describe(const OpHeader& h, int peer, bool as_receiver) {
  if (h.magic != kHeaderMagic) {
    return fmt::format("<not a ddp header: magic {:#x}>", h.magic);
  }
  if (h.dtype > static_cast<std::uint8_t>(DType::kInt64) || h.kind > Collective::kSend) {
    return fmt::format("<corrupt header: kind {} dtype {}>", static_cast<int>(h.kind),
                       static_cast<int>(h.dtype));
  }
  const auto dtype = to_string(static_cast<DType>(h.dtype));
  const std::string reduce_op =
      h.reduce_op == kNoReduceOp ? std::string("?")
                                 : (h.reduce_op <= static_cast<std::uint8_t>(ReduceOp::kBxor)
                                        ? std::string(to_string(static_cast<ReduceOp>(h.reduce_op)))
                                        : fmt::format("op{}", h.reduce_op));
  switch (h.kind) {
    case Collective::kAllreduce:
      return fmt::format("allreduce({} x {}, {}) #{}", dtype, h.count, reduce_op, h.sequence);
    case Collective::kBroadcast:
      return fmt::format("broadcast({} x {}, root {}) #{}", dtype, h.count, h.root, h.sequence);
    case Collective::kReduce:
      return fmt::format("reduce({} x {}, {}, root {}) #{}", dtype, h.count, reduce_op, h.root,
                         h.sequence);
    case Collective::kAllgather:
      return fmt::format("allgather({} x {} per rank) #{}", dtype, h.count, h.sequence);
    case Collective::kGather:
      return fmt::format("gather({} x {} per rank, root {}) #{}", dtype, h.count, h.root,
                         h.sequence);
    case Collective::kScatter:
      return fmt::format("scatter({} x {} per rank, root {}) #{}", dtype, h.count, h.root,
                         h.sequence);
    case Collective::kReduceScatter:
      return fmt::format("reduce_scatter({} x {} per rank, {}) #{}", dtype, h.count, reduce_op,
                         h.sequence);
    case Collective::kAlltoall:
      return fmt::format("alltoall({} x {} per rank) #{}", dtype, h.count, h.sequence);
    case Collective::kBarrier:
      return fmt::format("barrier() #{}", h.sequence);
    case Collective::kSend:
      if (peer < 0) {
        return fmt::format("{}({} x {}, tag {}) #{}", as_receiver ? "recv" : "send", dtype, h.count,
                           h.root, h.sequence);
      }
      return fmt::format("{}({} x {}, tag {}) {} rank {} #{}", as_receiver ? "recv" : "send", dtype,
                         h.count, h.root, as_receiver ? "from" : "to", peer, h.sequence);
  }
  return "unknown";
}

}  // namespace ddp::comm
