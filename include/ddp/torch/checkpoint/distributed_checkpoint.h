// PyTorch's distributed checkpoint format (torch.distributed.checkpoint, "DCP": what
// `dcp.save` writes for FSDP2, tensor parallelism, torchtitan and the Hugging Face stack) read
// from C++, at any layout: a folder holding `.metadata` (every entry's global shape, dtype and
// saved chunks, and where each chunk's bytes lie) and the data files (`__<rank>_<n>.distcp`).
//
//   ddp::DcpReader checkpoint("ckpt/step_1000");             // reads and checks .metadata
//   at::Tensor w = checkpoint.read("model.layers.0.weight");  // the whole tensor
//   at::Tensor shard = checkpoint.read("model.layers.0.weight", {rank * rows, 0}, {rows, cols});
//   c10::IValue step = checkpoint.read_value("step");         // a non-tensor entry
//
// Resharding: read(name, offsets, sizes) assembles any region from the saved chunks that overlap
// it, so a checkpoint saved at one world size or split loads at another; each overlapping chunk
// is read once for the call, one at a time (a read holds at most one chunk beyond the region),
// and a region that is exactly one chunk is that chunk's tensor, not a copy. The overlapping
// chunks are found through an index by first offset: O(log C) and the candidates, not O(C).
//
// Security and integrity, as every reader of PyTorch's files in ddp: nothing from the files runs
// (`.metadata` is read by the restricted pickle reader, which knows DCP's dataclasses and
// nothing else), every chunk is a zip record set whose CRC-32s are verified as it is read, and
// its dtype and shape must be what `.metadata` records. `.metadata` must describe a consistent
// checkpoint before anything else is read: the chunks of each tensor cover it exactly once,
// every chunk has its bytes in a plain file of the folder (no path outside it).
//
// Versions: what PyTorch 2.x's `dcp.save` writes (tested: 2.15, format version "1.0.0") with
// the default FileSystemWriter; storage transforms (compression extensions) and sparse layouts
// are refused by name. Writing: distributed_checkpoint_save.h; a whole checkpoint converts to
// one torch.save file (dcp_to_torch_save, `ddp-checkpoint dcp-to-torch`).
//
// Errors: ConfigError (the folder or a file missing or unreadable; a name the checkpoint lacks; a
// region outside its tensor), StateDictFormatError (what the files hold contradicts the format or
// itself: truncated, damaged, a chunk of another dtype or shape), UnsafePickleError (`.metadata`
// names a global outside DCP's classes). Each message names the folder and the entry.
// Threads: a DcpReader is immutable after construction; reads from several threads are safe.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "ddp/error.h"
#include "ddp/torch/formats/state_dict.h"

#pragma GCC visibility push(default)
namespace ddp {

// Where an item's bytes lie: [offset, offset + length) of `file` in the checkpoint's folder.
struct DcpStorageInfo {
  std::string file;
  std::uint64_t offset = 0;
  std::uint64_t length = 0;
};

struct DcpChunkInfo {
  std::vector<std::int64_t> offsets;  // where the chunk starts in the tensor
  std::vector<std::int64_t> sizes;
  DcpStorageInfo storage;
};

struct DcpTensorInfo {
  at::ScalarType dtype = at::kFloat;
  std::vector<std::int64_t> shape;
  std::vector<DcpChunkInfo> chunks;
};

// One step of an entry's path in the nested state dict that was saved: a dict's key, or a
// list's position (index >= 0).
struct DcpPathKey {
  std::string name;
  std::int64_t index = -1;
};

struct DcpCheckpointInfo {
  std::string version;  // the format's, as recorded ("1.0.0"); empty where none is
  std::map<std::string, DcpTensorInfo> tensors;  // by fully qualified name
  std::map<std::string, DcpStorageInfo> values;  // the non-tensor entries
  std::vector<std::string> order;                // every entry's name, as the file lists them
  // Each entry's path in the nested state dict that was saved ("optim", "state", 0, ...);
  // an entry without one was saved at the top level under its name.
  std::map<std::string, std::vector<DcpPathKey>> paths;
};

class DcpReader {
 public:
  explicit DcpReader(std::filesystem::path folder);

  const std::filesystem::path& folder() const { return folder_; }
  const DcpCheckpointInfo& info() const { return info_; }

  // The whole tensor `name`, on the CPU.
  at::Tensor read(const std::string& name) const;
  // The region [offsets, offsets + sizes) of the tensor `name`: one offset and size per
  // dimension, inside its shape.
  at::Tensor read(const std::string& name, const std::vector<std::int64_t>& offsets,
                  const std::vector<std::int64_t>& sizes) const;
  // A non-tensor entry (a number, a string, a list...), as torch.load(weights_only=True) reads it.
  c10::IValue read_value(const std::string& name) const;

  // Reads every chunk and value and checks each (CRC-32s, dtypes, shapes): the first problem is
  // thrown. Returns the bytes of the items read.
  std::uint64_t verify() const;

  // Every entry, tensors whole, in the nested dict that was saved, rebuilt from the entries'
  // paths as PyTorch's dcp_to_torch_save rebuilds it (a level whose keys are integers becomes a
  // list, Nones where a position was not saved).
  c10::IValue read_state_dict() const;

 private:
  // The chunks of a tensor that may overlap [begin, end) of its first dimension, in the order
  // saved: found in O(log C) plus the candidates (chunk_index_), not by a scan of all C chunks.
  std::vector<std::size_t> chunks_in_rows(const std::string& name, const DcpTensorInfo& tensor,
                                          std::int64_t begin, std::int64_t end) const;

  std::filesystem::path folder_;
  DcpCheckpointInfo info_;
  // Per tensor: its chunks' indices sorted by their first offset, and the longest chunk's extent
  // in that dimension (a chunk overlapping [b, e) starts in (b - longest, e)).
  struct ChunkIndex {
    std::vector<std::size_t> by_first_offset;
    std::int64_t longest = 0;
  };
  std::map<std::string, ChunkIndex> chunk_index_;
};

// What PyTorch's torch.distributed.checkpoint.format_utils.dcp_to_torch_save writes for `folder`:
// one torch.save file of read_state_dict() (a plain dict at the top), readable with
// torch.load(weights_only=True). Written through FILE.tmp renamed over `file`.
void dcp_to_torch_save(const std::filesystem::path& folder, const std::filesystem::path& file);

}  // namespace ddp
#pragma GCC visibility pop
