// The zip reader (zip_reader.h). Layout from PKWARE's APPNOTE 6.3: local headers and data, the
// central directory, [zip64 end record, zip64 locator,] the end record with an optional comment.
#include "archive/zip_reader.h"

#include <fcntl.h>
#include <libdeflate.h>
#include <sched.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <exception>
#include <numeric>
#include <thread>

#include <fmt/format.h>

namespace ddp::archive {
namespace {

constexpr std::uint32_t kLocalHeader = 0x04034b50;
constexpr std::uint32_t kCentralHeader = 0x02014b50;
constexpr std::uint32_t kEndRecord = 0x06054b50;
constexpr std::uint32_t kZip64EndRecord = 0x06064b50;
constexpr std::uint32_t kZip64Locator = 0x07064b50;
constexpr std::size_t kEndRecordBytes = 22;
constexpr std::size_t kZip64EndRecordBytes = 56;
constexpr std::size_t kZip64LocatorBytes = 20;
constexpr std::size_t kCentralHeaderBytes = 46;
constexpr std::size_t kLocalHeaderBytes = 30;
// Deflate's largest ratio: a block of 258-byte matches costs at least about 2 bits per match.
constexpr std::uint64_t kMaxDeflateRatio = 1032;
// Records are read and checked in pieces of this size, so each piece's CRC runs while the piece
// is still in the cache the read put it in.
constexpr std::size_t kPiece = std::size_t{256} << 10;
// A stored record this large is read by several threads, each a contiguous part of at least
// kPart bytes: its copy from the page cache (and the page faults of fresh memory) and its CRC run
// side by side, and the parts' CRCs are combined (zlib's crc32_combine). One thread reads 1.4 GB/s
// here, of which the CRC is about a tenth.
constexpr std::uint64_t kParallelBytes = std::uint64_t{16} << 20;
constexpr std::uint64_t kPart = std::uint64_t{8} << 20;
constexpr unsigned kMaxReadThreads = 4;

// The CPUs this process may run on (its affinity mask: a rank pinned to one core reads alone).
unsigned usable_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (::sched_getaffinity(0, sizeof set, &set) != 0) return 1;
  return static_cast<unsigned>(std::max(1, CPU_COUNT(&set)));
}

[[noreturn]] void damaged(const std::string& what) {
  throw FormatError(FormatError::Kind::kDamaged, what);
}

std::uint64_t le(const unsigned char* p, int bytes) {
  std::uint64_t v = 0;
  for (int i = 0; i < bytes; ++i)
    v |= std::uint64_t{p[i]} << (8 * i);
  return v;
}
std::uint16_t u16(const unsigned char* p) {
  return static_cast<std::uint16_t>(le(p, 2));
}
std::uint32_t u32(const unsigned char* p) {
  return static_cast<std::uint32_t>(le(p, 4));
}
std::uint64_t u64(const unsigned char* p) {
  return le(p, 8);
}

// a + b <= limit, without overflow.
bool fits(std::uint64_t a, std::uint64_t b, std::uint64_t limit) {
  return a <= limit && b <= limit - a;
}

}  // namespace

// Where the bytes come from: a file read with pread (positional, so reads need no shared
// position) or memory (fuzzing, tests).
class ZipReader::Source {
 public:
  explicit Source(std::string bytes) : memory_(std::move(bytes)), size_(memory_.size()) {}
  Source(int fd, std::uint64_t size, std::string path)
      : fd_(fd), size_(size), path_(std::move(path)) {}
  ~Source() {
    if (fd_ >= 0) ::close(fd_);
  }
  Source(const Source&) = delete;
  Source& operator=(const Source&) = delete;

  std::uint64_t size() const { return size_; }

  void read(std::uint64_t offset, void* out, std::size_t n) const {
    if (!fits(offset, n, size_)) {
      damaged(fmt::format("a read of {} bytes at byte {} reaches past the end of the {}-byte file",
                          n, offset, size_));
    }
    if (fd_ < 0) {
      std::memcpy(out, memory_.data() + offset, n);
      return;
    }
    auto* to = static_cast<char*>(out);
    while (n > 0) {
      const ssize_t got = ::pread(fd_, to, n, static_cast<off_t>(offset));
      if (got < 0) {
        if (errno == EINTR) continue;
        throw ConfigError(
            fmt::format("{}: cannot read at byte {}: {}", path_, offset, std::strerror(errno)));
      }
      if (got == 0) {
        damaged(
            fmt::format("the file ended at byte {}, though it was {} bytes when opened "
                        "(changed while being read?)",
                        offset, size_));
      }
      to += got;
      offset += static_cast<std::uint64_t>(got);
      n -= static_cast<std::size_t>(got);
    }
  }
  std::vector<unsigned char> read(std::uint64_t offset, std::size_t n) const {
    std::vector<unsigned char> bytes(n);
    read(offset, bytes.data(), n);
    return bytes;
  }

 private:
  int fd_ = -1;
  std::string memory_;
  std::uint64_t size_;
  std::string path_;
};

ZipReader ZipReader::open(const std::filesystem::path& path, ZipLimits limits) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    throw ConfigError(
        fmt::format("{}: cannot open the file to read: {}", path.string(), std::strerror(errno)));
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    const int error = errno;
    ::close(fd);
    throw ConfigError(fmt::format("{}: {}", path.string(),
                                  S_ISDIR(st.st_mode) ? "a directory, not a file"
                                  : error != 0        ? std::strerror(error)
                                                      : "not a regular file"));
  }
  return ZipReader(
      std::make_unique<Source>(fd, static_cast<std::uint64_t>(st.st_size), path.string()), limits);
}

ZipReader ZipReader::from_bytes(std::string bytes, ZipLimits limits) {
  return ZipReader(std::make_unique<Source>(std::move(bytes)), limits);
}

ZipReader::ZipReader(std::unique_ptr<Source> source, ZipLimits limits)
    : source_(std::move(source)), limits_(limits) {
  read_central_directory();
}
ZipReader::ZipReader(ZipReader&&) noexcept = default;
ZipReader& ZipReader::operator=(ZipReader&&) noexcept = default;
ZipReader::~ZipReader() = default;

std::uint64_t ZipReader::file_size() const {
  return source_->size();
}

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

const ZipEntry* ZipReader::find(std::string_view name) const {
  const auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : &entries_[it->second];
}

// Hands the record's bytes to `sink(const void*, size_t)` in pieces, checks the CRC-32 of all
// of them and that they add up to the declared size exactly.
template <class Sink>
void ZipReader::stream(const ZipEntry& entry, Sink&& sink, bool verify) const {
  const std::size_t index = index_of(entry);
  std::uint32_t crc = 0;
  std::vector<unsigned char> piece(static_cast<std::size_t>(
      std::min<std::uint64_t>(kPiece, std::max(entry.compressed_size, std::uint64_t{1}))));
  if (entry.method == 0) {
    for (std::uint64_t done = 0; done < entry.size;) {
      const auto n = static_cast<std::size_t>(std::min<std::uint64_t>(kPiece, entry.size - done));
      unsigned char* at = sink.place(n, piece.data());
      source_->read(entry.data_offset + done, at, n);
      if (verify) crc = libdeflate_crc32(crc, at, n);
      sink.took(at, n);
      done += n;
    }
  } else {
    z_stream z{};
    if (inflateInit2(&z, -MAX_WBITS) != Z_OK) throw Error("zlib: inflateInit2 failed");
    struct End {
      z_stream* z;
      ~End() { inflateEnd(z); }
    } end{&z};
    std::vector<unsigned char> out(kPiece);
    std::uint64_t consumed = 0, produced = 0;
    int status = Z_OK;
    while (status != Z_STREAM_END) {
      if (z.avail_in == 0) {
        if (consumed == entry.compressed_size) {
          damaged(fmt::format("deflated record '{}' ends before its stream does", entry.name));
        }
        const auto n = static_cast<std::size_t>(
            std::min<std::uint64_t>(piece.size(), entry.compressed_size - consumed));
        source_->read(entry.data_offset + consumed, piece.data(), n);
        consumed += n;
        z.next_in = piece.data();
        z.avail_in = static_cast<uInt>(n);
      }
      // Never more output than declared: the stream stops at the declared size.
      const auto room =
          static_cast<std::size_t>(std::min<std::uint64_t>(kPiece, entry.size - produced));
      unsigned char* at = room > 0 ? sink.place(room, out.data()) : out.data();
      z.next_out = at;
      z.avail_out = static_cast<uInt>(room > 0 ? room : 1);
      status = inflate(&z, Z_NO_FLUSH);
      const std::size_t made = (room > 0 ? room : 1) - z.avail_out;
      if (status != Z_OK && status != Z_STREAM_END && !(status == Z_BUF_ERROR && made == 0)) {
        damaged(fmt::format("deflated record '{}' is damaged ({})", entry.name,
                            z.msg != nullptr ? z.msg : "inflate failed"));
      }
      if (produced + made > entry.size) {
        damaged(fmt::format("deflated record '{}' inflates to more than its declared {} bytes",
                            entry.name, entry.size));
      }
      if (made > 0) {
        if (verify) crc = libdeflate_crc32(crc, at, made);
        sink.took(at, made);
        produced += made;
      } else if (status == Z_BUF_ERROR && z.avail_in > 0) {
        damaged(fmt::format("deflated record '{}' is damaged (no progress)", entry.name));
      }
    }
    if (produced != entry.size) {
      damaged(fmt::format("deflated record '{}' inflates to {} bytes, not its declared {}",
                          entry.name, produced, entry.size));
    }
  }
  if (verify) check_crc(entry, crc);
  read_[index] = true;
}

std::size_t ZipReader::index_of(const ZipEntry& entry) const {
  if (std::less<>{}(&entry, entries_.data()) ||
      !std::less<>{}(&entry, entries_.data() + entries_.size())) {
    throw Error("ZipReader: an entry of another reader (use entries() or find() of this one)");
  }
  return static_cast<std::size_t>(&entry - entries_.data());
}

void ZipReader::check_crc(const ZipEntry& entry, std::uint32_t crc) const {
  if (crc != entry.crc32) {
    damaged(
        fmt::format("record '{}' fails its CRC-32 check (recorded {:08x}, computed {:08x}): "
                    "the file is damaged",
                    entry.name, entry.crc32, crc));
  }
}

namespace {

// Sinks for ZipReader::stream: place(n, scratch) says where the next n bytes go, took(at, n)
// that they are there.
struct IntoBuffer {
  unsigned char* out;
  std::uint64_t filled = 0;
  unsigned char* place(std::size_t, unsigned char*) { return out + filled; }
  void took(const unsigned char*, std::size_t n) { filled += n; }
};
struct Discard {
  unsigned char* place(std::size_t, unsigned char* scratch) { return scratch; }
  void took(const unsigned char*, std::size_t) {}
};

}  // namespace

void ZipReader::read(const ZipEntry& entry, void* out) const {
  read_into(entry, static_cast<unsigned char*>(out), /*verify=*/true);
}

void ZipReader::read_unverified(const ZipEntry& entry, void* out) const {
  read_into(entry, static_cast<unsigned char*>(out), /*verify=*/false);
}

void ZipReader::read_into(const ZipEntry& entry, unsigned char* out, bool verify) const {
  const unsigned threads = static_cast<unsigned>(
      std::min<std::uint64_t>({kMaxReadThreads, usable_cpus(), entry.size / kPart}));
  if (entry.method != 0 || entry.size < kParallelBytes || threads < 2) {
    stream(entry, IntoBuffer{out}, verify);
    return;
  }
  const std::size_t index = index_of(entry);
  // Part p covers [begin(p), begin(p + 1)), each a whole number of pieces but the last.
  const std::uint64_t pieces = (entry.size + kPiece - 1) / kPiece;
  auto begin = [&](unsigned p) {
    return std::min<std::uint64_t>(entry.size, pieces * p / threads * kPiece);
  };
  std::vector<std::uint32_t> crcs(threads, 0);
  std::vector<std::exception_ptr> errors(threads);
  auto read_part = [&](unsigned p) {
    try {
      std::uint32_t crc = 0;
      for (std::uint64_t at = begin(p); at < begin(p + 1);) {
        const auto n = static_cast<std::size_t>(std::min<std::uint64_t>(kPiece, begin(p + 1) - at));
        source_->read(entry.data_offset + at, out + at, n);
        if (verify) crc = libdeflate_crc32(crc, out + at, n);
        at += n;
      }
      crcs[p] = crc;
    } catch (...) {
      errors[p] = std::current_exception();
    }
  };
  {
    std::vector<std::jthread> helpers;
    for (unsigned p = 1; p < threads; ++p)
      helpers.emplace_back(read_part, p);
    read_part(0);
  }
  for (const auto& error : errors)
    if (error) std::rethrow_exception(error);
  if (verify) {
    uLong crc = crcs[0];
    for (unsigned p = 1; p < threads; ++p)
      crc = crc32_combine64(crc, crcs[p], static_cast<z_off64_t>(begin(p + 1) - begin(p)));
    check_crc(entry, static_cast<std::uint32_t>(crc));
  }
  read_[index] = true;
}

std::string ZipReader::read_string(const ZipEntry& entry, std::uint64_t max_bytes) const {
  if (entry.size > max_bytes) {
    throw FormatError(FormatError::Kind::kTooLarge,
                      fmt::format("record '{}' holds {} bytes, over this reader's limit of {} "
                                  "for it",
                                  entry.name, entry.size, max_bytes));
  }
  std::string bytes(static_cast<std::size_t>(entry.size), '\0');
  read(entry, bytes.data());
  return bytes;
}

void ZipReader::verify(const ZipEntry& entry) const {
  if (entry.method != 0 && entry.size > limits_.max_unread_inflated_bytes) {
    throw FormatError(FormatError::Kind::kTooLarge,
                      fmt::format("record '{}' inflates to {} bytes: over the {} this reader "
                                  "inflates only to verify it",
                                  entry.name, entry.size, limits_.max_unread_inflated_bytes));
  }
  stream(entry, Discard{});
}

void ZipReader::verify_unread() const {
  for (std::size_t i = 0; i < entries_.size(); ++i) {
    if (!read_[i]) verify(entries_[i]);
  }
}

std::string pytorch_record_prefix(const ZipReader& zip) {
  if (zip.entries().empty()) damaged("an empty zip archive");
  const std::string& first = zip.entries().front().name;
  const auto slash = first.find('/');
  if (slash == std::string::npos || slash == 0) {
    damaged(
        fmt::format("record '{}' lies in no folder (torch.save puts every record in one)", first));
  }
  std::string prefix = first.substr(0, slash + 1);
  for (const auto& e : zip.entries()) {
    if (!e.name.starts_with(prefix)) {
      damaged(fmt::format("record '{}' lies outside the archive's folder '{}'", e.name, prefix));
    }
  }
  return prefix;
}

}  // namespace ddp::archive
