// PrefixStore: a view of another Store in which every key becomes prefix + "/" + key, so that
// several process groups (or several jobs' phases) share one server without their keys meeting.
//
//   auto base = std::make_shared<ddp::TcpStore>(host, port, ddp::TcpStoreOptions{});
//   ddp::PrefixStore group_a("pg/1", base), group_b("pg/2", base);
//   group_a.set("rank0", "x");   // stored as "pg/1/rank0"; group_b.get("rank0") does not see it
//
// PrefixStores nest ("a" over "b" gives keys "b/a/key"). Thread-safe as far as the base store
// is (TcpStore is). Its timeout starts as the base's and can be changed independently. Throws
// whatever the base throws; key limits apply to the prefixed key.
//
// num_keys() returns the base store's count, every prefix included: counting one prefix's keys
// would need a scan of the server that the protocol does not offer.
#pragma once

#include <memory>
#include <string>

#include "ddp/store/store.h"

// Exported by ddp's shared libraries, which hide the rest (src/CMakeLists.txt).
#pragma GCC visibility push(default)
namespace ddp {

class PrefixStore final : public Store {
 public:
  // Throws ConfigError when `base` is null.
  PrefixStore(std::string prefix, std::shared_ptr<Store> base);

  using Store::compare_set;
  using Store::get;
  using Store::set;
  using Store::wait;

  void set(std::string_view key, std::span<const std::uint8_t> value) override;
  Bytes get(std::string_view key, Milliseconds timeout) override;
  std::int64_t add(std::string_view key, std::int64_t delta) override;
  Bytes compare_set(std::string_view key, std::span<const std::uint8_t> expected,
                    std::span<const std::uint8_t> desired) override;
  bool check(std::span<const std::string> keys) override;
  void wait(std::span<const std::string> keys, Milliseconds timeout) override;
  bool delete_key(std::string_view key) override;
  std::int64_t num_keys() override;

  const std::string& prefix() const { return prefix_; }
  const std::shared_ptr<Store>& base() const { return base_; }

 private:
  std::string prefixed(std::string_view key) const;
  std::vector<std::string> prefixed(std::span<const std::string> keys) const;

  std::string prefix_;
  std::shared_ptr<Store> base_;
};

}  // namespace ddp
#pragma GCC visibility pop
