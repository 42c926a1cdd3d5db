// The zip reader's second phase (zip_reader.h): reading records, stored or deflated, each
// verified against its CRC-32 and its declared size. Layout from PKWARE's APPNOTE 6.3: local
// headers and data, the central directory, [zip64 end record, zip64 locator,] the end record;
// zip_directory.cc reads and checks all but the data.
#include "archive/zip_reader.h"

#include <sched.h>
#include <zlib.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <exception>
#include <thread>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "archive/byte_source.h"
#include "archive/crc32.h"
#include "archive/zip_format.h"

namespace ddp::archive {

using zip::damaged;

namespace {

// Records are read and checked in pieces of this size, so each piece's CRC runs while the piece
// is still in the cache the read put it in (64 KiB: the CRC's share of a 1 GiB load was a median
// 9 % over seven runs of state_dict_bench, 12 % with 256 KiB pieces).
constexpr std::size_t kPiece = std::size_t{64} << 10;
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

}  // namespace

ZipReader ZipReader::open(const std::filesystem::path& path, ZipLimits limits) {
  return ZipReader(ByteSource::open(path), limits);
}

ZipReader ZipReader::open_range(const std::filesystem::path& path, std::uint64_t offset,
                                std::uint64_t length, ZipLimits limits) {
  return ZipReader(ByteSource::open_range(path, offset, length), limits);
}

ZipReader ZipReader::from_bytes(std::string bytes, ZipLimits limits) {
  return ZipReader(std::make_unique<ByteSource>(std::move(bytes)), limits);
}

ZipReader::ZipReader(std::unique_ptr<ByteSource> source, ZipLimits limits)
    : source_(std::move(source)), limits_(limits) {
  read_central_directory();
}
ZipReader::ZipReader(ZipReader&&) noexcept = default;
ZipReader& ZipReader::operator=(ZipReader&&) noexcept = default;
ZipReader::~ZipReader() = default;

std::uint64_t ZipReader::file_size() const {
  return source_->size();
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
      if (verify) crc = archive::crc32(at, n, crc);
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
        if (verify) crc = archive::crc32(at, made, crc);
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
  if (crc == entry.crc32) return;
  // PyTorch 2.x writes 0 for every record's CRC when told not to compute them: say so, since
  // "damaged" would send the user looking for a broken disk.
  const bool all_zero =
      std::all_of(entries_.begin(), entries_.end(), [](const ZipEntry& e) { return e.crc32 == 0; });
  damaged(fmt::format(
      "record '{}' fails its CRC-32 check (recorded {:08x}, computed {:08x}): {}", entry.name,
      entry.crc32, crc,
      all_zero ? "every record's recorded CRC is 0, which is what PyTorch writes with "
                 "torch.utils.serialization.config.save.compute_crc32 = False; save it again with "
                 "the default (True): ddp verifies every record"
               : "the file is damaged"));
}

namespace {

// Sinks for ZipReader::stream: place(n, scratch) says where the next n bytes go, took(at, n)
// that they are there.
// The record's bytes [begin, end) into out: a piece wholly inside goes there directly, any other
// through the scratch piece, from which its part inside (if any) is copied.
struct IntoWindow {
  unsigned char* out;
  std::uint64_t begin, end;
  std::uint64_t filled = 0;  // bytes of the record seen so far
  bool direct = false;       // whether the last place() was in `out`
  unsigned char* place(std::size_t n, unsigned char* scratch) {
    direct = filled >= begin && filled + n <= end;
    return direct ? out + (filled - begin) : scratch;
  }
  void took(const unsigned char* at, std::size_t n) {
    if (!direct) {
      const std::uint64_t lo = std::max(filled, begin), hi = std::min(filled + n, end);
      if (lo < hi) std::memcpy(out + (lo - begin), at + (lo - filled), hi - lo);
    }
    filled += n;
  }
};
// The elements of a ZipArrayWindow's region: its runs (the region's part of a row of the array,
// with trailing dimensions the region and the destination hold whole merged in), visited in the
// record's order by an odometer over the dimensions before the last, each copied out of the
// scratch pieces as they pass.
class IntoArray {
 public:
  explicit IntoArray(const ZipArrayWindow& w)
      : shape_(w.shape),
        begin_(w.begin),
        count_(w.count),
        out_strides_(w.out_strides),
        out_(w.out) {
    while (shape_.size() >= 2 && count_.back() == shape_.back() &&
           out_strides_[out_strides_.size() - 2] == count_.back() * out_strides_.back()) {
      const std::uint64_t last = shape_.back();
      shape_.pop_back();
      begin_.pop_back();
      count_.pop_back();
      out_strides_.pop_back();
      shape_.back() *= last;
      begin_.back() *= last;
      count_.back() *= last;
      out_strides_.back() = w.element_bytes;
    }
    record_strides_.assign(shape_.size(), w.element_bytes);
    for (std::size_t d = shape_.size() - 1; d > 0; --d)
      record_strides_[d - 1] = record_strides_[d] * shape_[d];
    run_bytes_ = count_.back() * w.element_bytes;
    index_.assign(shape_.size(), 0);
    done_ = std::any_of(count_.begin(), count_.end(), [](std::uint64_t c) { return c == 0; });
    locate();
  }
  unsigned char* place(std::size_t, unsigned char* scratch) { return scratch; }
  void took(const unsigned char* at, std::size_t n) {
    const std::uint64_t end = filled_ + n;
    while (!done_ && run_begin_ < end) {
      const std::uint64_t lo = std::max(run_begin_, filled_);
      const std::uint64_t hi = std::min(run_begin_ + run_bytes_, end);
      if (lo < hi) std::memcpy(run_out_ + (lo - run_begin_), at + (lo - filled_), hi - lo);
      if (run_begin_ + run_bytes_ > end) break;  // the run goes on in the next piece
      advance();
    }
    filled_ = end;
  }

 private:
  void locate() {
    run_begin_ = 0;
    run_out_ = out_;
    for (std::size_t d = 0; d < shape_.size(); ++d) {
      run_begin_ += (begin_[d] + index_[d]) * record_strides_[d];
      run_out_ += index_[d] * out_strides_[d];
    }
  }
  void advance() {
    for (std::size_t d = shape_.size() - 1; d-- > 0;) {
      if (++index_[d] < count_[d]) {
        locate();
        return;
      }
      index_[d] = 0;
    }
    done_ = true;
  }

  std::vector<std::uint64_t> shape_, begin_, count_, out_strides_, record_strides_, index_;
  unsigned char* out_;
  std::uint64_t run_bytes_ = 0, run_begin_ = 0, filled_ = 0;
  unsigned char* run_out_ = nullptr;
  bool done_ = false;
};

struct Discard {
  unsigned char* place(std::size_t, unsigned char* scratch) { return scratch; }
  void took(const unsigned char*, std::size_t) {}
};

}  // namespace

void ZipReader::read(const ZipEntry& entry, void* out) const {
  read_into(entry, static_cast<unsigned char*>(out), /*verify=*/true, 0, entry.size);
}

void ZipReader::read_unverified(const ZipEntry& entry, void* out) const {
  read_into(entry, static_cast<unsigned char*>(out), /*verify=*/false, 0, entry.size);
}

void ZipReader::read_window(const ZipEntry& entry, std::uint64_t begin, std::uint64_t length,
                            void* out) const {
  if (begin > entry.size || length > entry.size - begin) {
    throw Error(
        fmt::format("ZipReader::read_window: bytes [{}, {} + {}) are not inside record "
                    "'{}' of {} bytes",
                    begin, begin, length, entry.name, entry.size));
  }
  read_into(entry, static_cast<unsigned char*>(out), /*verify=*/true, begin, length);
}

void ZipReader::read_array_window(const ZipEntry& entry, const ZipArrayWindow& window) const {
  const std::size_t dims = window.shape.size();
  bool fits = dims > 0 && window.element_bytes > 0 && window.begin.size() == dims &&
              window.count.size() == dims && window.out_strides.size() == dims &&
              window.out_strides.back() == window.element_bytes;
  std::uint64_t bytes = window.element_bytes;
  for (std::size_t d = 0; fits && d < dims; ++d) {
    fits = window.begin[d] <= window.shape[d] &&
           window.count[d] <= window.shape[d] - window.begin[d] &&
           (window.shape[d] == 0 || bytes <= UINT64_MAX / window.shape[d]);
    bytes *= window.shape[d];
  }
  if (!fits || bytes != entry.size) {
    throw Error(fmt::format(
        "ZipReader::read_array_window: the window does not describe record '{}' of {} bytes "
        "(an array of [{}] elements of {} bytes, a region at [{}] of [{}])",
        entry.name, entry.size, fmt::join(window.shape, ", "), window.element_bytes,
        fmt::join(window.begin, ", "), fmt::join(window.count, ", ")));
  }
  stream(entry, IntoArray(window));
}

void ZipReader::read_into(const ZipEntry& entry, unsigned char* out, bool verify,
                          std::uint64_t begin, std::uint64_t length) const {
  const std::uint64_t end = begin + length;
  const unsigned threads = static_cast<unsigned>(
      std::min<std::uint64_t>({kMaxReadThreads, usable_cpus(), entry.size / kPart}));
  if (entry.method != 0 || entry.size < kParallelBytes || threads < 2) {
    stream(entry, IntoWindow{out, begin, end}, verify);
    return;
  }
  const std::size_t index = index_of(entry);
  // Part p covers [part_begin(p), part_begin(p + 1)), each a whole number of pieces but the last.
  const std::uint64_t pieces = (entry.size + kPiece - 1) / kPiece;
  auto part_begin = [&](unsigned p) {
    return std::min<std::uint64_t>(entry.size, pieces * p / threads * kPiece);
  };
  std::vector<std::uint32_t> crcs(threads, 0);
  std::vector<std::exception_ptr> errors(threads);
  auto read_part = [&](unsigned p) {
    try {
      std::uint32_t crc = 0;
      std::vector<unsigned char> scratch;  // for pieces not wholly inside the window
      for (std::uint64_t at = part_begin(p); at < part_begin(p + 1);) {
        const auto n =
            static_cast<std::size_t>(std::min<std::uint64_t>(kPiece, part_begin(p + 1) - at));
        const bool inside = at >= begin && at + n <= end;
        if (!inside && scratch.empty()) scratch.resize(kPiece);
        unsigned char* place = inside ? out + (at - begin) : scratch.data();
        source_->read(entry.data_offset + at, place, n);
        if (verify) crc = archive::crc32(place, n, crc);
        if (!inside) {
          const std::uint64_t lo = std::max(at, begin), hi = std::min(at + n, end);
          if (lo < hi) std::memcpy(out + (lo - begin), place + (lo - at), hi - lo);
        }
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
      crc =
          crc32_combine64(crc, crcs[p], static_cast<z_off64_t>(part_begin(p + 1) - part_begin(p)));
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
