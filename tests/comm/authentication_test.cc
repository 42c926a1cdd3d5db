// The ring backend's data plane under attack: a job with a secret runs correctly, and strangers,
// impostors, replayed handshakes, garbage and bad hellos sent to a rank's data port while the
// group is set up are refused (closed and logged) while the real ranks still connect. Real
// processes on 127.0.0.1; the attacker is a process of its own that reads rank 0's data address
// from the store, as a port scan would find it.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <sys/socket.h>

#include <cstring>
#include <fstream>
#include <iterator>
#include <numeric>
#include <thread>

#include <fmt/ranges.h>

#include "comm/comm_test_util.h"
#include "comm/ring/mesh_handshake.h"
#include "comm/wire.h"
#include "net/socket.h"
#include "support/multiprocess.h"
#include "support/unity_namespace.h"

namespace ddp::test {
namespace {
namespace DDP_UNITY_ID {

using namespace std::chrono_literals;
using ::testing::HasSubstr;

constexpr const char* kSecret = "correct horse battery staple";

// Every rank allreduces (rank + 1) * (i + 1) over `count` floats and checks the sums.
void check_allreduce(ProcessGroup& pg, std::size_t count = 4096) {
  std::vector<float> data(count);
  for (std::size_t i = 0; i < count; ++i)
    data[i] = static_cast<float>((pg.rank() + 1) * (i % 100 + 1));
  pg.allreduce(data.data(), count, DType::kFloat32, ReduceOp::kSum)->wait();
  const float ranks = static_cast<float>(pg.size() * (pg.size() + 1) / 2);
  for (std::size_t i = 0; i < count; ++i) {
    if (data[i] != ranks * static_cast<float>(i % 100 + 1)) {
      throw std::runtime_error(fmt::format("rank {}: element {} is {}, expected {}", pg.rank(), i,
                                           data[i], ranks * static_cast<float>(i % 100 + 1)));
    }
  }
}

// Lines the group logged, kept in a file so that the rank process can check them.
struct LogFile {
  std::string path;
  std::function<void(const std::string&)> sink() const {
    return [path = path](const std::string& line) {
      std::ofstream(path, std::ios::app) << line << "\n";
    };
  }
  std::string text() const {
    std::ifstream in(path);
    return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  }
};

// host, port of "host:port".
std::pair<std::string, std::uint16_t> split_address(const std::string& address) {
  const auto colon = address.rfind(':');
  return {address.substr(0, colon),
          static_cast<std::uint16_t>(std::stoi(address.substr(colon + 1)))};
}

// Waits until the peer closes the connection (true), or the deadline passes (false). Bytes the
// peer sends meanwhile are counted in *received.
bool closed_by_peer(net::Socket& socket, std::chrono::milliseconds timeout,
                    std::size_t* received = nullptr) {
  const auto deadline = net::deadline_after(timeout);
  char buf[256];
  for (;;) {
    pollfd pfd{socket.fd(), POLLIN, 0};
    if (::poll(&pfd, 1, net::poll_timeout_ms(deadline)) <= 0) return false;
    const ssize_t n = ::recv(socket.fd(), buf, sizeof buf, 0);
    if (n <= 0) return true;  // EOF or reset
    if (received != nullptr) *received += static_cast<std::size_t>(n);
  }
}

std::vector<std::uint8_t> hello_bytes(std::uint32_t magic, const std::string& group, int size,
                                      int from, int to) {
  comm::Hello hello{.magic = magic,
                    .version = comm::kProtocolVersion,
                    .size = size,
                    .from_rank = from,
                    .to_rank = to,
                    .name_length = static_cast<std::uint32_t>(group.size())};
  std::vector<std::uint8_t> out(sizeof hello + group.size());
  std::memcpy(out.data(), &hello, sizeof hello);
  std::memcpy(out.data() + sizeof hello, group.data(), group.size());
  return out;
}

net::Socket connect_to(const std::string& address) {
  const auto [host, port] = split_address(address);
  return net::connect_tcp(host, port, net::deadline_after(5s));
}

// Sends `bytes` on a fresh connection to `address` and expects the rank to close it without
// letting a byte of a collective through. Returns a description of a failure, or "".
std::string expect_refused(const std::string& address, const std::vector<std::uint8_t>& bytes,
                           const std::string& what) {
  net::Socket socket = connect_to(address);
  try {
    socket.send_all(bytes.data(), bytes.size(), net::deadline_after(5s));
  } catch (const Error&) {
    return "";  // reset while sending: refused before all of it was read
  }
  if (!closed_by_peer(socket, 10s)) return what + ": the connection was not closed";
  return "";
}

// --- A job with a secret works -------------------------------------------------------------

class SecretJob : public ::testing::TestWithParam<std::tuple<int, Mode>> {};

TEST_P(SecretJob, CollectivesAreCorrect) {
  // Not a structured binding: clang before 16 (the sanitizer stages) cannot capture one.
  const int world = std::get<0>(GetParam());
  const Mode mode = std::get<1>(GetParam());
  TempDir dir;
  auto results = run_ranks(world, [&](int rank) {
    RingOptions options = apply_mode(mode, rank, world);
    options.secret = kSecret;
    auto pg = make_group(dir.path(), rank, world, options);
    if (!transport_matches(mode, world, ring_transport_of(*pg))) {
      throw std::runtime_error("unexpected transport " + ring_transport_of(*pg));
    }
    check_allreduce(*pg);
    check_allreduce(*pg, 1 << 20);  // large: the ring (or the segment) over several chunks
    std::vector<int> buf(16, pg->rank() == 1 ? 7 : 0);
    pg->broadcast(buf.data(), buf.size(), DType::kInt32, 1)->wait();
    if (buf != std::vector<int>(16, 7)) throw std::runtime_error("broadcast from rank 1 is wrong");
    // Point to point runs on connections of its own, authenticated the same way.
    const int next = (pg->rank() + 1) % world;
    const int previous = (pg->rank() + world - 1) % world;
    std::vector<int> out(1000, pg->rank()), in(1000, -1);
    auto sent = pg->send(out.data(), out.size(), DType::kInt32, next, 5);
    pg->recv(in.data(), in.size(), DType::kInt32, previous, 5)->wait();
    sent->wait();
    if (in != std::vector<int>(1000, previous)) throw std::runtime_error("recv got wrong data");
  });
  EXPECT_ALL_RANKS_OK(results);
}

INSTANTIATE_TEST_SUITE_P(WorldAndTransport, SecretJob,
                         ::testing::Combine(::testing::Values(2, 3),
                                            ::testing::Values(Mode::kTcp, Mode::kShm,
                                                              Mode::kHierEqual)),
                         [](const auto& info) {
                           return fmt::format("world{}_{}", std::get<0>(info.param),
                                              mode_name(std::get<1>(info.param)));
                         });

// --- Attacks during set-up ------------------------------------------------------------------

// Ranks 0 and 1 form a group of two over TCP; a third process, the attacker, runs `attack`
// against rank 0's data port after rank 0 has published it and before rank 1 starts. Rank 0 must
// refuse every attack, log each with the attacker's address, and still form the group with the
// real rank 1 and compute correct results. Connections the attack leaves in `held` stay open
// until rank 0 is done.
using Attack =
    std::function<std::string(const std::string& address, std::vector<net::Socket>& held)>;
void run_attack(const std::string& secret, int expected_refusals, const Attack& attack) {
  TempDir dir;
  LogFile log{dir.file("rank0.log")};
  auto results = run_ranks(3, [&](int rank) {
    FileStore store(dir.path() / "store", 30s);
    if (rank == 2) {
      const std::string address = store.get_string("ring/default/0/addr/0", 20s);
      std::vector<net::Socket> held;
      const std::string failure = attack(address, held);
      store.set("attacks_done", "1");
      if (!failure.empty()) throw std::runtime_error(failure);
      store.get("job_done", 30s);
      return;
    }
    if (rank == 1) store.get("attacks_done", 30s);
    RingOptions options{.timeout = 30s, .transport = Transport::kTcp};
    options.secret = secret;
    options.log = log.sink();
    auto pg = make_group(dir.path() / "store", rank, 2, options);
    check_allreduce(*pg);
    if (rank == 0) {
      const std::string lines = log.text();
      // One line per refusal, except where a line says how many it stands for (the log is rate
      // limited after the first 20).
      int refusals = 0;
      for (std::size_t at = lines.find("refused a connection from 127.0.0.1:");
           at != std::string::npos;
           at = lines.find("refused a connection from 127.0.0.1:", at + 1)) {
        ++refusals;
        const auto end = lines.find('\n', at);
        const auto more = lines.find(" more refused since the last such line", at);
        if (more != std::string::npos && more < end) {
          const auto open = lines.rfind('(', more);
          refusals += std::stoi(lines.substr(open + 1, more - open - 1));
        }
      }
      if (refusals != expected_refusals) {
        throw std::runtime_error(fmt::format("rank 0 logged {} refusals, expected {}:\n{}",
                                             refusals, expected_refusals, lines));
      }
      store.set("job_done", "1");
    }
  });
  EXPECT_ALL_RANKS_OK(results);
}

std::vector<std::uint8_t> random_bytes(std::size_t n, unsigned seed) {
  std::vector<std::uint8_t> bytes(n);
  for (auto& b : bytes) {
    seed = seed * 1103515245u + 12345u;
    b = static_cast<std::uint8_t>(seed >> 16);
  }
  return bytes;
}

// Garbage, an HTTP request, a hello cut short, a hello of another group, of a rank that does not
// exist, and a connection that stays silent: none of them ends rank 0's wait for rank 1.
std::string garbage_and_bad_hellos(const std::string& address, std::uint32_t magic,
                                   std::vector<net::Socket>& held) {
  std::vector<std::string> failures;
  // With a secret a hello carries the connector's nonce: send it, so that the rank has all it
  // needs to judge the hello (it waits for a hello's missing bytes, without holding up others).
  auto check = [&](std::vector<std::uint8_t> bytes, const std::string& what) {
    if (magic == comm::kAuthHandshakeMagic && what.find("hello") != std::string::npos) {
      const auto nonce = random_bytes(32, 5);
      bytes.insert(bytes.end(), nonce.begin(), nonce.end());
    }
    if (auto f = expect_refused(address, bytes, what); !f.empty()) failures.push_back(f);
  };
  check(random_bytes(4096, 1), "random bytes");
  const std::string http = "GET / HTTP/1.1\r\nHost: x\r\n\r\n";
  check({http.begin(), http.end()}, "an HTTP request");
  check(hello_bytes(magic, "other", 2, 1, 0), "a hello of another group");
  check(hello_bytes(magic, "default", 3, 1, 0), "a hello with another world size");
  check(hello_bytes(magic, "default", 2, 5, 0), "a hello from rank 5 of 2");
  check(hello_bytes(magic, "default", 2, 1, 1), "a hello addressed to rank 1");
  {
    auto cut = hello_bytes(magic, "default", 2, 1, 0);
    cut.resize(10);
    net::Socket socket = connect_to(address);
    socket.send_all(cut.data(), cut.size(), net::deadline_after(5s));
    socket.close();  // closes mid-hello: refused as soon as rank 0 sees the EOF
  }
  // A silent connection, held open while the real rank 1 connects (it is dropped with the
  // listener once the group is complete, and is not counted as refused).
  held.push_back(connect_to(address));
  return failures.empty() ? "" : fmt::format("{}", fmt::join(failures, "; "));
}

TEST(DataPlaneAttack, GarbageAndBadHellosDuringSetUpDoNotKillStartUpWithoutSecret) {
  run_attack("", 7, [](const std::string& address, std::vector<net::Socket>& held) {
    return garbage_and_bad_hellos(address, comm::kHandshakeMagic, held);
  });
}

TEST(DataPlaneAttack, GarbageAndBadHellosDuringSetUpDoNotKillStartUpWithSecret) {
  run_attack(kSecret, 7, [](const std::string& address, std::vector<net::Socket>& held) {
    return garbage_and_bad_hellos(address, comm::kAuthHandshakeMagic, held);
  });
}

// The attacker claims rank 1 without the secret: with the plain hello (as the injection
// script did), and with the authenticated hello followed by a guessed MAC, and by another
// secret's MAC; then it tries to send collective data on the refused connection.
std::string impostor_round(const std::string& address, unsigned seed) {
  if (auto f = expect_refused(address, hello_bytes(comm::kHandshakeMagic, "default", 2, 1, 0),
                              "a plain hello claiming rank 1");
      !f.empty()) {
    return f;
  }
  for (const std::string& wrong : {std::string(), std::string("not the secret")}) {
    net::Socket socket = connect_to(address);
    auto hello = hello_bytes(comm::kAuthHandshakeMagic, "default", 2, 1, 0);
    const auto nonce = random_bytes(32, seed * 4 + 1);
    hello.insert(hello.end(), nonce.begin(), nonce.end());
    socket.send_all(hello.data(), hello.size(), net::deadline_after(5s));
    // Rank 0 answers with its hello, its nonce and its MAC ...
    std::vector<std::uint8_t> answer(sizeof(comm::Hello) + 7 + 64);
    socket.recv_all(answer.data(), answer.size(), net::deadline_after(5s));
    // ... and the attacker answers with a guess, or a MAC under another secret.
    std::vector<std::uint8_t> mac = random_bytes(32, seed * 4 + 2);
    if (!wrong.empty()) {
      comm::HandshakeParams p{.group = "default", .size = 2, .rank = 1, .secret = wrong};
      // The session id is in the store, which an attacker without the secret cannot read;
      // even with it, the MAC under another secret fails.
      mac = comm::handshake_mac(p, false, 1, 0, nonce.data(), answer.data() + 31);
    }
    socket.send_all(mac.data(), mac.size(), net::deadline_after(5s));
    // Then it sends what would be an allreduce's header and data.
    comm::OpHeader header{};
    header.count = 4096;
    std::vector<std::uint8_t> payload(sizeof header + 4096 * 4, 0xff);
    std::memcpy(payload.data(), &header, sizeof header);
    try {
      socket.send_all(payload.data(), payload.size(), net::deadline_after(5s));
    } catch (const Error&) {
      // A reset while sending is a refusal too.
    }
    if (!closed_by_peer(socket, 10s)) return "an authenticated hello with a wrong MAC was kept";
  }
  // A connection that claims rank 1 with the authenticated hello and then stays silent.
  net::Socket socket = connect_to(address);
  auto hello = hello_bytes(comm::kAuthHandshakeMagic, "default", 2, 1, 0);
  const auto nonce = random_bytes(32, seed * 4 + 3);
  hello.insert(hello.end(), nonce.begin(), nonce.end());
  socket.send_all(hello.data(), hello.size(), net::deadline_after(5s));
  socket.close();
  return "";
}

// 25 rounds of the four impostors above: 100 attempts, 100 refusals, and the job still runs.
TEST(DataPlaneAttack, ImpostorWithoutTheSecretIsRefused) {
  run_attack(kSecret, 100, [](const std::string& address, std::vector<net::Socket>&) {
    for (unsigned round = 0; round < 25; ++round) {
      if (auto f = impostor_round(address, round); !f.empty()) return f;
    }
    return std::string();
  });
}

// A process that sits between rank 1 and rank 0 while a job with the secret starts records what
// rank 1 sends; replaying it to rank 0 of the next group of the same name (same secret, same
// store) gets nowhere: rank 0's nonce is new, so the recorded MAC is worthless.
TEST(DataPlaneAttack, ReplayedHandshakeIsRefused) {
  TempDir dir;
  LogFile log{dir.file("rank0.log")};
  auto results = run_ranks(3, [&](int rank) {
    FileStore store(dir.path() / "store", 30s);
    RingOptions options{.timeout = 30s, .transport = Transport::kTcp};
    options.secret = kSecret;
    options.log = log.sink();
    if (rank == 2) {
      // First job: relay rank 1 <-> rank 0 and record rank 1's bytes.
      const std::string real = store.get_string("ring/default/0/addr/0", 20s);
      net::Socket listener = net::listen_tcp("127.0.0.1", 0);
      store.set("ring/default/0/addr/0", fmt::format("127.0.0.1:{}", listener.local_port()));
      store.set("relay_ready", "1");
      net::Socket from_rank1 = net::accept_tcp(listener, net::deadline_after(20s));
      net::Socket to_rank0 = connect_to(real);
      std::vector<std::uint8_t> recorded;
      const auto deadline = net::deadline_after(20s);
      bool open = true;
      while (open && net::Clock::now() < deadline) {
        pollfd fds[2] = {{from_rank1.fd(), POLLIN, 0}, {to_rank0.fd(), POLLIN, 0}};
        if (::poll(fds, 2, 100) <= 0) continue;
        for (int i = 0; i < 2; ++i) {
          if (fds[i].revents == 0) continue;
          std::uint8_t buf[65536];
          net::Socket& in = i == 0 ? from_rank1 : to_rank0;
          net::Socket& out = i == 0 ? to_rank0 : from_rank1;
          const ssize_t n = ::recv(in.fd(), buf, sizeof buf, 0);
          if (n <= 0) {
            open = false;
            break;
          }
          if (i == 0 && recorded.size() < 4096) recorded.insert(recorded.end(), buf, buf + n);
          out.send_all(buf, static_cast<std::size_t>(n), deadline);
        }
      }
      // Second job: replay hello + nonce, read rank 0's answer, replay the recorded MAC.
      const std::string address = store.get_string("ring/default/1/addr/0", 20s);
      const std::size_t hello_size = sizeof(comm::Hello) + 7 + 32;
      net::Socket socket = connect_to(address);
      socket.send_all(recorded.data(), hello_size, net::deadline_after(5s));
      std::vector<std::uint8_t> answer(sizeof(comm::Hello) + 7 + 64);
      socket.recv_all(answer.data(), answer.size(), net::deadline_after(5s));
      socket.send_all(recorded.data() + hello_size, 32, net::deadline_after(5s));
      const bool refused = closed_by_peer(socket, 10s);
      store.set("replay_done", "1");
      if (!refused) throw std::runtime_error("the replayed handshake was not refused");
      return;
    }
    if (rank == 1) store.get("relay_ready", 30s);
    {
      auto pg = make_group(dir.path() / "store", rank, 2, options);
      check_allreduce(*pg);
      pg->barrier()->wait();
    }
    if (rank == 1) store.get("replay_done", 30s);
    auto pg = make_group(dir.path() / "store", rank, 2, options);
    check_allreduce(*pg);
    if (rank == 0 && log.text().find("authentication failed") == std::string::npos) {
      throw std::runtime_error("rank 0 did not log the replay:\n" + log.text());
    }
  });
  EXPECT_ALL_RANKS_OK(results);
}

// --- Misconfiguration is still a clear error --------------------------------------------------

// Rank 1 (the connector) fails at once with the reason; rank 0 refuses it and times out naming
// the refusal.
void expect_setup_error(const std::string& secret0, const std::string& secret1,
                        const std::string& rank1_says, const std::string& rank0_says) {
  TempDir dir;
  auto results = run_ranks(2, [&](int rank) {
    RingOptions options{.timeout = rank == 0 ? 3s : 20s, .transport = Transport::kTcp};
    options.secret = rank == 0 ? secret0 : secret1;
    options.log = [](const std::string&) {};
    try {
      make_group(dir.path(), rank, 2, options);
    } catch (const CommError& e) {
      const std::string& expected = rank == 0 ? rank0_says : rank1_says;
      if (std::string(e.what()).find(expected) == std::string::npos) {
        throw std::runtime_error(fmt::format("rank {}: '{}' lacks '{}'", rank, e.what(), expected));
      }
      return;
    }
    throw std::runtime_error("the group was made");
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(DataPlaneAttack, DifferentSecretsFailClearlyOnBothRanks) {
  expect_setup_error(kSecret, "another secret", "could not prove it knows the job's secret",
                     "connection closed during the handshake");
}

TEST(DataPlaneAttack, SecretOnOneSideOnlyFailsClearly) {
  expect_setup_error("", kSecret, "refused this rank",
                     "authenticates with a secret but this rank has none");
  expect_setup_error(kSecret, "", "refused this rank", "has no secret but this rank has one");
}

}  // namespace DDP_UNITY_ID
}  // namespace
}  // namespace ddp::test
