// The shared-memory lane of an RPC connection (src/rpc/shared_ring.h) within one process: bytes
// cross intact while the ring wraps, a reader copies behind a writer that publishes as it goes,
// sleeps and wakes when the writer is slow, and gives up by name at its deadline or when the
// writer's connection closes; every offer that is not the ring offered is refused unmapped, and
// a count that cannot be is refused on both sides.
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "ddp/error.h"
#include "net/shared_memory.h"
#include "rpc/shared_ring.h"

namespace ddp::rpc::transport {
namespace {

using namespace std::chrono_literals;

constexpr std::size_t kCapacity = kMinRingBytes;
const std::string kDomain = "boot|pid:[1]|";

// A connected pair of sockets: the reader watches one end for the writer's.
struct SocketPair {
  int fds[2] = {-1, -1};
  SocketPair() { EXPECT_EQ(::socketpair(AF_UNIX, SOCK_STREAM, 0, fds), 0); }
  ~SocketPair() {
    for (int fd : fds)
      if (fd >= 0) ::close(fd);
  }
};

std::vector<std::uint8_t> pattern(std::size_t n, std::uint8_t seed) {
  std::vector<std::uint8_t> bytes(n);
  for (std::size_t i = 0; i < n; ++i)
    bytes[i] = static_cast<std::uint8_t>(seed + i * 7 + (i >> 9));
  return bytes;
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "no error";
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

TEST(RpcSharedRing, BytesCrossIntactWhileTheRingWrapsAndAFullRingSaysSo) {
  RingWriter writer(kCapacity);
  RingReader reader(writer.offer(kDomain), kDomain);
  SocketPair sockets;
  const auto deadline = net::deadline_after(5s);
  std::uint8_t seed = 0;
  // Sizes that do not divide the capacity: the payloads straddle its end again and again.
  for (std::size_t size : {std::size_t{1}, std::size_t{4095}, std::size_t{40000},
                           std::size_t{30001}, kCapacity, std::size_t{12345}}) {
    for (int round = 0; round < 5; ++round, ++seed) {
      const auto in = pattern(size, seed);
      bool damaged = false;
      ASSERT_TRUE(writer.has_room(in.size(), damaged));
      writer.append(in);
      std::vector<std::uint8_t> out(size);
      reader.read(out.data(), out.size(), "peer", deadline, 0us, sockets.fds[0]);
      ASSERT_EQ(out, in) << "size " << size << " round " << round;
      EXPECT_FALSE(damaged);
    }
  }
  // Full until the reader has copied out.
  bool damaged = false;
  ASSERT_TRUE(writer.has_room(kCapacity / 2, damaged));
  writer.append(pattern(kCapacity / 2, 1));
  EXPECT_FALSE(writer.has_room(kCapacity / 2 + 1, damaged));
  EXPECT_TRUE(writer.has_room(kCapacity / 2, damaged));
  std::vector<std::uint8_t> out(kCapacity / 2);
  reader.read(out.data(), out.size(), "peer", deadline, 0us, sockets.fds[0]);
  EXPECT_TRUE(writer.has_room(kCapacity, damaged));
  EXPECT_FALSE(damaged);
}

TEST(RpcSharedRing, AReaderCopiesBehindAWriterAndSleepsUntilItPublishes) {
  constexpr std::size_t kBig = std::size_t{1} << 20;
  RingWriter writer(kBig);
  RingReader reader(writer.offer(kDomain), kDomain);
  SocketPair sockets;
  for (const auto spin : {0us, 100us}) {
    const auto in = pattern(kBig, 3);
    std::thread write([&] {
      // Late, so that the reader has gone to sleep (with spin 0 at once).
      std::this_thread::sleep_for(30ms);
      bool damaged = false;
      ASSERT_TRUE(writer.has_room(in.size(), damaged));
      writer.append({in.data(), in.size() / 3});
      std::this_thread::sleep_for(10ms);
      writer.append({in.data() + in.size() / 3, in.size() - in.size() / 3});
    });
    std::vector<std::uint8_t> out(kBig);
    const auto start = std::chrono::steady_clock::now();
    reader.read(out.data(), out.size(), "peer", net::deadline_after(10s), spin, sockets.fds[0]);
    const auto took = std::chrono::steady_clock::now() - start;
    write.join();
    EXPECT_EQ(out, in) << "spin " << spin.count();
    EXPECT_LT(took, 2s) << "the sleeping reader was not woken";
  }
}

TEST(RpcSharedRing, AReaderGivesUpAtItsDeadlineAndWhenTheWritersConnectionCloses) {
  RingWriter writer(kCapacity);
  RingReader reader(writer.offer(kDomain), kDomain);
  std::vector<std::uint8_t> out(100);
  {
    SocketPair sockets;
    const auto start = std::chrono::steady_clock::now();
    const std::string timeout = error_of([&] {
      reader.read(out.data(), out.size(), "worker 'w' (rank 1)", net::deadline_after(100ms), 50us,
                  sockets.fds[0]);
    });
    EXPECT_TRUE(contains(timeout, "did not write the 100 bytes") &&
                contains(timeout, "worker 'w' (rank 1)"))
        << timeout;
    EXPECT_LT(std::chrono::steady_clock::now() - start, 2s);
  }
  {
    SocketPair sockets;
    std::thread close([&] {
      std::this_thread::sleep_for(30ms);
      ::close(sockets.fds[1]);
      sockets.fds[1] = -1;
    });
    const auto start = std::chrono::steady_clock::now();
    const std::string closed = error_of([&] {
      reader.read(out.data(), out.size(), "worker 'w' (rank 1)", net::deadline_after(30s), 0us,
                  sockets.fds[0]);
    });
    close.join();
    EXPECT_TRUE(contains(closed, "closed the connection with 100 bytes")) << closed;
    EXPECT_LT(std::chrono::steady_clock::now() - start, 2s) << "waited for the deadline";
  }
}

// The ring's counters, where a hostile peer can write them (the layout of shared_ring.cc).
constexpr std::size_t kWrittenAt = 64, kConsumedAt = 128;

TEST(RpcSharedRing, ACountThatCannotBeIsRefusedOnBothSides) {
  RingWriter writer(kCapacity);
  const RingOffer offer = writer.offer(kDomain);
  RingReader reader(offer, kDomain);
  // A third mapping plays the hostile side.
  net::SharedMemory other = net::SharedMemory::open(offer.path, kRingHeaderBytes + kCapacity);
  auto* written = reinterpret_cast<std::uint64_t*>(other.data() + kWrittenAt);
  auto* consumed = reinterpret_cast<std::uint64_t*>(other.data() + kConsumedAt);
  SocketPair sockets;
  std::vector<std::uint8_t> out(10);

  *written = kCapacity + 5;  // more than the ring holds
  const std::string too_much = error_of([&] {
    reader.read(out.data(), out.size(), "peer p", net::deadline_after(1s), 0us, sockets.fds[0]);
  });
  EXPECT_TRUE(contains(too_much, "counts") && contains(too_much, "peer p")) << too_much;
  const std::string too_big = error_of([&] {
    std::vector<std::uint8_t> big(kCapacity + 1);
    reader.read(big.data(), big.size(), "peer p", net::deadline_after(1s), 0us, sockets.fds[0]);
  });
  EXPECT_TRUE(contains(too_big, "in a shared-memory ring of")) << too_big;

  bool damaged = false;
  *consumed = 1;  // more than was written
  EXPECT_FALSE(writer.has_room(1, damaged));
  EXPECT_TRUE(damaged);
}

TEST(RpcSharedRing, EveryOfferThatIsNotTheRingOfferedIsRefusedUnmapped) {
  RingWriter writer(kCapacity);
  const RingOffer good = writer.offer(kDomain);

  RingOffer other_host = good;
  other_host.domain = "another boot|pid:[1]|";
  EXPECT_TRUE(contains(error_of([&] { RingReader r(other_host, kDomain); }), "another host"));
  EXPECT_TRUE(contains(error_of([&] { RingReader r(good, ""); }), "another host"));

  RingOffer wrong_nonce = good;
  wrong_nonce.nonce[0] ^= 1;
  EXPECT_TRUE(
      contains(error_of([&] { RingReader r(wrong_nonce, kDomain); }), "not the ring offered"));

  RingOffer wrong_size = good;
  wrong_size.capacity = kCapacity * 2;
  EXPECT_TRUE(contains(error_of([&] { RingReader r(wrong_size, kDomain); }), "not the"));
  wrong_size.capacity = kCapacity + 1;
  EXPECT_TRUE(contains(error_of([&] { RingReader r(wrong_size, kDomain); }), "must be a multiple"));

  RingOffer not_proc = good;
  not_proc.path = "/etc/passwd";
  EXPECT_TRUE(contains(error_of([&] { RingReader r(not_proc, kDomain); }),
                       "not a path of the form /proc/<pid>/fd/<fd>"));

  // A pipe, and a regular file that is not sealed shared memory, both through /proc.
  int pipe_fds[2];
  ASSERT_EQ(::pipe(pipe_fds), 0);
  RingOffer pipe = good;
  pipe.path = "/proc/" + std::to_string(::getpid()) + "/fd/" + std::to_string(pipe_fds[0]);
  EXPECT_TRUE(contains(error_of([&] { RingReader r(pipe, kDomain); }), "is not shared memory"));
  ::close(pipe_fds[0]);
  ::close(pipe_fds[1]);
  std::FILE* file = std::tmpfile();
  ASSERT_NE(file, nullptr);
  ASSERT_EQ(::ftruncate(::fileno(file), static_cast<off_t>(kRingHeaderBytes + kCapacity)), 0);
  RingOffer plain = good;
  plain.path = "/proc/" + std::to_string(::getpid()) + "/fd/" + std::to_string(::fileno(file));
  EXPECT_TRUE(
      contains(error_of([&] { RingReader r(plain, kDomain); }), "not sealed shared memory"));
  std::fclose(file);

  // Once the writer closed its descriptor, nobody can open the ring any more.
  writer.close_descriptor();
  EXPECT_TRUE(contains(error_of([&] { RingReader r(good, kDomain); }), "cannot"));
}

TEST(RpcSharedRing, OffersAndAnswersRoundTripAndDamagedOnesAreNamed) {
  RingOffer offer{{1, 2, 3}, kCapacity, "/proc/12/fd/34", kDomain};
  const std::string bytes = encode_ring_offer(offer);
  const auto span = [](const std::string& s) {
    return std::span<const std::uint8_t>(reinterpret_cast<const std::uint8_t*>(s.data()), s.size());
  };
  const RingOffer back = decode_ring_offer(span(bytes), "peer");
  EXPECT_EQ(back.nonce, offer.nonce);
  EXPECT_EQ(back.capacity, offer.capacity);
  EXPECT_EQ(back.path, offer.path);
  EXPECT_EQ(back.domain, offer.domain);
  EXPECT_TRUE(contains(error_of([&] { decode_ring_offer(span(bytes.substr(0, 20)), "peer q"); }),
                       "ends before its fields do"));
  EXPECT_TRUE(contains(error_of([&] { decode_ring_offer(span(bytes + "x"), "peer q"); }),
                       "1 bytes after its last field"));
  RingOffer long_path = offer;
  long_path.path = std::string(200, '/');
  EXPECT_TRUE(
      contains(error_of([&] { decode_ring_offer(span(encode_ring_offer(long_path)), "peer q"); }),
               "path of 200 bytes"));

  const RingAnswer answer{{9}, "no room"};
  const RingAnswer answer_back = decode_ring_answer(span(encode_ring_answer(answer)), "peer");
  EXPECT_EQ(answer_back.nonce, answer.nonce);
  EXPECT_EQ(answer_back.refusal, "no room");
  EXPECT_TRUE(contains(error_of([&] { decode_ring_answer(span(std::string(17, 'a')), "peer"); }),
                       "a shared-memory answer from peer ends before its fields do"));
}

}  // namespace
}  // namespace ddp::rpc::transport
