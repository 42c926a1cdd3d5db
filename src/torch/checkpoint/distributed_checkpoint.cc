// DcpReader (ddp/torch/checkpoint/distributed_checkpoint.h): `.metadata` through the archive
// layer's parser (archive/dcp_metadata.h, torch-free and fuzzed), each item through the
// PyTorch-archive reader over its byte range (torch/formats/pytorch_archive.h).
#include "ddp/torch/checkpoint/distributed_checkpoint.h"

#include <algorithm>
#include <cstring>
#include <fstream>
#include <iterator>
#include <utility>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "archive/dcp_metadata.h"
#include "archive/zip_reader.h"
#include "torch/checkpoint/dcp_info.h"
#include "torch/formats/pytorch_archive.h"

namespace ddp {
namespace {

// A `.metadata` holds ~300 bytes an entry: this is about a million entries.
constexpr std::uintmax_t kMaxMetadataBytes = std::uintmax_t{256} << 20;

std::string read_metadata_bytes(const std::filesystem::path& file) {
  std::error_code error;
  const auto bytes = std::filesystem::file_size(file, error);
  if (error) {
    throw ConfigError(fmt::format(
        "{}: cannot read the checkpoint's metadata ({}): is this a folder dcp.save wrote?",
        file.string(), error.message()));
  }
  if (bytes > kMaxMetadataBytes) {
    throw StateDictFormatError(
        fmt::format("{}: {} bytes, over the {} a checkpoint's metadata "
                    "may take here",
                    file.string(), bytes, kMaxMetadataBytes));
  }
  std::ifstream in(file, std::ios::binary);
  std::string contents(static_cast<std::size_t>(bytes), '\0');
  if (!in.read(contents.data(), static_cast<std::streamsize>(bytes))) {
    throw ConfigError(fmt::format("{}: cannot read the checkpoint's metadata", file.string()));
  }
  return contents;
}

}  // namespace

DcpReader::DcpReader(std::filesystem::path folder) : folder_(std::move(folder)) {
  std::error_code error;
  if (!std::filesystem::is_directory(folder_, error)) {
    throw ConfigError(
        fmt::format("{}: not a folder; a distributed checkpoint is the folder "
                    "dcp.save wrote (.metadata and __<rank>_<n>.distcp files)",
                    folder_.string()));
  }
  const std::filesystem::path file = folder_ / ".metadata";
  archive::DcpMetadata parsed;
  try {
    parsed = archive::parse_dcp_metadata(read_metadata_bytes(file));
  } catch (const archive::FormatError& e) {
    if (e.kind() == archive::FormatError::Kind::kUnsafe) {
      throw UnsafePickleError(
          fmt::format("{}: refused {}, which DCP's metadata never holds: reading it could run "
                      "code from the file",
                      file.string(), e.what()),
          e.global_name());
    }
    throw StateDictFormatError(fmt::format("{}: {}", file.string(), e.what()));
  }
  info_ = detail::dcp_checkpoint_info(std::move(parsed), file.string());
  for (const auto& [name, tensor] : info_.tensors) {
    if (tensor.shape.empty()) continue;  // a scalar: one chunk
    ChunkIndex& index = chunk_index_[name];
    index.by_first_offset.resize(tensor.chunks.size());
    for (std::size_t i = 0; i < tensor.chunks.size(); ++i) {
      index.by_first_offset[i] = i;
      index.longest = std::max(index.longest, tensor.chunks[i].sizes[0]);
    }
    std::stable_sort(index.by_first_offset.begin(), index.by_first_offset.end(),
                     [&](std::size_t a, std::size_t b) {
                       return tensor.chunks[a].offsets[0] < tensor.chunks[b].offsets[0];
                     });
  }
}

std::vector<std::size_t> DcpReader::chunks_in_rows(const std::string& name,
                                                   const DcpTensorInfo& tensor, std::int64_t begin,
                                                   std::int64_t end) const {
  std::vector<std::size_t> found;
  const auto it = chunk_index_.find(name);
  if (it == chunk_index_.end()) {  // a scalar
    for (std::size_t i = 0; i < tensor.chunks.size(); ++i)
      found.push_back(i);
    return found;
  }
  const ChunkIndex& index = it->second;
  // Chunks may be empty (size 0) in the first dimension: those overlap nothing, and are skipped
  // by the caller's per-dimension check; they are still candidates here when they start inside.
  const std::int64_t from = begin - index.longest;
  auto first = std::upper_bound(
      index.by_first_offset.begin(), index.by_first_offset.end(), from,
      [&](std::int64_t value, std::size_t i) { return value < tensor.chunks[i].offsets[0]; });
  for (auto i = first; i != index.by_first_offset.end() && tensor.chunks[*i].offsets[0] < end;
       ++i) {
    found.push_back(*i);
  }
  std::sort(found.begin(), found.end());  // the order saved, as a scan would visit them
  return found;
}

namespace {

// One item's archive, read and checked; `what` names it ("the chunk of 'w' at [0, 4]").
c10::IValue read_item(const std::filesystem::path& folder, const DcpStorageInfo& storage,
                      const std::string& what,
                      const detail::PytorchArchiveReadOptions& options = {}) {
  const std::filesystem::path file = folder / storage.file;
  const std::string source = fmt::format("{} ({} at byte {})", what, file.string(), storage.offset);
  std::error_code error;
  if (!std::filesystem::is_regular_file(file, error)) {
    throw ConfigError(
        fmt::format("{}: the data file is missing (a checkpoint copied in part?)", source));
  }
  return detail::read_pytorch_archive_range(file, storage.offset, storage.length, source, options);
}

// The chunk's tensor; with `into`, its storage is read straight into those bytes (the chunk's
// size exactly), which the returned tensor views, or only its bytes [into_offset, into_offset +
// into_bytes) are (the returned tensor then views no data: its dtype, sizes and strides only);
// with `window`, only that region of its storage read as the chunk's array is kept, where the
// window places it (PytorchArchiveReadOptions::array_window: the tensor views no data, unless the
// storage was not that array and was read whole).
at::Tensor read_chunk(const std::filesystem::path& folder, const std::string& name,
                      const DcpTensorInfo& tensor, const DcpChunkInfo& chunk, void* into = nullptr,
                      std::uint64_t into_bytes = 0, std::uint64_t into_offset = 0,
                      const archive::ZipArrayWindow* window = nullptr) {
  const std::string what =
      fmt::format("the chunk of '{}' at [{}]", name, fmt::join(chunk.offsets, ", "));
  detail::PytorchArchiveReadOptions options;
  options.into = into;
  options.into_bytes = into_bytes;
  options.into_offset = into_offset;
  options.array_window = window;
  const c10::IValue value = read_item(folder, chunk.storage, what, options);
  if (!value.isTensor()) {
    throw StateDictFormatError(
        fmt::format("{} in {}: holds a {}, not a tensor", what, folder.string(), value.tagKind()));
  }
  at::Tensor t = value.toTensor();
  if (t.scalar_type() != tensor.dtype || t.sizes() != at::IntArrayRef(chunk.sizes)) {
    throw StateDictFormatError(
        fmt::format("{} in {}: holds a {} tensor of [{}]; the metadata records {} [{}]", what,
                    folder.string(), c10::toString(t.scalar_type()), fmt::join(t.sizes(), ", "),
                    c10::toString(tensor.dtype), fmt::join(chunk.sizes, ", ")));
  }
  return t;
}

const DcpTensorInfo& find_tensor(const DcpCheckpointInfo& info, const std::filesystem::path& folder,
                                 const std::string& name) {
  const auto it = info.tensors.find(name);
  if (it != info.tensors.end()) return it->second;
  const bool value = info.values.contains(name);
  throw ConfigError(fmt::format("{}: the checkpoint has no tensor '{}'{}", folder.string(), name,
                                value ? " (it is a non-tensor value: read_value)" : ""));
}

}  // namespace

at::Tensor DcpReader::read(const std::string& name) const {
  const DcpTensorInfo& tensor = find_tensor(info_, folder_, name);
  return read(name, std::vector<std::int64_t>(tensor.shape.size(), 0), tensor.shape);
}

at::Tensor DcpReader::read(const std::string& name, const std::vector<std::int64_t>& offsets,
                           const std::vector<std::int64_t>& sizes) const {
  const DcpTensorInfo& tensor = find_tensor(info_, folder_, name);
  const std::size_t dims = tensor.shape.size();
  bool inside = offsets.size() == dims && sizes.size() == dims;
  for (std::size_t d = 0; inside && d < dims; ++d) {
    inside = offsets[d] >= 0 && sizes[d] >= 0 && offsets[d] <= tensor.shape[d] &&
             sizes[d] <= tensor.shape[d] - offsets[d];
  }
  if (!inside) {
    throw ConfigError(fmt::format(
        "{}: the region at [{}] of [{}] is not inside '{}', of shape [{}]", folder_.string(),
        fmt::join(offsets, ", "), fmt::join(sizes, ", "), name, fmt::join(tensor.shape, ", ")));
  }
  // A region that is one saved chunk exactly (a load at the layout of the save): the chunk's
  // tensor, read once, is the answer; no second buffer and no copy.
  const std::vector<std::size_t> candidates =
      dims == 0 ? chunks_in_rows(name, tensor, 0, 1)
                : chunks_in_rows(name, tensor, offsets[0],
                                 offsets[0] + std::max<std::int64_t>(sizes[0], 1));
  for (const std::size_t i : candidates) {
    const DcpChunkInfo& chunk = tensor.chunks[i];
    if (chunk.offsets == offsets && chunk.sizes == sizes) {
      return read_chunk(folder_, name, tensor, chunk);
    }
  }
  at::Tensor out = at::empty(sizes, at::TensorOptions().dtype(tensor.dtype));
  std::int64_t copied = 0;
  const auto element = static_cast<std::int64_t>(c10::elementSize(tensor.dtype));
  std::int64_t row_elements = 1;  // of the region, below its first dimension
  for (std::size_t d = 1; d < dims; ++d)
    row_elements *= sizes[d];
  // The overlap of a chunk and the region, through the chunk read whole: the general case.
  auto copy_overlap = [&](const DcpChunkInfo& chunk) {
    std::vector<std::int64_t> lo(dims), hi(dims);
    for (std::size_t d = 0; d < dims; ++d) {
      lo[d] = std::max(offsets[d], chunk.offsets[d]);
      hi[d] = std::min(offsets[d] + sizes[d], chunk.offsets[d] + chunk.sizes[d]);
      if (lo[d] >= hi[d]) return;
    }
    at::Tensor from = read_chunk(folder_, name, tensor, chunk);
    at::Tensor to = out;
    std::int64_t elements = 1;
    for (std::size_t d = 0; d < dims; ++d) {
      const auto dim = static_cast<std::int64_t>(d);
      from = from.narrow(dim, lo[d] - chunk.offsets[d], hi[d] - lo[d]);
      to = to.narrow(dim, lo[d] - offsets[d], hi[d] - lo[d]);
      elements *= hi[d] - lo[d];
    }
    to.copy_(from);
    copied += elements;
  };
  // The overlap of a chunk split along another dimension than the region's rows (a column
  // split, resharding tensor parallelism's row-parallel weights) read as a window of the chunk's
  // array: the overlap's part of each of its rows goes straight into place, the rest through
  // scratch memory (all of the record read and verified), so no chunk-sized buffer is made.
  auto read_overlap = [&](const DcpChunkInfo& chunk) {
    archive::ZipArrayWindow window;
    window.element_bytes = static_cast<std::uint64_t>(element);
    std::int64_t elements = 1;
    auto* place = static_cast<unsigned char*>(out.data_ptr());
    for (std::size_t d = 0; d < dims; ++d) {
      const std::int64_t lo = std::max(offsets[d], chunk.offsets[d]);
      const std::int64_t hi = std::min(offsets[d] + sizes[d], chunk.offsets[d] + chunk.sizes[d]);
      if (lo >= hi) return;
      const auto dim = static_cast<std::int64_t>(d);
      window.shape.push_back(static_cast<std::uint64_t>(chunk.sizes[d]));
      window.begin.push_back(static_cast<std::uint64_t>(lo - chunk.offsets[d]));
      window.count.push_back(static_cast<std::uint64_t>(hi - lo));
      window.out_strides.push_back(static_cast<std::uint64_t>(out.stride(dim) * element));
      place += (lo - offsets[d]) * out.stride(dim) * element;
      elements *= hi - lo;
    }
    window.out = place;
    const at::Tensor read = read_chunk(folder_, name, tensor, chunk, nullptr, 0, 0, &window);
    if (read.storage().data() != nullptr) {
      // The chunk's storage held more than its elements, so it was read whole: take the overlap.
      at::Tensor from = read, to = out;
      for (std::size_t d = 0; d < dims; ++d) {
        const auto dim = static_cast<std::int64_t>(d);
        const std::int64_t lo = std::max(offsets[d], chunk.offsets[d]);
        const std::int64_t hi = std::min(offsets[d] + sizes[d], chunk.offsets[d] + chunk.sizes[d]);
        from = from.narrow(dim, lo - chunk.offsets[d], hi - lo);
        to = to.narrow(dim, lo - offsets[d], hi - lo);
      }
      to.copy_(from);
    } else if (!read.is_contiguous() || read.storage_offset() != 0) {
      // Saved with other strides (a transposed tensor whose storage was compact): the bytes put
      // in place were in that order; read the chunk whole instead, over them.
      copy_overlap(chunk);
      return;
    }
    copied += elements;
  };
  for (const std::size_t i : candidates) {
    const DcpChunkInfo& chunk = tensor.chunks[i];
    // A chunk whose rows are the region's rows whole (every dimension but the first as the
    // region's): the rows they share are one contiguous run in the chunk's storage and in the
    // region's memory, read straight into place (resharding FSDP's row shards). A chunk wholly
    // inside is read into place as it is; of one partly inside, the whole record is still read
    // and verified, the rest passing through scratch memory, so no chunk-sized buffer is made.
    bool rows_whole = dims > 0 && row_elements > 0;
    for (std::size_t d = 1; rows_whole && d < dims; ++d) {
      rows_whole = chunk.offsets[d] == offsets[d] && chunk.sizes[d] == sizes[d];
    }
    if (!rows_whole) {
      if (dims > 0) {
        read_overlap(chunk);
      } else {
        copy_overlap(chunk);  // a scalar: its one element
      }
      continue;
    }
    const std::int64_t lo = std::max(offsets[0], chunk.offsets[0]);
    const std::int64_t hi = std::min(offsets[0] + sizes[0], chunk.offsets[0] + chunk.sizes[0]);
    if (lo >= hi) continue;
    const std::int64_t row_bytes = row_elements * element;
    char* place = static_cast<char*>(out.data_ptr()) + (lo - offsets[0]) * row_bytes;
    const std::int64_t count = (hi - lo) * row_elements;
    const bool whole = lo == chunk.offsets[0] && hi == chunk.offsets[0] + chunk.sizes[0];
    at::Tensor read =
        read_chunk(folder_, name, tensor, chunk, place, static_cast<std::uint64_t>(count * element),
                   static_cast<std::uint64_t>((lo - chunk.offsets[0]) * row_bytes));
    if (!read.is_contiguous() || read.storage_offset() != 0) {
      // Saved with other strides (a transposed tensor whose storage was compact): the bytes in
      // `place` are in that order. Whole, they are the chunk's: put them in row-major order; a
      // part is no run of rows (nor is a chunk whose storage held more than it, which the archive
      // read as a window and left without data): read the chunk whole instead.
      if (whole && read.storage().data() != nullptr) {
        const at::Tensor ordered = read.clone(at::MemoryFormat::Contiguous);
        std::memcpy(place, ordered.data_ptr(), static_cast<std::size_t>(count * element));
      } else {
        copy_overlap(chunk);
        continue;
      }
    }
    copied += count;
  }
  // The metadata's chunks tile the tensor (checked when it was read), so this holds; it is
  // checked again because an element left out would be silently uninitialised.
  if (copied != out.numel()) {
    throw StateDictFormatError(
        fmt::format("{}: the chunks of '{}' gave {} of the region's {} "
                    "elements",
                    folder_.string(), name, copied, out.numel()));
  }
  return out;
}

c10::IValue DcpReader::read_value(const std::string& name) const {
  const auto it = info_.values.find(name);
  if (it == info_.values.end()) {
    throw ConfigError(fmt::format("{}: the checkpoint has no value '{}'{}", folder_.string(), name,
                                  info_.tensors.contains(name) ? " (it is a tensor: read)" : ""));
  }
  return read_item(folder_, it->second, fmt::format("the value '{}'", name));
}

std::uint64_t DcpReader::verify() const {
  std::uint64_t bytes = 0;
  for (const auto& [name, tensor] : info_.tensors) {
    for (const DcpChunkInfo& chunk : tensor.chunks) {
      read_chunk(folder_, name, tensor, chunk);
      bytes += chunk.storage.length;
    }
  }
  for (const auto& [name, storage] : info_.values) {
    read_value(name);
    bytes += storage.length;
  }
  return bytes;
}

namespace {

c10::IValue path_key(const DcpPathKey& key) {
  return key.index >= 0 ? c10::IValue(key.index) : c10::IValue(key.name);
}

c10::IValue empty_container(const DcpPathKey& next) {
  if (next.index >= 0) return c10::impl::GenericList(c10::AnyType::get());
  return c10::impl::GenericDict(c10::AnyType::get(), c10::AnyType::get());
}

void extend_list(c10::impl::GenericList& list, std::int64_t index) {
  while (static_cast<std::int64_t>(list.size()) <= index)
    list.push_back(c10::IValue());
}

// PyTorch's torch.distributed.checkpoint._traverse.set_element: `value` at `path` under `root`,
// creating each level on the way (a dict where the next key is a name, a list where it is a
// position).
void set_element(c10::IValue root, const std::vector<DcpPathKey>& path, c10::IValue value,
                 const std::string& name) {
  auto fail = [&] {
    throw StateDictFormatError(fmt::format(
        "the entry '{}': its path in the saved state dict crosses another entry's value or "
        "uses a name as a list's position",
        name));
  };
  c10::IValue current = std::move(root);
  for (std::size_t i = 1; i < path.size(); ++i) {
    const DcpPathKey& previous = path[i - 1];
    if (current.isGenericDict()) {
      auto dict = current.toGenericDict();
      const c10::IValue key = path_key(previous);
      if (!dict.contains(key)) dict.insert(key, empty_container(path[i]));
      current = dict.at(key);
    } else if (current.isList() && previous.index >= 0) {
      auto list = current.toList();
      extend_list(list, previous.index);
      if (list.get(static_cast<std::size_t>(previous.index)).isNone()) {
        list.set(static_cast<std::size_t>(previous.index), empty_container(path[i]));
      }
      current = list.get(static_cast<std::size_t>(previous.index));
    } else {
      fail();
    }
  }
  const DcpPathKey& last = path.back();
  if (current.isGenericDict()) {
    current.toGenericDict().insert_or_assign(path_key(last), std::move(value));
  } else if (current.isList() && last.index >= 0) {
    auto list = current.toList();
    extend_list(list, last.index);
    list.set(static_cast<std::size_t>(last.index), std::move(value));
  } else {
    fail();
  }
}

}  // namespace

c10::IValue DcpReader::read_state_dict() const {
  c10::impl::GenericDict root(c10::AnyType::get(), c10::AnyType::get());
  for (const std::string& name : info_.order) {
    c10::IValue value = info_.tensors.contains(name) ? c10::IValue(read(name)) : read_value(name);
    const auto path = info_.paths.find(name);
    if (path == info_.paths.end()) {
      root.insert_or_assign(name, std::move(value));
      continue;
    }
    try {
      set_element(root, path->second, std::move(value), name);
    } catch (const StateDictFormatError& e) {
      throw StateDictFormatError(fmt::format("{}: {}", folder_.string(), e.what()));
    }
  }
  return root;
}

void dcp_to_torch_save(const std::filesystem::path& folder, const std::filesystem::path& file) {
  const DcpReader checkpoint(folder);
  detail::write_pytorch_archive(file, checkpoint.read_state_dict(), /*ordered_dict_at_top=*/false);
}

}  // namespace ddp
