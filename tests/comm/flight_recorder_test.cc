// comm::FlightRecorder: the ring of the last N operations (wrap-around, fields, states), its JSON
// dump (valid, atomic, a folder that cannot be written is a warning), the OpQueue's hooks (a
// failure dumps with the failing and the queued operations), SIGUSR1 dumps, and the settings.
#include "comm/flight_recorder.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "comm/flight_dump_signal.h"
#include "comm/op_queue.h"
#include "ddp/comm/comm_error.h"
#include "ddp/error.h"
#include "settings/settings.h"
#include "support/temp_dir.h"
#include "support/unity_namespace.h"

namespace ddp::test {
namespace {
namespace DDP_UNITY_ID {

using namespace std::chrono_literals;
using comm::FlightChannel;
using comm::FlightRecorder;
using comm::FlightState;
using nlohmann::json;

comm::OpHeader header(Collective kind, std::uint64_t count, int root = -1) {
  comm::OpHeader h;
  h.kind = kind;
  h.dtype = static_cast<std::uint8_t>(DType::kFloat32);
  h.reduce_op = kind == Collective::kAllreduce ? static_cast<std::uint8_t>(ReduceOp::kSum)
                                               : comm::kNoReduceOp;
  h.count = count;
  h.root = root;
  h.algorithm = comm::Algorithm::kRing;
  return h;
}

json read_json(const std::filesystem::path& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return json::parse(text.str());  // throws on invalid JSON
}

net::Clock::time_point at(int us) {
  return net::Clock::time_point(std::chrono::microseconds(1'000'000 + us));
}

TEST(FlightRecorder, KeepsTheLastNOperationsOldestFirstAcrossWrapAround) {
  std::mutex guard;
  FlightRecorder recorder({.group = "g", .rank = 1, .size = 2}, {.entries = 4}, guard);
  std::lock_guard lock(guard);
  std::vector<FlightRecorder::Handle> handles;
  for (int i = 0; i < 10; ++i) {
    const auto h = header(Collective::kAllreduce, 100 + i);
    handles.push_back(
        recorder.record_enqueued(&h, FlightChannel::kCollective, -1, 50 + i, at(i * 10)));
  }
  const auto entries = recorder.snapshot();
  ASSERT_EQ(entries.size(), 4u);
  for (std::size_t k = 0; k < 4; ++k) {
    EXPECT_EQ(entries[k].id, 6 + k);
    EXPECT_EQ(entries[k].sequence, 56 + k);
    EXPECT_EQ(entries[k].count, 106 + k);
    EXPECT_EQ(entries[k].state, FlightState::kQueued);
  }
  // An operation whose entry was overwritten changes nothing.
  recorder.record_started(handles[2], at(500));
  recorder.record_ended(handles[2], at(600), true);
  for (const auto& e : recorder.snapshot())
    EXPECT_EQ(e.state, FlightState::kQueued) << "entry " << e.id;
}

TEST(FlightRecorder, RecordsFieldsStatesAndTimes) {
  std::mutex guard;
  FlightRecorder recorder({.group = "g"}, {.entries = 8}, guard);
  std::lock_guard lock(guard);
  const auto bcast = header(Collective::kBroadcast, 64, 1);
  const auto a = recorder.record_enqueued(&bcast, FlightChannel::kCollective, -1, 0, at(1));
  const auto b = recorder.record_enqueued(nullptr, FlightChannel::kSend, 3, 7, at(2));
  const auto c = recorder.record_enqueued(&bcast, FlightChannel::kCollective, -1, 1, at(3));
  recorder.record_started(a, at(10));
  recorder.record_ended(a, at(20), true);
  recorder.record_started(b, at(30));
  recorder.record_ended(b, at(40), false);
  recorder.record_ended(b, at(50), true);  // a failure stays a failure
  recorder.record_cancelled(c);
  const auto e = recorder.snapshot();
  ASSERT_EQ(e.size(), 3u);
  EXPECT_EQ(e[0].kind, Collective::kBroadcast);
  EXPECT_EQ(e[0].root, 1);
  EXPECT_EQ(e[0].count, 64u);
  EXPECT_EQ(e[0].reduce_op, comm::kNoReduceOp);
  EXPECT_EQ(e[0].algorithm, comm::Algorithm::kRing);
  EXPECT_TRUE(e[0].has_fingerprint);
  EXPECT_EQ(e[0].state, FlightState::kCompleted);
  EXPECT_EQ(e[0].enqueued_ns, at(1).time_since_epoch().count());
  EXPECT_EQ(e[0].started_ns, at(10).time_since_epoch().count());
  EXPECT_EQ(e[0].ended_ns, at(20).time_since_epoch().count());
  EXPECT_FALSE(e[1].has_fingerprint);
  EXPECT_EQ(e[1].channel, FlightChannel::kSend);
  EXPECT_EQ(e[1].peer, 3);
  EXPECT_EQ(e[1].sequence, 7u);
  EXPECT_EQ(e[1].state, FlightState::kFailed);
  EXPECT_EQ(e[1].ended_ns, at(40).time_since_epoch().count());
  EXPECT_EQ(e[2].state, FlightState::kFailed);
  EXPECT_EQ(e[2].started_ns, 0);
}

TEST(FlightRecorder, OffRecordsAndDumpsNothing) {
  std::mutex guard;
  TempDir dir("ddp-flight");
  FlightRecorder recorder({.group = "g"}, {.entries = 0, .dump_dir = dir.path().string()}, guard);
  EXPECT_FALSE(recorder.enabled());
  {
    std::lock_guard lock(guard);
    const auto h = header(Collective::kAllreduce, 1);
    recorder.record_enqueued(&h, FlightChannel::kCollective, -1, 0, at(0));
    EXPECT_TRUE(recorder.snapshot().empty());
  }
  EXPECT_EQ(recorder.dump("failure", "x"), "");
  EXPECT_TRUE(std::filesystem::is_empty(dir.path()));
}

TEST(FlightRecorder, DumpIsValidJsonWithTheIdentityAndEntries) {
  std::mutex guard;
  TempDir dir("ddp-flight");
  FlightRecorder recorder({.group = "default/sub0",
                           .backend = "ring",
                           .rank = 1,
                           .size = 2,
                           .job_rank = 3,
                           .job_world_size = 4},
                          {.entries = 16, .dump_dir = dir.path().string()}, guard);
  {
    std::lock_guard lock(guard);
    const auto h = header(Collective::kAllreduce, 256);
    const auto now = net::Clock::now();
    const auto a = recorder.record_enqueued(&h, FlightChannel::kCollective, -1, 0, now);
    recorder.record_started(a, now + 1us);
    recorder.record_ended(a, now + 5us, true);
    recorder.record_enqueued(&h, FlightChannel::kCollective, -1, 1, now + 6us);
  }
  const std::string path = recorder.dump("timeout", "rank 1 timed out \"quoted\"\nsecond line");
  EXPECT_EQ(std::filesystem::path(path).filename(), "ddp_flight_default_sub0_rank1.json");
  const json d = read_json(path);
  EXPECT_EQ(d["format"], "ddp-flight-recorder");
  EXPECT_EQ(d["version"], 1);
  EXPECT_EQ(d["group"], "default/sub0");
  EXPECT_EQ(d["backend"], "ring");
  EXPECT_EQ(d["rank"], 1);
  EXPECT_EQ(d["size"], 2);
  EXPECT_EQ(d["job_rank"], 3);
  EXPECT_EQ(d["job_world_size"], 4);
  EXPECT_EQ(d["pid"], ::getpid());
  EXPECT_FALSE(d["host"].get<std::string>().empty());
  EXPECT_EQ(d["reason"], "timeout");
  EXPECT_EQ(d["error"], "rank 1 timed out \"quoted\"\nsecond line");
  EXPECT_EQ(d["capacity"], 16);
  EXPECT_EQ(d["recorded"], 2);
  const auto now_us = std::chrono::duration_cast<std::chrono::microseconds>(
                          std::chrono::system_clock::now().time_since_epoch())
                          .count();
  EXPECT_NEAR(d["dump_time_unix_us"].get<double>(), static_cast<double>(now_us), 60e6);
  ASSERT_EQ(d["entries"].size(), 2u);
  const json& e = d["entries"][0];
  EXPECT_EQ(e["op"], "allreduce");
  EXPECT_EQ(e["dtype"], "float32");
  EXPECT_EQ(e["count"], 256);
  EXPECT_EQ(e["bytes"], 1024);
  EXPECT_EQ(e["reduce_op"], "sum");
  EXPECT_TRUE(e["root"].is_null());
  EXPECT_EQ(e["channel"], "collective");
  EXPECT_EQ(e["state"], "completed");
  EXPECT_EQ(e["duration_us"], 4);
  EXPECT_EQ(e["started_us"].get<std::int64_t>() - e["enqueued_us"].get<std::int64_t>(), 1);
  // Wall-clock times: within a minute of now.
  EXPECT_NEAR(e["ended_us"].get<double>(), static_cast<double>(now_us), 60e6);
  EXPECT_EQ(d["entries"][1]["state"], "queued");
  EXPECT_TRUE(d["entries"][1]["started_us"].is_null());
  // Written atomically: no temporary file is left behind.
  std::size_t files = 0;
  for ([[maybe_unused]] const auto& f : std::filesystem::directory_iterator(dir.path()))
    ++files;
  EXPECT_EQ(files, 1u);
}

TEST(FlightRecorder, AFolderThatCannotBeWrittenIsAWarningNotAnError) {
  std::mutex guard;
  TempDir dir("ddp-flight");
  const std::string missing = (dir.path() / "no" / "such" / "folder").string();
  FlightRecorder recorder({.group = "g"}, {.entries = 4, .dump_dir = missing}, guard);
  {
    std::lock_guard lock(guard);
    recorder.record_enqueued(nullptr, FlightChannel::kCollective, -1, 0, at(0));
  }
  testing::internal::CaptureStderr();
  std::string path;
  EXPECT_NO_THROW(path = recorder.dump("failure", "boom"));
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_EQ(path, "");
  EXPECT_NE(err.find("could not write the flight recorder of group 'g'"), std::string::npos) << err;
  EXPECT_NE(err.find("DDP_DUMP_DIR"), std::string::npos) << err;
}

// The OpQueue records every operation and dumps on its first error, before the caller sees it.
class Work final : public comm::QueuedWork {
 public:
  Work(int id, Collective kind) : QueuedWork(5s, 8), id(id) { h = header(kind, 2); }
  std::string description() const override { return "op" + std::to_string(id); }
  const comm::OpHeader* fingerprint() const override { return &h; }
  const int id;
  comm::OpHeader h;
};

class Backend final : public comm::OpQueue::Runner {
 public:
  void run(comm::QueuedWork& work, net::Deadline) override {
    if (static_cast<Work&>(work).id == fail_id) {
      // Fails only once the test has queued what comes after it.
      const auto deadline = std::chrono::steady_clock::now() + 10s;
      while (!release.load() && std::chrono::steady_clock::now() < deadline)
        std::this_thread::sleep_for(1ms);
      throw CommError(kind, text, "g", "op", 0, 1);
    }
  }
  void on_poison(const std::string&) noexcept override {}
  int fail_id = -1;
  CommErrorKind kind = CommErrorKind::kTimeout;
  std::string text = "rank 0 timed out after 5 ms waiting for rank 1";
  std::atomic<bool> release{false};
};

struct Group {
  explicit Group(comm::OpQueue::Options options) : queue(backend, std::move(options)) {}
  Backend backend;
  comm::OpQueue queue;
};

TEST(FlightRecorder, TheQueueDumpsOnItsFirstErrorWithTheFailedAndQueuedOperations) {
  TempDir dir("ddp-flight");
  auto g = std::make_shared<Group>(
      comm::OpQueue::Options{.group = "g",
                             .rank = 0,
                             .size = 2,
                             .flight_recorder = {.entries = 16, .dump_dir = dir.path().string()},
                             .backend = "fake"});
  g->backend.fail_id = 2;
  g->queue.start(g);
  std::vector<std::shared_ptr<Work>> works;
  for (int i = 0; i < 5; ++i) {
    works.push_back(
        std::make_shared<Work>(i, i == 1 ? Collective::kBarrier : Collective::kAllreduce));
  }
  g->queue.enqueue(works[0]);
  g->queue.enqueue(works[1]);
  works[1]->wait();
  const auto file = dir.path() / "ddp_flight_g_rank0.json";
  EXPECT_FALSE(std::filesystem::exists(file)) << "no dump without a failure";
  for (int i = 2; i < 5; ++i)
    g->queue.enqueue(works[static_cast<std::size_t>(i)]);
  g->backend.release = true;
  EXPECT_THROW(works[2]->wait(), CommError);
  // The dump was written before the error reached the caller.
  ASSERT_TRUE(std::filesystem::exists(file));
  const json d = read_json(file);
  EXPECT_EQ(d["reason"], "timeout");
  EXPECT_EQ(d["backend"], "fake");
  EXPECT_NE(d["error"].get<std::string>().find("timed out"), std::string::npos);
  ASSERT_EQ(d["entries"].size(), 5u);
  EXPECT_EQ(d["entries"][0]["state"], "completed");
  EXPECT_EQ(d["entries"][1]["state"], "completed");
  EXPECT_EQ(d["entries"][1]["op"], "barrier");
  EXPECT_EQ(d["entries"][2]["state"], "failed");
  EXPECT_FALSE(d["entries"][2]["started_us"].is_null());
  EXPECT_FALSE(d["entries"][2]["ended_us"].is_null());
  for (int i = 0; i < 5; ++i)
    EXPECT_EQ(d["entries"][static_cast<std::size_t>(i)]["sequence"], i);
  // After the dump the queued ones fail without running; the recorder says so.
  EXPECT_THROW(works[4]->wait(), CommError);
  g->queue.dump_flight_recorder("signal", "");
  const json after = read_json(file);
  for (std::size_t i = 3; i < 5; ++i) {
    EXPECT_EQ(after["entries"][i]["state"], "failed");
    EXPECT_TRUE(after["entries"][i]["started_us"].is_null());
  }
  g->queue.stop();
}

// The dump's reason comes from the error's kind, never from its wording.
TEST(FlightRecorder, TheDumpReasonIsTheErrorKindNotItsText) {
  struct Case {
    CommErrorKind kind;
    const char* text;
    const char* reason;
  };
  for (const Case& c :
       {Case{CommErrorKind::kMismatch, "ranks disagree about call #2", "mismatch"},
        Case{CommErrorKind::kTimeout, "rank 1 never answered", "timeout"},
        Case{CommErrorKind::kPeerGone, "rank 1 timed out? no: it closed", "failure"},
        Case{CommErrorKind::kAborted, "a mismatch elsewhere", "failure"}}) {
    SCOPED_TRACE(c.text);
    TempDir dir("ddp-flight");
    auto g = std::make_shared<Group>(
        comm::OpQueue::Options{.group = "g",
                               .rank = 0,
                               .size = 2,
                               .flight_recorder = {.entries = 4, .dump_dir = dir.path().string()},
                               .backend = "fake"});
    g->backend.fail_id = 0;
    g->backend.kind = c.kind;
    g->backend.text = c.text;
    g->backend.release = true;
    g->queue.start(g);
    auto work = std::make_shared<Work>(0, Collective::kAllreduce);
    g->queue.enqueue(work);
    try {
      work->wait();
      ADD_FAILURE() << "the operation did not fail";
    } catch (const CommError& e) {
      EXPECT_EQ(e.kind(), c.kind);
    }
    EXPECT_EQ(read_json(dir.path() / "ddp_flight_g_rank0.json")["reason"], c.reason);
    g->queue.stop();
  }
}

// SIGUSR1: the handler only wakes the dump thread, which dumps every live recorder.
TEST(FlightRecorder, SigUsr1DumpsEveryLiveRecorder) {
  std::mutex guard_a, guard_b;
  TempDir dir("ddp-flight");
  FlightRecorder a({.group = "a", .rank = 0, .size = 1}, {.entries = 4, .dump_dir = dir.path()},
                   guard_a);
  FlightRecorder b({.group = "b", .rank = 0, .size = 1}, {.entries = 4, .dump_dir = dir.path()},
                   guard_b);
  {
    std::lock_guard lock_a(guard_a);
    std::lock_guard lock_b(guard_b);
    const auto h = header(Collective::kAllreduce, 4);
    a.record_enqueued(&h, FlightChannel::kCollective, -1, 0, net::Clock::now());
    b.record_enqueued(&h, FlightChannel::kCollective, -1, 0, net::Clock::now());
  }
  if (!comm::signal_dumps_installed()) {
    GTEST_SKIP() << "SIGUSR1 had a handler before ddp's (the test runner's?): not replaced";
  }
  ASSERT_EQ(::raise(SIGUSR1), 0);  // the process survives: ddp handles it
  const auto deadline = std::chrono::steady_clock::now() + 10s;
  const auto file_a = dir.path() / "ddp_flight_a_rank0.json";
  const auto file_b = dir.path() / "ddp_flight_b_rank0.json";
  while ((!std::filesystem::exists(file_a) || !std::filesystem::exists(file_b)) &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(5ms);
  }
  ASSERT_TRUE(std::filesystem::exists(file_a));
  ASSERT_TRUE(std::filesystem::exists(file_b));
  EXPECT_EQ(read_json(file_a)["reason"], "signal");
  EXPECT_EQ(read_json(file_b)["entries"].size(), 1u);
}

TEST(FlightRecorderSettings, EntriesDefaultOffAndBadValues) {
  const auto lookup = [](std::map<std::string, std::string> values) {
    return [values](const std::string& name) -> std::optional<std::string> {
      const auto it = values.find(name);
      if (it == values.end()) return std::nullopt;
      return it->second;
    };
  };
  EXPECT_EQ(settings::flight_recorder_entries(lookup({})), 2000u);
  EXPECT_EQ(settings::flight_recorder_entries(lookup({{"DDP_FLIGHT_RECORDER_ENTRIES", "0"}})), 0u);
  EXPECT_EQ(settings::flight_recorder_entries(lookup({{"DDP_FLIGHT_RECORDER_ENTRIES", "50"}})),
            50u);
  for (const char* bad : {"", "-1", "ten", "5x", "99999999999"}) {
    try {
      settings::flight_recorder_entries(lookup({{"DDP_FLIGHT_RECORDER_ENTRIES", bad}}));
      ADD_FAILURE() << "accepted '" << bad << "'";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("DDP_FLIGHT_RECORDER_ENTRIES"), std::string::npos);
    }
  }
  EXPECT_EQ(settings::dump_dir(lookup({{"DDP_DUMP_DIR", "/x"}})), "/x");
  EXPECT_EQ(settings::dump_dir(lookup({})), "");
  const auto place = settings::job_place(lookup({{"RANK", "3"}, {"WORLD_SIZE", "8"}}));
  EXPECT_EQ(place.rank, 3);
  EXPECT_EQ(place.world_size, 8);
  const auto mpi =
      settings::job_place(lookup({{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "2"}}));
  EXPECT_EQ(mpi.rank, 1);
  EXPECT_EQ(settings::job_place(lookup({{"RANK", "x"}})).rank, -1);
  // The wait warning (DDP_WAIT_WARN_SECONDS, seconds): default 30 s, 0 = never.
  EXPECT_EQ(settings::wait_warning(lookup({})), std::chrono::seconds(30));
  EXPECT_EQ(settings::wait_warning(lookup({{"DDP_WAIT_WARN_SECONDS", "0.25"}})), 250ms);
  EXPECT_EQ(settings::wait_warning(lookup({{"DDP_WAIT_WARN_SECONDS", "0"}})), 0ms);
  EXPECT_THROW(settings::wait_warning(lookup({{"DDP_WAIT_WARN_SECONDS", "-1"}})), ConfigError);
  EXPECT_THROW(settings::wait_warning(lookup({{"DDP_WAIT_WARN_SECONDS", "soon"}})), ConfigError);
}

}  // namespace DDP_UNITY_ID
}  // namespace
}  // namespace ddp::test
