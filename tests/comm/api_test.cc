// ProcessGroup/Work API contracts that need no peers: argument checks (ConfigError at once),
// Work semantics, timeouts from options and DDP_TIMEOUT, and the connection handshake.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <thread>

#include "comm/comm_test_util.h"
#include "comm/wire.h"
#include "net/socket.h"
#include "support/unity_namespace.h"

namespace ddp::test {
namespace {
namespace DDP_UNITY_ID {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

TEST(Types, SizesAndNames) {
  EXPECT_EQ(dtype_size(DType::kBFloat16), 2u);
  EXPECT_EQ(dtype_size(DType::kInt64), 8u);
  EXPECT_EQ(to_string(DType::kFloat16), "float16");
  EXPECT_EQ(to_string(ReduceOp::kProduct), "product");
}

TEST(Work, ThenRunsOnCompletionAndAtOnceWhenDone) {
  Work work("test op", 1s);
  int calls = 0;
  work.then([&](Work& w) {
    EXPECT_TRUE(w.is_completed());
    ++calls;
  });
  EXPECT_FALSE(work.is_completed());
  EXPECT_FALSE(work.wait_for(10ms));
  work.complete();
  EXPECT_EQ(calls, 1);
  work.then([&](Work&) { ++calls; });
  EXPECT_EQ(calls, 2);
  EXPECT_NO_THROW(work.wait());
  EXPECT_EQ(work.error(), nullptr);
}

TEST(Work, WaitRethrowsTheErrorAndWaitForDoesNot) {
  Work work("test op", 1s);
  std::thread completer([&] {
    work.complete(std::make_exception_ptr(
        CommError(CommErrorKind::kTransport, "boom", "g", "allreduce", 3, 1)));
  });
  EXPECT_THROW(work.wait(), CommError);
  completer.join();
  EXPECT_TRUE(work.wait_for(0ms));
  EXPECT_NE(work.error(), nullptr);
}

TEST(Work, WaitTimesOutWhenNeverCompleted) {
  Work work("stuck op", 100ms);
  const auto t0 = Clock::now();
  EXPECT_THROW(work.wait(), TimeoutError);
  EXPECT_GE(Clock::now() - t0, 1200ms);  // 2 x timeout + 1 s: a safety net
  EXPECT_LT(Clock::now() - t0, 3s);
}

TEST(Work, WaitReturnsAfterCallbacksAndACallbackMayWaitForItsOwnWork) {
  Work work("op", 1s);
  std::atomic<bool> callback_done{false};
  work.then([&](Work& w) {
    w.wait();                           // must not wait for itself
    std::this_thread::sleep_for(50ms);  // a slow callback: wait() below must see it finished
    callback_done = true;
  });
  std::thread completer([&] { work.complete(); });
  work.wait();
  EXPECT_TRUE(callback_done);
  completer.join();
}

// What a callback holds (the torch layer keeps a collective's input tensor alive in one) is
// released before wait() returns, so that memory the caller frees after the wait is free then.
TEST(Work, WaitReturnsAfterWhatTheCallbacksHeldIsReleased) {
  struct SlowToRelease {
    explicit SlowToRelease(std::atomic<bool>* flag) : released(flag) {}
    SlowToRelease(const SlowToRelease&) = delete;
    SlowToRelease& operator=(const SlowToRelease&) = delete;
    ~SlowToRelease() {
      std::this_thread::sleep_for(50ms);  // wait() below must not return before this ends
      *released = true;
    }
    std::atomic<bool>* released;
  };
  std::atomic<bool> released{false};
  auto work = std::make_shared<Work>("op", 1s);
  {
    auto held = std::make_shared<SlowToRelease>(&released);
    work->then([held](Work&) {});
  }
  std::thread completer([&] { work->complete(); });
  work->wait();
  EXPECT_TRUE(released);
  completer.join();
}

TEST(Work, ThrowingCallbackDoesNotEscape) {
  Work work("op", 1s);
  work.then([](Work&) { throw std::runtime_error("callback bug"); });
  EXPECT_NO_THROW(work.complete());
}

TEST(Work, AndThenStartsTheNextStageAndCompletesWithIt) {
  auto first = std::make_shared<Work>("first", 1s);
  auto second = std::make_shared<Work>("second", 1s);
  int calls = 0;
  auto chain = first->and_then([&](Work& done) {
    EXPECT_TRUE(done.is_completed());
    ++calls;
    return second;
  });
  EXPECT_EQ(calls, 0);
  first->complete();
  EXPECT_EQ(calls, 1);
  EXPECT_FALSE(chain->is_completed());  // waits for the stage the continuation started
  second->set_result(std::string("done"));
  second->complete();
  EXPECT_TRUE(chain->is_completed());
  EXPECT_NO_THROW(chain->wait());
  EXPECT_EQ(chain->result_as<std::string>(), "done");
  EXPECT_THROW(chain->result_as<int>(), ConfigError);
}

TEST(Work, AndThenPassesErrorsOnWithoutCallingTheContinuation) {
  auto failing = std::make_shared<Work>("first", 1s);
  bool called = false;
  auto chain = failing->and_then([&](Work&) -> std::shared_ptr<Work> {
    called = true;
    return nullptr;
  });
  failing->complete(std::make_exception_ptr(TimeoutError("first timed out")));
  EXPECT_FALSE(called);
  EXPECT_THROW(chain->wait(), TimeoutError);
  // A continuation that throws completes the chain with its exception; one that returns nullptr
  // completes it at once with the stage's result.
  auto done = std::make_shared<Work>("done", 1s);
  done->set_result(7);
  done->complete();
  auto thrower =
      done->and_then([](Work&) -> std::shared_ptr<Work> { throw ConfigError("no next stage"); });
  EXPECT_THROW(thrower->wait(), ConfigError);
  auto empty = done->and_then([](Work&) { return std::shared_ptr<Work>(); });
  EXPECT_NO_THROW(empty->wait());
  EXPECT_EQ(empty->result_as<int>(), 7);
}

TEST(ProcessGroupDefaults, LocalRankAndSizeNameTheBackendWhenUnknown) {
  TempDir dir;
  auto group = make_group(dir.path(), 0, 1);
  try {
    (void)group->local_size();
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("ring"), std::string::npos) << e.what();
    return;
  }
  SUCCEED() << "the ring backend knows its hosts (overridden)";
}

TEST(RingGroup, SingleRankCollectivesCopyOrKeep) {
  TempDir dir;
  auto pg = make_group(dir.path(), 0, 1);
  EXPECT_EQ(pg->backend(), "ring");
  EXPECT_EQ(pg->size(), 1);
  std::vector<float> in{1, 2, 3}, out(3);
  pg->allreduce(in.data(), out.data(), 3, DType::kFloat32, ReduceOp::kAvg)->wait();
  EXPECT_EQ(out, in);
  pg->barrier()->wait();
  EXPECT_EQ(pg->new_group({0})->size(), 1);
}

TEST(RingGroup, BadArgumentsThrowConfigErrorAtOnce) {
  TempDir dir;
  auto pg = make_group(dir.path(), 0, 1);
  std::vector<float> buf(4);
  EXPECT_THROW(pg->allreduce(nullptr, 4, DType::kFloat32, ReduceOp::kSum), ConfigError);
  EXPECT_NO_THROW(pg->allreduce(nullptr, 0, DType::kFloat32, ReduceOp::kSum)->wait());
  EXPECT_THROW(pg->broadcast(buf.data(), 4, DType::kFloat32, 1), ConfigError);
  EXPECT_THROW(pg->reduce(buf.data(), buf.data(), 4, DType::kFloat32, ReduceOp::kSum, -1),
               ConfigError);
  EXPECT_THROW(pg->send(buf.data(), 4, DType::kFloat32, 0), ConfigError);  // itself
  EXPECT_THROW(pg->allreduce(buf.data(), 4, static_cast<DType>(42), ReduceOp::kSum), ConfigError);
  EXPECT_THROW(pg->allreduce(buf.data(), 4, DType::kFloat32, static_cast<ReduceOp>(9)),
               ConfigError);
  EXPECT_THROW(pg->new_group({}), ConfigError);
  EXPECT_THROW(pg->new_group({0, 0}), ConfigError);
  EXPECT_THROW(pg->new_group({1}), ConfigError);
  try {
    pg->broadcast(buf.data(), 4, DType::kFloat32, 7);
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("root 7"), std::string::npos) << e.what();
  }
  auto store = std::make_shared<FileStore>(dir.path());
  EXPECT_THROW(make_ring_process_group(store, 2, 2), ConfigError);
  EXPECT_THROW(make_ring_process_group(nullptr, 0, 1), ConfigError);
  EXPECT_THROW(make_ring_process_group(store, 0, 1, {.chunk_bytes = 8}), ConfigError);
}

// A rank whose peers never come fails at its deadline, naming who is missing.
TEST(RingGroup, MissingPeersFailAtTheTimeoutNamingThem) {
  TempDir dir;
  const auto t0 = Clock::now();
  try {
    make_group(dir.path(), 0, 3, {.timeout = 500ms});
    FAIL() << "expected CommError";
  } catch (const CommError& e) {
    EXPECT_NE(std::string(e.what()).find("ranks 1, 2"), std::string::npos) << e.what();
  }
  EXPECT_LT(Clock::now() - t0, 3s);
}

class EnvGuard {
 public:
  EnvGuard(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    ::setenv(name, value, 1);
  }
  ~EnvGuard() {
    if (old_) {
      ::setenv(name_, old_->c_str(), 1);
    } else {
      ::unsetenv(name_);
    }
  }

 private:
  const char* name_;
  std::optional<std::string> old_;
};

TEST(RingGroup, DdpTimeoutEnvironmentAppliesWhenNoTimeoutIsGiven) {
  TempDir dir;
  EnvGuard env("DDP_TIMEOUT", "0.4");
  auto store = std::make_shared<FileStore>(dir.path());
  const auto t0 = Clock::now();
  EXPECT_THROW(make_ring_process_group(store, 0, 2, {.advertise_host = "127.0.0.1"}), CommError);
  const auto elapsed = Clock::now() - t0;
  EXPECT_GE(elapsed, 350ms);
  EXPECT_LT(elapsed, 3s);
  // An explicit RingOptions::timeout wins over the environment.
  TempDir dir2;
  auto store2 = std::make_shared<FileStore>(dir2.path());
  const auto t1 = Clock::now();
  EXPECT_THROW(
      make_ring_process_group(store2, 0, 2, {.timeout = 1200ms, .advertise_host = "127.0.0.1"}),
      CommError);
  EXPECT_GE(Clock::now() - t1, 1100ms);
}

TEST(RingGroup, BadDdpTimeoutIsAConfigError) {
  TempDir dir;
  EnvGuard env("DDP_TIMEOUT", "soon");
  auto store = std::make_shared<FileStore>(dir.path());
  try {
    make_ring_process_group(store, 0, 1);
    FAIL() << "expected ConfigError";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("DDP_TIMEOUT='soon'"), std::string::npos) << e.what();
  }
}

// A fake "rank 0" answers the handshake of a real rank 1 with the wrong values.
std::string handshake_error_with_fake_rank0(std::uint32_t magic, const std::string& group,
                                            std::int32_t claimed_rank) {
  TempDir dir;
  auto store = std::make_shared<FileStore>(dir.path());
  net::Socket listener = net::listen_tcp("127.0.0.1", 0);
  store->add("ring/default/joins", 1);  // the fake rank 0 joined generation 0
  store->set("ring/default/0/addr/0", fmt::format("127.0.0.1:{}", listener.local_port()));
  std::thread fake([&] {
    net::Socket conn = net::accept_tcp(listener, net::deadline_after(5s));
    std::uint32_t header[6];
    conn.recv_all(header, sizeof header, net::deadline_after(5s));
    std::string name(header[5], '\0');
    conn.recv_all(name.data(), name.size(), net::deadline_after(5s));
    std::int32_t reply[6];
    reply[0] = static_cast<std::int32_t>(magic);
    reply[1] = static_cast<std::int32_t>(comm::kProtocolVersion);
    reply[2] = 2;
    reply[3] = claimed_rank;
    reply[4] = 1;
    reply[5] = static_cast<std::int32_t>(group.size());
    conn.send_all(reply, sizeof reply, net::deadline_after(5s));
    conn.send_all(group.data(), group.size(), net::deadline_after(5s));
    char byte;
    try {
      conn.recv_all(&byte, 1, net::deadline_after(5s));  // until rank 1 hangs up
    } catch (const std::exception&) {
    }
  });
  std::string message;
  try {
    make_ring_process_group(store, 1, 2, {.timeout = 3s, .advertise_host = "127.0.0.1"});
  } catch (const CommError& e) {
    message = e.what();
  }
  fake.join();
  return message;
}

TEST(RingGroup, HandshakeChecksMagicGroupAndRank) {
  EXPECT_NE(handshake_error_with_fake_rank0(0x12345678, "default", 0).find("does not speak"),
            std::string::npos);
  const std::string other_group =
      handshake_error_with_fake_rank0(comm::kHandshakeMagic, "other", 0);
  EXPECT_NE(other_group.find("group 'other'"), std::string::npos) << other_group;
  EXPECT_NE(other_group.find("group 'default'"), std::string::npos) << other_group;
  const std::string wrong_rank =
      handshake_error_with_fake_rank0(comm::kHandshakeMagic, "default", 1);
  EXPECT_NE(wrong_rank.find("expected rank 0 but rank 1 answered"), std::string::npos)
      << wrong_rank;
}

}  // namespace DDP_UNITY_ID
}  // namespace
}  // namespace ddp::test
