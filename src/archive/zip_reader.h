// A zip archive read the way a server reads a file a stranger sent. Made for the archives
// torch.save writes (PyTorch's PyTorchStreamWriter, miniz: stored records, zip64 where a size
// needs it) and ddp's writer; reads any single-disk zip of stored or deflated records.
//
// What is checked, before anything is allocated or inflated:
//   - the end-of-central-directory record (and the zip64 one) against the file's size, the
//     central directory against them, every local header against its central entry (name,
//     method) and the data area: no record reaches outside it, no two overlap, no name repeats;
//   - each record's declared size: stored records are as long as declared, a deflated one cannot
//     declare more than deflate can produce from its compressed bytes (1032:1);
// and while reading: every record's CRC-32 (libdeflate's, several GB/s), a deflated record
// inflates to exactly its declared size (never more: the output is the caller's buffer of that
// size), and a file that changes size under the reader is an error, not a short record.
//
// Not thread-safe: one thread at a time per reader (reads are positional, but the reader keeps
// which records were read for verify_unread). A large stored record is read by up to 4 threads
// of the reader's own (fewer where the process's CPU affinity allows fewer), which end before the
// read returns.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "archive/archive_error.h"

namespace ddp::archive {

class ByteSource;

struct ZipLimits {
  std::size_t max_entries = std::size_t{1} << 20;
  // The central directory is read whole: 1 Mi records of 200-byte names fit.
  std::uint64_t max_directory_bytes = std::uint64_t{256} << 20;
  // verify and verify_unread inflate a deflated record only up to this size (time is bounded).
  std::uint64_t max_unread_inflated_bytes = std::uint64_t{64} << 20;
};

struct ZipEntry {
  std::string name;
  std::uint16_t method = 0;  // 0: stored, 8: deflated
  std::uint32_t crc32 = 0;
  std::uint64_t compressed_size = 0;
  std::uint64_t size = 0;  // uncompressed
  std::uint64_t local_header_offset = 0;
  std::uint64_t data_offset = 0;  // from the local header
};

// A region of a record that is a row-major array (a tensor's storage): which elements are kept,
// and where. Element (i_0, ..., i_{n-1}) of the region (i_d < count[d]) goes to out + sum(i_d *
// out_strides[d]); out_strides' last is element_bytes (the region's rows are contiguous there).
struct ZipArrayWindow {
  std::vector<std::uint64_t> shape;  // the record's array, in elements; the product fills it
  std::uint64_t element_bytes = 1;
  std::vector<std::uint64_t> begin, count;
  unsigned char* out = nullptr;
  std::vector<std::uint64_t> out_strides;  // in bytes
};

class ZipReader {
 public:
  // Throws ConfigError where the file cannot be opened or read, FormatError where its bytes are
  // not a zip archive this reader accepts (message without the file's name).
  static ZipReader open(const std::filesystem::path& path, ZipLimits limits = {});
  static ZipReader from_bytes(std::string bytes, ZipLimits limits = {});
  // The archive that fills [offset, offset + length) of the file at `path` (its offsets count
  // from `offset`): ByteSource::open_range.
  static ZipReader open_range(const std::filesystem::path& path, std::uint64_t offset,
                              std::uint64_t length, ZipLimits limits = {});

  ZipReader(ZipReader&&) noexcept;
  ZipReader& operator=(ZipReader&&) noexcept;
  ~ZipReader();

  std::uint64_t file_size() const;
  const std::vector<ZipEntry>& entries() const { return entries_; }
  const ZipEntry* find(std::string_view name) const;

  // Reads the record whole into `out` (entry.size bytes), its CRC-32 verified. `entry` is one of
  // this reader's entries(). Throws FormatError (damaged) and ConfigError (an I/O error).
  void read(const ZipEntry& entry, void* out) const;
  // The same without the CRC-32 (sizes still checked): only to measure what the check costs.
  void read_unverified(const ZipEntry& entry, void* out) const;
  // Reads the whole record and verifies it as read() does, but keeps only its bytes [begin,
  // begin + length) (in `out`, `length` bytes): the rest passes through one piece of scratch
  // memory, so reading part of a large record costs no more memory than that part. A window past
  // the record's end is an Error (a caller's bug).
  void read_window(const ZipEntry& entry, std::uint64_t begin, std::uint64_t length,
                   void* out) const;
  // Reads the whole record and verifies it as read() does, but keeps only the elements of a
  // region of it (a column split of a matrix: the overlap's part of each row), through one piece
  // of scratch memory. A window that does not describe the record (its shape's bytes are not the
  // record's size, a region outside the shape, strides of another count) is an Error (a caller's
  // bug).
  void read_array_window(const ZipEntry& entry, const ZipArrayWindow& window) const;
  // The same into a string; a record over `max_bytes` is a FormatError (kTooLarge) before it is
  // read.
  std::string read_string(const ZipEntry& entry, std::uint64_t max_bytes) const;
  // Reads the record only to verify it (sizes and CRC-32), keeping nothing.
  void verify(const ZipEntry& entry) const;
  // Verifies the CRC-32 of every record not read so far, so that no damaged byte passes
  // unnoticed because nobody needed it (deflated ones only up to max_unread_inflated_bytes).
  void verify_unread() const;

 private:
  ZipReader(std::unique_ptr<ByteSource> source, ZipLimits limits);
  void read_central_directory();
  template <class Sink>
  void stream(const ZipEntry& entry, Sink&& sink, bool verify = true) const;
  // The record's bytes [begin, begin + length) into `out`; all of it read and (if `verify`)
  // checked.
  void read_into(const ZipEntry& entry, unsigned char* out, bool verify, std::uint64_t begin,
                 std::uint64_t length) const;
  std::size_t index_of(const ZipEntry& entry) const;
  void check_crc(const ZipEntry& entry, std::uint32_t crc) const;

  std::unique_ptr<ByteSource> source_;
  ZipLimits limits_;
  std::vector<ZipEntry> entries_;
  std::unordered_map<std::string_view, std::size_t> by_name_;
  mutable std::vector<bool> read_;
};

// The folder every record of a PyTorch archive lies in ("archive/" for torch.save's, the file's
// stem for older writers): the first record's name up to its first '/'. Records are looked up
// as prefix + "data.pkl", as PyTorch's own reader does. FormatError where the first record has no
// folder or another record lies outside it.
std::string pytorch_record_prefix(const ZipReader& zip);

}  // namespace ddp::archive
