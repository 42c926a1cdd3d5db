// The `.metadata` file of PyTorch's distributed checkpoint (torch.distributed.checkpoint, "DCP"):
// a pickled torch.distributed.checkpoint.metadata.Metadata, read without torch and without
// running anything from the file (archive/pickle_reader.h: the dataclasses it names are
// interpreted here field by field; any other global is refused).
//
// What is checked, so that a reader of the data files can trust what it returns:
//   - every tensor's global shape, and each saved chunk lies inside it; the chunks of a tensor
//     cover it exactly once (no element twice, none missing), checked on the grid their
//     boundaries make, within a limit on that grid's cells;
//   - every chunk and every non-tensor value has exactly one storage record, and every record
//     belongs to one: a data file name that is a plain name in the checkpoint's folder (no '/',
//     no "..", no hidden file), an offset and a length;
//   - dtypes the torch layer knows, the strided layout only, no storage transforms (the
//     extensions PyTorch may record: compression and the like, refused by name).
// Format versions: what PyTorch 2.x writes ("1.0.0", or none for the early 2.x releases).
// Writing: encode_dcp_metadata (archive/dcp_metadata_writer.cc).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "archive/archive_error.h"

namespace ddp::archive {

// Where the bytes of one item lie: [offset, offset + length) of `file`, a file in the
// checkpoint's folder. Each item is a zip archive as torch.save writes it.
struct DcpStorage {
  std::string file;
  std::uint64_t offset = 0;
  std::uint64_t length = 0;
};

struct DcpChunk {
  std::vector<std::int64_t> offsets;  // where the chunk starts in the global tensor, per dim
  std::vector<std::int64_t> sizes;    // its extent per dim
  DcpStorage storage;
};

struct DcpTensorEntry {
  std::string dtype;  // PyTorch's name: "float32", "bfloat16", "int64", ...
  std::vector<std::int64_t> shape;
  std::vector<DcpChunk> chunks;  // as saved; they tile `shape`
};

// One step of an entry's path in the nested state dict that was saved: a dict's key, or a list's
// position (index >= 0).
struct DcpPathKey {
  std::string name;
  std::int64_t index = -1;
};

struct DcpMetadata {
  std::string version;                            // "" where the file records none
  std::map<std::string, DcpTensorEntry> tensors;  // by fully qualified name ("layers.0.weight")
  std::map<std::string, DcpStorage> values;       // the non-tensor entries, torch.save'd objects
  std::vector<std::string> order;                 // every entry's name, as the file lists them
  // planner_data: each entry's path in the nested state dict that was saved ("optim", "state",
  // 0, "exp_avg"); an entry without one was saved at the top level under its name.
  std::map<std::string, std::vector<DcpPathKey>> paths;
};

struct DcpMetadataLimits {
  std::uint64_t max_entries = std::uint64_t{1} << 20;
  std::size_t max_dims = 64;
  // The cells of the grid a tensor's chunk boundaries make, summed over tensors: what checking
  // that chunks tile their tensor costs.
  std::uint64_t max_grid_cells = std::uint64_t{1} << 24;
};

// Parses the bytes of a `.metadata` file. Throws FormatError: kUnsafe (a global outside DCP's
// classes), kDamaged (not DCP's metadata, or contradicting itself: chunks outside their tensor,
// overlapping or leaving a hole, a storage record missing or for nothing, a bad file name),
// kUnsupported (another layout, a storage transform, an unknown dtype), kTooLarge (limits).
DcpMetadata parse_dcp_metadata(std::string_view bytes, const DcpMetadataLimits& limits = {});

// The bytes of the `.metadata` file that describes `metadata`, pickled as PyTorch 2.x's dcp.save
// pickles its Metadata (the same classes, field names and state forms; TensorProperties in the
// five-field form every 2.x release reads; storage_meta None), so that dcp.load and
// parse_dcp_metadata read it. Entries are written in `metadata.order`, which must name every
// tensor and value once; a version "" is written as "1.0.0"; an entry without a path gets
// its name as its one-step path, as dcp.save records. Nothing else is checked here: a writer
// parses the result (parse_dcp_metadata) before it commits it. Throws FormatError kDamaged when
// `order` does not match the entries.
std::string encode_dcp_metadata(const DcpMetadata& metadata);

}  // namespace ddp::archive
