#include "ddp/store/prefix_store.h"

#include <fmt/format.h>

#include "ddp/error.h"

namespace ddp {

PrefixStore::PrefixStore(std::string prefix, std::shared_ptr<Store> base)
    : prefix_(std::move(prefix)), base_(std::move(base)) {
  if (!base_) {
    throw ConfigError(fmt::format("PrefixStore('{}'): the base store is null", prefix_));
  }
  timeout_ = base_->timeout();
}

std::string PrefixStore::prefixed(std::string_view key) const {
  std::string out;
  out.reserve(prefix_.size() + 1 + key.size());
  out.append(prefix_).append("/").append(key);
  return out;
}

std::vector<std::string> PrefixStore::prefixed(std::span<const std::string> keys) const {
  std::vector<std::string> out;
  out.reserve(keys.size());
  for (const auto& key : keys)
    out.push_back(prefixed(key));
  return out;
}

void PrefixStore::set(std::string_view key, std::span<const std::uint8_t> value) {
  base_->set(prefixed(key), value);
}

Bytes PrefixStore::get(std::string_view key, Milliseconds timeout) {
  return base_->get(prefixed(key), timeout);
}

std::int64_t PrefixStore::add(std::string_view key, std::int64_t delta) {
  return base_->add(prefixed(key), delta);
}

Bytes PrefixStore::compare_set(std::string_view key, std::span<const std::uint8_t> expected,
                               std::span<const std::uint8_t> desired) {
  return base_->compare_set(prefixed(key), expected, desired);
}

bool PrefixStore::check(std::span<const std::string> keys) {
  return base_->check(prefixed(keys));
}

void PrefixStore::wait(std::span<const std::string> keys, Milliseconds timeout) {
  base_->wait(prefixed(keys), timeout);
}

bool PrefixStore::delete_key(std::string_view key) {
  return base_->delete_key(prefixed(key));
}

std::int64_t PrefixStore::num_keys() {
  return base_->num_keys();
}

}  // namespace ddp
