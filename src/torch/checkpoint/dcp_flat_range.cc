// Flat ranges of a tensor as a checkpoint's boxes, and read back (dcp_flat_range.h).
#include "torch/checkpoint/dcp_flat_range.h"

#include "torch/checkpoint/dcp_model_layout.h"

#include <functional>
#include <numeric>

namespace ddp::detail {
namespace {

std::int64_t product(std::vector<std::int64_t>::const_iterator first,
                     std::vector<std::int64_t>::const_iterator last) {
  return std::accumulate(first, last, std::int64_t{1}, std::multiplies<>());
}

// The boxes of [begin, end) within the sub-tensor at `fixed` (the indices of the dimensions
// before d), whose first flat element is `base`; [begin, end) relative to it.
void split(const std::vector<std::int64_t>& shape, std::size_t d, std::vector<std::int64_t>& fixed,
           std::int64_t base, std::int64_t begin, std::int64_t end, std::vector<DcpFlatBox>& out) {
  if (begin >= end) return;
  const std::size_t dims = shape.size();
  // A box over dimension d from index `from` for `count` indices, whole below it.
  auto push = [&](std::int64_t from, std::int64_t count, std::int64_t inner) {
    DcpFlatBox box;
    box.offsets = fixed;
    box.offsets.push_back(from);
    box.offsets.resize(dims, 0);
    box.sizes.assign(d, 1);
    box.sizes.push_back(count);
    box.sizes.insert(box.sizes.end(), shape.begin() + static_cast<std::ptrdiff_t>(d) + 1,
                     shape.end());
    box.flat_begin = base + from * inner;
    box.numel = count * inner;
    out.push_back(std::move(box));
  };
  if (d == dims) {  // a 0-dim tensor: its one element
    out.push_back({{}, {}, base, 1});
    return;
  }
  const std::int64_t inner =
      product(shape.begin() + static_cast<std::ptrdiff_t>(d) + 1, shape.end());
  if (d + 1 == dims) {  // the last dimension: one run
    push(begin, end - begin, 1);
    return;
  }
  const std::int64_t first = begin / inner;
  const std::int64_t last = (end - 1) / inner;
  auto descend = [&](std::int64_t index, std::int64_t from, std::int64_t to) {
    fixed.push_back(index);
    split(shape, d + 1, fixed, base + index * inner, from, to, out);
    fixed.pop_back();
  };
  if (first == last) {
    descend(first, begin - first * inner, end - first * inner);
    return;
  }
  std::int64_t whole_from = first;
  std::int64_t whole_to = last + 1;
  if (begin % inner != 0) {
    descend(first, begin - first * inner, inner);
    whole_from = first + 1;
  }
  const bool partial_tail = end % inner != 0;
  if (partial_tail) whole_to = last;
  if (whole_from < whole_to) push(whole_from, whole_to - whole_from, inner);
  if (partial_tail) descend(last, 0, end - last * inner);
}

}  // namespace

std::vector<DcpFlatBox> dcp_flat_boxes(const std::vector<std::int64_t>& shape, std::int64_t begin,
                                       std::int64_t end) {
  std::vector<DcpFlatBox> out;
  std::vector<std::int64_t> fixed;
  split(shape, 0, fixed, 0, begin, end, out);
  return out;
}

at::Tensor read_dcp_flat_range(const DcpReader& reader, const std::string& name,
                               const std::vector<std::int64_t>& shape, std::int64_t begin,
                               std::int64_t end, const DcpShardSpec* place) {
  if (shape.empty()) return reader.read(name).reshape({1}).narrow(0, begin, end - begin);
  const std::int64_t row = product(shape.begin() + 1, shape.end());
  if (begin >= end || row == 0) {
    return at::empty({0}, at::TensorOptions(reader.info().tensors.at(name).dtype));
  }
  const std::int64_t first = begin / row;
  const std::int64_t rows = (end - 1) / row + 1 - first;
  std::vector<std::int64_t> offsets =
      place == nullptr ? std::vector<std::int64_t>(shape.size(), 0) : place->offsets;
  offsets[0] += first;
  std::vector<std::int64_t> sizes = shape;
  sizes[0] = rows;
  const at::Tensor read = place == nullptr ? reader.read(name, offsets, sizes)
                                           : read_spec_region(reader, name, *place, offsets, sizes);
  return read.reshape({-1}).narrow(0, begin - first * row, end - begin);
}

}  // namespace ddp::detail
