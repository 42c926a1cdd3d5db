#include "auth/hmac.h"

#include <sys/random.h>

#include <cerrno>
#include <string>
#include <vector>

#include "ddp/error.h"

#ifdef DDP_AUTH_HAVE_OPENSSL
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>
#endif

namespace ddp::auth {
#ifdef DDP_AUTH_HAVE_OPENSSL

bool auth_available() {
  return true;
}

void require_auth() {}

Nonce random_nonce() {
  Nonce nonce{};
  // The kernel's generator first: OpenSSL's is as good but sets itself up on first use (1 ms and
  // more per process, paid by every rank at start-up).
  std::size_t got = 0;
  while (got < nonce.size()) {
    const ssize_t n = ::getrandom(nonce.data() + got, nonce.size() - got, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    got += static_cast<std::size_t>(n);
  }
  if (got == nonce.size()) return nonce;
  if (RAND_bytes(nonce.data(), static_cast<int>(nonce.size())) != 1) {
    throw Error("authentication: OpenSSL could not produce random bytes");
  }
  return nonce;
}

Mac auth_mac(std::string_view secret, std::string_view role, std::span<const std::uint8_t> nonce) {
  std::vector<std::uint8_t> message(role.begin(), role.end());
  message.insert(message.end(), nonce.begin(), nonce.end());
  Mac mac{};
  unsigned int size = 0;
  if (HMAC(EVP_sha256(), secret.data(), static_cast<int>(secret.size()), message.data(),
           message.size(), mac.data(), &size) == nullptr ||
      size != mac.size()) {
    throw Error("authentication: HMAC-SHA256 failed");
  }
  return mac;
}

bool macs_equal(std::span<const std::uint8_t> a, std::span<const std::uint8_t> b) {
  return a.size() == b.size() && CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

#else

bool auth_available() {
  return false;
}

void require_auth() {
  throw ConfigError(
      "authentication with a shared secret needs OpenSSL, and this ddp was built without it: "
      "install libssl-dev and rebuild, or run without a secret (DDP_SECRET, DDP_SECRET_FILE, "
      "the store's auth_secret)");
}

// Unreachable returns: require_auth() always throws in this build.
Nonce random_nonce() {
  require_auth();
  return {};
}
Mac auth_mac(std::string_view, std::string_view, std::span<const std::uint8_t>) {
  require_auth();
  return {};
}
bool macs_equal(std::span<const std::uint8_t>, std::span<const std::uint8_t>) {
  require_auth();
  return false;
}

#endif

}  // namespace ddp::auth
