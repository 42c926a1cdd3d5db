#include "store/protocol.h"

#include <cstring>

#include <fmt/format.h>

#include "ddp/error.h"

namespace ddp::store {

const char* opcode_name(Opcode op) {
  switch (op) {
    case Opcode::kSet:
      return "set";
    case Opcode::kGet:
      return "get";
    case Opcode::kAdd:
      return "add";
    case Opcode::kCompareSet:
      return "compare_set";
    case Opcode::kCheck:
      return "check";
    case Opcode::kWait:
      return "wait";
    case Opcode::kDelete:
      return "delete_key";
    case Opcode::kNumKeys:
      return "num_keys";
    case Opcode::kCancel:
      return "cancel";
  }
  return "unknown";
}

void put_u32(std::uint8_t* out, std::uint32_t value) {
  for (int i = 0; i < 4; ++i)
    out[i] = static_cast<std::uint8_t>(value >> (8 * i));
}

std::uint32_t get_u32(const std::uint8_t* in) {
  std::uint32_t value = 0;
  for (int i = 0; i < 4; ++i)
    value |= static_cast<std::uint32_t>(in[i]) << (8 * i);
  return value;
}

FrameWriter::FrameWriter(std::uint8_t code) {
  buffer_.resize(4);  // length prefix, patched by finish()
  buffer_.push_back(code);
}

FrameWriter& FrameWriter::u8(std::uint8_t value) {
  buffer_.push_back(value);
  return *this;
}

FrameWriter& FrameWriter::u32(std::uint32_t value) {
  std::uint8_t raw[4];
  put_u32(raw, value);
  buffer_.insert(buffer_.end(), raw, raw + 4);
  return *this;
}

FrameWriter& FrameWriter::i64(std::int64_t value) {
  const auto bits = static_cast<std::uint64_t>(value);
  for (int i = 0; i < 8; ++i)
    buffer_.push_back(static_cast<std::uint8_t>(bits >> (8 * i)));
  return *this;
}

FrameWriter& FrameWriter::bytes(std::span<const std::uint8_t> value) {
  u32(static_cast<std::uint32_t>(value.size()));
  buffer_.insert(buffer_.end(), value.begin(), value.end());
  return *this;
}

FrameWriter& FrameWriter::bytes(std::string_view value) {
  return bytes({reinterpret_cast<const std::uint8_t*>(value.data()), value.size()});
}

std::vector<std::uint8_t> FrameWriter::finish() {
  put_u32(buffer_.data(), static_cast<std::uint32_t>(buffer_.size() - 4));
  return std::move(buffer_);
}

std::span<const std::uint8_t> FrameReader::take(std::size_t size, const char* field) {
  if (size > remaining()) {
    throw ProtocolError(fmt::format("truncated field '{}': needs {} bytes, frame has {} left",
                                    field, size, remaining()));
  }
  auto out = body_.subspan(offset_, size);
  offset_ += size;
  return out;
}

std::uint8_t FrameReader::u8(const char* field) {
  return take(1, field)[0];
}

std::uint32_t FrameReader::u32(const char* field) {
  return get_u32(take(4, field).data());
}

std::int64_t FrameReader::i64(const char* field) {
  const auto raw = take(8, field);
  std::uint64_t bits = 0;
  for (int i = 0; i < 8; ++i)
    bits |= static_cast<std::uint64_t>(raw[i]) << (8 * i);
  return static_cast<std::int64_t>(bits);
}

std::span<const std::uint8_t> FrameReader::bytes(const char* field, std::size_t limit) {
  const std::uint32_t size = u32(field);
  if (size > limit) {
    throw ProtocolError(
        fmt::format("field '{}' is {} bytes, over the limit of {} bytes", field, size, limit));
  }
  return take(size, field);
}

std::string FrameReader::string(const char* field, std::size_t limit) {
  const auto raw = bytes(field, limit);
  return {raw.begin(), raw.end()};
}

void FrameReader::expect_end(const char* what) const {
  if (remaining() != 0) {
    throw ProtocolError(
        fmt::format("{} frame has {} unexpected trailing bytes", what, remaining()));
  }
}

std::string printable(std::string_view text, std::size_t max_chars) {
  std::string out;
  for (const char c : text) {
    if (out.size() >= max_chars) {
      out += "...";
      break;
    }
    const auto byte = static_cast<unsigned char>(c);
    if (byte >= 0x20 && byte < 0x7f && c != '\\') {
      out += c;
    } else {
      out += fmt::format("\\x{:02x}", byte);
    }
  }
  return out;
}

std::string quoted_keys(std::span<const std::string> keys) {
  std::string out;
  for (std::size_t i = 0; i < keys.size(); ++i) {
    if (i == 8) {
      out += fmt::format(", ... ({} keys in all)", keys.size());
      break;
    }
    if (i > 0) out += ", ";
    out += "'" + printable(keys[i]) + "'";
  }
  return out;
}

std::string key_call(const char* op, std::string_view key) {
  return fmt::format("{}('{}')", op, printable(key));
}

}  // namespace ddp::store
