// The TcpStore wire protocol: constants, limits and frame encoding shared by client and server.
//
// Internal to ddp (src/, not include/): users talk to the store through ddp::TcpStore. The
// protocol is written down in docs/store.md; keep the two in step. All integers are
// little-endian. Every frame is [u32 length][u8 code][fields...], where length counts the code
// byte and the fields.
//
// FrameReader throws ProtocolError on any field that does not fit the frame; the server turns that
// into "close this connection with a logged reason". Not thread-safe (plain value types).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace ddp::store {

// "DDPS" read as a little-endian u32; the first four bytes every client sends.
inline constexpr std::uint32_t kMagic = 0x53504444;
// Bump on any incompatible change of frames or semantics.
inline constexpr std::uint32_t kProtocolVersion = 1;

// Limits (also enforced by the client, which raises ConfigError before sending).
inline constexpr std::size_t kMaxKeyBytes = 4 * 1024;
inline constexpr std::size_t kMaxValueBytes = 64 * 1024 * 1024;
inline constexpr std::size_t kMaxKeysPerRequest = 64 * 1024;
// The largest request is compare_set: a key and two values, plus small fixed fields.
inline constexpr std::size_t kFrameOverheadBytes = 64;
inline constexpr std::size_t kMaxFrameBytes =
    2 * kMaxValueBytes + kMaxKeyBytes + kFrameOverheadBytes;

// Handshake: client sends kHelloBytes (magic, version); server answers kHelloReplyBytes (magic,
// its version, HelloStatus). kVersionMismatch: the server closes the connection. kAuthRequired:
// a 32-byte server nonce follows, the client sends its MAC and its own nonce (kAuthBytes), the
// server answers one AuthStatus byte and, when accepted, its own MAC (see auth.h).
inline constexpr std::size_t kHelloBytes = 8;
inline constexpr std::size_t kHelloReplyBytes = 9;
inline constexpr std::size_t kAuthBytes = 64;
enum class HelloStatus : std::uint8_t { kAccepted = 0, kVersionMismatch = 1, kAuthRequired = 2 };
enum class AuthStatus : std::uint8_t { kAccepted = 0, kRejected = 1 };

enum class Opcode : std::uint8_t {
  kSet = 1,         // key, value                       -> kOk
  kGet = 2,         // key                              -> kOk value (parked until the key exists)
  kAdd = 3,         // key, i64 delta                   -> kOk i64 new value
  kCompareSet = 4,  // key, expected, desired           -> kOk value held afterwards
  kCheck = 5,       // u32 n, n keys                    -> kOk u8 (1: all exist)
  kWait = 6,        // u32 n, n keys                    -> kOk (parked until all exist)
  kDelete = 7,      // key                              -> kOk u8 (1: existed)
  kNumKeys = 8,     // (nothing)                        -> kOk i64
  kCancel = 9,      // (nothing); no reply of its own: answers a parked get/wait with kCancelled
};
inline constexpr std::uint8_t kMaxOpcode = 9;

enum class Status : std::uint8_t {
  kOk = 0,
  kCancelled = 1,  // a parked get/wait dropped on kCancel; fields: u32 n, n missing keys
  kError = 2,      // the request was refused; field: message (bytes)
};

const char* opcode_name(Opcode op);

// Builds one frame. Call finish() to patch the length prefix and take the bytes.
class FrameWriter {
 public:
  explicit FrameWriter(std::uint8_t code);
  FrameWriter& u8(std::uint8_t value);
  FrameWriter& u32(std::uint32_t value);
  FrameWriter& i64(std::int64_t value);
  // u32 length then the bytes.
  FrameWriter& bytes(std::span<const std::uint8_t> value);
  FrameWriter& bytes(std::string_view value);
  std::vector<std::uint8_t> finish();

 private:
  std::vector<std::uint8_t> buffer_;
};

// Reads the fields of one frame body (everything after the length prefix). Each accessor throws
// ProtocolError naming the field when the frame is too short; `limit` bounds a bytes field.
class FrameReader {
 public:
  explicit FrameReader(std::span<const std::uint8_t> body) : body_(body) {}
  std::uint8_t u8(const char* field);
  std::uint32_t u32(const char* field);
  std::int64_t i64(const char* field);
  std::span<const std::uint8_t> bytes(const char* field, std::size_t limit);
  std::string string(const char* field, std::size_t limit);
  // Throws ProtocolError when bytes are left over (a frame longer than its fields).
  void expect_end(const char* what) const;
  std::size_t remaining() const { return body_.size() - offset_; }

 private:
  std::span<const std::uint8_t> take(std::size_t size, const char* field);
  std::span<const std::uint8_t> body_;
  std::size_t offset_ = 0;
};

void put_u32(std::uint8_t* out, std::uint32_t value);
std::uint32_t get_u32(const std::uint8_t* in);

// `text` with non-printable bytes escaped and long text cut, for error and log messages.
std::string printable(std::string_view text, std::size_t max_chars = 200);
// The first eight of `keys`, printable and quoted ("'a', 'b', ... (12 keys in all)").
std::string quoted_keys(std::span<const std::string> keys);
// "get('key')": a store call and its key, for messages.
std::string key_call(const char* op, std::string_view key);

}  // namespace ddp::store
