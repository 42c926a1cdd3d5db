// A flat range of a row-major tensor in a distributed checkpoint: what FSDP's flat shards are of
// each parameter. A checkpoint records rectangular chunks, so a save cuts the range into boxes; a
// load reads the rows that hold the range (one region, a row split) and takes the range from them.
// Internal to ddp_torch.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "ddp/torch/checkpoint/dcp_model_state.h"
#include "ddp/torch/checkpoint/distributed_checkpoint.h"

namespace ddp::detail {

// A box of a tensor: the region [offsets, offsets + sizes), which holds the flat elements
// [flat_begin, flat_begin + numel) of the tensor (row-major: they are contiguous).
struct DcpFlatBox {
  std::vector<std::int64_t> offsets, sizes;
  std::int64_t flat_begin = 0, numel = 0;
};

// The fewest boxes, in flat order, whose union is the flat elements [begin, end) of a tensor of
// `shape`: at most 2 * dims - 1 (the end of a row, whole rows, the start of a row, recursively);
// none for an empty range. Requires 0 <= begin <= end <= the tensor's element count.
std::vector<DcpFlatBox> dcp_flat_boxes(const std::vector<std::int64_t>& shape, std::int64_t begin,
                                       std::int64_t end);

// The flat elements [begin, end) of a tensor of `shape` that is the checkpoint's tensor `name`
// (`place` null: `shape` is the saved tensor's, as the metadata records it) or the region at
// place->offsets of place's global tensor (a tensor-parallel part, `shape` its local view), as a
// 1-D tensor: read as one region, the rows of the first dimension that hold them (the reader reads
// only the chunks those rows overlap), then narrowed.
at::Tensor read_dcp_flat_range(const DcpReader& reader, const std::string& name,
                               const std::vector<std::int64_t>& shape, std::int64_t begin,
                               std::int64_t end, const DcpShardSpec* place = nullptr);

}  // namespace ddp::detail
