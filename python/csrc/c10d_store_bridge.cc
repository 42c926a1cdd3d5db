#include "c10d_store_bridge.h"

#include <fmt/format.h>

#include <utility>

#include "ddp/error.h"

namespace torch_ddp {
namespace {

// Runs a c10d store call, turning its exceptions into ddp's.
template <class Call>
auto translated(const char* what, std::string_view key, Call&& call) {
  try {
    return call();
  } catch (const c10::DistStoreError& e) {
    const std::string message = e.what_without_backtrace();
    if (message.find("imeout") != std::string::npos ||
        message.find("imed out") != std::string::npos) {
      throw ddp::TimeoutError(
          fmt::format("torch.distributed's store: {} '{}' timed out: {}", what, key, message));
    }
    throw ddp::StoreError(
        fmt::format("torch.distributed's store: {} '{}': {}", what, key, message));
  } catch (const c10::Error& e) {
    throw ddp::StoreError(fmt::format("torch.distributed's store: {} '{}': {}", what, key,
                                      e.what_without_backtrace()));
  }
}

std::vector<std::uint8_t> bytes_of(std::span<const std::uint8_t> value) {
  return {value.begin(), value.end()};
}

}  // namespace

C10dStoreBridge::C10dStoreBridge(c10::intrusive_ptr<c10d::Store> store) : store_(std::move(store)) {
  set_timeout(std::chrono::duration_cast<ddp::Milliseconds>(store_->getTimeout()));
}

void C10dStoreBridge::set(std::string_view key, std::span<const std::uint8_t> value) {
  translated("set", key, [&] {
    store_->set(std::string(key), bytes_of(value));
    return 0;
  });
}

ddp::Bytes C10dStoreBridge::get(std::string_view key, ddp::Milliseconds timeout) {
  // c10d's get waits for its store's own timeout; the wait first bounds it by ours.
  wait(std::vector<std::string>{std::string(key)}, timeout);
  return translated("get", key, [&] {
    auto value = store_->get(std::string(key));
    return ddp::Bytes(value.begin(), value.end());
  });
}

std::int64_t C10dStoreBridge::add(std::string_view key, std::int64_t delta) {
  return translated("add", key, [&] { return store_->add(std::string(key), delta); });
}

ddp::Bytes C10dStoreBridge::compare_set(std::string_view key,
                                        std::span<const std::uint8_t> expected,
                                        std::span<const std::uint8_t> desired) {
  return translated("compare_set", key, [&] {
    auto value = store_->compareSet(std::string(key), bytes_of(expected), bytes_of(desired));
    return ddp::Bytes(value.begin(), value.end());
  });
}

bool C10dStoreBridge::check(std::span<const std::string> keys) {
  return translated("check", keys.empty() ? std::string() : keys.front(), [&] {
    return store_->check(std::vector<std::string>(keys.begin(), keys.end()));
  });
}

void C10dStoreBridge::wait(std::span<const std::string> keys, ddp::Milliseconds timeout) {
  translated("wait for", keys.empty() ? std::string() : keys.front(), [&] {
    store_->wait(std::vector<std::string>(keys.begin(), keys.end()), timeout);
    return 0;
  });
}

bool C10dStoreBridge::delete_key(std::string_view key) {
  return translated("delete", key, [&] { return store_->deleteKey(std::string(key)); });
}

std::int64_t C10dStoreBridge::num_keys() {
  return translated("count keys", "", [&] { return store_->getNumKeys(); });
}

}  // namespace torch_ddp
