// Point to point on the ring backend, in real processes: sends and receives progress on their
// own (a cycle in which every rank sends 64 MiB before it receives completes; so does a halo
// exchange posted sends-first), match by (source, tag) in posting order, do not wait for the
// collective queue, and fail with a named CommError on both ranks for a count, dtype or tag
// mismatch and on the receiver when the sender dies mid-message; a sender that exits at once
// after its last send loses none of its messages (though the receiver's writes to it fail or it
// resets the connection). Over TCP and over the auto transport (shared memory for collectives;
// point to point runs over TCP for both).
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <thread>

#include "comm/comm_test_util.h"
#include "support/multiprocess.h"
#include "support/unity_namespace.h"

namespace ddp::test {
namespace {
namespace DDP_UNITY_ID {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

// Element i of the message rank `from` sends with `salt`: cheap to fill and to check.
std::uint32_t pattern(std::size_t i, int from, std::uint32_t salt) {
  return static_cast<std::uint32_t>(i) * 2654435761u + static_cast<std::uint32_t>(from) * 40503u +
         salt;
}

std::vector<std::uint32_t> make_message(std::size_t count, int from, std::uint32_t salt) {
  std::vector<std::uint32_t> v(count);
  for (std::size_t i = 0; i < count; ++i)
    v[i] = pattern(i, from, salt);
  return v;
}

void check_message(const std::vector<std::uint32_t>& got, int from, std::uint32_t salt,
                   const std::string& what) {
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (got[i] != pattern(i, from, salt)) {
      throw std::runtime_error(fmt::format("{}: element {} of {} is {:#x}, expected {:#x}", what, i,
                                           got.size(), got[i], pattern(i, from, salt)));
    }
  }
}

template <class F>
std::string expect_comm_error(F&& call) {
  try {
    call();
  } catch (const CommError& e) {
    return e.what();
  }
  throw std::runtime_error("expected a CommError, but the call succeeded");
}

void expect_contains(const std::string& text, const std::string& part) {
  if (text.find(part) == std::string::npos) {
    throw std::runtime_error(fmt::format("message lacks '{}': {}", part, text));
  }
}

RingOptions with_mode(Mode mode, RingOptions o = {}) {
  o.transport = mode == Mode::kTcp ? Transport::kTcp : Transport::kAuto;
  return o;
}

class PointToPoint : public ::testing::TestWithParam<std::tuple<int, Mode>> {};

// Every rank posts its send to the next rank before its receive from the previous one: with one
// operation at a time this deadlocks as soon as a message exceeds the socket buffers.
TEST_P(PointToPoint, CycleOfSixtyFourMiBSendsBeforeReceivesCompletes) {
  const int size = std::get<0>(GetParam());
  const Mode mode = std::get<1>(GetParam());
  TempDir dir;
  auto results = run_ranks(
      size,
      [&](int rank) {
        auto pg = make_group(dir.path(), rank, size, with_mode(mode, {.timeout = 30s}));
        constexpr std::size_t kCount = (64u << 20) / 4;
        const int next = (rank + 1) % size;
        const int prev = (rank + size - 1) % size;
        const auto mine = make_message(kCount, rank, 1);
        std::vector<std::uint32_t> got(kCount, 0);
        const auto start = Clock::now();
        auto s = pg->send(mine.data(), kCount, DType::kInt32, next, 11);
        auto r = pg->recv(got.data(), kCount, DType::kInt32, prev, 11);
        s->wait();
        r->wait();
        const auto took = Clock::now() - start;
        if (took > 20s) throw std::runtime_error("the cycle took more than 20 s");
        check_message(got, prev, 1, "64 MiB from the previous rank");
      },
      90s);
  EXPECT_ALL_RANKS_OK(results);
}

// Each rank sends to both neighbours (tag 1 to the left, tag 2 to the right) before it receives
// from them; tags say which direction a message travelled.
TEST_P(PointToPoint, HaloExchangePostedSendsFirstCompletes) {
  const int size = std::get<0>(GetParam());
  const Mode mode = std::get<1>(GetParam());
  TempDir dir;
  auto results = run_ranks(
      size,
      [&](int rank) {
        auto pg = make_group(dir.path(), rank, size, with_mode(mode, {.timeout = 30s}));
        constexpr std::size_t kCount = (8u << 20) / 4;
        constexpr int kToLeft = 1, kToRight = 2;
        const int left = (rank + size - 1) % size;
        const int right = (rank + 1) % size;
        const auto to_left = make_message(kCount, rank, 100 + kToLeft);
        const auto to_right = make_message(kCount, rank, 100 + kToRight);
        std::vector<std::uint32_t> from_left(kCount), from_right(kCount);
        std::vector<std::shared_ptr<Work>> works;
        works.push_back(pg->send(to_left.data(), kCount, DType::kInt32, left, kToLeft));
        works.push_back(pg->send(to_right.data(), kCount, DType::kInt32, right, kToRight));
        // The left neighbour sent its message to the right (to this rank) and vice versa.
        works.push_back(pg->recv(from_right.data(), kCount, DType::kInt32, right, kToLeft));
        works.push_back(pg->recv(from_left.data(), kCount, DType::kInt32, left, kToRight));
        for (auto& w : works)
          w->wait();
        check_message(from_left, left, 100 + kToRight, "halo from the left");
        check_message(from_right, right, 100 + kToLeft, "halo from the right");
      },
      90s);
  EXPECT_ALL_RANKS_OK(results);
}

std::string param_name(const ::testing::TestParamInfo<std::tuple<int, Mode>>& info) {
  return mode_name(std::get<1>(info.param)) + "_world" + std::to_string(std::get<0>(info.param));
}

INSTANTIATE_TEST_SUITE_P(Worlds, PointToPoint,
                         ::testing::Combine(::testing::Values(2, 3, 4),
                                            ::testing::Values(Mode::kTcp, Mode::kShm)),
                         param_name);

class PointToPointRules : public ::testing::TestWithParam<Mode> {};

// Rank 0 sends many messages of varying sizes with tags 0..3 interleaved; rank 1 posts its
// receives one tag after another (tag 3 first). Per tag they match in posting order; messages
// of the other tags wait (buffered up to a bound, then at the sender) without blocking them.
TEST_P(PointToPointRules, ManySmallMessagesWithInterleavedTagsMatchPerTagInOrder) {
  TempDir dir;
  auto results = run_ranks(2, [&](int rank) {
    auto pg = make_group(dir.path(), rank, 2, with_mode(GetParam(), {.timeout = 30s}));
    constexpr int kMessages = 2000;
    constexpr int kTags = 4;
    auto count_of = [](int k) { return static_cast<std::size_t>(1 + (k * 37) % 3000); };
    std::vector<std::vector<std::uint32_t>> bufs(kMessages);
    std::vector<std::shared_ptr<Work>> works;
    if (rank == 0) {
      for (int k = 0; k < kMessages; ++k) {
        bufs[static_cast<std::size_t>(k)] = make_message(count_of(k), 0, static_cast<unsigned>(k));
        works.push_back(pg->send(bufs[static_cast<std::size_t>(k)].data(), count_of(k),
                                 DType::kInt32, 1, k % kTags));
      }
    } else {
      for (int tag = kTags - 1; tag >= 0; --tag) {
        for (int k = tag; k < kMessages; k += kTags) {
          bufs[static_cast<std::size_t>(k)].assign(count_of(k), 0);
          works.push_back(pg->recv(bufs[static_cast<std::size_t>(k)].data(), count_of(k),
                                   DType::kInt32, 0, tag));
        }
      }
    }
    for (auto& w : works)
      w->wait();
    if (rank == 1) {
      for (int k = 0; k < kMessages; ++k) {
        check_message(bufs[static_cast<std::size_t>(k)], 0, static_cast<unsigned>(k),
                      fmt::format("message {} (tag {})", k, k % kTags));
      }
    }
  });
  EXPECT_ALL_RANKS_OK(results);
}

// A receive posted before a collective does not hold the collective up (nor the reverse): rank 0
// waits for its receive only after an allreduce that rank 1 joins before it sends.
TEST_P(PointToPointRules, ReceivesDoNotWaitForCollectivesOrTheReverse) {
  TempDir dir;
  auto results = run_ranks(2, [&](int rank) {
    auto pg = make_group(dir.path(), rank, 2, with_mode(GetParam(), {.timeout = 10s}));
    std::vector<float> sum(1024, 1.0f);
    auto got = std::vector<std::uint32_t>(1000);
    const auto mine = make_message(1000, rank, 7);
    if (rank == 0) {
      auto r = pg->recv(got.data(), got.size(), DType::kInt32, 1, 0);
      pg->allreduce(sum.data(), sum.size(), DType::kFloat32, ReduceOp::kSum)->wait();
      r->wait();
      check_message(got, 1, 7, "message from rank 1");
    } else {
      pg->allreduce(sum.data(), sum.size(), DType::kFloat32, ReduceOp::kSum)->wait();
      pg->send(mine.data(), mine.size(), DType::kInt32, 0, 0)->wait();
    }
    if (sum[0] != 2.0f) throw std::runtime_error(fmt::format("allreduce gave {}", sum[0]));
  });
  EXPECT_ALL_RANKS_OK(results);
}

// Same tag, different count (or dtype): both ranks fail at once with both calls named, and the
// receive buffer keeps its contents (no partial or wrong data).
TEST_P(PointToPointRules, CountOrDtypeMismatchNamesBothCallsOnBothRanks) {
  for (const bool dtype_differs : {false, true}) {
    TempDir dir;
    const auto start = Clock::now();
    auto results = run_ranks(
        2,
        [&](int rank) {
          auto pg = make_group(dir.path(), rank, 2, with_mode(GetParam(), {.timeout = 20s}));
          constexpr std::size_t kCount = 1 << 20;  // 4 MiB: more than is ever sent unasked
          std::vector<std::uint32_t> buf(kCount, 0xabababab);
          const std::string message = expect_comm_error([&] {
            if (rank == 0) {
              pg->send(buf.data(), kCount, DType::kInt32, 1, 7)->wait();
            } else {
              pg->recv(buf.data(), dtype_differs ? kCount : kCount / 2,
                       dtype_differs ? DType::kFloat32 : DType::kInt32, 0, 7)
                  ->wait();
            }
          });
          expect_contains(message, "send(int32 x 1048576, tag 7)");
          expect_contains(message, dtype_differs ? "recv(float32 x 1048576, tag 7)"
                                                 : "recv(int32 x 524288, tag 7)");
          if (rank == 1 && buf[0] != 0xabababab) {
            throw std::runtime_error("the mismatched receive wrote into its buffer");
          }
        },
        60s);
    EXPECT_ALL_RANKS_OK(results);
    EXPECT_LT(Clock::now() - start, 15s) << "a mismatch must fail at once, not at the deadline";
  }
}

// A small send goes at once and may complete before its receiver sees the mismatch: the sender's
// pending and later operations with that peer then fail with it, both calls named.
TEST_P(PointToPointRules, SmallMessageMismatchFailsTheSendersNextCallWithThatPeer) {
  TempDir dir;
  auto results = run_ranks(
      2,
      [&](int rank) {
        auto pg = make_group(dir.path(), rank, 2, with_mode(GetParam(), {.timeout = 10s}));
        std::vector<std::uint32_t> buf(16, 5);
        const auto start = Clock::now();
        std::string message;
        if (rank == 0) {
          auto sent = pg->send(buf.data(), 16, DType::kInt32, 1, 3);
          sent->wait_for(5s);  // completes, or fails with the mismatch if rejected first
          auto never = pg->recv(buf.data(), 16, DType::kInt32, 1, 9);
          message = expect_comm_error([&] { never->wait(); });
          if (sent->error() == nullptr) {
            message =
                expect_comm_error([&] { pg->send(buf.data(), 1, DType::kInt32, 1, 0)->wait(); });
          }
        } else {
          message =
              expect_comm_error([&] { pg->recv(buf.data(), 8, DType::kInt32, 0, 3)->wait(); });
          if (buf[0] != 5) throw std::runtime_error("the mismatched receive wrote into its buffer");
        }
        expect_contains(message, "send(int32 x 16, tag 3) to rank 1 #0");
        expect_contains(message, "recv(int32 x 8, tag 3) from rank 0 #0");
        if (Clock::now() - start > 5s) throw std::runtime_error("the mismatch took the deadline");
      },
      60s);
  EXPECT_ALL_RANKS_OK(results);
}

// Different tags never match: both ranks fail at their deadline, the receiver naming the message
// that did arrive with another tag.
TEST_P(PointToPointRules, TagMismatchFailsBothRanksAtTheDeadlineNamingTheOtherTag) {
  TempDir dir;
  const auto start = Clock::now();
  auto results = run_ranks(
      2,
      [&](int rank) {
        auto pg = make_group(dir.path(), rank, 2, with_mode(GetParam(), {.timeout = 2s}));
        constexpr std::size_t kCount = 1 << 20;
        std::vector<std::uint32_t> buf(kCount);
        const std::string message = expect_comm_error([&] {
          if (rank == 0) {
            pg->send(buf.data(), kCount, DType::kInt32, 1, 1)->wait();
          } else {
            pg->recv(buf.data(), kCount, DType::kInt32, 0, 2)->wait();
          }
        });
        if (rank == 0) {
          expect_contains(message, "send(int32 x 1048576, tag 1)");
        } else {
          expect_contains(message, "recv(int32 x 1048576, tag 2) from rank 0");
          expect_contains(message, "send(int32 x 1048576, tag 1)");
        }
      },
      60s);
  EXPECT_ALL_RANKS_OK(results);
  EXPECT_LT(Clock::now() - start, 15s);
}

// The sender dies while a 256 MiB message is on the wire: the receiver fails within its deadline
// with a CommError naming rank 0.
TEST_P(PointToPointRules, SenderDyingMidMessageFailsTheReceiverNamingIt) {
  TempDir dir;
  const auto start = Clock::now();
  auto results = run_ranks(
      2,
      [&](int rank) {
        auto pg = make_group(dir.path(), rank, 2, with_mode(GetParam(), {.timeout = 10s}));
        constexpr std::size_t kCount = (256u << 20) / 4;
        std::vector<std::uint32_t> buf(kCount, 1);
        if (rank == 0) {
          auto s = pg->send(buf.data(), kCount, DType::kInt32, 1, 0);
          std::this_thread::sleep_for(10ms);
          ::kill(::getpid(), SIGKILL);
        }
        const auto posted = Clock::now();
        auto r = pg->recv(buf.data(), kCount, DType::kInt32, 0, 0);
        CommError error(CommErrorKind::kInternal, "", "", "", 0, -1);
        const std::string message = expect_comm_error([&] {
          try {
            r->wait();
          } catch (const CommError& e) {
            error = e;
            throw;
          }
        });
        if (Clock::now() - posted > 8s) throw std::runtime_error("failed only at the deadline");
        if (error.peer() != 0) {
          throw std::runtime_error(fmt::format("peer() is {}, not 0: {}", error.peer(), message));
        }
        if (error.kind() != CommErrorKind::kPeerGone) {
          throw std::runtime_error(
              fmt::format("kind is '{}', not 'peer gone': {}", to_string(error.kind()), message));
        }
        expect_contains(message, "rank 0");
      },
      60s);
  ASSERT_EQ(results.size(), 2u);
  EXPECT_EQ(results[0].signal, SIGKILL) << describe(results);
  EXPECT_TRUE(results[1].ok()) << describe(results);
  EXPECT_LT(Clock::now() - start, 30s);
}

// Whether process `pid` has exited (its files, sockets included, are closed): gone, or a zombie.
bool has_exited(pid_t pid) {
  std::ifstream stat(fmt::format("/proc/{}/stat", pid));
  std::string line;
  if (!std::getline(stat, line)) return true;
  const auto paren = line.rfind(')');
  return paren != std::string::npos && paren + 2 < line.size() && line[paren + 2] == 'Z';
}

// The bytes queued on this process's TCP connections (/proc/net/tcp and tcp6): written but not yet
// acknowledged by the peer's kernel (tx), and arrived but not yet read (rx).
struct TcpQueues {
  unsigned long long tx = 0, rx = 0;
};

TcpQueues tcp_queues() {
  std::set<std::string> inodes;
  for (const auto& entry : std::filesystem::directory_iterator("/proc/self/fd")) {
    std::error_code ec;
    const std::string target = std::filesystem::read_symlink(entry.path(), ec).string();
    if (!ec && target.rfind("socket:[", 0) == 0) {
      inodes.insert(target.substr(8, target.size() - 9));
    }
  }
  TcpQueues q;
  for (const char* table : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::ifstream in(table);
    std::string line;
    std::getline(in, line);  // the header
    while (std::getline(in, line)) {
      std::istringstream fields(line);
      std::string slot, local, remote, state, queues, timer, retransmits, uid, probes, inode;
      fields >> slot >> local >> remote >> state >> queues >> timer >> retransmits >> uid >>
          probes >> inode;
      const auto colon = queues.find(':');
      if (inodes.count(inode) == 0 || colon == std::string::npos) continue;
      q.tx += std::stoull(queues.substr(0, colon), nullptr, 16);
      q.rx += std::stoull(queues.substr(colon + 1), nullptr, 16);
    }
  }
  return q;
}

bool all_tcp_acknowledged() {
  return tcp_queues().tx == 0;
}

// Waits for `w`, which must fail as 'peer gone' naming rank 0.
void expect_peer_gone(const std::shared_ptr<Work>& w, const std::string& what) {
  try {
    w->wait();
  } catch (const CommError& e) {
    if (e.kind() != CommErrorKind::kPeerGone || e.peer() != 0) {
      throw std::runtime_error(fmt::format("{}: kind '{}', peer {}, not 'peer gone', 0: {}", what,
                                           to_string(e.kind()), e.peer(), e.what()));
    }
    return;
  }
  throw std::runtime_error(what + " succeeded");
}

// Polls `ready` every millisecond until it holds or `limit` passes; returns whether it held.
template <class F>
bool poll_until(F&& ready, std::chrono::milliseconds limit) {
  const auto until = Clock::now() + limit;
  while (!ready()) {
    if (Clock::now() >= until) return false;
    std::this_thread::sleep_for(1ms);
  }
  return true;
}

// The sender's messages are all written, and it exits at once (std::_Exit, no goodbye), while
// most of them are still unread in the receiver's socket: the receiver's progress thread is held
// in a callback, and its own receives meanwhile return credit for messages it had buffered, so
// that it writes to a connection whose peer has gone (EPIPE or ECONNRESET). That broken write
// must not lose what already arrived: every message is received, in order. A receive the sender
// never matched fails at the end of the stream as 'peer gone' (not at its deadline), as do a
// receive and a send posted afterwards.
TEST_P(PointToPointRules, MessagesStillUnreadWhenWritingToTheExitedSenderFailsAreAllReceived) {
  TempDir dir;
  const auto pid_file = dir.path() / "sender.pid";
  const auto ready_file = dir.path() / "receiver.ready";
  const auto held_file = dir.path() / "progress.held";
  auto touch = [](const std::filesystem::path& path, const std::string& text) {
    const auto tmp = path.string() + ".tmp";
    std::ofstream(tmp) << text;
    std::filesystem::rename(tmp, path);
  };
  auto results = run_ranks(
      2,
      [&](int rank) {
        // Spinning waiters would read on the waiting thread: only the progress thread reads here.
        auto pg =
            make_group(dir.path(), rank, 2, with_mode(GetParam(), {.timeout = 20s, .spin = 0us}));
        constexpr int kBuffered = 4;  // eager, buffered by the receiver before it is held
        constexpr int kUnread = 200;  // eager, sent while its progress thread is held
        constexpr std::size_t kLarge = (256u << 10) / 4;  // rendezvous (over kEagerMaxBytes)
        auto count_of = [](int k) { return static_cast<std::size_t>(1 + (k * 37) % 60); };
        const auto large = make_message(kLarge, rank, 999);
        if (rank == 0) {
          touch(pid_file, std::to_string(::getpid()));
          std::vector<std::vector<std::uint32_t>> bufs;
          for (int k = 0; k < kBuffered + kUnread; ++k)
            bufs.push_back(make_message(count_of(k), 0, static_cast<unsigned>(k)));
          for (int k = 0; k < kBuffered; ++k)
            pg->send(bufs[static_cast<std::size_t>(k)].data(), count_of(k), DType::kInt32, 1, 1)
                ->wait();
          if (!poll_until([&] { return std::filesystem::exists(ready_file); }, 20s)) {
            throw std::runtime_error("the receiver did not post its first receive");
          }
          pg->send(large.data(), kLarge, DType::kInt32, 1, 0)->wait();
          if (!poll_until([&] { return std::filesystem::exists(held_file); }, 20s)) {
            throw std::runtime_error("the receiver's progress thread was not held");
          }
          std::vector<std::shared_ptr<Work>> sends;
          for (int k = kBuffered; k < kBuffered + kUnread; ++k) {
            sends.push_back(pg->send(bufs[static_cast<std::size_t>(k)].data(), count_of(k),
                                     DType::kInt32, 1, 1));
          }
          for (auto& s : sends)
            s->wait();
          // Written is not yet delivered: once the receiver's kernel has it, an exit loses none
          // of it (the receiver's writes to the gone process then reset the connection, which
          // drops what that process's kernel still held).
          if (!poll_until(all_tcp_acknowledged, 20s)) {
            throw std::runtime_error("the receiver's kernel did not acknowledge the messages");
          }
          std::_Exit(0);  // at once: no group destructor, no goodbye
        }
        // Rank 1. The rendezvous message completes on the progress thread, which its callback
        // then holds until every receive below is posted.
        // Shared with the callback, which may outlive this frame when a check throws.
        auto release = std::make_shared<std::atomic<bool>>(false);
        std::vector<std::uint32_t> got_large(kLarge);
        auto r_large = pg->recv(got_large.data(), kLarge, DType::kInt32, 0, 0);
        r_large->then([release, held_file, touch](Work&) {
          touch(held_file, "");
          poll_until([&] { return release->load(); }, 30s);
        });
        touch(ready_file, "");
        pid_t sender = 0;
        if (!poll_until([&] { return std::filesystem::exists(pid_file); }, 20s)) {
          *release = true;
          throw std::runtime_error("rank 0 wrote no pid");
        }
        std::ifstream(pid_file) >> sender;
        if (!poll_until([&] { return std::filesystem::exists(held_file) && has_exited(sender); },
                        20s)) {
          *release = true;
          throw std::runtime_error("rank 0 did not exit, or the progress thread was not held");
        }
        std::vector<std::vector<std::uint32_t>> got(kBuffered + kUnread);
        std::vector<std::shared_ptr<Work>> recvs;
        for (int k = 0; k < kBuffered + kUnread; ++k) {
          got[static_cast<std::size_t>(k)].assign(count_of(k), 0);
          recvs.push_back(
              pg->recv(got[static_cast<std::size_t>(k)].data(), count_of(k), DType::kInt32, 0, 1));
          // The buffered ones complete at once, each writing credit to the gone sender: the
          // first write draws its reset, the next ones fail.
          if (k < kBuffered) std::this_thread::sleep_for(50ms);
        }
        std::vector<std::uint32_t> never(16);
        auto r_never = pg->recv(never.data(), never.size(), DType::kInt32, 0, 1);
        *release = true;
        const auto released = Clock::now();
        r_large->wait();
        check_message(got_large, 0, 999, "the rendezvous message");
        for (int k = 0; k < kBuffered + kUnread; ++k) {
          recvs[static_cast<std::size_t>(k)]->wait();
          check_message(got[static_cast<std::size_t>(k)], 0, static_cast<unsigned>(k),
                        fmt::format("message {}", k));
        }
        expect_peer_gone(r_never, "the receive rank 0 never matched");
        if (Clock::now() - released > 10s) {
          throw std::runtime_error("the unmatched receive failed only at its deadline");
        }
        expect_peer_gone(pg->recv(never.data(), never.size(), DType::kInt32, 0, 1),
                         "a receive posted after rank 0 exited");
        expect_peer_gone(pg->send(never.data(), never.size(), DType::kInt32, 0, 1),
                         "a send posted after rank 0 exited");
      },
      90s);
  EXPECT_ALL_RANKS_OK(results);
}

// The sender exits at once (std::_Exit) with credit the receiver returned still unread by it, so
// its kernel resets the connection (no orderly end): the messages the receiver had already
// buffered are still received, in order, after the reset. A receive that rank 0 never matched
// fails as 'peer gone' at once, as does a send.
TEST_P(PointToPointRules, MessagesBufferedBeforeTheExitedSendersResetAreStillReceived) {
  TempDir dir;
  const auto pid_file = dir.path() / "sender.pid";
  const auto credited_file = dir.path() / "receiver.credited";
  const auto ready_file = dir.path() / "sender.ready";
  auto touch = [](const std::filesystem::path& path, const std::string& text) {
    const auto tmp = path.string() + ".tmp";
    std::ofstream(tmp) << text;
    std::filesystem::rename(tmp, path);
  };
  auto results = run_ranks(
      2,
      [&](int rank) {
        auto pg =
            make_group(dir.path(), rank, 2, with_mode(GetParam(), {.timeout = 20s, .spin = 0us}));
        constexpr int kMessages = 50;                     // eager, tag 1
        constexpr std::size_t kLarge = (256u << 10) / 4;  // rendezvous, tag 0
        auto count_of = [](int k) { return static_cast<std::size_t>(1 + (k * 37) % 60); };
        if (rank == 0) {
          touch(pid_file, std::to_string(::getpid()));
          std::vector<std::vector<std::uint32_t>> bufs;
          for (int k = 0; k < kMessages; ++k) {
            bufs.push_back(make_message(count_of(k), 0, static_cast<unsigned>(k)));
            pg->send(bufs.back().data(), count_of(k), DType::kInt32, 1, 1)->wait();
          }
          // The rendezvous send completes on the progress thread (once its payload is written),
          // whose callback then holds it: the credit that comes back stays unread.
          const auto large = make_message(kLarge, 0, 999);
          auto held = std::make_shared<std::atomic<bool>>(false);
          auto s_large = pg->send(large.data(), kLarge, DType::kInt32, 1, 0);
          s_large->then([held](Work&) {
            *held = true;
            std::this_thread::sleep_for(60s);  // the process exits meanwhile
          });
          touch(ready_file, "");  // the receive may go: the callback cannot run here
          if (!poll_until([&] { return held->load(); }, 20s)) {
            throw std::runtime_error("the rendezvous send did not complete");
          }
          if (!poll_until([&] { return std::filesystem::exists(credited_file); }, 20s)) {
            throw std::runtime_error("the receiver returned no credit");
          }
          // Everything written is in the receiver's kernel, and its credit is in ours, unread: the
          // exit resets the connection.
          if (!poll_until(
                  [] {
                    const auto q = tcp_queues();
                    return q.tx == 0 && q.rx > 0;
                  },
                  20s)) {
            throw std::runtime_error("the credit did not arrive, or the messages were not taken");
          }
          std::_Exit(0);
        }
        if (!poll_until([&] { return std::filesystem::exists(ready_file); }, 20s)) {
          throw std::runtime_error("rank 0 did not send its rendezvous message");
        }
        std::vector<std::uint32_t> got_large(kLarge);
        pg->recv(got_large.data(), kLarge, DType::kInt32, 0, 0)->wait();
        check_message(got_large, 0, 999, "the rendezvous message");
        // The eager messages came before it, so they are all buffered here now.
        std::vector<std::vector<std::uint32_t>> got(kMessages);
        std::vector<std::shared_ptr<Work>> recvs;
        auto post = [&](int k) {
          got[static_cast<std::size_t>(k)].assign(count_of(k), 0);
          recvs.push_back(
              pg->recv(got[static_cast<std::size_t>(k)].data(), count_of(k), DType::kInt32, 0, 1));
        };
        post(0);  // delivered at once: its credit goes back to rank 0, which does not read it
        recvs[0]->wait();
        touch(credited_file, "");
        pid_t sender = 0;
        if (!poll_until([&] { return std::filesystem::exists(pid_file); }, 20s)) {
          throw std::runtime_error("rank 0 wrote no pid");
        }
        std::ifstream(pid_file) >> sender;
        if (!poll_until([&] { return has_exited(sender); }, 20s)) {
          throw std::runtime_error("rank 0 did not exit");
        }
        // Lets the progress thread read the reset before the receives below are posted (they
        // must succeed in either order).
        std::this_thread::sleep_for(200ms);
        for (int k = 1; k < kMessages; ++k)
          post(k);
        for (int k = 0; k < kMessages; ++k) {
          recvs[static_cast<std::size_t>(k)]->wait();
          check_message(got[static_cast<std::size_t>(k)], 0, static_cast<unsigned>(k),
                        fmt::format("message {}", k));
        }
        std::vector<std::uint32_t> never(16);
        const auto posted = Clock::now();
        expect_peer_gone(pg->recv(never.data(), never.size(), DType::kInt32, 0, 1),
                         "a receive rank 0 never matched");
        if (Clock::now() - posted > 10s) {
          throw std::runtime_error("the unmatched receive failed only at its deadline");
        }
        expect_peer_gone(pg->send(never.data(), never.size(), DType::kInt32, 0, 1),
                         "a send posted after rank 0 exited");
      },
      90s);
  EXPECT_ALL_RANKS_OK(results);
}

INSTANTIATE_TEST_SUITE_P(Transports, PointToPointRules, ::testing::Values(Mode::kTcp, Mode::kShm),
                         [](const auto& info) { return mode_name(info.param); });

}  // namespace DDP_UNITY_ID
}  // namespace
}  // namespace ddp::test
