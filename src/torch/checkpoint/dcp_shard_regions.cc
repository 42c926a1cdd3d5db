// A split tensor's regions in the checkpoint's tensor, where that merges the first two dimensions
// of the spec's global shape (dcp_model_layout.h: saved_regions, read_spec_region).
#include <utility>

#include "torch/checkpoint/dcp_model_layout.h"

namespace ddp::detail {

const std::vector<std::int64_t>& saved_shape_of(const DcpShardSpec& spec) {
  return spec.saved_shape.empty() ? spec.global_shape : spec.saved_shape;
}

bool records_spec(const DcpShardSpec& spec, const std::vector<std::int64_t>& recorded) {
  return recorded == spec.global_shape ||
         (!spec.saved_shape.empty() && recorded == spec.saved_shape);
}

std::vector<DcpSavedRegion> saved_regions(const DcpShardSpec& spec,
                                          const std::vector<std::int64_t>& offsets,
                                          const std::vector<std::int64_t>& sizes) {
  if (spec.saved_shape.empty()) return {{-1, offsets, sizes}};
  // [blocks, rows, rest...] saved as [blocks * rows, rest...] (check_layout checked the shapes).
  const std::int64_t rows = spec.global_shape[1];
  std::vector<std::int64_t> rest_offsets(offsets.begin() + 2, offsets.end());
  std::vector<std::int64_t> rest_sizes(sizes.begin() + 2, sizes.end());
  auto region = [&](std::int64_t index, std::int64_t first, std::int64_t count) {
    DcpSavedRegion out{index, {first}, {count}};
    out.offsets.insert(out.offsets.end(), rest_offsets.begin(), rest_offsets.end());
    out.sizes.insert(out.sizes.end(), rest_sizes.begin(), rest_sizes.end());
    return out;
  };
  // Whole blocks are one contiguous run of the merged dimension.
  if (sizes[1] == rows) return {region(-1, offsets[0] * rows, sizes[0] * rows)};
  std::vector<DcpSavedRegion> out;
  out.reserve(static_cast<std::size_t>(sizes[0]));
  for (std::int64_t b = 0; b < sizes[0]; ++b)
    out.push_back(region(b, (offsets[0] + b) * rows + offsets[1], sizes[1]));
  return out;
}

at::Tensor read_spec_region(const DcpReader& reader, const std::string& name,
                            const DcpShardSpec& spec, const std::vector<std::int64_t>& offsets,
                            const std::vector<std::int64_t>& sizes) {
  if (reader.info().tensors.at(name).shape == spec.global_shape) {
    return reader.read(name, offsets, sizes);
  }
  const std::vector<DcpSavedRegion> regions = saved_regions(spec, offsets, sizes);
  if (regions.size() == 1 && regions[0].index < 0) {
    return reader.read(name, regions[0].offsets, regions[0].sizes).reshape(sizes);
  }
  at::Tensor out = at::empty(sizes, at::TensorOptions(reader.info().tensors.at(name).dtype));
  for (const DcpSavedRegion& region : regions)
    out.select(0, region.index).copy_(reader.read(name, region.offsets, region.sizes));
  return out;
}

}  // namespace ddp::detail
