// Races between a client's requests and its connection going away, each repeated 200 times:
// a parked get is answered even when the setter resets its connection before reading the reply,
// and complete requests that arrive together with the close are applied every time.
#include <sys/socket.h>

#include <gtest/gtest.h>

#include <functional>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include "ddp/error.h"
#include "ddp/store/tcp_store.h"
#include "net/socket.h"
#include "raw_client.h"
#include "store/protocol.h"
#include "support/unity_namespace.h"

namespace ddp::store {
namespace {
namespace DDP_UNITY_ID {

using namespace std::chrono_literals;

constexpr Milliseconds kTestTimeout{5'000};
constexpr int kIterations = 200;

using test::Frame;
using test::hello;
using test::op;
using test::reset;

void append(Frame& to, const Frame& more) {
  to.insert(to.end(), more.begin(), more.end());
}

bool wait_until(const std::function<bool()>& done) {
  return test::wait_until(done, kTestTimeout);
}

class StoreRaceTest : public testing::Test {
 protected:
  net::Socket connect() {
    return net::connect_tcp("127.0.0.1", server_.port(), net::deadline_after(kTestTimeout));
  }

  TcpStoreServer server_{{.listen_host = "127.0.0.1", .log = [](const std::string&) {}}};
  TcpStore reader_{
      "127.0.0.1", server_.port(), {.timeout = kTestTimeout, .connect_timeout = kTestTimeout}};
};

// The waiter is parked on the key; the setter sends set and resets its connection at once, so the
// server's reply to it fails. The waiter must still get the value (it used to wait forever).
TEST_F(StoreRaceTest, AParkedGetIsAnsweredWhenTheSetterResetsItsConnection) {
  for (int i = 0; i < kIterations; ++i) {
    const std::string key = "wake/" + std::to_string(i);
    TcpStore waiter("127.0.0.1", server_.port(),
                    {.timeout = kTestTimeout, .connect_timeout = kTestTimeout});
    auto got = std::async(std::launch::async, [&] { return waiter.get_string(key, 2s); });
    ASSERT_TRUE(wait_until([&] { return server_.num_parked_requests() == 1; }))
        << "iteration " << i;

    net::Socket setter = connect();
    const Frame h = hello();
    setter.send_all(h.data(), h.size(), net::deadline_after(kTestTimeout));
    std::uint8_t reply[kHelloReplyBytes];
    setter.recv_all(reply, sizeof reply, net::deadline_after(kTestTimeout));
    const Frame set = FrameWriter(op(Opcode::kSet)).bytes(key).bytes("value").finish();
    setter.send_all(set.data(), set.size(), net::deadline_after(kTestTimeout));
    reset(setter);

    std::string value;
    ASSERT_NO_THROW(value = got.get()) << "iteration " << i << ": the wake-up was lost";
    ASSERT_EQ(value, "value") << "iteration " << i;
  }
  EXPECT_TRUE(wait_until([&] { return server_.num_parked_requests() == 0; }));
}

// hello + set + add written at once, then the close: both requests are applied every time.
TEST_F(StoreRaceTest, RequestsThatArriveWithTheCloseAreApplied) {
  for (int i = 0; i < kIterations; ++i) {
    const std::string key = "close/" + std::to_string(i);
    Frame bytes = hello();
    append(bytes, FrameWriter(op(Opcode::kSet)).bytes(key).bytes("v").finish());
    append(bytes, FrameWriter(op(Opcode::kAdd)).bytes(key + "/n").i64(i).finish());
    net::Socket client = connect();
    client.send_all(bytes.data(), bytes.size(), net::deadline_after(kTestTimeout));
    client.close();
    ASSERT_EQ(reader_.get_string(key, 2s), "v") << "iteration " << i;
    ASSERT_EQ(reader_.get_string(key + "/n", 2s), std::to_string(i)) << "iteration " << i;
  }
}

// The same with a reset instead of a FIN: the requests had fully arrived, so they count.
TEST_F(StoreRaceTest, RequestsThatArriveWithAResetAreApplied) {
  for (int i = 0; i < kIterations; ++i) {
    const std::string key = "reset/" + std::to_string(i);
    Frame bytes = hello();
    append(bytes, FrameWriter(op(Opcode::kSet)).bytes(key).bytes("v").finish());
    net::Socket client = connect();
    client.send_all(bytes.data(), bytes.size(), net::deadline_after(kTestTimeout));
    reset(client);
    ASSERT_EQ(reader_.get_string(key, 2s), "v") << "iteration " << i;
  }
}

// A client that shuts down only its sending side still gets the replies to what it sent.
TEST_F(StoreRaceTest, AHalfClosedClientStillReceivesItsReplies) {
  Frame bytes = hello();
  append(bytes, FrameWriter(op(Opcode::kAdd)).bytes("half").i64(41).finish());
  append(bytes, FrameWriter(op(Opcode::kAdd)).bytes("half").i64(1).finish());
  net::Socket client = connect();
  client.send_all(bytes.data(), bytes.size(), net::deadline_after(kTestTimeout));
  ASSERT_EQ(::shutdown(client.fd(), SHUT_WR), 0);
  // hello reply (9) + two add replies (4 + 1 + 8 each)
  std::vector<std::uint8_t> replies(kHelloReplyBytes + 2 * 13);
  client.recv_all(replies.data(), replies.size(), net::deadline_after(kTestTimeout));
  EXPECT_EQ(replies[kHelloReplyBytes + 13 + 5], 42);
  EXPECT_EQ(reader_.get_string("half"), "42");
}

}  // namespace DDP_UNITY_ID
}  // namespace
}  // namespace ddp::store
