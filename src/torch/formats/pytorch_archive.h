// PyTorch's zip archive as torch.save writes it (archive/data.pkl, archive/data/<key>,
// archive/version, archive/byteorder), holding one pickled value of plain data and tensors.
// What Python's state_dict() and optimizer.state_dict() are, and what ddp's state_dict.h and
// optimizer_state_dict.h read and write.
//
// Values are c10::IValues of these kinds only: None, Bool, Int, Double, String, Tuple,
// GenericList, GenericDict (keys: strings or ints) and CPU Tensor. Reading turns a pickled
// collections.OrderedDict into a GenericDict (insertion order kept) and drops its `_metadata`.
#pragma once

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <string>
#include <string_view>

#include <torch/torch.h>

namespace ddp::archive {
struct ZipArrayWindow;  // archive/zip_reader.h
}  // namespace ddp::archive

namespace ddp::detail {

struct PytorchArchiveReadOptions {
  // Every record's CRC-32 is verified; false only for state_dict_bench, which measures what the
  // check costs against skipping it.
  bool verify_crc = true;
  // Where the archive's storage is read, instead of fresh memory: `into_bytes` bytes the caller
  // owns and keeps alive while the value lives (its tensors view them). The archive must hold
  // exactly one storage of exactly that size (a distributed checkpoint's chunk, read straight into
  // its place in the destination tensor), or of at least into_offset + into_bytes (below);
  // anything else is a StateDictFormatError.
  void* into = nullptr;
  std::uint64_t into_bytes = 0;
  // With `into`: the storage's bytes [into_offset, into_offset + into_bytes) only, when that is
  // not all of it (a part of a saved chunk, resharding): the whole record is still read and its
  // CRC-32 verified, the rest through scratch memory (ZipReader::read_window). The value's tensor
  // then views no data (a null pointer): only its dtype, sizes and strides may be used.
  std::uint64_t into_offset = 0;
  // Instead of `into`: the archive's one storage, where it holds exactly the window's array, read
  // as that row-major array keeping only the window's region, at the window's `out` and strides
  // (ZipReader::read_array_window: all of the record read and verified); the value's tensor then
  // views no data. A storage of another size is read into fresh memory as without options (the
  // tensor views it: the caller takes the region from that).
  const archive::ZipArrayWindow* array_window = nullptr;
};

// Reads the archive at `path` (with the zip reader's checks, archive/zip_reader.h, and the
// restricted unpickler's limits). Throws ConfigError (missing, unreadable), StateDictFormatError
// (not a zip archive, the legacy format, a TorchScript archive, damaged: a CRC, a size, an
// offset, a pickle too deep or too large) and UnsafePickleError.
c10::IValue read_pytorch_archive(const std::filesystem::path& path,
                                 const PytorchArchiveReadOptions& options = {});

// The archive that fills [offset, offset + length) of the file at `path` (one of the items of a
// distributed checkpoint's data file), read as read_pytorch_archive reads a file; `source` names
// it in errors ("ckpt/__0_0.distcp at byte 1577"). A range past the file's end is a
// StateDictFormatError (truncated).
c10::IValue read_pytorch_archive_range(const std::filesystem::path& path, std::uint64_t offset,
                                       std::uint64_t length, const std::string& source,
                                       const PytorchArchiveReadOptions& options = {});

// Writes `value` to `path` through PATH.tmp renamed over it. `ordered_dict_at_top`: the top-level
// dict is pickled as a collections.OrderedDict (as Python's state_dict() is), others as dicts.
// Throws ConfigError on I/O failures, ddp::Error for a value of another kind.
void write_pytorch_archive(const std::filesystem::path& path, const c10::IValue& value,
                           bool ordered_dict_at_top);

// Appends the archive of `value` (as write_pytorch_archive writes it) to `file` at its position
// (an item of a distributed checkpoint's data file) and returns its length in bytes; `name`
// names the file in errors. Throws ConfigError when a write fails, ddp::Error, starting with
// `context`, for a value of another kind. The caller flushes.
std::uint64_t append_pytorch_archive(std::FILE* file, const std::string& name,
                                     const c10::IValue& value, bool ordered_dict_at_top,
                                     const std::string& context);

// Where pickle_value puts each storage it reaches, once per storage, under the key its pickle
// names it by ("0", "1", ... in the order reached).
using StorageSink = std::function<void(const std::string& key, const at::Storage& storage)>;

// The pickle of `value` as write_pytorch_archive writes it (same kinds, same opcodes), handing
// every storage to `sink` instead of a zip archive (what an RPC message carries beside its pickle).
// Tensors off the CPU are copied to it first. Throws ddp::Error, starting with `context`, for a
// value of another kind.
std::string pickle_value(const c10::IValue& value, bool ordered_dict_at_top,
                         const StorageSink& sink, const std::string& context);

// One storage that a pickle refers to by persistent id ("storage", torch.FloatStorage, key,
// location, numel).
struct StorageRequest {
  at::ScalarType dtype;
  std::string key;
  std::int64_t numel;
};
using StorageLoader = std::function<at::Storage(const StorageRequest&)>;

// Unpickles `pickle` (see pytorch_archive.h) through the allowlist, loading storages with
// `load_storage`. `source` names the file in errors. Throws StateDictFormatError and
// UnsafePickleError.
c10::IValue unpickle_restricted(std::string_view pickle, const StorageLoader& load_storage,
                                const std::string& source);

}  // namespace ddp::detail
