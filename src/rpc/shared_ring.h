// The shared-memory lane of an RPC connection between two workers of one host (internal;
// agent.h): a byte ring one side writes a frame's payload into and the other copies it out of,
// while the frame's header still travels on the TCP connection. A large payload then crosses no
// kernel copy and no loopback segmentation (issue 51's 1 MiB echo), and TCP keeps doing what it
// does well: ordering the frames, waking the reader, and telling a dead peer.
//
//   writer: ring header page | capacity bytes of data, written in order and wrapping around
//   RingHeader: magic, version, capacity, nonce | written (writer's) | consumed (reader's)
//
// Each side of a connection may offer its own ring (a kRingOffer frame: RingOffer below); the
// peer maps it and answers (kRingAnswer) whether it could. Payloads then go into the ring while
// it has room, in the order their frames are sent. The writer sends a frame's header first and
// then copies its payload in, publishing every 64 KiB; the reader, woken by the header, copies
// out behind it, so the two copies of a payload overlap instead of adding up. Neither side trusts
// a counter it did not write: the reader refuses a count that cannot be (a ProtocolError closes
// the connection) and waits for bytes no longer than the frame's deadline, the writer stops using
// a ring whose reader's count went backwards or past what was written (its payloads go by TCP
// from then on).
#pragma once

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include "net/shared_memory.h"
#include "net/socket.h"

namespace ddp::rpc::transport {

inline constexpr std::size_t kRingHeaderBytes = 4096;
inline constexpr std::size_t kMinRingBytes = std::size_t{64} << 10;
inline constexpr std::size_t kMaxRingBytes = std::size_t{1} << 30;
// Smaller payloads go by TCP: their copies cost less than the ring's bookkeeping and a cache
// line that bounces between the two processes.
inline constexpr std::size_t kRingMinPayloadBytes = std::size_t{16} << 10;

using RingNonce = std::array<std::uint8_t, 16>;

// What a kRingOffer frame's payload says.
struct RingOffer {
  RingNonce nonce{};
  std::uint64_t capacity = 0;  // data bytes, after the header page
  std::string path;            // net::SharedMemory::path()
  std::string domain;          // net::shared_memory_domain() of the writer
};

std::string encode_ring_offer(const RingOffer& offer);
// Throws ProtocolError naming `peer` and what is wrong (lengths, sizes, trailing bytes).
RingOffer decode_ring_offer(std::span<const std::uint8_t> bytes, const std::string& peer);

// What a kRingAnswer frame's payload says: the offer's nonce, and why the ring was refused ("":
// it is mapped).
struct RingAnswer {
  RingNonce nonce{};
  std::string refusal;
};
std::string encode_ring_answer(const RingAnswer& answer);
RingAnswer decode_ring_answer(std::span<const std::uint8_t> bytes, const std::string& peer);

// The writing side: made by the worker that sends into it.
class RingWriter {
 public:
  // Throws Error when the memory cannot be had (the connection then stays on TCP).
  explicit RingWriter(std::size_t capacity);
  RingOffer offer(const std::string& domain) const;
  // Whether `total` more bytes fit in the room the reader has left; `damaged` is set (and false
  // returned) when the reader's count is impossible.
  bool has_room(std::size_t total, bool& damaged);
  // Copies `bytes` in after what was written, publishing as it goes. Only after has_room() said
  // yes for at least these bytes.
  void append(std::span<const std::uint8_t> bytes);
  const RingNonce& nonce() const { return nonce_; }
  // The peer has it mapped or gave up: nobody else may open it.
  void close_descriptor() { memory_.close_descriptor(); }

 private:
  net::SharedMemory memory_;
  std::size_t capacity_;
  RingNonce nonce_{};
  std::uint64_t written_ = 0;
  std::uint64_t consumed_ = 0;  // the reader's count as last seen
};

// The reading side: the peer's ring, mapped.
class RingReader {
 public:
  // Throws Error naming what is wrong with the offer or the memory it names.
  // `domain`: this worker's net::shared_memory_domain(); a ring of another is refused unopened.
  RingReader(const RingOffer& offer, const std::string& domain);
  // Copies the next `n` bytes out as the writer publishes them, and counts them consumed. While
  // none are there it yields its core for up to `spin`, then sleeps in steps of a millisecond
  // watching `socket_fd` (the connection) for the writer's end. Throws ProtocolError (naming
  // `peer`) when the count cannot be, TimeoutError at `deadline`, Error when the peer closed.
  void read(std::uint8_t* out, std::size_t n, const std::string& peer, net::Deadline deadline,
            std::chrono::microseconds spin, int socket_fd);

 private:
  net::SharedMemory memory_;
  std::size_t capacity_;
  std::uint64_t consumed_ = 0;
};

}  // namespace ddp::rpc::transport
