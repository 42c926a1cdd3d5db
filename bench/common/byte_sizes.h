// Byte sizes on benchmark command lines: "1024", "64K", "1M", "1MiB", "2G"; lists "1K,64K,1M".
#pragma once

#include <cstddef>
#include <stdexcept>
#include <string>
#include <vector>

inline std::size_t parse_byte_size(const std::string& text) {
  std::size_t pos = 0;
  std::size_t value = 0;
  try {
    value = std::stoull(text, &pos);
  } catch (const std::exception&) {
    pos = 0;
  }
  const std::string unit = text.substr(pos);
  if (pos > 0) {
    if (unit.empty() || unit == "B") return value;
    if (unit == "K" || unit == "KiB" || unit == "k") return value << 10;
    if (unit == "M" || unit == "MiB" || unit == "m") return value << 20;
    if (unit == "G" || unit == "GiB" || unit == "g") return value << 30;
  }
  throw std::runtime_error("bad size '" + text + "' (use 1024, 64K, 1M, ...)");
}

inline std::vector<std::size_t> parse_byte_sizes(const std::string& list) {
  std::vector<std::size_t> sizes;
  std::size_t start = 0;
  while (true) {
    const auto comma = list.find(',', start);
    sizes.push_back(parse_byte_size(list.substr(start, comma - start)));
    if (comma == std::string::npos) return sizes;
    start = comma + 1;
  }
}
