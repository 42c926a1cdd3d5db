// The zip reader's first phase (zip_reader.h): the end records, the central directory and every
// local header, checked against the file's size and each other before any record is read.
#include <algorithm>
#include <cstring>
#include <numeric>

#include <fmt/format.h>

#include "archive/byte_source.h"
#include "archive/zip_format.h"
#include "archive/zip_reader.h"

namespace ddp::archive {

using namespace zip;

void ZipReader::read_central_directory() {
  const std::uint64_t size = source_->size();
  if (size < kEndRecordBytes) {
    damaged(fmt::format("{} bytes, too short for a zip archive", size));
  }
  // The end record is the last 22 bytes but for a comment of up to 65535 bytes: the last
  // signature whose comment length reaches the end of the file exactly.
  const std::size_t tail_bytes =
      static_cast<std::size_t>(std::min<std::uint64_t>(size, kEndRecordBytes + 0xffff));
  const std::uint64_t tail_start = size - tail_bytes;
  const auto tail = source_->read(tail_start, tail_bytes);
  std::size_t at = tail_bytes - kEndRecordBytes;
  for (;; --at) {
    if (u32(&tail[at]) == kEndRecord && at + kEndRecordBytes + u16(&tail[at + 20]) == tail_bytes) {
      break;
    }
    if (at == 0) damaged("no end-of-central-directory record (truncated, or not a zip archive)");
  }
  const unsigned char* end = &tail[at];
  const std::uint64_t end_offset = tail_start + at;
  std::uint64_t disk = u16(end + 4), directory_disk = u16(end + 6);
  std::uint64_t entries_here = u16(end + 8), entries = u16(end + 10);
  std::uint64_t directory_size = u32(end + 12), directory_offset = u32(end + 16);
  std::uint64_t data_end = end_offset;

  const bool saturated = entries == 0xffff || directory_size == 0xffffffff ||
                         directory_offset == 0xffffffff || entries_here == 0xffff;
  bool zip64 = false;
  if (end_offset >= kZip64LocatorBytes) {
    const auto locator = source_->read(end_offset - kZip64LocatorBytes, kZip64LocatorBytes);
    zip64 = u32(locator.data()) == kZip64Locator;
    if (zip64) {
      const std::uint64_t record_offset = u64(&locator[8]);
      if (!fits(record_offset, kZip64EndRecordBytes, end_offset - kZip64LocatorBytes)) {
        damaged(fmt::format("the zip64 end record at byte {} lies outside the file's end",
                            record_offset));
      }
      const auto record = source_->read(record_offset, kZip64EndRecordBytes);
      if (u32(record.data()) != kZip64EndRecord) {
        damaged(
            fmt::format("no zip64 end record at byte {}, where its locator points", record_offset));
      }
      disk = u32(&record[16]);
      directory_disk = u32(&record[20]);
      entries_here = u64(&record[24]);
      entries = u64(&record[32]);
      directory_size = u64(&record[40]);
      directory_offset = u64(&record[48]);
      data_end = record_offset;
    }
  }
  if (saturated && !zip64) damaged("sizes that need a zip64 end record, which the file lacks");
  if (disk != 0 || directory_disk != 0 || entries_here != entries) {
    throw FormatError(FormatError::Kind::kUnsupported, "an archive split over several disks");
  }
  if (!fits(directory_offset, directory_size, data_end) ||
      directory_offset + directory_size != data_end) {
    damaged(
        fmt::format("the central directory ({} bytes at byte {}) does not end where the end "
                    "record begins (byte {})",
                    directory_size, directory_offset, data_end));
  }
  if (entries > limits_.max_entries) {
    throw FormatError(
        FormatError::Kind::kTooLarge,
        fmt::format("{} records, over this reader's limit of {}", entries, limits_.max_entries));
  }
  if (directory_size > limits_.max_directory_bytes) {
    throw FormatError(FormatError::Kind::kTooLarge,
                      fmt::format("a central directory of {} bytes, over this reader's limit of {}",
                                  directory_size, limits_.max_directory_bytes));
  }
  if (entries * kCentralHeaderBytes > directory_size) {
    damaged(fmt::format("{} records cannot fit a central directory of {} bytes", entries,
                        directory_size));
  }

  const auto directory = source_->read(directory_offset, static_cast<std::size_t>(directory_size));
  std::size_t pos = 0;
  entries_.reserve(static_cast<std::size_t>(entries));
  for (std::uint64_t i = 0; i < entries; ++i) {
    if (directory.size() - pos < kCentralHeaderBytes || u32(&directory[pos]) != kCentralHeader) {
      damaged(fmt::format("central directory record {} is not where it should be (byte {})", i,
                          directory_offset + pos));
    }
    const unsigned char* h = &directory[pos];
    const std::uint16_t flags = u16(h + 8);
    ZipEntry e;
    e.method = u16(h + 10);
    e.crc32 = u32(h + 16);
    e.compressed_size = u32(h + 20);
    e.size = u32(h + 24);
    const std::size_t name_bytes = u16(h + 28), extra_bytes = u16(h + 30),
                      comment_bytes = u16(h + 32);
    std::uint64_t start_disk = u16(h + 34);
    e.local_header_offset = u32(h + 42);
    if (directory.size() - pos - kCentralHeaderBytes < name_bytes + extra_bytes + comment_bytes) {
      damaged(fmt::format("central directory record {} runs past the directory's end", i));
    }
    e.name.assign(reinterpret_cast<const char*>(h + kCentralHeaderBytes), name_bytes);
    // The zip64 extra field holds, in this order, the fields saturated above.
    const unsigned char* extra = h + kCentralHeaderBytes + name_bytes;
    for (std::size_t x = 0; x + 4 <= extra_bytes;) {
      const std::uint16_t id = u16(extra + x), length = u16(extra + x + 2);
      if (x + 4 + length > extra_bytes)
        damaged(fmt::format("record '{}': a damaged extra field", e.name));
      if (id == 0x0001) {
        const unsigned char* field = extra + x + 4;
        std::size_t left = length;
        auto take = [&](std::uint64_t& value) {
          if (left < 8) damaged(fmt::format("record '{}': a zip64 field too short", e.name));
          value = u64(field);
          field += 8;
          left -= 8;
        };
        if (e.size == 0xffffffff) take(e.size);
        if (e.compressed_size == 0xffffffff) take(e.compressed_size);
        if (e.local_header_offset == 0xffffffff) take(e.local_header_offset);
        if (start_disk == 0xffff) {
          if (left < 4) damaged(fmt::format("record '{}': a zip64 field too short", e.name));
          start_disk = u32(field);
        }
      }
      x += 4 + length;
    }
    pos += kCentralHeaderBytes + name_bytes + extra_bytes + comment_bytes;

    if (e.name.empty() || e.name.find('\0') != std::string::npos) {
      damaged(fmt::format("central directory record {} has an empty or binary name", i));
    }
    if (start_disk != 0) {
      throw FormatError(FormatError::Kind::kUnsupported, "an archive split over several disks");
    }
    if ((flags & 0x41) != 0) {
      throw FormatError(FormatError::Kind::kUnsupported,
                        fmt::format("record '{}' is encrypted", e.name));
    }
    if (e.method != 0 && e.method != 8) {
      throw FormatError(FormatError::Kind::kUnsupported,
                        fmt::format("record '{}' is compressed with method {} (this reader "
                                    "reads stored (0) and deflated (8) records)",
                                    e.name, e.method));
    }
    if (e.method == 0 && e.compressed_size != e.size) {
      damaged(fmt::format("stored record '{}' declares {} bytes but holds {}", e.name, e.size,
                          e.compressed_size));
    }
    if (e.method == 8 && e.size / kMaxDeflateRatio > e.compressed_size) {
      damaged(
          fmt::format("deflated record '{}' declares {} bytes, more than its {} compressed "
                      "bytes can inflate to",
                      e.name, e.size, e.compressed_size));
    }
    entries_.push_back(std::move(e));
  }
  if (pos != directory.size()) {
    damaged(fmt::format("the central directory holds {} bytes after its {} records",
                        directory.size() - pos, entries));
  }

  // Every local header, checked against its central record and the data area (which ends where
  // the central directory begins).
  for (auto& e : entries_) {
    if (!fits(e.local_header_offset, kLocalHeaderBytes + e.name.size(), directory_offset)) {
      damaged(fmt::format("record '{}' starts at byte {}, outside the data area", e.name,
                          e.local_header_offset));
    }
    const auto local = source_->read(e.local_header_offset, kLocalHeaderBytes + e.name.size());
    if (u32(local.data()) != kLocalHeader || u16(&local[8]) != e.method ||
        u16(&local[26]) != e.name.size() ||
        std::memcmp(&local[kLocalHeaderBytes], e.name.data(), e.name.size()) != 0) {
      damaged(
          fmt::format("the local header of record '{}' (byte {}) does not match its "
                      "central directory entry",
                      e.name, e.local_header_offset));
    }
    e.data_offset = e.local_header_offset + kLocalHeaderBytes + e.name.size() + u16(&local[28]);
    if (!fits(e.data_offset, e.compressed_size, directory_offset)) {
      damaged(fmt::format("record '{}' ({} bytes at byte {}) reaches past the data area", e.name,
                          e.compressed_size, e.data_offset));
    }
  }
  std::vector<std::size_t> order(entries_.size());
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
    return entries_[a].local_header_offset < entries_[b].local_header_offset;
  });
  for (std::size_t k = 1; k < order.size(); ++k) {
    const ZipEntry& before = entries_[order[k - 1]];
    const ZipEntry& after = entries_[order[k]];
    if (before.data_offset + before.compressed_size > after.local_header_offset) {
      damaged(fmt::format("records '{}' and '{}' overlap in the file", before.name, after.name));
    }
  }
  by_name_.reserve(entries_.size());
  for (std::size_t i = 0; i < entries_.size(); ++i) {
    if (!by_name_.emplace(entries_[i].name, i).second) {
      damaged(fmt::format("two records are named '{}'", entries_[i].name));
    }
  }
  read_.assign(entries_.size(), false);
}

}  // namespace ddp::archive
