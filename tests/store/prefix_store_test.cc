// PrefixStore over a real TcpStore: keys are isolated per prefix and map to prefix + "/" + key.
#include "ddp/store/prefix_store.h"

#include <gtest/gtest.h>

#include <thread>

#include "ddp/error.h"
#include "ddp/store/tcp_store.h"
#include "support/unity_namespace.h"

namespace ddp {
namespace {
namespace DDP_UNITY_ID {

using namespace std::chrono_literals;

class PrefixStoreTest : public testing::Test {
 protected:
  std::shared_ptr<TcpStore> base_ = std::make_shared<TcpStore>(
      "127.0.0.1", 0,
      TcpStoreOptions{
          .is_server = true, .timeout = 5s, .connect_timeout = 5s, .listen_host = "127.0.0.1"});
};

TEST_F(PrefixStoreTest, TwoPrefixesKeepTheSameKeyApart) {
  PrefixStore a("group/a", base_);
  PrefixStore b("group/b", base_);
  a.set("rank0", "alpha");
  b.set("rank0", "beta");
  EXPECT_EQ(a.get_string("rank0"), "alpha");
  EXPECT_EQ(b.get_string("rank0"), "beta");
  EXPECT_EQ(base_->get_string("group/a/rank0"), "alpha");
  EXPECT_EQ(a.add("count", 2), 2);
  EXPECT_EQ(b.add("count", 5), 5);
  EXPECT_TRUE(a.delete_key("rank0"));
  EXPECT_FALSE(a.check(std::vector<std::string>{"rank0"}));
  EXPECT_TRUE(b.check(std::vector<std::string>{"rank0", "count"}));
  // num_keys counts the whole server: group/b/rank0, group/a/count, group/b/count.
  EXPECT_EQ(a.num_keys(), 3);
  EXPECT_EQ(b.num_keys(), base_->num_keys());
}

TEST_F(PrefixStoreTest, EveryOperationGoesThroughThePrefix) {
  PrefixStore store("p", base_);
  EXPECT_EQ(store.compare_set("leader", "", "me"), "me");
  EXPECT_EQ(base_->get_string("p/leader"), "me");
  base_->set("p/ready", "1");
  store.wait(std::vector<std::string>{"ready", "leader"});
  EXPECT_EQ(store.get_string("ready"), "1");
}

TEST_F(PrefixStoreTest, TimeoutNamesThePrefixedKey) {
  PrefixStore store("job7", base_);
  EXPECT_EQ(store.timeout(), 5s);
  try {
    store.get("missing", 50ms);
    FAIL() << "get should time out";
  } catch (const TimeoutError& e) {
    EXPECT_NE(std::string(e.what()).find("'job7/missing'"), std::string::npos) << e.what();
  }
}

TEST_F(PrefixStoreTest, NestedPrefixesCompose) {
  auto outer = std::make_shared<PrefixStore>("outer", base_);
  PrefixStore inner("inner", outer);
  inner.set("k", "v");
  EXPECT_EQ(base_->get_string("outer/inner/k"), "v");
}

TEST_F(PrefixStoreTest, GetBlocksUntilTheKeyIsSetUnderThePrefix) {
  PrefixStore store("blocking", base_);
  // Set from another connection; the getter below must be parked, not racing a local write.
  std::thread setter([&] {
    try {
      auto other = std::make_shared<TcpStore>(
          "127.0.0.1", base_->port(), TcpStoreOptions{.timeout = 5s, .connect_timeout = 5s});
      PrefixStore("blocking", other).set("late", "here");
    } catch (const std::exception& e) {
      ADD_FAILURE() << e.what();
    }
  });
  EXPECT_EQ(store.get_string("late"), "here");
  setter.join();
}

TEST(PrefixStore, NullBaseIsAConfigError) {
  EXPECT_THROW(PrefixStore("p", nullptr), ConfigError);
}

}  // namespace DDP_UNITY_ID
}  // namespace
}  // namespace ddp
