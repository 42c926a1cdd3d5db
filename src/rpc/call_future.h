// The result of one RPC as the transport sees it (internal; agent.h): bytes, or a failure that
// says what kind of failure it was. A CallPromise completes once; its CallFuture waits for it or
// runs callbacks after it. The agent completes every future it hands out by the call's deadline at
// the latest (a timer fails the calls whose deadline passed), so wait() never waits forever.
//
// Threads: any thread may wait, add callbacks and complete. Callbacks added before completion
// run on the executor given to the promise (never on the thread reading the connection, which a
// callback that blocks would stall); added after completion, at once on the adding thread.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace ddp::rpc::transport {

// Leaves the bytes of `Bytes(n)` and `resize(n)` uninitialised: a message is received into them
// at once, and zeroing a megabyte first costs as much as receiving it (issue 51's echo).
template <typename T>
struct UninitialisedAllocator : std::allocator<T> {
  template <typename U>
  struct rebind {
    using other = UninitialisedAllocator<U>;
  };
  UninitialisedAllocator() = default;
  template <typename U>
  UninitialisedAllocator(const UninitialisedAllocator<U>&) noexcept {}
  template <typename U>
  void construct(U* p) noexcept {
    ::new (static_cast<void*>(p)) U;
  }
  template <typename U, typename... Args>
  void construct(U* p, Args&&... args) {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
};

using Bytes = std::vector<std::uint8_t, UninitialisedAllocator<std::uint8_t>>;

// Bytes that follow a message's own on the wire, sent from where they lie (a tensor's storage)
// without a copy: the receiver gets one payload, the message's bytes then each attachment's.
// `keep` holds the memory until the message is sent.
struct Attachment {
  const std::uint8_t* data = nullptr;
  std::size_t size = 0;
  std::shared_ptr<const void> keep;
};

// A message to send: its bytes, then its attachments'.
struct Outgoing {
  Bytes bytes;
  std::vector<Attachment> attachments;
  std::size_t size() const;
  // All of it in one buffer (for a call to this worker itself, which nothing sends).
  Bytes flatten() &&;
};

enum class FailureKind : std::uint8_t {
  kRemoteException = 1,  // the function threw: type_name and message are the callee's
  kUnknownFunction = 2,  // the callee has no function of that name
  kWorkerGone = 3,       // the connection to the worker closed or failed mid-call
  kTimeout = 4,          // the call's deadline passed
  kShutdown = 5,         // the agent was shut down before the call completed
  kProtocol = 6,         // the peer broke the wire protocol
  kUnknownWorker = 7,    // no worker of that name or rank
  kCallerError = 8,      // refused before sending (e.g. a message over the limit)
  kBadArguments = 9,     // the callee could not decode the arguments
};
inline constexpr std::uint8_t kLastFailureKind = 9;

std::string to_string(FailureKind kind);

struct Failure {
  FailureKind kind = FailureKind::kRemoteException;
  std::string type_name;  // kRemoteException: the callee's exception type
  std::string message;    // the whole text, naming the worker and the function
};

struct Reply {
  Bytes payload;
  std::optional<Failure> failure = std::nullopt;
  std::vector<Attachment> attachments = {};  // sent after `payload`; empty in a received reply
  bool ok() const { return !failure.has_value(); }
};

using Executor = std::function<void(std::function<void()>)>;

// How long a thread that waits for a call, or for work in the agent's pool, first yields its core
// in a loop before it sleeps (process-wide; the agent sets it from AgentOptions): a round trip on
// one host takes tens of microseconds, and a thread woken from sleep adds 10-20 of them (issue
// 51's empty call). Zero: sleep at once.
inline constexpr std::chrono::microseconds kDefaultSpinBeforeSleep{100};
void set_spin_before_sleep(std::chrono::microseconds spin);
std::chrono::microseconds spin_before_sleep();

// What a thread that spins while it waits (for a call's reply, for a task of the agent's pool)
// does besides looking: read the connection its work comes on itself, so that no reader sleeping
// on that connection has to be woken for it (agent_spin.cc). poll() between looks; end(found)
// once, when the spin ends, saying whether what it waited for came.
struct SpinHook {
  virtual ~SpinHook() = default;
  virtual void poll() = 0;
  virtual void end(bool found) = 0;
};

class CallFuture {
 public:
  CallFuture() = default;
  bool valid() const { return state_ != nullptr; }
  bool done() const;
  // Blocks until the call completes; the reply stays readable as long as the future lives. On a
  // temporary (`agent.call(...).wait()`) a copy, which outlives it. The waiter first yields its
  // core in a loop for up to spin_before_sleep(), then sleeps.
  const Reply& wait() const&;
  Reply wait() && { return static_cast<const CallFuture&>(*this).wait(); }
  void then(std::function<void(const Reply&)> callback) const;
  // For the future's only consumer: wait() or then() that moves the reply (its payload) out of
  // the future instead of lending it, so that a large payload is decoded where it was received.
  Reply take() const;
  void then_take(std::function<void(Reply)> callback) const;

 private:
  friend class CallPromise;
  struct State;
  void spin_until_ready() const;
  void sleep_until_done(std::unique_lock<std::mutex>& lock) const;
  explicit CallFuture(std::shared_ptr<State> state) : state_(std::move(state)) {}
  std::shared_ptr<State> state_;
};

class CallPromise {
 public:
  CallPromise() = default;
  explicit CallPromise(Executor executor);
  CallFuture future() const { return CallFuture(state_); }
  // Completes the call; false (and nothing changes) when it had completed already, which is how
  // a reply that arrives after its deadline's failure is dropped.
  bool complete(Reply reply) const;
  bool fail(FailureKind kind, std::string message, std::string type_name = {}) const;
  // The first thread that spins waiting for this call runs `hook` (set before the future is
  // handed out).
  void set_spin_hook(std::shared_ptr<SpinHook> hook) const;
  // The reply is arriving (a large one is being read): wakes a thread sleeping in wait() or
  // take() to look for it as it does before it sleeps, so that completion does not wait for the
  // wake-up. Harmless when nobody waits.
  void expect_completion() const;
  bool valid() const { return state_ != nullptr; }

 private:
  std::shared_ptr<CallFuture::State> state_;
};

struct CallFuture::State {
  std::mutex mutex;
  std::condition_variable cv;
  bool done = false;
  // `done` as a waiter may read it without the mutex, while it spins before sleeping.
  std::atomic<bool> ready{false};
  bool woken_early = false;             // expect_completion(), under the mutex
  std::shared_ptr<SpinHook> spin_hook;  // under the mutex; taken by the first spin
  Reply reply;
  std::vector<std::function<void(const Reply&)>> callbacks;
  Executor executor;
};

}  // namespace ddp::rpc::transport
