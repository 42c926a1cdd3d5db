// KvState and ServerProtocol without sockets: the store's semantics, parked requests and the
// order of wake-ups, driven directly.
#include "store/kv_state.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <map>
#include <set>
#include <string>
#include <vector>

#include "store/server_protocol.h"
#include "support/unity_namespace.h"

namespace ddp::store {
namespace {
namespace DDP_UNITY_ID {

using testing::ElementsAre;
using testing::HasSubstr;

std::span<const std::uint8_t> bytes(std::string_view text) {
  return {reinterpret_cast<const std::uint8_t*>(text.data()), text.size()};
}

std::string text(const Bytes* value) {
  return value ? std::string(value->begin(), value->end()) : "<missing>";
}

TEST(KvState, SetGetEraseAndMemoryAccounting) {
  KvState state;
  EXPECT_EQ(state.bytes(), 0u);
  EXPECT_TRUE(state.set("k", bytes("value")).empty());
  EXPECT_EQ(text(state.find("k")), "value");
  EXPECT_EQ(state.bytes(), 1 + 5 + KvState::kEntryOverheadBytes);
  EXPECT_EQ(state.bytes_after_store("k", 2), 1 + 2 + KvState::kEntryOverheadBytes);
  EXPECT_EQ(state.bytes_after_store("new", 2),
            state.bytes() + 3 + 2 + KvState::kEntryOverheadBytes);
  state.set("k", bytes("v2"));
  EXPECT_EQ(state.bytes(), 1 + 2 + KvState::kEntryOverheadBytes);
  EXPECT_EQ(state.num_keys(), 1u);
  EXPECT_TRUE(state.erase("k"));
  EXPECT_FALSE(state.erase("k"));
  EXPECT_EQ(state.bytes(), 0u);
  EXPECT_EQ(state.find("k"), nullptr);
}

TEST(KvState, AddCountsInDecimalAndRefusesNonIntegersAndOverflow) {
  KvState state;
  EXPECT_EQ(state.add("n", 5).value, 5);
  EXPECT_EQ(state.add("n", -7).value, -2);
  EXPECT_EQ(text(state.find("n")), "-2");
  state.set("s", bytes("abc"));
  const auto refused = state.add("s", 1);
  EXPECT_FALSE(refused.value);
  EXPECT_THAT(refused.error, HasSubstr("not a decimal integer"));
  state.add("big", INT64_MAX);
  EXPECT_THAT(state.add("big", 1).error, HasSubstr("overflows"));
}

TEST(KvState, CompareSetTreatsAMissingKeyAsEmpty) {
  KvState state;
  EXPECT_EQ(state.compare_set("k", bytes("x"), bytes("y")).value, Bytes{});
  EXPECT_FALSE(state.contains("k"));
  EXPECT_EQ(state.compare_set("k", {}, bytes("first")).value,
            Bytes(bytes("first").begin(), bytes("first").end()));
  EXPECT_EQ(text(state.find("k")), "first");
  const Bytes held = state.compare_set("k", bytes("wrong"), bytes("z")).value;
  EXPECT_EQ(text(&held), "first");
}

TEST(KvState, AParkedGetWakesWhenItsKeyIsCreatedByAnyMutation) {
  KvState state;
  const std::string a[] = {"a"};
  const std::string b[] = {"b"};
  const std::string c[] = {"c"};
  EXPECT_TRUE(state.park(1, Opcode::kGet, a));
  EXPECT_TRUE(state.park(2, Opcode::kGet, a));
  EXPECT_TRUE(state.park(3, Opcode::kGet, b));
  EXPECT_TRUE(state.park(4, Opcode::kGet, c));
  EXPECT_EQ(state.num_parked(), 4u);
  EXPECT_THAT(state.set("a", bytes("1")),
              ElementsAre(Wakeup{1, Opcode::kGet, "a"}, Wakeup{2, Opcode::kGet, "a"}));
  EXPECT_THAT(state.add("b", 1).woken, ElementsAre(Wakeup{3, Opcode::kGet, "b"}));
  EXPECT_TRUE(state.compare_set("c", bytes("no"), bytes("x")).woken.empty());
  EXPECT_THAT(state.compare_set("c", {}, bytes("x")).woken,
              ElementsAre(Wakeup{4, Opcode::kGet, "c"}));
  EXPECT_EQ(state.num_parked(), 0u);
  EXPECT_FALSE(state.park(5, Opcode::kGet, a)) << "the key exists: nothing to park";
}

TEST(KvState, AWaitWakesOnlyWhenItsLastKeyExists) {
  KvState state;
  state.set("x", bytes("1"));
  const std::string keys[] = {"x", "y", "z"};
  EXPECT_TRUE(state.park(9, Opcode::kWait, keys));
  EXPECT_TRUE(state.set("z", bytes("1")).empty());
  EXPECT_THAT(state.set("y", bytes("1")), ElementsAre(Wakeup{9, Opcode::kWait, "x"}));
}

TEST(KvState, UnparkReturnsTheMissingKeysAndStopsTheWakeUp) {
  KvState state;
  const std::string keys[] = {"b", "a", "c"};
  state.set("c", bytes("1"));
  ASSERT_TRUE(state.park(1, Opcode::kWait, keys));
  EXPECT_EQ(state.parked_op(1), Opcode::kWait);
  EXPECT_THAT(*state.unpark(1), ElementsAre("a", "b"));
  EXPECT_FALSE(state.unpark(1));
  EXPECT_TRUE(state.set("a", bytes("1")).empty());
  EXPECT_TRUE(state.set("b", bytes("1")).empty());
}

TEST(KvState, AKeyDeletedAgainParksNewWaiters) {
  KvState state;
  state.set("k", bytes("1"));
  state.erase("k");
  const std::string k[] = {"k"};
  EXPECT_TRUE(state.park(1, Opcode::kGet, k));
  EXPECT_THAT(state.set("k", bytes("2")), ElementsAre(Wakeup{1, Opcode::kGet, "k"}));
}

// An outbox that records replies and can play a connection whose sends fail.
class RecordingOutbox : public Outbox {
 public:
  void send(ConnectionId id, std::vector<std::uint8_t> frame) override {
    order.push_back(id);
    if (!failing.contains(id)) replies[id].push_back(std::move(frame));
  }
  std::size_t buffered_bytes() const override { return buffered; }
  void refused(ConnectionId, const std::string& reason) override { refusals.push_back(reason); }

  std::map<ConnectionId, std::vector<std::vector<std::uint8_t>>> replies;
  std::vector<ConnectionId> order;
  std::set<ConnectionId> failing;
  std::vector<std::string> refusals;
  std::size_t buffered = 0;
};

std::vector<std::uint8_t> hello() {
  std::vector<std::uint8_t> out(kHelloBytes);
  put_u32(out.data(), kMagic);
  put_u32(out.data() + 4, kProtocolVersion);
  return out;
}

void greet(ServerProtocol& protocol, ConnectionId id, RecordingOutbox& out) {
  protocol.open(id);
  const auto h = hello();
  ASSERT_EQ(protocol.unit_size(id, h), kHelloBytes);
  EXPECT_EQ(protocol.handle(id, h, out), "");
  EXPECT_TRUE(protocol.ready(id));
  out.replies.clear();
  out.order.clear();
}

void request(ServerProtocol& protocol, ConnectionId id, const std::vector<std::uint8_t>& frame,
             RecordingOutbox& out) {
  ASSERT_EQ(protocol.unit_size(id, frame), frame.size());
  EXPECT_EQ(protocol.handle(id, frame, out), "");
}

std::uint8_t op(Opcode code) {
  return static_cast<std::uint8_t>(code);
}

TEST(ServerProtocol, WaitersAreAnsweredBeforeTheSetterAndEvenWhenItsSendFails) {
  ServerProtocol protocol({});
  RecordingOutbox out;
  greet(protocol, 1, out);
  greet(protocol, 2, out);
  request(protocol, 1, FrameWriter(op(Opcode::kGet)).bytes("k").finish(), out);
  EXPECT_TRUE(protocol.parked(1));
  out.failing.insert(2);  // the setter reset its connection
  request(protocol, 2, FrameWriter(op(Opcode::kSet)).bytes("k").bytes("v").finish(), out);
  EXPECT_THAT(out.order, ElementsAre(1u, 2u));
  ASSERT_EQ(out.replies[1].size(), 1u);
  const auto expected = FrameWriter(0).bytes("v").finish();
  EXPECT_EQ(out.replies[1][0], expected);
  EXPECT_FALSE(protocol.parked(1));
}

TEST(ServerProtocol, OversizedFramesAreRejectedFromTheHeaderAlone) {
  ServerProtocol protocol({});
  RecordingOutbox out;
  greet(protocol, 1, out);
  std::vector<std::uint8_t> header(4);
  put_u32(header.data(), 100u << 20);
  EXPECT_EQ(protocol.unit_size(1, header), 4 + (std::size_t{100} << 20));
  put_u32(header.data(), static_cast<std::uint32_t>(kMaxFrameBytes + 1));
  EXPECT_THROW(protocol.unit_size(1, header), DropConnection);
}

TEST(ServerProtocol, ASetOverTheMemoryLimitIsRefusedNamingIt) {
  ServerProtocol protocol({.max_memory_bytes = 1000});
  RecordingOutbox out;
  greet(protocol, 1, out);
  request(protocol, 1, FrameWriter(op(Opcode::kSet)).bytes("small").bytes("x").finish(), out);
  request(protocol, 1,
          FrameWriter(op(Opcode::kSet)).bytes("big").bytes(std::string(2000, 'x')).finish(), out);
  ASSERT_EQ(out.replies[1].size(), 2u);
  EXPECT_EQ(out.replies[1][0], FrameWriter(0).finish());
  EXPECT_EQ(out.replies[1][1][4], static_cast<std::uint8_t>(Status::kError));
  ASSERT_EQ(out.refusals.size(), 1u);
  EXPECT_THAT(out.refusals[0], HasSubstr("max_memory_bytes"));
  EXPECT_FALSE(protocol.state().contains("big"));
  EXPECT_TRUE(protocol.state().contains("small"));
}

}  // namespace DDP_UNITY_ID
}  // namespace
}  // namespace ddp::store
