#include "ddp/process_group.h"

#include <cstring>

#include <fmt/format.h>

#include "comm/argument_checks.h"
#include "ddp/error.h"

namespace ddp {

int ProcessGroup::local_rank() const {
  throw ConfigError(
      fmt::format("the {} backend does not know which ranks share a host, so it has "
                  "no local_rank(); use LOCAL_RANK from the launcher",
                  backend()));
}

int ProcessGroup::local_size() const {
  throw ConfigError(
      fmt::format("the {} backend does not know which ranks share a host, so it has "
                  "no local_size(); use LOCAL_WORLD_SIZE from the launcher",
                  backend()));
}

// The portable allreduce_segments: pack, allreduce the packed buffer, unpack on success. The
// unpacking is a completion callback, so it has run when wait() returns.
std::shared_ptr<Work> ProcessGroup::allreduce_segments(std::vector<BufferSegment> segments,
                                                       DType dtype, ReduceOp op,
                                                       CallOptions options) {
  comm::check_enums("allreduce_segments", dtype, op);
  std::size_t total = 0;
  for (const auto& segment : segments) {
    comm::check_buffer(segment.data, segment.count, "allreduce_segments", "segment");
    total += segment.count;
  }
  const std::size_t element_bytes = dtype_size(dtype);
  auto packed = std::make_shared<std::vector<std::byte>>(total * element_bytes);
  std::size_t offset = 0;
  for (const auto& segment : segments) {
    if (segment.count == 0) continue;
    std::memcpy(packed->data() + offset, segment.data, segment.count * element_bytes);
    offset += segment.count * element_bytes;
  }
  auto work = allreduce(packed->data(), total, dtype, op, options);
  work->then([packed, segments = std::move(segments), element_bytes](Work& done) {
    if (done.error()) return;
    std::size_t at = 0;
    for (const auto& segment : segments) {
      if (segment.count == 0) continue;
      std::memcpy(segment.data, packed->data() + at, segment.count * element_bytes);
      at += segment.count * element_bytes;
    }
  });
  return work;
}

}  // namespace ddp
