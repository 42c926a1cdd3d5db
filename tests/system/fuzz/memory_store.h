// MemoryStore: a ddp::Store held in this process's memory, for the fuzz harnesses, which need a
// rendezvous store for in-process ranks without a server whose sockets would slow every input.
//
// Thread-safe (one mutex; get/wait park on a condition variable until their deadline). `on_set`,
// when set, may rewrite a value before it is stored (the ring harness's recorder uses it to put a
// proxy between two ranks). Test fixture only: no limits, no persistence.
#pragma once

#include <condition_variable>
#include <functional>
#include <map>
#include <mutex>
#include <string>

#include <fmt/format.h>

#include "ddp/error.h"
#include "ddp/store/store.h"

namespace ddp::fuzz {

class MemoryStore : public Store {
 public:
  using Store::set;  // set(key, string_view)
  std::function<void(const std::string& key, Bytes& value)> on_set;

  void set(std::string_view key, std::span<const std::uint8_t> value) override {
    Bytes bytes(value.begin(), value.end());
    if (on_set) on_set(std::string(key), bytes);
    std::lock_guard lock(mutex_);
    data_[std::string(key)] = std::move(bytes);
    changed_.notify_all();
  }

  Bytes get(std::string_view key, Milliseconds timeout) override {
    std::unique_lock lock(mutex_);
    const std::string k(key);
    if (!changed_.wait_for(lock, timeout, [&] { return data_.contains(k); })) {
      throw TimeoutError(
          fmt::format("MemoryStore: key '{}' not set within {} ms", k, timeout.count()));
    }
    return data_[k];
  }

  std::int64_t add(std::string_view key, std::int64_t delta) override {
    std::lock_guard lock(mutex_);
    Bytes& value = data_[std::string(key)];
    const std::int64_t now =
        (value.empty() ? 0 : std::stoll(std::string(value.begin(), value.end()))) + delta;
    const std::string text = std::to_string(now);
    value.assign(text.begin(), text.end());
    changed_.notify_all();
    return now;
  }

  Bytes compare_set(std::string_view key, std::span<const std::uint8_t> expected,
                    std::span<const std::uint8_t> desired) override {
    std::lock_guard lock(mutex_);
    const std::string k(key);
    const auto it = data_.find(k);
    const Bytes current = it == data_.end() ? Bytes() : it->second;
    if (current == Bytes(expected.begin(), expected.end())) {
      data_[k] = Bytes(desired.begin(), desired.end());
      changed_.notify_all();
      return data_[k];
    }
    return current;
  }

  bool check(std::span<const std::string> keys) override {
    std::lock_guard lock(mutex_);
    for (const auto& k : keys)
      if (!data_.contains(k)) return false;
    return true;
  }

  void wait(std::span<const std::string> keys, Milliseconds timeout) override {
    std::unique_lock lock(mutex_);
    auto all = [&] {
      for (const auto& k : keys)
        if (!data_.contains(k)) return false;
      return true;
    };
    if (!changed_.wait_for(lock, timeout, all)) {
      throw TimeoutError(fmt::format("MemoryStore: keys not set within {} ms", timeout.count()));
    }
  }

  bool delete_key(std::string_view key) override {
    std::lock_guard lock(mutex_);
    return data_.erase(std::string(key)) > 0;
  }

  std::int64_t num_keys() override {
    std::lock_guard lock(mutex_);
    return static_cast<std::int64_t>(data_.size());
  }

 private:
  std::mutex mutex_;
  std::condition_variable changed_;
  std::map<std::string, Bytes> data_;
};

}  // namespace ddp::fuzz
