// encode_dcp_metadata (archive/dcp_metadata.h): the pickle dcp.save writes, opcode for opcode in
// meaning (PyTorch writes protocol 4 with a memo; this writes protocol 2 without one, which
// pickle.load and the restricted reader take alike).
#include <set>

#include <fmt/format.h>

#include "archive/dcp_metadata.h"
#include "archive/pickle_writer.h"

namespace ddp::archive {
namespace {

constexpr std::string_view kMetadataPythonModule = "torch.distributed.checkpoint.metadata";

class MetadataPickler {
 public:
  std::string run(const DcpMetadata& metadata) {
    check_order(metadata);
    object(kMetadataPythonModule, "Metadata");
    out_.empty_dict();
    out_.mark();
    out_.string("state_dict_metadata");
    entries(metadata);
    out_.string("planner_data");
    paths(metadata);
    out_.string("storage_data");
    storage(metadata);
    out_.string("storage_meta");
    out_.none();
    out_.string("version");
    out_.string(metadata.version.empty() ? "1.0.0" : metadata.version);
    out_.setitems();
    out_.build();
    return out_.finish();
  }

 private:
  static void check_order(const DcpMetadata& metadata) {
    std::set<std::string_view> seen;
    for (const std::string& name : metadata.order) {
      if (!metadata.tensors.contains(name) && !metadata.values.contains(name)) {
        throw FormatError(FormatError::Kind::kDamaged,
                          fmt::format("the entry '{}' is listed but not described", name));
      }
      if (!seen.insert(name).second) {
        throw FormatError(FormatError::Kind::kDamaged,
                          fmt::format("the entry '{}' is listed twice", name));
      }
    }
    if (seen.size() != metadata.tensors.size() + metadata.values.size()) {
      throw FormatError(FormatError::Kind::kDamaged,
                        "an entry is described but not listed in the metadata's order");
    }
  }

  // cls.__new__(cls): the object whose state BUILD sets next.
  void object(std::string_view module, std::string_view cls) {
    out_.global(module, cls);
    out_.empty_tuple();
    out_.newobj();
  }

  void size(const std::vector<std::int64_t>& dims) {
    out_.global("torch", "Size");
    out_.mark();
    for (const std::int64_t d : dims)
      out_.integer(d);
    out_.tuple();
    out_.tuple1();
    out_.reduce();
  }

  // TensorProperties.__getstate__'s five fields: (dtype, layout, requires_grad, memory format
  // encoding, pin_memory).
  void properties(const std::string& dtype) {
    object(kMetadataPythonModule, "TensorProperties");
    out_.mark();
    out_.global("torch", dtype);
    out_.global("torch.serialization", "_get_layout");
    out_.string("torch.strided");
    out_.tuple1();
    out_.reduce();
    out_.boolean(false);
    out_.global("builtins", "getattr");
    out_.mark();
    out_.global(kMetadataPythonModule, "_MEM_FORMAT_ENCODING");
    out_.string("TORCH_CONTIGUOUS_FORMAT");
    out_.tuple();
    out_.reduce();
    out_.boolean(false);
    out_.tuple();
    out_.build();
  }

  void entries(const DcpMetadata& metadata) {
    out_.empty_dict();
    out_.mark();
    for (const std::string& name : metadata.order) {
      out_.string(name);
      const auto tensor = metadata.tensors.find(name);
      if (tensor == metadata.tensors.end()) {
        object(kMetadataPythonModule, "BytesStorageMetadata");
        continue;
      }
      const DcpTensorEntry& entry = tensor->second;
      object(kMetadataPythonModule, "TensorStorageMetadata");
      out_.empty_dict();
      out_.mark();
      out_.string("properties");
      properties(entry.dtype);
      out_.string("size");
      size(entry.shape);
      out_.string("chunks");
      out_.empty_list();
      out_.mark();
      for (const DcpChunk& chunk : entry.chunks) {
        object(kMetadataPythonModule, "ChunkStorageMetadata");
        out_.empty_dict();
        out_.mark();
        out_.string("offsets");
        size(chunk.offsets);
        out_.string("sizes");
        size(chunk.sizes);
        out_.setitems();
        out_.build();
      }
      out_.appends();
      out_.setitems();
      out_.build();
    }
    out_.setitems();
  }

  // planner_data: each entry's path in the nested state dict, a tuple of names and positions.
  void paths(const DcpMetadata& metadata) {
    out_.empty_dict();
    out_.mark();
    for (const std::string& name : metadata.order) {
      out_.string(name);
      out_.mark();
      const auto path = metadata.paths.find(name);
      if (path == metadata.paths.end()) {
        out_.string(name);
      } else {
        for (const DcpPathKey& key : path->second) {
          if (key.index >= 0) {
            out_.integer(key.index);
          } else {
            out_.string(key.name);
          }
        }
      }
      out_.tuple();
    }
    out_.setitems();
  }

  void index(const std::string& fqn, const std::vector<std::int64_t>* offsets, std::size_t at) {
    object(kMetadataPythonModule, "MetadataIndex");
    out_.empty_dict();
    out_.mark();
    out_.string("fqn");
    out_.string(fqn);
    out_.string("offset");
    if (offsets) {
      size(*offsets);
    } else {
      out_.none();
    }
    out_.string("index");
    if (offsets) {
      out_.integer(static_cast<std::int64_t>(at));
    } else {
      out_.none();
    }
    out_.setitems();
    out_.build();
  }

  void storage_info(const DcpStorage& storage) {
    object("torch.distributed.checkpoint.filesystem", "_StorageInfo");
    out_.empty_dict();
    out_.mark();
    out_.string("relative_path");
    out_.string(storage.file);
    out_.string("offset");
    out_.integer(static_cast<std::int64_t>(storage.offset));
    out_.string("length");
    out_.integer(static_cast<std::int64_t>(storage.length));
    out_.setitems();
    out_.build();
  }

  void storage(const DcpMetadata& metadata) {
    out_.empty_dict();
    out_.mark();
    for (const std::string& name : metadata.order) {
      const auto tensor = metadata.tensors.find(name);
      if (tensor == metadata.tensors.end()) {
        index(name, nullptr, 0);
        storage_info(metadata.values.at(name));
        continue;
      }
      const auto& chunks = tensor->second.chunks;
      for (std::size_t i = 0; i < chunks.size(); ++i) {
        index(name, &chunks[i].offsets, i);
        storage_info(chunks[i].storage);
      }
    }
    out_.setitems();
  }

  PickleWriter out_;
};

}  // namespace

std::string encode_dcp_metadata(const DcpMetadata& metadata) {
  return MetadataPickler().run(metadata);
}

}  // namespace ddp::archive
