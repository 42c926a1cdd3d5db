// The ring backend's mesh connects by pattern and on first use (issue 28): a group holds O(log N)
// connections after creation and its usual collectives add none; alltoall and gather connect the
// other peers when they first need them; a peer that died before its first connection is a named
// error within the timeout; a stranger on the lazy path is refused and logged. Point to point
// holds no connection at creation and one per peer it exchanges messages with. Real processes on
// 127.0.0.1 over TCP.
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <bit>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <sstream>
#include <string>
#include <thread>

#include "comm/comm_test_util.h"
#include "comm/ring/mesh.h"
#include "comm/ring/mesh_handshake.h"
#include "comm/wire.h"
#include "net/socket.h"
#include "support/multiprocess.h"
#include "support/unity_namespace.h"

namespace ddp::test {
namespace {
namespace DDP_UNITY_ID {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

constexpr const char* kSecret = "correct horse battery staple";

TEST(PatternPeers, SymmetricAndLogarithmic) {
  for (int size = 1; size <= 600; ++size) {
    std::vector<std::vector<int>> of(static_cast<std::size_t>(size));
    for (int r = 0; r < size; ++r)
      of[static_cast<std::size_t>(r)] = comm::pattern_peers(r, size);
    const int log2 = std::bit_width(static_cast<unsigned>(size));
    for (int r = 0; r < size; ++r) {
      const auto& mine = of[static_cast<std::size_t>(r)];
      ASSERT_LE(static_cast<int>(mine.size()), 3 * log2 + 1) << "rank " << r << " of " << size;
      for (const int p : mine) {
        ASSERT_NE(p, r);
        const auto& theirs = of[static_cast<std::size_t>(p)];
        // Symmetric: open() connects each pair from both sides or from neither.
        ASSERT_TRUE(std::binary_search(theirs.begin(), theirs.end(), r))
            << "rank " << r << " names " << p << " but not the reverse, size " << size;
      }
      // The ring's neighbours are there.
      if (size > 1) {
        ASSERT_TRUE(std::binary_search(mine.begin(), mine.end(), (r + 1) % size));
        ASSERT_TRUE(std::binary_search(mine.begin(), mine.end(), (r + size - 1) % size));
      }
    }
  }
}

void expect(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error(what);
}

// World 8 over TCP: O(log N) connections after creation, none added by allreduce (both
// algorithms), broadcast (tree and chain, any root), reduce, allgather, reduce_scatter and
// barrier; alltoall connects everyone on first use and computes correctly; point to point to a
// peer outside the pattern works.
TEST(LazyMesh, PatternAtCreationOthersOnFirstUse) {
  constexpr int kWorld = 8;
  TempDir dir;
  auto results = run_ranks(kWorld, [&](int rank) {
    auto pg = make_group(dir.path(), rank, kWorld, {.timeout = 30s, .transport = Transport::kTcp});
    const int pattern = static_cast<int>(comm::pattern_peers(rank, kWorld).size());
    const int at_creation = ring_collective_connections_of(*pg);
    expect(at_creation == pattern,
           fmt::format("rank {}: {} connections after creation, expected {}", rank, at_creation,
                       pattern));
    expect(at_creation < kWorld - 1, "the pattern is the full mesh");
    for (const std::size_t count : {std::size_t{16}, std::size_t{1} << 18}) {
      std::vector<float> data(count, static_cast<float>(rank + 1));
      pg->allreduce(data.data(), count, DType::kFloat32, ReduceOp::kSum)->wait();
      expect(data[count - 1] == 36.0f, "allreduce is wrong");
      for (int root = 0; root < kWorld; ++root) {
        std::vector<float> b(count, rank == root ? 7.0f : 0.0f);
        pg->broadcast(b.data(), count, DType::kFloat32, root)->wait();
        expect(b[count - 1] == 7.0f, "broadcast is wrong");
      }
      std::vector<float> red(count);
      pg->reduce(data.data(), red.data(), count, DType::kFloat32, ReduceOp::kSum, 3)->wait();
    }
    std::vector<float> all(kWorld * 4);
    std::vector<float> mine(4, static_cast<float>(rank));
    pg->allgather(mine.data(), all.data(), 4, DType::kFloat32)->wait();
    std::vector<float> in(kWorld * 4, 1.0f), out(4);
    pg->reduce_scatter(in.data(), out.data(), 4, DType::kFloat32, ReduceOp::kSum)->wait();
    pg->barrier()->wait();
    const int after_pattern_calls = ring_collective_connections_of(*pg);
    expect(after_pattern_calls == pattern,
           fmt::format("rank {}: {} connections after the pattern's calls, expected {}", rank,
                       after_pattern_calls, pattern));
    // Alltoall needs every peer.
    std::vector<int> send(kWorld * 3), recv(kWorld * 3, -1);
    for (int p = 0; p < kWorld; ++p)
      for (int i = 0; i < 3; ++i)
        send[static_cast<std::size_t>(p * 3 + i)] = rank * 100 + p * 10 + i;
    pg->alltoall(send.data(), recv.data(), 3, DType::kInt32)->wait();
    for (int p = 0; p < kWorld; ++p)
      for (int i = 0; i < 3; ++i)
        expect(recv[static_cast<std::size_t>(p * 3 + i)] == p * 100 + rank * 10 + i,
               fmt::format("rank {}: alltoall block from {} is wrong", rank, p));
    expect(ring_collective_connections_of(*pg) == kWorld - 1, "alltoall did not connect everyone");
    pg->alltoall(send.data(), recv.data(), 3, DType::kInt32)->wait();  // on the same connections
    // Point to point with a peer outside the pattern (rank +- 3).
    const int to = (rank + 3) % kWorld;
    const int from = (rank + kWorld - 3) % kWorld;
    std::vector<int> message(1000, rank), got(1000, -1);
    auto sent = pg->send(message.data(), message.size(), DType::kInt32, to, 9);
    pg->recv(got.data(), got.size(), DType::kInt32, from, 9)->wait();
    sent->wait();
    expect(got == std::vector<int>(1000, from), "recv from a peer outside the pattern is wrong");
  });
  EXPECT_ALL_RANKS_OK(results);
}

// Whether a socket listens on 127.0.0.1 or any address at `port` (/proc/net/tcp, this network
// namespace).
bool listens_on(int port) {
  std::ifstream table("/proc/self/net/tcp");
  std::string line;
  std::getline(table, line);  // the header
  while (std::getline(table, line)) {
    std::istringstream row(line);
    std::string slot, local, remote, state;
    row >> slot >> local >> remote >> state;
    const auto colon = local.find(':');
    if (colon != std::string::npos && state == "0A" &&
        std::stoi(local.substr(colon + 1), nullptr, 16) == port)
      return true;
  }
  return false;
}

// The port of the collective mesh's listener that `rank` published for the first incarnation of
// the group "default".
int published_port(const std::filesystem::path& dir, int rank) {
  FileStore store(dir);
  const std::string address =
      store.get_string(fmt::format("ring/default/0/addr/{}", rank), std::chrono::seconds(10));
  return std::stoi(address.substr(address.rfind(':') + 1));
}

// A rank's collective listener is open only while a rank above it has yet to connect (on first
// use): after creation exactly the ranks with a lazy peer above still listen, and after an
// alltoall (every peer connected) none does, a connection to the port is refused, and the group
// goes on working.
TEST(LazyMesh, ListenerStopsOnceEveryRankAboveHasConnected) {
  constexpr int kWorld = 8;
  TempDir dir;
  auto results = run_ranks(kWorld, [&](int rank) {
    auto pg = make_group(dir.path(), rank, kWorld, {.timeout = 30s, .transport = Transport::kTcp});
    const auto pattern = comm::pattern_peers(rank, kWorld);
    bool lazy_above = false;
    for (int p = rank + 1; p < kWorld; ++p)
      lazy_above = lazy_above || !std::binary_search(pattern.begin(), pattern.end(), p);
    const int port = published_port(dir.path(), rank);
    expect(listens_on(port) == lazy_above,
           fmt::format("rank {}: listening {} after creation, with a lazy peer above: {}", rank,
                       listens_on(port), lazy_above));
    // Every rank looks before any connects on first use: a fast rank above would otherwise close
    // a slow rank's listener before that rank looked (seen once under ASan on a loaded host).
    FileStore store(dir.path(), 30s);
    store.set(fmt::format("looked/{}", rank), "1");
    std::vector<std::string> looked;
    for (int r = 0; r < kWorld; ++r)
      looked.push_back(fmt::format("looked/{}", r));
    store.wait(looked, 30s);
    std::vector<int> send(kWorld, rank), recv(kWorld, -1);
    pg->alltoall(send.data(), recv.data(), 1, DType::kInt32)->wait();
    expect(!listens_on(port), fmt::format("rank {}: still listening after the alltoall", rank));
    const int probe = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_port = htons(static_cast<std::uint16_t>(port));
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    const int connected = ::connect(probe, reinterpret_cast<sockaddr*>(&address), sizeof address);
    const int error = errno;
    ::close(probe);
    expect(connected != 0 && error == ECONNREFUSED,
           fmt::format("rank {}: a connection to the shut port was not refused", rank));
    std::vector<float> values(1000, static_cast<float>(rank + 1));
    pg->allreduce(values.data(), values.data(), values.size(), DType::kFloat32, ReduceOp::kSum)
        ->wait();
    expect(values == std::vector<float>(1000, kWorld * (kWorld + 1) / 2.0f),
           fmt::format("rank {}: the allreduce after the listener stopped is wrong", rank));
  });
  EXPECT_ALL_RANKS_OK(results);
}

// Gather and scatter at a root connect only the root's missing peers; a secret changes nothing.
TEST(LazyMesh, GatherAndScatterConnectOnFirstUseWithSecret) {
  constexpr int kWorld = 6;  // rank 0's pattern lacks rank 3
  TempDir dir;
  auto results = run_ranks(kWorld, [&](int rank) {
    RingOptions options{.timeout = 30s, .transport = Transport::kTcp};
    options.secret = kSecret;
    auto pg = make_group(dir.path(), rank, kWorld, options);
    const auto pattern = comm::pattern_peers(rank, kWorld);
    std::vector<float> mine(5, static_cast<float>(rank)), all(kWorld * 5, -1.0f);
    pg->gather(mine.data(), rank == 0 ? all.data() : nullptr, 5, DType::kFloat32, 0)->wait();
    if (rank == 0) {
      for (int p = 0; p < kWorld; ++p)
        expect(all[static_cast<std::size_t>(p * 5)] == static_cast<float>(p), "gather is wrong");
      expect(ring_collective_connections_of(*pg) == kWorld - 1, "the root is not connected");
    } else {
      const bool had_root = std::binary_search(pattern.begin(), pattern.end(), 0);
      expect(ring_collective_connections_of(*pg) ==
                 static_cast<int>(pattern.size()) + (had_root ? 0 : 1),
             "gather connected more than the root");
    }
    std::vector<float> part(5, -1.0f);
    pg->scatter(rank == 0 ? all.data() : nullptr, part.data(), 5, DType::kFloat32, 0)->wait();
    expect(part[0] == static_cast<float>(rank), "scatter is wrong");
  });
  EXPECT_ALL_RANKS_OK(results);
}

// Rank 3 of 8 leaves after a barrier (which never connects it to rank 0, outside its pattern);
// rank 0's alltoall then waits for rank 3 to connect: a CommError naming rank 3 within the
// group's timeout, never a hang. The others fail too, each with a named error.
TEST(LazyMesh, PeerThatDiedBeforeItsFirstConnectionIsANamedError) {
  constexpr int kWorld = 8;
  constexpr auto kTimeout = 4s;
  TempDir dir;
  auto results = run_ranks(
      kWorld,
      [&](int rank) {
        auto pg = make_group(dir.path(), rank, kWorld,
                             {.timeout = kTimeout, .transport = Transport::kTcp});
        const auto pattern = comm::pattern_peers(0, kWorld);
        expect(!std::binary_search(pattern.begin(), pattern.end(), 3), "3 is in 0's pattern");
        pg->barrier()->wait();
        if (rank == 3) ::_exit(0);
        std::vector<int> send(kWorld, rank), recv(kWorld);
        const auto start = Clock::now();
        try {
          pg->alltoall(send.data(), recv.data(), 1, DType::kInt32)->wait();
        } catch (const CommError& e) {
          const auto took = Clock::now() - start;
          expect(took < kTimeout + 3s,
                 fmt::format("rank {} failed after {} ms", rank,
                             std::chrono::duration_cast<std::chrono::milliseconds>(took).count()));
          if (rank != 0) return;
          const std::string what = e.what();
          expect(e.peer() == 3, fmt::format("peer() is {}, not 3: {}", e.peer(), what));
          expect(what.find("rank(s) 3 to open their first connection") != std::string::npos,
                 "the error does not say rank 3 never connected: " + what);
          expect(what.find("alltoall") != std::string::npos, "the error lacks the call: " + what);
          return;
        }
        throw std::runtime_error("alltoall with a dead rank succeeded");
      },
      60s);
  for (int r = 0; r < kWorld; ++r)
    EXPECT_TRUE(results[static_cast<std::size_t>(r)].ok()) << describe(results);
}

// Rank 3 of 6 is in the middle of its first connection to rank 0 (outside its pattern) for an
// alltoall when rank 0, which issued an allreduce instead, finds the mismatch and fails: rank 0
// shuts its listener with its connections, so rank 3's handshake is reset and it fails at once
// naming rank 0, instead of waiting for an answer until its deadline.
TEST(LazyMesh, ConnectorToAFailedRankFailsAtOnce) {
  constexpr int kWorld = 6;
  constexpr auto kTimeout = 20s;
  TempDir dir;
  auto results = run_ranks(
      kWorld,
      [&](int rank) {
        auto pg = make_group(dir.path(), rank, kWorld,
                             {.timeout = kTimeout, .transport = Transport::kTcp});
        const auto pattern = comm::pattern_peers(3, kWorld);
        expect(!std::binary_search(pattern.begin(), pattern.end(), 0), "0 is in 3's pattern");
        pg->barrier()->wait();
        const auto start = Clock::now();
        try {
          if (rank == 0) {
            // Let rank 3's connection reach the backlog and its hello arrive first.
            std::this_thread::sleep_for(1s);
            float x = 1.0f;
            pg->allreduce(&x, 1, DType::kFloat32, ReduceOp::kSum)->wait();
          } else {
            std::vector<int> send(kWorld, rank), recv(kWorld);
            pg->alltoall(send.data(), recv.data(), 1, DType::kInt32)->wait();
          }
        } catch (const CommError& e) {
          // Rank 0 stays alive until rank 3 has failed (or 12 s): its process's exit would reset
          // the connection anyway.
          const auto rank3_done = std::filesystem::path(dir.path()) / "rank3_failed";
          if (rank == 0) {
            const auto patience = Clock::now() + 12s;
            while (!std::filesystem::exists(rank3_done) && Clock::now() < patience)
              std::this_thread::sleep_for(20ms);
          }
          if (rank != 3) return;
          const auto took = Clock::now() - start;
          std::ofstream(rank3_done) << "failed\n";
          expect(took < 10s,
                 fmt::format("rank 3 failed after {} ms: {}",
                             std::chrono::duration_cast<std::chrono::milliseconds>(took).count(),
                             e.what()));
          expect(e.peer() == 0, fmt::format("peer() is {}, not 0: {}", e.peer(), e.what()));
          return;
        }
        throw std::runtime_error("mismatched calls succeeded");
      },
      60s);
  EXPECT_ALL_RANKS_OK(results);
}

// --- A stranger on the lazy path ------------------------------------------------------------

bool closed_by_peer(net::Socket& socket, std::chrono::milliseconds timeout) {
  const auto deadline = net::deadline_after(timeout);
  char buf[256];
  for (;;) {
    pollfd pfd{socket.fd(), POLLIN, 0};
    if (::poll(&pfd, 1, net::poll_timeout_ms(deadline)) <= 0) return false;
    const ssize_t n = ::recv(socket.fd(), buf, sizeof buf, 0);
    if (n <= 0) return true;
  }
}

net::Socket connect_to(const std::string& address) {
  const auto colon = address.rfind(':');
  return net::connect_tcp(address.substr(0, colon),
                          static_cast<std::uint16_t>(std::stoi(address.substr(colon + 1))),
                          net::deadline_after(5s));
}

std::vector<std::uint8_t> hello(std::uint32_t magic, int size, int from, int to) {
  const std::string group = "default";
  comm::Hello h{.magic = magic,
                .version = comm::kProtocolVersion,
                .size = size,
                .from_rank = from,
                .to_rank = to,
                .name_length = static_cast<std::uint32_t>(group.size())};
  std::vector<std::uint8_t> out(sizeof h + group.size());
  std::memcpy(out.data(), &h, sizeof h);
  std::memcpy(out.data() + sizeof h, group.data(), group.size());
  return out;
}

// Ranks 0..5 form a group with a secret; rank 0 waits in an alltoall for rank 3 (outside its
// pattern), which holds back until an attacker (process 6) has tried, on rank 0's listener: random
// bytes, a plain hello claiming rank 3, and an authenticated hello claiming rank 3 followed by a
// guessed MAC. Each is closed and logged; then rank 3 connects and the alltoall is correct.
TEST(LazyMesh, AttackerOnTheLazyPathIsRefusedAndLogged) {
  constexpr int kWorld = 6;
  TempDir dir;
  const std::string log_path = (dir.path() / "rank0.log").string();
  auto results = run_ranks(kWorld + 1, [&](int rank) {
    FileStore store(dir.path(), 30s);
    if (rank == kWorld) {
      store.get("group_ready", 30s);
      const std::string address = store.get_string("ring/default/0/addr/0", 10s);
      std::string failures;
      auto attempt = [&](std::vector<std::uint8_t> bytes, bool read_answer, const char* what) {
        net::Socket socket = connect_to(address);
        socket.send_all(bytes.data(), bytes.size(), net::deadline_after(5s));
        if (read_answer) {
          std::vector<std::uint8_t> answer(sizeof(comm::Hello) + 7 + 64);
          socket.recv_all(answer.data(), answer.size(), net::deadline_after(10s));
          std::vector<std::uint8_t> mac(32, 0x5a);
          socket.send_all(mac.data(), mac.size(), net::deadline_after(5s));
        }
        if (!closed_by_peer(socket, 10s)) failures += std::string(what) + " was kept; ";
      };
      std::vector<std::uint8_t> garbage(512);
      for (std::size_t i = 0; i < garbage.size(); ++i)
        garbage[i] = static_cast<std::uint8_t>(i * 37 + 11);
      attempt(garbage, false, "random bytes");
      attempt(hello(comm::kHandshakeMagic, kWorld, 3, 0), false, "a plain hello");
      auto authenticated = hello(comm::kAuthHandshakeMagic, kWorld, 3, 0);
      authenticated.resize(authenticated.size() + 32, 0x42);  // the connector's nonce
      attempt(authenticated, true, "a guessed MAC");
      store.set("attacks_done", "1");
      expect(failures.empty(), failures);
      return;
    }
    RingOptions options{.timeout = 30s, .transport = Transport::kTcp};
    options.secret = kSecret;
    if (rank == 0) {
      options.log = [log_path](const std::string& line) {
        std::ofstream(log_path, std::ios::app) << line << "\n";
      };
    }
    auto pg = make_group(dir.path(), rank, kWorld, options);
    pg->barrier()->wait();
    if (rank == 0) store.set("group_ready", "1");
    if (rank == 3) store.get("attacks_done", 30s);
    std::vector<int> send(kWorld), recv(kWorld, -1);
    for (int p = 0; p < kWorld; ++p)
      send[static_cast<std::size_t>(p)] = rank * 10 + p;
    pg->alltoall(send.data(), recv.data(), 1, DType::kInt32)->wait();
    for (int p = 0; p < kWorld; ++p)
      expect(recv[static_cast<std::size_t>(p)] == p * 10 + rank, "alltoall is wrong");
    if (rank == 0) {
      std::ifstream in(log_path);
      const std::string lines{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
      int refusals = 0;
      for (auto at = lines.find("refused a connection from 127.0.0.1:"); at != std::string::npos;
           at = lines.find("refused a connection from 127.0.0.1:", at + 1))
        ++refusals;
      expect(refusals == 3,
             fmt::format("rank 0 logged {} refusals, expected 3:\n{}", refusals, lines));
      expect(lines.find("authentication failed") != std::string::npos,
             "the guessed MAC is not logged:\n" + lines);
    }
  });
  EXPECT_ALL_RANKS_OK(results);
}

// Waits until ready() or `limit`; returns ready().
template <typename F>
bool wait_until(F&& ready, std::chrono::milliseconds limit) {
  const auto until = Clock::now() + limit;
  while (!ready() && Clock::now() < until)
    std::this_thread::sleep_for(5ms);
  return ready();
}

// Point to point connects on first use (p2p_connector.h): no connection at creation; a pair that
// exchanges a message holds one, whichever rank needs it first (the lower rank's small send
// completes while the higher is still in a barrier: it knocked, and the higher connected); a
// receive from any source connects its rank with every other. World 4 over TCP.
TEST(LazyPointToPoint, NoConnectionAtCreationThenOnePerPeerUsed) {
  constexpr int kWorld = 4;
  TempDir dir;
  auto results = run_ranks(kWorld, [&](int rank) {
    auto pg = make_group(dir.path(), rank, kWorld, {.timeout = 30s, .transport = Transport::kTcp});
    auto connections = [&] { return ring_point_to_point_connections_of(*pg); };
    expect(connections() == 0, fmt::format("rank {}: {} point-to-point connections after creation",
                                           rank, connections()));
    pg->barrier()->wait();
    std::int32_t value = 0;
    if (rank == 0) {  // the lower rank first, waiting for its send alone
      const std::int32_t x = 70;
      pg->send(&x, 1, DType::kInt32, 2, 0)->wait();
    }
    pg->barrier()->wait();
    if (rank == 2) {
      pg->recv(&value, 1, DType::kInt32, 0, 0)->wait();
      expect(value == 70, fmt::format("rank 2 received {} from rank 0", value));
    }
    if (rank == 3) {  // the higher rank first
      const std::int32_t x = 31;
      pg->send(&x, 1, DType::kInt32, 1, 1)->wait();
    }
    if (rank == 1) {
      pg->recv(&value, 1, DType::kInt32, 3, 1)->wait();
      expect(value == 31, fmt::format("rank 1 received {} from rank 3", value));
    }
    pg->barrier()->wait();
    expect(connections() == 1, fmt::format("rank {}: {} connections after one exchange, expected 1",
                                           rank, connections()));
    pg->barrier()->wait();  // every rank counted before the next step connects more
    if (rank == 0) {
      const std::int32_t x = 1;
      pg->send(&x, 1, DType::kInt32, 1, 2)->wait();
    }
    if (rank == 1) {
      int source = -1;
      pg->recv_any_source(&value, 1, DType::kInt32, &source, 2)->wait();
      expect(source == 0 && value == 1,
             fmt::format("rank 1 received {} from rank {} from any source", value, source));
    }
    // 0-2 and 1-3, then rank 1 with everyone: 0-1 and 1-2.
    const int expected[kWorld] = {2, 3, 2, 1};
    const bool reached = wait_until([&] { return connections() == expected[rank]; }, 10s);
    expect(reached, fmt::format("rank {}: {} connections after the receive from any source, "
                                "expected {}",
                                rank, connections(), expected[rank]));
    pg->barrier()->wait();
  });
  EXPECT_ALL_RANKS_OK(results);
}

// Process `pid`'s state letter from /proc/<pid>/stat ('R', 'S', 'T', 'Z', ...), or '?' when gone.
char process_state(pid_t pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string text((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
  const auto paren = text.rfind(')');
  if (!stat.good() || paren == std::string::npos || paren + 2 >= text.size()) return '?';
  return text[paren + 2];
}

// Whether process `pid` has exited (gone, or a zombie: its descriptors are closed either way).
bool exited(pid_t pid) {
  const char state = process_state(pid);
  return state == '?' || state == 'Z';
}

// A rank that has gone before its first point-to-point connection: the rank below that knocks
// and the rank above that connects both fail within seconds (not at their 60 s deadline), with a
// CommError naming it. World 4 over TCP; rank 2 exits after a barrier, and the others start once
// it has (a rank still exiting could answer the knock first, and take a small send).
TEST(LazyPointToPoint, PeerGoneBeforeItsFirstConnectionFailsWithinSeconds) {
  constexpr int kWorld = 4;
  TempDir dir;
  const auto pid_file = dir.path() / "rank2.pid";
  auto results = run_ranks(
      kWorld,
      [&](int rank) {
        auto pg =
            make_group(dir.path(), rank, kWorld, {.timeout = 60s, .transport = Transport::kTcp});
        if (rank == 2) {
          std::ofstream(pid_file.string() + ".tmp") << ::getpid();
          std::filesystem::rename(pid_file.string() + ".tmp", pid_file);
        }
        pg->barrier()->wait();
        if (rank == 2) ::_exit(0);
        if (rank == 0) return;
        pid_t gone = 0;
        std::ifstream(pid_file) >> gone;
        expect(gone > 0 && wait_until([&] { return exited(gone); }, 20s),
               "rank 2 did not exit within 20 s");
        const auto start = Clock::now();
        std::int32_t x = 5;
        try {
          if (rank == 1) {
            pg->send(&x, 1, DType::kInt32, 2, 0)->wait();  // knocks
          } else {
            pg->recv(&x, 1, DType::kInt32, 2, 0)->wait();  // connects
          }
        } catch (const CommError& e) {
          const auto took = Clock::now() - start;
          const std::string what = e.what();
          expect(took < 15s,
                 fmt::format("rank {} failed after {} ms: {}", rank,
                             std::chrono::duration_cast<std::chrono::milliseconds>(took).count(),
                             what));
          expect(e.peer() == 2, fmt::format("peer() is {}, not 2: {}", e.peer(), what));
          expect(e.kind() == CommErrorKind::kPeerGone,
                 fmt::format("kind {}: {}", to_string(e.kind()), what));
          expect(what.find("rank 2") != std::string::npos,
                 "the error does not name rank 2: " + what);
          return;
        }
        throw std::runtime_error("a point-to-point operation with a dead rank succeeded");
      },
      90s);
  for (int r = 0; r < kWorld; ++r)
    EXPECT_TRUE(results[static_cast<std::size_t>(r)].ok()) << describe(results);
}

// World 2 over TCP where rank 1 stops itself (SIGSTOP) after a barrier, before any point-to-point
// connection: `on_rank_0(group, rank 1's pid)` runs on rank 0 and must kill rank 1 (SIGKILL).
// Expects rank 0 to succeed and rank 1 to die of that SIGKILL.
void with_rank_1_stopped(const std::function<void(ProcessGroup&, pid_t)>& on_rank_0) {
  constexpr int kWorld = 2;
  TempDir dir;
  const auto pid_file = dir.path() / "rank1.pid";
  auto results = run_ranks(
      kWorld,
      [&](int rank) {
        auto pg =
            make_group(dir.path(), rank, kWorld, {.timeout = 60s, .transport = Transport::kTcp});
        if (rank == 1) {
          std::ofstream(pid_file.string() + ".tmp") << ::getpid();
          std::filesystem::rename(pid_file.string() + ".tmp", pid_file);
        }
        pg->barrier()->wait();
        if (rank == 1) {
          ::raise(SIGSTOP);  // killed by rank 0
          ::_exit(3);
        }
        pid_t stuck = 0;
        std::ifstream(pid_file) >> stuck;
        expect(stuck > 0, "no pid from rank 1");
        // Rank 1 must be stopped before rank 0 knocks: a rank 1 still on its way to SIGSTOP
        // (a loaded machine) could answer the knock and take a small send (CI saw it once).
        expect(wait_until([&] { return process_state(stuck) == 'T'; }, 20s),
               "rank 1 did not stop within 20 s");
        try {
          on_rank_0(*pg, stuck);
        } catch (...) {
          ::kill(stuck, SIGKILL);
          throw;
        }
      },
      90s);
  ASSERT_EQ(results.size(), 2u);
  EXPECT_TRUE(results[0].ok()) << describe(results);
  EXPECT_EQ(results[1].signal, SIGKILL) << describe(results);
}

// Throws unless `e` is a CommError of `kind` naming rank 1, with `text` in its message.
void expect_error_naming_rank_1(const CommError& e, CommErrorKind kind, const std::string& text) {
  const std::string what = e.what();
  expect(e.kind() == kind, fmt::format("kind {}: {}", to_string(e.kind()), what));
  expect(e.peer() == 1, fmt::format("peer() is {}, not 1: {}", e.peer(), what));
  expect(what.find(text) != std::string::npos, fmt::format("'{}' is not in: {}", text, what));
}

long long ms_since(Clock::time_point start) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start).count();
}

// A peer alive but stuck before its first connection: the lower rank's knock is never answered,
// so its send fails at the operation's deadline with a timeout that says the peer never opened
// the connection (not a hang, not "posted no receive").
TEST(LazyPointToPoint, StuckPeerThatNeverAnswersTheKnockTimesOutNamingIt) {
  with_rank_1_stopped([](ProcessGroup& pg, pid_t stuck) {
    const auto start = Clock::now();
    std::int32_t x = 5;
    try {
      pg.send(&x, 1, DType::kInt32, 1, 0, {.timeout = 2s})->wait();
      throw std::runtime_error("a send to a stopped rank succeeded");
    } catch (const CommError& e) {
      ::kill(stuck, SIGKILL);
      const long long took = ms_since(start);
      expect(took >= 1900 && took < 15000, fmt::format("failed after {} ms: {}", took, e.what()));
      expect_error_naming_rank_1(e, CommErrorKind::kTimeout,
                                 "rank 1 never opened the point-to-point connection");
    }
  });
}

// Sockets this process has open (/proc/self/fd).
int open_sockets() {
  int n = 0;
  for (const auto& entry : std::filesystem::directory_iterator("/proc/self/fd")) {
    std::error_code error;
    const auto target = std::filesystem::read_symlink(entry.path(), error);
    if (!error && target.string().rfind("socket:", 0) == 0) ++n;
  }
  return n;
}

// The same stuck peer killed while the knock waits in its listener's queue, unread: the kernel
// resets the knock, and the send fails at once with kPeerGone saying so (not at its deadline).
TEST(LazyPointToPoint, PeerKilledWithTheKnockUnreadIsNamedAtOnce) {
  with_rank_1_stopped([](ProcessGroup& pg, pid_t stuck) {
    std::int32_t x = 5;
    const int before = open_sockets();
    auto sent = pg.send(&x, 1, DType::kInt32, 1, 0);
    // The knock's connection is made by the kernel even though rank 1 is stopped; its hello
    // follows at once on the same thread.
    expect(wait_until([&] { return open_sockets() > before; }, 20s), "no knock within 20 s");
    std::this_thread::sleep_for(300ms);
    ::kill(stuck, SIGKILL);
    const auto killed = Clock::now();
    try {
      sent->wait();
      throw std::runtime_error("a send to a killed rank succeeded");
    } catch (const CommError& e) {
      const long long took = ms_since(killed);
      expect(took < 10000, fmt::format("failed {} ms after the kill: {}", took, e.what()));
      expect_error_naming_rank_1(e, CommErrorKind::kPeerGone, "reset the request unread");
    }
  });
}

}  // namespace DDP_UNITY_ID
}  // namespace
}  // namespace ddp::test
