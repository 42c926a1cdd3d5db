// The shared-secret primitives (needs a build with OpenSSL; checks the refusal without).
#include "auth/hmac.h"

#include <gtest/gtest.h>

#include <string_view>

#include "ddp/error.h"

namespace ddp::auth {
namespace {

constexpr std::string_view kRole = "test role";
constexpr std::string_view kOtherRole = "other role";

TEST(AuthMac, DependsOnSecretRoleAndNonce) {
  if (!auth_available()) GTEST_SKIP() << "built without OpenSSL";
  const Nonce nonce = random_nonce();
  EXPECT_NE(random_nonce(), nonce);
  const Mac mac = auth_mac("a", kRole, nonce);
  EXPECT_TRUE(macs_equal(mac, auth_mac("a", kRole, nonce)));
  EXPECT_FALSE(macs_equal(mac, auth_mac("b", kRole, nonce)));
  EXPECT_FALSE(macs_equal(mac, auth_mac("a", kOtherRole, nonce)));
  EXPECT_FALSE(macs_equal(mac, auth_mac("a", kRole, random_nonce())));
}

TEST(AuthMac, IsHmacSha256OfRoleAndNonce) {
  if (!auth_available()) GTEST_SKIP() << "built without OpenSSL";
  // RFC 4231 test case 2: key "Jefe", data "what do ya want for nothing?" (split into role and
  // nonce, which the MAC covers as one message).
  const std::string_view data = "for nothing?";
  const std::span<const std::uint8_t> nonce(reinterpret_cast<const std::uint8_t*>(data.data()),
                                            data.size());
  const Mac mac = auth_mac("Jefe", "what do ya want ", nonce);
  const Mac expected = {0x5b, 0xdc, 0xc1, 0x46, 0xbf, 0x60, 0x75, 0x4e, 0x6a, 0x04, 0x24,
                        0x26, 0x08, 0x95, 0x75, 0xc7, 0x5a, 0x00, 0x3f, 0x08, 0x9d, 0x27,
                        0x39, 0x83, 0x9d, 0xec, 0x58, 0xb9, 0x64, 0xec, 0x38, 0x43};
  EXPECT_EQ(mac, expected);
}

TEST(AuthMac, MacsOfDifferentLengthsDiffer) {
  if (!auth_available()) GTEST_SKIP() << "built without OpenSSL";
  const Mac mac = auth_mac("a", kRole, random_nonce());
  EXPECT_FALSE(macs_equal(mac, std::span<const std::uint8_t>(mac).first(kMacBytes - 1)));
}

TEST(AuthAvailable, RequireAuthThrowsExactlyWhenUnavailable) {
  if (auth_available()) {
    EXPECT_NO_THROW(require_auth());
  } else {
    EXPECT_THROW(require_auth(), ConfigError);
    EXPECT_THROW(random_nonce(), ConfigError);
  }
}

}  // namespace
}  // namespace ddp::auth
