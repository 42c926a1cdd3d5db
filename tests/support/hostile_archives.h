// Makers of the files a user or an attacker hands a reader of PyTorch's formats: zip archives of
// any record (stored or deflated, with a recorded CRC-32 or a wrong one, declared sizes that lie,
// zip64 records) and the pickles of torch.save's state dicts, well-formed or hostile. Tests make
// their hostile files with these instead of checking in blobs. Header-only; needs zlib.
#pragma once

#include <zlib.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace ddp::test {

struct ZipRecord {
  std::string name;
  std::string data;  // what the record holds (stored as is, or deflated)
  bool deflate = false;
  std::int64_t crc = -1;       // the CRC-32 to record; -1: the data's own
  std::int64_t declared = -1;  // the uncompressed size to record; -1: the data's own
  // A deflated record whose stream inflates to this many zeros (data is ignored): a zip bomb
  // made in a few milliseconds, without the bytes themselves.
  std::uint64_t zeros = 0;
};

namespace zip_detail {

inline void put(std::string& out, std::uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i)
    out += static_cast<char>((v >> (8 * i)) & 0xff);
}

inline std::string deflate_raw(const std::string& data) {
  z_stream z{};
  deflateInit2(&z, 9, Z_DEFLATED, -MAX_WBITS, 9, Z_DEFAULT_STRATEGY);
  std::string out(deflateBound(&z, data.size()) + 16, '\0');
  z.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(data.data()));
  z.avail_in = static_cast<uInt>(data.size());
  z.next_out = reinterpret_cast<Bytef*>(out.data());
  z.avail_out = static_cast<uInt>(out.size());
  deflate(&z, Z_FINISH);
  out.resize(z.total_out);
  deflateEnd(&z);
  return out;
}

// A raw deflate stream of `count` zeros, and their CRC-32: 1 MiB of zeros deflated once and
// ended with Z_FULL_FLUSH (byte-aligned, no history that later blocks may refer to), so the
// stream is that compressed block over and over (about 1 KiB a MiB), then a final block.
inline std::string deflated_zeros(std::uint64_t count, std::uint32_t* crc) {
  constexpr std::size_t kBlock = 1 << 20;
  const std::string zeros(kBlock, '\0');
  z_stream z{};
  deflateInit2(&z, 9, Z_DEFLATED, -MAX_WBITS, 9, Z_DEFAULT_STRATEGY);
  std::string block(deflateBound(&z, kBlock) + 64, '\0');
  z.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(zeros.data()));
  z.avail_in = kBlock;
  z.next_out = reinterpret_cast<Bytef*>(block.data());
  z.avail_out = static_cast<uInt>(block.size());
  deflate(&z, Z_FULL_FLUSH);  // byte-aligned, no history needed by what follows
  // Written this way, GCC 12 sees that the size cannot wrap (it warned of a memset of 2^64 bytes
  // from `block.size() - z.avail_out` in some unity batches).
  const std::size_t written =
      static_cast<std::size_t>(z.next_out - reinterpret_cast<Bytef*>(block.data()));
  if (written > block.size()) std::abort();
  block.resize(written);
  deflateEnd(&z);
  std::string out;
  uLong c = crc32(0, nullptr, 0);
  const uLong block_crc = crc32(0, reinterpret_cast<const Bytef*>(zeros.data()), kBlock);
  std::uint64_t left = count;
  while (left >= kBlock) {
    out += block;
    c = crc32_combine(c, block_crc, kBlock);
    left -= kBlock;
  }
  // The rest, and the final (BFINAL) block.
  const std::string tail(left, '\0');
  z_stream t{};
  deflateInit2(&t, 9, Z_DEFLATED, -MAX_WBITS, 9, Z_DEFAULT_STRATEGY);
  std::string last(deflateBound(&t, left) + 64, '\0');
  t.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(tail.data()));
  t.avail_in = static_cast<uInt>(left);
  t.next_out = reinterpret_cast<Bytef*>(last.data());
  t.avail_out = static_cast<uInt>(last.size());
  deflate(&t, Z_FINISH);
  last.resize(t.total_out);
  deflateEnd(&t);
  out += last;
  c = crc32_combine(c,
                    crc32(0, reinterpret_cast<const Bytef*>(tail.data()), static_cast<uInt>(left)),
                    static_cast<z_off_t>(left));
  *crc = static_cast<std::uint32_t>(c);
  return out;
}

}  // namespace zip_detail

// A zip archive of `records` in order, with zip64 end records when `zip64` (as PyTorch writes
// them for large files) or where a size needs one.
inline std::string make_zip(const std::vector<ZipRecord>& records, bool zip64 = false) {
  using zip_detail::put;
  std::string out, directory;
  for (const auto& r : records) {
    std::string body;
    std::uint32_t crc = 0;
    std::uint64_t size = 0;
    if (r.zeros > 0) {
      body = zip_detail::deflated_zeros(r.zeros, &crc);
      size = r.zeros;
    } else {
      body = r.deflate ? zip_detail::deflate_raw(r.data) : r.data;
      crc = static_cast<std::uint32_t>(crc32(0, reinterpret_cast<const Bytef*>(r.data.data()),
                                             static_cast<uInt>(r.data.size())));
      size = r.data.size();
    }
    if (r.crc >= 0) crc = static_cast<std::uint32_t>(r.crc);
    if (r.declared >= 0) size = static_cast<std::uint64_t>(r.declared);
    const std::uint16_t method = (r.deflate || r.zeros > 0) ? 8 : 0;
    const std::uint64_t offset = out.size();
    const bool big =
        zip64 || size >= 0xffffffff || body.size() >= 0xffffffff || offset >= 0xffffffff;
    std::string extra;
    if (big) {
      put(extra, 1, 2);
      put(extra, 24, 2);
      put(extra, size, 8);
      put(extra, body.size(), 8);
      put(extra, offset, 8);
    }
    // Local header (sizes in the central directory only, as with a data descriptor's archives).
    put(out, 0x04034b50, 4);
    put(out, big ? 45 : 20, 2);
    put(out, 0, 2);
    put(out, method, 2);
    put(out, 0, 4);  // time, date
    put(out, crc, 4);
    put(out, big ? 0xffffffff : body.size(), 4);
    put(out, big ? 0xffffffff : size, 4);
    put(out, r.name.size(), 2);
    put(out, 0, 2);
    out += r.name;
    out += body;
    // Central directory entry.
    put(directory, 0x02014b50, 4);
    put(directory, 45, 2);
    put(directory, big ? 45 : 20, 2);
    put(directory, 0, 2);
    put(directory, method, 2);
    put(directory, 0, 4);
    put(directory, crc, 4);
    put(directory, big ? 0xffffffff : body.size(), 4);
    put(directory, big ? 0xffffffff : size, 4);
    put(directory, r.name.size(), 2);
    put(directory, extra.size(), 2);
    put(directory, 0, 2);  // comment
    put(directory, 0, 2);  // disk
    put(directory, 0, 2);
    put(directory, 0, 4);
    put(directory, big ? 0xffffffff : offset, 4);
    directory += r.name;
    directory += extra;
  }
  const std::uint64_t directory_offset = out.size();
  out += directory;
  if (zip64) {
    const std::uint64_t record_offset = out.size();
    put(out, 0x06064b50, 4);
    put(out, 44, 8);
    put(out, 45, 2);
    put(out, 45, 2);
    put(out, 0, 4);
    put(out, 0, 4);
    put(out, records.size(), 8);
    put(out, records.size(), 8);
    put(out, directory.size(), 8);
    put(out, directory_offset, 8);
    put(out, 0x07064b50, 4);
    put(out, 0, 4);
    put(out, record_offset, 8);
    put(out, 1, 4);
  }
  put(out, 0x06054b50, 4);
  put(out, 0, 2);
  put(out, 0, 2);
  put(out, zip64 ? 0xffff : records.size(), 2);
  put(out, zip64 ? 0xffff : records.size(), 2);
  put(out, zip64 ? 0xffffffff : directory.size(), 4);
  put(out, zip64 ? 0xffffffff : directory_offset, 4);
  put(out, 0, 2);
  return out;
}

// --- pickles, protocol 2, as torch.save writes a state dict ---

namespace pickle {

inline std::string binunicode(const std::string& s) {
  std::string out = "X";
  zip_detail::put(out, s.size(), 4);
  return out + s;
}
inline std::string integer(std::int64_t v) {
  std::string out = "\x8a\x08";  // LONG1, 8 bytes
  zip_detail::put(out, static_cast<std::uint64_t>(v), 8);
  return out;
}
inline std::string ints_tuple(const std::vector<std::int64_t>& values) {
  std::string out = "(";
  for (const auto v : values)
    out += integer(v);
  return out + "t";
}

inline std::string floating(double v) {  // BINFLOAT, big-endian
  std::uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof bits);
  std::string out = "G";
  for (int i = 7; i >= 0; --i)
    out += static_cast<char>((bits >> (8 * i)) & 0xff);
  return out;
}
inline std::string boolean(bool v) {
  return v ? "\x88" : "\x89";
}
// Containers of pickled items: a dict of (pickled key, pickled value), a list, a tuple.
inline std::string dict(const std::vector<std::pair<std::string, std::string>>& entries) {
  std::string out = "}(";
  for (const auto& [key, value] : entries)
    out += key + value;
  return out + "u";
}
inline std::string list(const std::vector<std::string>& items) {
  std::string out = "](";
  for (const auto& item : items)
    out += item;
  return out + "e";
}
inline std::string tuple(const std::vector<std::string>& items) {
  std::string out = "(";
  for (const auto& item : items)
    out += item;
  return out + "t";
}

// One tensor: _rebuild_tensor_v2(('storage', torch.<type>, key, 'cpu', numel), offset, size,
// stride, False, OrderedDict()).
inline std::string tensor(const std::string& storage_type, const std::string& key,
                          std::int64_t numel, std::int64_t offset,
                          const std::vector<std::int64_t>& size,
                          const std::vector<std::int64_t>& stride) {
  return "ctorch._utils\n_rebuild_tensor_v2\n((" + binunicode("storage") + "ctorch\n" +
         storage_type + "\n" + binunicode(key) + binunicode("cpu") + integer(numel) + "tQ" +
         integer(offset) + ints_tuple(size) + ints_tuple(stride) +
         "\x89"
         "ccollections\nOrderedDict\n)RtR";
}

// A whole pickle: OrderedDict with `entries` (pickled key, pickled value) set on it.
inline std::string state_dict(const std::vector<std::pair<std::string, std::string>>& entries) {
  std::string out =
      "\x80\x02"
      "ccollections\nOrderedDict\n)R(";
  for (const auto& [key, value] : entries)
    out += binunicode(key) + value;
  return out + "u.";
}

}  // namespace pickle

// A torch.save-style archive of `pickle` and its storages ("archive/data/<key>"), stored.
inline std::string make_torch_archive(
    const std::string& pickle, const std::vector<std::pair<std::string, std::string>>& storages,
    bool zip64 = false) {
  std::vector<ZipRecord> records{{.name = "archive/data.pkl", .data = pickle}};
  for (const auto& [key, bytes] : storages)
    records.push_back({.name = "archive/data/" + key, .data = bytes});
  records.push_back({.name = "archive/version", .data = "3\n"});
  return make_zip(records, zip64);
}

}  // namespace ddp::test
