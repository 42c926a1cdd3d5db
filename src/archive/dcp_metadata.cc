// parse_dcp_metadata (dcp_metadata.h): the pickle tree of DCP's Metadata dataclass, read field by
// field. Python pickles each dataclass as NEWOBJ of its class with no arguments, then BUILD with
// its fields as a dict (TensorProperties: a tuple, its __getstate__), torch.Size as a call of
// torch.Size on a tuple of ints, a dtype as the global torch.<name>.
#include "archive/dcp_metadata.h"

#include <algorithm>
#include <array>
#include <limits>
#include <set>
#include <utility>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "archive/pickle_reader.h"

namespace ddp::archive {
namespace {

using Kind = PickleNode::Kind;

constexpr std::string_view kMetadataModule = "torch.distributed.checkpoint.metadata.";
constexpr std::string_view kFilesystemModule = "torch.distributed.checkpoint.filesystem.";

// The dtypes the torch layer reads (c10's ScalarType names as torch exposes them).
constexpr std::array<std::string_view, 14> kDtypes = {
    "float32", "float64", "float16", "bfloat16",  "int64",      "int32",         "int16",
    "int8",    "uint8",   "bool",    "complex64", "complex128", "float8_e4m3fn", "float8_e5m2"};

bool is_metadata_class(std::string_view name) {
  static const std::set<std::string, std::less<>> classes = {
      "Metadata",         "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
      "TensorProperties", "MetadataIndex",         "StorageMeta"};
  return name.starts_with(kMetadataModule) && classes.contains(name.substr(kMetadataModule.size()));
}

bool is_object_class(std::string_view name) {
  return is_metadata_class(name) || name == "torch.distributed.checkpoint.filesystem._StorageInfo";
}

bool is_allowed_global(std::string_view name) {
  if (is_object_class(name)) return true;
  if (name.starts_with("torch.") &&
      std::find(kDtypes.begin(), kDtypes.end(), name.substr(6)) != kDtypes.end()) {
    return true;
  }
  static const std::set<std::string, std::less<>> others = {
      "torch.Size",
      "torch.serialization._get_layout",
      "torch.strided",
      // the memory format: getattr(_MEM_FORMAT_ENCODING, "TORCH_CONTIGUOUS_FORMAT"), read as data
      "builtins.getattr",
      "torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING",
      "torch.contiguous_format",
      "torch.channels_last",
      "torch.preserve_format",
      // StorageMeta.checkpoint_id, where dcp.save was given a path
      "pathlib.PosixPath",
      "pathlib._local.PosixPath",
  };
  return others.contains(name);
}

class Interpreter {
 public:
  Interpreter(const PickleTree& tree, const DcpMetadataLimits& limits)
      : tree_(tree), limits_(limits) {}

  DcpMetadata run() {
    const auto fields = object_fields(tree_.root(), "Metadata", "the file");
    DcpMetadata metadata;
    const NodeId entries = required(fields, "state_dict_metadata", "Metadata");
    const NodeId storage = required(fields, "storage_data", "Metadata");
    if (const auto it = fields.find("version"); it != fields.end() && !is_none(it->second)) {
      metadata.version = string(it->second, "Metadata.version");
    }
    read_entries(entries, metadata);
    if (const auto it = fields.find("planner_data"); it != fields.end()) {
      read_paths(it->second, metadata);
    }
    read_storage(storage, metadata);
    check_tiling(metadata);
    return metadata;
  }

 private:
  template <class... Args>
  [[noreturn]] static void damaged(fmt::format_string<Args...> format, Args&&... args) {
    throw FormatError(FormatError::Kind::kDamaged,
                      "not a distributed checkpoint's metadata ddp can read: " +
                          fmt::format(format, std::forward<Args>(args)...));
  }

  const PickleNode& node(NodeId id) const { return tree_.node(id); }
  bool is_none(NodeId id) const { return node(id).kind == Kind::kNone; }

  std::string global_name(NodeId id) const {
    return node(id).kind == Kind::kGlobal ? tree_.text(node(id)) : std::string();
  }

  // The fields of an object of DCP's class `short_name` (BUILD's dict, string keys).
  std::map<std::string, NodeId> object_fields(NodeId id, std::string_view short_name,
                                              std::string_view what) const {
    const NodeId state = object_state(id, short_name, what);
    std::map<std::string, NodeId> fields;
    if (state == kNoNode) return fields;
    const PickleNode& s = node(state);
    if (s.kind != Kind::kDict) damaged("{}'s fields are not a dict", what);
    for (std::size_t i = 0; i + 1 < s.items.size(); i += 2) {
      fields[string(s.items[i], what)] = s.items[i + 1];
    }
    return fields;
  }

  NodeId object_state(NodeId id, std::string_view short_name, std::string_view what) const {
    const PickleNode& n = node(id);
    const std::string cls = n.kind == Kind::kObject ? global_name(n.items[0]) : std::string();
    const bool ours = cls.ends_with(short_name) && cls.size() > short_name.size() &&
                      cls[cls.size() - short_name.size() - 1] == '.';
    if (!ours) {
      damaged("{} is {}, not a {}", what, cls.empty() ? "not an object" : "a " + cls, short_name);
    }
    return n.state;
  }

  static NodeId required(const std::map<std::string, NodeId>& fields, const std::string& name,
                         std::string_view what) {
    const auto it = fields.find(name);
    if (it == fields.end()) damaged("{} has no field '{}'", what, name);
    return it->second;
  }

  std::string string(NodeId id, std::string_view what) const {
    if (node(id).kind != Kind::kString) damaged("{} is not a string", what);
    return tree_.text(node(id));
  }

  std::int64_t non_negative(NodeId id, std::string_view what) const {
    if (node(id).kind != Kind::kInt || node(id).integer < 0) {
      damaged("{} is not a non-negative integer", what);
    }
    return node(id).integer;
  }

  // torch.Size((a, b, ...)): REDUCE of torch.Size on a 1-tuple holding a tuple of ints.
  std::vector<std::int64_t> size(NodeId id, std::string_view what) const {
    const PickleNode& n = node(id);
    if (n.kind != Kind::kCall || global_name(n.items[0]) != "torch.Size") {
      damaged("{} is not a torch.Size", what);
    }
    const PickleNode& args = node(n.items[1]);
    if (args.items.size() != 1 || node(args.items[0]).kind != Kind::kTuple) {
      damaged("{} is a torch.Size without a tuple of dimensions", what);
    }
    const PickleNode& dims = node(args.items[0]);
    if (dims.items.size() > limits_.max_dims) {
      throw FormatError(FormatError::Kind::kTooLarge,
                        fmt::format("{} has {} dimensions; at most {} are read", what,
                                    dims.items.size(), limits_.max_dims));
    }
    std::vector<std::int64_t> out;
    out.reserve(dims.items.size());
    for (const NodeId d : dims.items)
      out.push_back(non_negative(d, what));
    return out;
  }

  void read_entries(NodeId id, DcpMetadata& metadata) const {
    const PickleNode& n = node(id);
    if (n.kind != Kind::kDict) damaged("state_dict_metadata is not a dict");
    if (n.items.size() / 2 > limits_.max_entries) {
      throw FormatError(FormatError::Kind::kTooLarge,
                        fmt::format("the checkpoint has {} entries; at most {} are read",
                                    n.items.size() / 2, limits_.max_entries));
    }
    for (std::size_t i = 0; i + 1 < n.items.size(); i += 2) {
      const std::string fqn = string(n.items[i], "an entry's name");
      const NodeId value = n.items[i + 1];
      if (metadata.tensors.contains(fqn) || metadata.values.contains(fqn)) {
        damaged("the entry '{}' is listed twice", fqn);
      }
      metadata.order.push_back(fqn);
      const std::string cls =
          node(value).kind == Kind::kObject ? global_name(node(value).items[0]) : "";
      if (cls.ends_with(".BytesStorageMetadata")) {
        object_state(value, "BytesStorageMetadata", fqn);
        metadata.values[fqn] = {};
      } else {
        metadata.tensors[fqn] = tensor_entry(value, fqn);
      }
    }
  }

  DcpTensorEntry tensor_entry(NodeId id, const std::string& fqn) const {
    const std::string what = fmt::format("the entry '{}'", fqn);
    const auto fields = object_fields(id, "TensorStorageMetadata", what);
    DcpTensorEntry entry;
    entry.dtype = dtype(required(fields, "properties", what), what);
    entry.shape = size(required(fields, "size", what), what + "'s size");
    std::uint64_t numel = 1;
    for (const std::int64_t d : entry.shape) {
      if (d != 0 && numel > (std::uint64_t{1} << 62) / static_cast<std::uint64_t>(d)) {
        throw FormatError(FormatError::Kind::kTooLarge,
                          fmt::format("{} has the shape [{}]: more elements than fit in memory",
                                      what, fmt::join(entry.shape, ", ")));
      }
      numel *= static_cast<std::uint64_t>(d);
    }
    const PickleNode& chunks = node(required(fields, "chunks", what));
    if (chunks.kind != Kind::kList) damaged("{}'s chunks are not a list", what);
    for (const NodeId c : chunks.items) {
      const auto chunk_fields = object_fields(c, "ChunkStorageMetadata", what + "'s chunk");
      DcpChunk chunk;
      chunk.offsets = size(required(chunk_fields, "offsets", what), what + "'s chunk offsets");
      chunk.sizes = size(required(chunk_fields, "sizes", what), what + "'s chunk sizes");
      if (chunk.offsets.size() != entry.shape.size() || chunk.sizes.size() != entry.shape.size()) {
        damaged("{} has {} dimensions, and a chunk at [{}] of [{}]", what, entry.shape.size(),
                fmt::join(chunk.offsets, ", "), fmt::join(chunk.sizes, ", "));
      }
      for (std::size_t d = 0; d < entry.shape.size(); ++d) {
        if (chunk.offsets[d] > entry.shape[d] ||
            chunk.sizes[d] > entry.shape[d] - chunk.offsets[d]) {
          damaged("{} of shape [{}] has a chunk at [{}] of [{}], outside it", what,
                  fmt::join(entry.shape, ", "), fmt::join(chunk.offsets, ", "),
                  fmt::join(chunk.sizes, ", "));
        }
      }
      entry.chunks.push_back(std::move(chunk));
    }
    return entry;
  }

  // TensorProperties' state: (dtype, layout, requires_grad, memory format, pin_memory[, strides])
  // from its __getstate__, or its fields as a dict where a release pickled those.
  std::string dtype(NodeId id, const std::string& what) const {
    const NodeId state = object_state(id, "TensorProperties", what + "'s properties");
    NodeId dtype_node = kNoNode, layout_node = kNoNode;
    if (state != kNoNode && node(state).kind == Kind::kTuple && node(state).items.size() >= 2) {
      dtype_node = node(state).items[0];
      layout_node = node(state).items[1];
    } else if (state != kNoNode && node(state).kind == Kind::kDict) {
      const auto fields = object_fields(id, "TensorProperties", what + "'s properties");
      dtype_node = required(fields, "dtype", what + "'s properties");
      if (const auto it = fields.find("layout"); it != fields.end()) layout_node = it->second;
    } else {
      damaged("{}'s properties hold no dtype", what);
    }
    const std::string name = global_name(dtype_node);
    if (!name.starts_with("torch.")) damaged("{}'s dtype is not a torch dtype", what);
    if (layout_node != kNoNode) {
      const PickleNode& layout = node(layout_node);
      const bool strided = global_name(layout_node) == "torch.strided" ||
                           (layout.kind == Kind::kCall &&
                            global_name(layout.items[0]) == "torch.serialization._get_layout" &&
                            node(layout.items[1]).items.size() == 1 &&
                            node(node(layout.items[1]).items[0]).kind == Kind::kString &&
                            tree_.text(node(node(layout.items[1]).items[0])) == "torch.strided");
      if (!strided) {
        throw FormatError(FormatError::Kind::kUnsupported,
                          fmt::format("{} is not a strided (dense) tensor; ddp reads dense "
                                      "tensors only",
                                      what));
      }
    }
    return name.substr(6);
  }

  void read_paths(NodeId id, DcpMetadata& metadata) const {
    const PickleNode& n = node(id);
    if (n.kind == Kind::kNone) return;
    if (n.kind != Kind::kDict) damaged("planner_data is not a dict");
    for (std::size_t i = 0; i + 1 < n.items.size(); i += 2) {
      const std::string fqn = string(n.items[i], "a planner_data name");
      const PickleNode& path = node(n.items[i + 1]);
      if (path.kind != Kind::kTuple && path.kind != Kind::kList) {
        damaged("planner_data's path of '{}' is not a tuple", fqn);
      }
      if (path.items.empty() || path.items.size() > limits_.max_dims) {
        damaged("planner_data's path of '{}' has {} keys", fqn, path.items.size());
      }
      std::vector<DcpPathKey> keys;
      for (const NodeId k : path.items) {
        if (node(k).kind == Kind::kInt) {
          // A list position; a list is extended to it with Nones, so it is bounded like one.
          if (node(k).integer < 0 || node(k).integer >= (std::int64_t{1} << 20)) {
            damaged("planner_data's path of '{}' holds the list position {}", fqn, node(k).integer);
          }
          keys.push_back({{}, node(k).integer});
        } else {
          keys.push_back({string(k, "a planner_data key"), -1});
        }
      }
      metadata.paths[fqn] = std::move(keys);
    }
  }

  static void check_file_name(const std::string& name, std::string_view what) {
    const bool plain = !name.empty() && name.size() <= 255 && name.front() != '.' &&
                       name.find('/') == std::string::npos &&
                       name.find('\\') == std::string::npos && name.find('\0') == std::string::npos;
    if (!plain) {
      damaged(
          "{} names the data file '{}', which is not a plain file name in the checkpoint's "
          "folder",
          what, name);
    }
  }

  void read_storage(NodeId id, DcpMetadata& metadata) const {
    const PickleNode& n = node(id);
    if (n.kind != Kind::kDict) damaged("storage_data is not a dict");
    // Each chunk by (name, offsets), each value by name: what a record may belong to.
    std::map<std::pair<std::string, std::vector<std::int64_t>>, DcpStorage*> chunks;
    for (auto& [fqn, entry] : metadata.tensors) {
      for (DcpChunk& chunk : entry.chunks) {
        if (!chunks.emplace(std::make_pair(fqn, chunk.offsets), &chunk.storage).second) {
          damaged("the entry '{}' has two chunks at [{}]", fqn, fmt::join(chunk.offsets, ", "));
        }
      }
    }
    std::set<const DcpStorage*> filled;
    for (std::size_t i = 0; i + 1 < n.items.size(); i += 2) {
      const auto key = object_fields(n.items[i], "MetadataIndex", "a storage record's key");
      const std::string fqn = string(required(key, "fqn", "MetadataIndex"), "MetadataIndex.fqn");
      const auto offset_it = key.find("offset");
      const bool tensor = offset_it != key.end() && !is_none(offset_it->second);
      DcpStorage* target = nullptr;
      std::string what;
      if (tensor) {
        const auto offsets = size(offset_it->second, "MetadataIndex.offset");
        what = fmt::format("the storage record of '{}' at [{}]", fqn, fmt::join(offsets, ", "));
        const auto it = chunks.find(std::make_pair(fqn, offsets));
        if (it == chunks.end()) damaged("{} belongs to no chunk the metadata lists", what);
        target = it->second;
      } else {
        what = fmt::format("the storage record of '{}'", fqn);
        const auto it = metadata.values.find(fqn);
        if (it == metadata.values.end()) damaged("{} belongs to no value the metadata lists", what);
        target = &it->second;
      }
      if (!filled.insert(target).second) damaged("{} appears twice", what);
      const auto info = object_fields(n.items[i + 1], "_StorageInfo", what);
      if (const auto t = info.find("transform_descriptors");
          t != info.end() && !is_none(t->second) && !node(t->second).items.empty()) {
        throw FormatError(FormatError::Kind::kUnsupported,
                          fmt::format("{} was written through storage transforms (a "
                                      "compression or another extension of DCP's), which ddp "
                                      "does not read",
                                      what));
      }
      target->file = string(required(info, "relative_path", what), what);
      check_file_name(target->file, what);
      target->offset =
          static_cast<std::uint64_t>(non_negative(required(info, "offset", what), what));
      target->length =
          static_cast<std::uint64_t>(non_negative(required(info, "length", what), what));
      if (target->offset > std::numeric_limits<std::uint64_t>::max() - target->length) {
        damaged("{} overflows", what);
      }
    }
    for (const auto& [key, storage] : chunks) {
      if (!filled.contains(storage)) {
        damaged("the chunk of '{}' at [{}] has no storage record", key.first,
                fmt::join(key.second, ", "));
      }
    }
    for (const auto& [fqn, storage] : metadata.values) {
      if (!filled.contains(&storage)) damaged("the value '{}' has no storage record", fqn);
    }
  }

  // The chunks of each tensor cover it exactly once: on the grid of their boundaries, every cell
  // is in exactly one non-empty chunk.
  void check_tiling(const DcpMetadata& metadata) const {
    std::uint64_t cells_checked = 0;
    for (const auto& [fqn, entry] : metadata.tensors) {
      const std::size_t dims = entry.shape.size();
      const bool empty_tensor =
          std::any_of(entry.shape.begin(), entry.shape.end(), [](auto d) { return d == 0; });
      if (empty_tensor) continue;  // nothing to cover; every chunk was checked to lie inside
      std::vector<std::vector<std::int64_t>> bounds(dims);
      for (std::size_t d = 0; d < dims; ++d) {
        bounds[d] = {0, entry.shape[d]};
        for (const DcpChunk& c : entry.chunks) {
          bounds[d].push_back(c.offsets[d]);
          bounds[d].push_back(c.offsets[d] + c.sizes[d]);
        }
        std::sort(bounds[d].begin(), bounds[d].end());
        bounds[d].erase(std::unique(bounds[d].begin(), bounds[d].end()), bounds[d].end());
      }
      std::uint64_t cells = 1;
      for (std::size_t d = 0; d < dims; ++d) {
        cells *= bounds[d].size() - 1;
        if (cells_checked + cells > limits_.max_grid_cells) {
          throw FormatError(FormatError::Kind::kTooLarge,
                            fmt::format("the chunks of '{}' (and those before it) cut their "
                                        "tensors into more than {} pieces to check",
                                        fqn, limits_.max_grid_cells));
        }
      }
      cells_checked += cells;
      std::vector<std::uint8_t> covered(cells, 0);
      for (const DcpChunk& c : entry.chunks) {
        if (std::any_of(c.sizes.begin(), c.sizes.end(), [](auto s) { return s == 0; })) continue;
        // The chunk's box of cells, [lo, hi) per dimension, visited as an odometer.
        std::vector<std::size_t> lo(dims), hi(dims), at(dims);
        for (std::size_t d = 0; d < dims; ++d) {
          const auto& b = bounds[d];
          lo[d] = static_cast<std::size_t>(std::lower_bound(b.begin(), b.end(), c.offsets[d]) -
                                           b.begin());
          hi[d] = static_cast<std::size_t>(
              std::lower_bound(b.begin(), b.end(), c.offsets[d] + c.sizes[d]) - b.begin());
          at[d] = lo[d];
        }
        while (true) {
          std::size_t index = 0;
          for (std::size_t d = 0; d < dims; ++d)
            index = index * (bounds[d].size() - 1) + at[d];
          if (covered[index]++ != 0) {
            damaged("the entry '{}' has chunks that overlap (one at [{}] of [{}])", fqn,
                    fmt::join(c.offsets, ", "), fmt::join(c.sizes, ", "));
          }
          std::size_t d = dims;
          while (d > 0 && ++at[d - 1] == hi[d - 1]) {
            at[d - 1] = lo[d - 1];
            --d;
          }
          if (d == 0) break;
        }
      }
      if (std::find(covered.begin(), covered.end(), 0) != covered.end()) {
        damaged("the chunks of the entry '{}' of shape [{}] leave part of it unsaved", fqn,
                fmt::join(entry.shape, ", "));
      }
    }
  }

  const PickleTree& tree_;
  const DcpMetadataLimits& limits_;
};

}  // namespace

DcpMetadata parse_dcp_metadata(std::string_view bytes, const DcpMetadataLimits& limits) {
  PickleOptions options;
  options.allow_global = is_allowed_global;
  options.allow_object = is_object_class;
  const PickleTree tree = read_pickle(bytes, options);
  tree.check_shape(options.limits);
  return Interpreter(tree, limits).run();
}

}  // namespace ddp::archive
