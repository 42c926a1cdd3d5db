#include "ddp/store/store.h"

namespace ddp {
namespace {

std::span<const std::uint8_t> as_bytes(std::string_view text) {
  return {reinterpret_cast<const std::uint8_t*>(text.data()), text.size()};
}

}  // namespace

void Store::set(std::string_view key, std::string_view value) {
  set(key, as_bytes(value));
}

std::string Store::get_string(std::string_view key, Milliseconds timeout) {
  const Bytes value = get(key, timeout);
  return {value.begin(), value.end()};
}

std::string Store::compare_set(std::string_view key, std::string_view expected,
                               std::string_view desired) {
  const Bytes value = compare_set(key, as_bytes(expected), as_bytes(desired));
  return {value.begin(), value.end()};
}

}  // namespace ddp
