#include "archive/pickle_writer.h"

#include <bit>
#include <climits>
#include <utility>

namespace ddp::archive {
namespace {

void little_endian(std::string& out, std::uint64_t bits, int bytes) {
  for (int i = 0; i < bytes; ++i)
    out += static_cast<char>((bits >> (8 * i)) & 0xff);
}

}  // namespace

void PickleWriter::integer(std::int64_t value) {
  if (value >= 0 && value < 256) {
    bytes_ += 'K';  // BININT1
    bytes_ += static_cast<char>(value);
  } else if (value >= 0 && value < 65536) {
    bytes_ += 'M';  // BININT2
    little_endian(bytes_, static_cast<std::uint64_t>(value), 2);
  } else if (value >= INT32_MIN && value <= INT32_MAX) {
    bytes_ += 'J';  // BININT, signed 4 bytes
    little_endian(bytes_, static_cast<std::uint32_t>(static_cast<std::int32_t>(value)), 4);
  } else {
    bytes_ += "\x8a\x08";  // LONG1, 8 bytes little-endian two's complement
    little_endian(bytes_, static_cast<std::uint64_t>(value), 8);
  }
}

void PickleWriter::floating(double value) {
  bytes_ += 'G';  // BINFLOAT, big-endian
  const auto bits = std::bit_cast<std::uint64_t>(value);
  for (int i = 7; i >= 0; --i)
    bytes_ += static_cast<char>((bits >> (8 * i)) & 0xff);
}

void PickleWriter::string(std::string_view value) {
  bytes_ += 'X';  // BINUNICODE: 4-byte length, UTF-8
  little_endian(bytes_, value.size(), 4);
  bytes_ += value;
}

void PickleWriter::global(std::string_view module, std::string_view name) {
  bytes_ += 'c';
  bytes_ += module;
  bytes_ += '\n';
  bytes_ += name;
  bytes_ += '\n';
}

std::string PickleWriter::finish() {
  bytes_ += '.';  // STOP
  std::string out = std::move(bytes_);
  bytes_ = "\x80\x02";
  return out;
}

}  // namespace ddp::archive
