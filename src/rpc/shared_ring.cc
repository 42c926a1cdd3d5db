#include "rpc/shared_ring.h"

#include <poll.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstring>
#include <random>
#include <thread>

#include <fmt/format.h>

#include "ddp/error.h"
#include "net/fd_io.h"

namespace ddp::rpc::transport {
namespace {

constexpr std::uint64_t kRingMagic = 0x474e495243505244ULL;  // "DRPCRING" in memory
constexpr std::uint32_t kRingVersion = 1;
constexpr std::size_t kMaxPathBytes = 64;
constexpr std::size_t kMaxDomainBytes = 512;
constexpr std::size_t kMaxRefusalBytes = 1024;
// The writer publishes what it copied every so many bytes: the reader copies out behind it.
constexpr std::size_t kPublishBytes = std::size_t{64} << 10;

// The ring's first page. The writer fills every field before it offers the ring, and afterwards
// writes only `written`; the reader writes only `consumed`. Each counter has its own cache line.
struct RingHeader {
  std::uint64_t magic;
  std::uint32_t version;
  std::uint32_t reserved;
  std::uint64_t capacity;
  RingNonce nonce;
  alignas(64) std::uint64_t written;
  // The reader sleeps on `wake` (a futex) once it has spun, saying so in `sleeping`; the writer
  // then bumps and wakes it with what it publishes.
  std::uint32_t wake;
  std::uint32_t sleeping;
  alignas(64) std::uint64_t consumed;
};
static_assert(sizeof(RingHeader) <= kRingHeaderBytes);
// tests/rpc/shared_ring_test.cc writes the counters where a hostile peer would.
static_assert(offsetof(RingHeader, written) == 64 && offsetof(RingHeader, consumed) == 128);

RingHeader& header_of(const net::SharedMemory& memory) {
  return *reinterpret_cast<RingHeader*>(memory.data());
}

std::atomic_ref<std::uint64_t> counter(std::uint64_t& word) {
  return std::atomic_ref<std::uint64_t>(word);
}
std::atomic_ref<std::uint32_t> flag(std::uint32_t& word) {
  return std::atomic_ref<std::uint32_t>(word);
}

// Little-endian fields of an offer or answer, read with their lengths checked.
class Writer {
 public:
  template <typename T>
  void put(T value) {
    const auto* p = reinterpret_cast<const char*>(&value);
    out_.append(p, sizeof value);
  }
  void text(const std::string& value) {
    put(static_cast<std::uint16_t>(value.size()));
    out_ += value;
  }
  void raw(const RingNonce& nonce) { out_.append(reinterpret_cast<const char*>(nonce.data()), 16); }
  std::string take() { return std::move(out_); }

 private:
  std::string out_;
};

class Reader {
 public:
  Reader(std::span<const std::uint8_t> bytes, std::string what, const std::string& peer)
      : bytes_(bytes), what_(std::move(what)), peer_(peer) {}
  template <typename T>
  T take() {
    need(sizeof(T));
    T value;
    std::memcpy(&value, bytes_.data() + at_, sizeof value);
    at_ += sizeof value;
    return value;
  }
  std::string text(std::size_t limit, const char* field) {
    const auto n = take<std::uint16_t>();
    if (n > limit) {
      throw fail(fmt::format("has a {} of {} bytes, more than the limit of {}", field, n, limit));
    }
    need(n);
    std::string value(reinterpret_cast<const char*>(bytes_.data() + at_), n);
    at_ += n;
    return value;
  }
  RingNonce nonce() {
    need(16);
    RingNonce value;
    std::memcpy(value.data(), bytes_.data() + at_, 16);
    at_ += 16;
    return value;
  }
  void end() {
    if (at_ != bytes_.size()) {
      throw fail(fmt::format("has {} bytes after its last field", bytes_.size() - at_));
    }
  }
  ProtocolError fail(const std::string& what) const {
    return ProtocolError(
        fmt::format("rpc: {} from {} {}; the connection is closed", what_, peer_, what));
  }

 private:
  void need(std::size_t n) {
    if (bytes_.size() - at_ < n) throw fail("ends before its fields do");
  }
  std::span<const std::uint8_t> bytes_;
  std::size_t at_ = 0;
  std::string what_;
  const std::string& peer_;
};

void check_capacity(std::uint64_t capacity) {
  if (capacity < kMinRingBytes || capacity > kMaxRingBytes || capacity % kRingHeaderBytes != 0) {
    throw ConfigError(fmt::format(
        "rpc: a shared-memory ring of {} bytes: it must be a multiple of {} from {} to {} "
        "(RpcOptions::shared_memory_bytes; 0 turns the rings off)",
        capacity, kRingHeaderBytes, kMinRingBytes, kMaxRingBytes));
  }
}

}  // namespace

std::string encode_ring_offer(const RingOffer& offer) {
  Writer w;
  w.raw(offer.nonce);
  w.put(offer.capacity);
  w.text(offer.path);
  w.text(offer.domain);
  return w.take();
}

RingOffer decode_ring_offer(std::span<const std::uint8_t> bytes, const std::string& peer) {
  Reader r(bytes, "a shared-memory offer", peer);
  RingOffer offer;
  offer.nonce = r.nonce();
  offer.capacity = r.take<std::uint64_t>();
  offer.path = r.text(kMaxPathBytes, "path");
  offer.domain = r.text(kMaxDomainBytes, "host identity");
  r.end();
  return offer;
}

std::string encode_ring_answer(const RingAnswer& answer) {
  Writer w;
  w.raw(answer.nonce);
  w.text(answer.refusal.substr(0, kMaxRefusalBytes));
  return w.take();
}

RingAnswer decode_ring_answer(std::span<const std::uint8_t> bytes, const std::string& peer) {
  Reader r(bytes, "a shared-memory answer", peer);
  RingAnswer answer;
  answer.nonce = r.nonce();
  answer.refusal = r.text(kMaxRefusalBytes, "reason");
  r.end();
  return answer;
}

RingWriter::RingWriter(std::size_t capacity) : capacity_(capacity) {
  check_capacity(capacity);
  memory_ = net::SharedMemory::make("ddp-rpc-ring", kRingHeaderBytes + capacity);
  std::random_device random;
  for (auto& b : nonce_)
    b = static_cast<std::uint8_t>(random());
  RingHeader& h = header_of(memory_);
  h.version = kRingVersion;
  h.capacity = capacity;
  h.nonce = nonce_;
  counter(h.magic).store(kRingMagic, std::memory_order_release);
}

RingOffer RingWriter::offer(const std::string& domain) const {
  return RingOffer{nonce_, capacity_, memory_.path(), domain};
}

bool RingWriter::has_room(std::size_t total, bool& damaged) {
  RingHeader& h = header_of(memory_);
  const std::uint64_t consumed = counter(h.consumed).load(std::memory_order_acquire);
  if (consumed < consumed_ || consumed > written_) {
    damaged = true;
    return false;
  }
  consumed_ = consumed;
  return total <= capacity_ - (written_ - consumed_);
}

void RingWriter::append(std::span<const std::uint8_t> bytes) {
  RingHeader& h = header_of(memory_);
  std::byte* data = memory_.data() + kRingHeaderBytes;
  std::size_t done = 0;
  while (done < bytes.size()) {
    const std::size_t pos = written_ % capacity_;
    const std::size_t n = std::min({bytes.size() - done, capacity_ - pos, kPublishBytes});
    std::memcpy(data + pos, bytes.data() + done, n);
    done += n;
    written_ += n;
    // seq_cst, as the reader's store to `sleeping` and load of `written`: either it sees these
    // bytes before it sleeps, or this sees it sleeping.
    counter(h.written).store(written_, std::memory_order_seq_cst);
    if (flag(h.sleeping).load(std::memory_order_seq_cst) != 0) {
      flag(h.wake).fetch_add(1, std::memory_order_seq_cst);
      net::futex_wake_all(&h.wake);
    }
  }
}

RingReader::RingReader(const RingOffer& offer, const std::string& domain)
    : capacity_(offer.capacity) {
  if (domain.empty() || offer.domain != domain) {
    throw Error(
        "its maker is on another host or in another pid namespace (or DDP_HOST_ID differs)");
  }
  try {
    check_capacity(offer.capacity);
  } catch (const ConfigError& e) {
    throw Error(e.what());
  }
  memory_ = net::SharedMemory::open(offer.path, kRingHeaderBytes + capacity_);
  RingHeader& h = header_of(memory_);
  if (counter(h.magic).load(std::memory_order_acquire) != kRingMagic || h.version != kRingVersion ||
      h.capacity != capacity_ || h.nonce != offer.nonce ||
      counter(h.consumed).load(std::memory_order_relaxed) != 0) {
    throw Error(fmt::format("{} is not the ring offered (its header differs)", offer.path));
  }
}

void RingReader::read(std::uint8_t* out, std::size_t n, const std::string& peer,
                      net::Deadline deadline, std::chrono::microseconds spin, int socket_fd) {
  RingHeader& h = header_of(memory_);
  const std::byte* data = memory_.data() + kRingHeaderBytes;
  if (n > capacity_) {
    throw ProtocolError(fmt::format(
        "rpc: {} sent a frame of {} bytes in a shared-memory ring of {}; the connection is closed",
        peer, n, capacity_));
  }
  const auto spin_until = std::chrono::steady_clock::now() + spin;
  while (n > 0) {
    const std::uint64_t written = counter(h.written).load(std::memory_order_acquire);
    if (written < consumed_ || written - consumed_ > capacity_) {
      throw ProtocolError(fmt::format(
          "rpc: {} counts {} bytes written into its shared-memory ring of {}, of which this "
          "worker read {}; the connection is closed",
          peer, written, capacity_, consumed_));
    }
    if (written == consumed_) {
      // The writer is copying the payload in: it sent the frame first.
      const auto now = std::chrono::steady_clock::now();
      if (now >= deadline) {
        throw TimeoutError(fmt::format(
            "rpc: {} did not write the {} bytes left of a payload into its shared-memory ring "
            "before the frame's deadline",
            peer, n));
      }
      if (now < spin_until) {
        std::this_thread::yield();
        continue;
      }
      const std::uint32_t wake = flag(h.wake).load(std::memory_order_seq_cst);
      flag(h.sleeping).store(1, std::memory_order_seq_cst);
      if (counter(h.written).load(std::memory_order_seq_cst) == consumed_) {
        // A millisecond at most: then whether the writer is still there.
        net::futex_wait(&h.wake, wake, std::chrono::milliseconds(1));
      }
      flag(h.sleeping).store(0, std::memory_order_relaxed);
      pollfd p{socket_fd, POLLRDHUP, 0};
      if (net::poll_fds({&p, 1}, 0) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR)) != 0) {
        throw Error(fmt::format(
            "rpc: {} closed the connection with {} bytes of a payload still to write", peer, n));
      }
      continue;
    }
    const std::size_t pos = consumed_ % capacity_;
    const std::size_t take =
        std::min({static_cast<std::size_t>(written - consumed_), n, capacity_ - pos});
    std::memcpy(out, data + pos, take);
    out += take;
    n -= take;
    consumed_ += take;
    counter(h.consumed).store(consumed_, std::memory_order_release);
  }
}

}  // namespace ddp::rpc::transport
