#include "store/kv_state.h"

#include <algorithm>
#include <charconv>
#include <string>

#include <fmt/format.h>

namespace ddp::store {

namespace {

std::string_view as_text(std::span<const std::uint8_t> bytes) {
  return {reinterpret_cast<const char*>(bytes.data()), bytes.size()};
}

}  // namespace

const Bytes* KvState::find(std::string_view key) const {
  auto it = data_.find(key);
  return it == data_.end() ? nullptr : &it->second;
}

std::size_t KvState::bytes_after_store(std::string_view key, std::size_t value_size) const {
  auto it = data_.find(key);
  if (it == data_.end()) return bytes_ + key.size() + value_size + kEntryOverheadBytes;
  return bytes_ - it->second.size() + value_size;
}

void KvState::store(std::string_view key, std::span<const std::uint8_t> value) {
  auto it = data_.find(key);
  if (it == data_.end()) {
    it = data_.emplace(std::string(key), Bytes{}).first;
    bytes_ += key.size() + kEntryOverheadBytes;
  }
  bytes_ = bytes_ - it->second.size() + value.size();
  // assign() may keep a larger old capacity; a fresh vector keeps the accounting honest.
  it->second = Bytes(value.begin(), value.end());
}

std::vector<Wakeup> KvState::set(std::string_view key, std::span<const std::uint8_t> value) {
  store(key, value);
  return key_created(key);
}

KvState::AddResult KvState::add(std::string_view key, std::int64_t delta) {
  AddResult result;
  std::int64_t current = 0;
  if (const Bytes* value = find(key)) {
    const auto text = as_text(*value);
    const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), current);
    if (ec != std::errc{} || end != text.data() + text.size() || text.empty()) {
      result.error = fmt::format(
          "add: the value of key '{}' is not a decimal integer ('{}'); add only works on keys "
          "written by add",
          printable(key), printable(text, 40));
      return result;
    }
  }
  std::int64_t sum = 0;
  if (__builtin_add_overflow(current, delta, &sum)) {
    result.error = fmt::format("add: {} + {} overflows the 64-bit counter '{}'", current, delta,
                               printable(key));
    return result;
  }
  const std::string text = std::to_string(sum);
  store(key, {reinterpret_cast<const std::uint8_t*>(text.data()), text.size()});
  result.value = sum;
  result.woken = key_created(key);
  return result;
}

KvState::CompareSetResult KvState::compare_set(std::string_view key,
                                               std::span<const std::uint8_t> expected,
                                               std::span<const std::uint8_t> desired) {
  const Bytes* current = find(key);
  const bool matches =
      current == nullptr ? expected.empty() : std::ranges::equal(*current, expected);
  if (!matches) return {current == nullptr ? Bytes{} : *current, {}};
  store(key, desired);
  return {Bytes(desired.begin(), desired.end()), key_created(key)};
}

bool KvState::erase(std::string_view key) {
  auto it = data_.find(key);
  if (it == data_.end()) return false;
  bytes_ -= it->first.size() + it->second.size() + kEntryOverheadBytes;
  data_.erase(it);
  return true;
}

bool KvState::park(WaiterId waiter, Opcode op, std::span<const std::string> keys) {
  Parked parked{op, keys.front(), {}};
  for (const auto& key : keys) {
    if (contains(key)) continue;
    if (parked.missing.insert(key).second) {
      auto it = waiters_.find(key);
      if (it == waiters_.end()) it = waiters_.emplace(key, std::vector<WaiterId>{}).first;
      it->second.push_back(waiter);
    }
  }
  if (parked.missing.empty()) return false;
  parked_.insert_or_assign(waiter, std::move(parked));
  return true;
}

std::optional<std::vector<std::string>> KvState::unpark(WaiterId waiter) {
  auto node = parked_.extract(waiter);
  if (node.empty()) return std::nullopt;
  std::vector<std::string> missing;
  for (const auto& key : node.mapped().missing) {
    auto it = waiters_.find(key);
    if (it != waiters_.end()) {
      std::erase(it->second, waiter);
      if (it->second.empty()) waiters_.erase(it);
    }
    missing.push_back(key);
  }
  return missing;
}

std::optional<Opcode> KvState::parked_op(WaiterId waiter) const {
  auto it = parked_.find(waiter);
  if (it == parked_.end()) return std::nullopt;
  return it->second.op;
}

std::vector<Wakeup> KvState::key_created(std::string_view key) {
  std::vector<Wakeup> woken;
  auto it = waiters_.find(key);
  if (it == waiters_.end()) return woken;
  const std::vector<WaiterId> ids = std::move(it->second);
  waiters_.erase(it);
  for (const WaiterId id : ids) {
    auto p = parked_.find(id);
    if (p == parked_.end()) continue;
    p->second.missing.erase(std::string(key));
    if (!p->second.missing.empty()) continue;
    woken.push_back({id, p->second.op, std::move(p->second.first_key)});
    parked_.erase(p);
  }
  return woken;
}

}  // namespace ddp::store
