// Shared-secret authentication of store connections (needs a build with OpenSSL; skips without).
// The primitives themselves: tests/auth/hmac_test.cc.
#include "store/auth.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "ddp/error.h"
#include "ddp/store/tcp_store.h"
#include "net/socket.h"
#include "store/protocol.h"
#include "support/unity_namespace.h"

namespace ddp::store {
namespace {
namespace DDP_UNITY_ID {

using namespace std::chrono_literals;
using testing::HasSubstr;

constexpr Milliseconds kTestTimeout{5'000};

std::string message_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no exception)";
}

class AuthTest : public testing::Test {
 protected:
  void SetUp() override {
    if (!auth::auth_available()) GTEST_SKIP() << "built without OpenSSL: no store authentication";
    server_ = std::make_unique<TcpStoreServer>(
        TcpStoreServerOptions{.listen_host = "127.0.0.1",
                              .auth_secret = "s3cret",
                              .log = [this](const std::string& line) {
                                std::lock_guard lock(log_mutex_);
                                log_.push_back(line);
                              }});
  }

  TcpStoreOptions options(std::string secret) {
    return {
        .timeout = kTestTimeout, .connect_timeout = kTestTimeout, .auth_secret = std::move(secret)};
  }

  bool logged(const std::string& text) {
    const auto deadline = net::Clock::now() + kTestTimeout;
    while (net::Clock::now() < deadline) {
      {
        std::lock_guard lock(log_mutex_);
        for (const auto& line : log_) {
          if (line.find(text) != std::string::npos) return true;
        }
      }
      std::this_thread::sleep_for(1ms);
    }
    return false;
  }

  std::mutex log_mutex_;
  std::vector<std::string> log_;
  std::unique_ptr<TcpStoreServer> server_;
};

TEST_F(AuthTest, ClientWithTheSecretIsServed) {
  TcpStore first("127.0.0.1", server_->port(), options("s3cret"));
  TcpStore second("127.0.0.1", server_->port(), options("s3cret"));
  first.set("k", "v");
  EXPECT_EQ(second.get_string("k"), "v");
  EXPECT_EQ(server_->num_dropped_connections(), 0u);
}

TEST_F(AuthTest, WrongSecretIsRejectedAndLogged) {
  TcpStore good("127.0.0.1", server_->port(), options("s3cret"));
  const std::string message =
      message_of([&] { TcpStore bad("127.0.0.1", server_->port(), options("guess")); });
  EXPECT_THAT(message, HasSubstr("rejected this client's shared secret"));
  EXPECT_TRUE(logged("authentication failed (wrong shared secret)"));
  good.set("still", "works");
  EXPECT_EQ(good.get_string("still"), "works");
}

TEST_F(AuthTest, ClientWithoutASecretIsToldToSetOne) {
  const std::string message =
      message_of([&] { TcpStore none("127.0.0.1", server_->port(), options("")); });
  EXPECT_THAT(message, HasSubstr("requires a shared secret"));
}

TEST_F(AuthTest, ClientWithASecretRefusesAServerWithout) {
  TcpStoreServer open_server({.listen_host = "127.0.0.1"});
  const std::string message =
      message_of([&] { TcpStore client("127.0.0.1", open_server.port(), options("s3cret")); });
  EXPECT_THAT(message, HasSubstr("does not ask for one"));
}

TEST_F(AuthTest, EmbeddedServerTakesTheSecretToo) {
  TcpStoreOptions server_options = options("xyz");
  server_options.is_server = true;
  server_options.listen_host = "127.0.0.1";
  TcpStore server("127.0.0.1", 0, server_options);
  TcpStore client("127.0.0.1", server.port(), options("xyz"));
  client.set("a", "b");
  EXPECT_EQ(server.get_string("a"), "b");
  EXPECT_THROW(TcpStore("127.0.0.1", server.port(), options("abc")), StoreError);
}

TEST_F(AuthTest, RawClientSkippingAuthenticationCannotSendRequests) {
  net::Socket socket =
      net::connect_tcp("127.0.0.1", server_->port(), net::deadline_after(kTestTimeout));
  std::uint8_t hello[kHelloBytes];
  put_u32(hello, kMagic);
  put_u32(hello + 4, kProtocolVersion);
  socket.send_all(hello, sizeof hello, net::deadline_after(kTestTimeout));
  std::uint8_t reply[kHelloReplyBytes + auth::kNonceBytes];
  socket.recv_all(reply, sizeof reply, net::deadline_after(kTestTimeout));
  EXPECT_EQ(reply[8], static_cast<std::uint8_t>(HelloStatus::kAuthRequired));
  // A request frame where the MAC belongs is just a wrong MAC (64 bytes of it).
  std::vector<std::uint8_t> frames;
  for (int i = 0; i < 8; ++i) {
    const auto frame =
        FrameWriter(static_cast<std::uint8_t>(Opcode::kSet)).bytes("k").bytes("v").finish();
    frames.insert(frames.end(), frame.begin(), frame.end());
  }
  socket.send_all(frames.data(), frames.size(), net::deadline_after(kTestTimeout));
  std::uint8_t status = 0;
  socket.recv_all(&status, 1, net::deadline_after(kTestTimeout));
  EXPECT_EQ(status, static_cast<std::uint8_t>(AuthStatus::kRejected));
  EXPECT_TRUE(logged("authentication failed"));
  TcpStore good("127.0.0.1", server_->port(), options("s3cret"));
  EXPECT_FALSE(good.check(std::vector<std::string>{"k"}));
}

}  // namespace DDP_UNITY_ID
}  // namespace
}  // namespace ddp::store
