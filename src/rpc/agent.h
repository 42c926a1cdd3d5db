// The RPC agent: ddp's transport for remote calls between named workers (the role of PyTorch's
// TensorPipe agent), torch-free. The torch layer's rpc room (src/torch/rpc) puts values, RRefs
// and distributed autograd on top; this layer moves bytes.
//
//   rpc::transport::Agent agent(store, {.name = "ps", .rank = 0, .world_size = 3, .secret =
//   secret}); agent.register_function("echo", [](const CallerInfo&, Bytes in, const CallPromise&
//   reply) {
//     reply.complete({std::move(in)});
//   });
//   CallFuture f = agent.call(1, "echo", bytes, 5s);      // never blocks on the peer
//   const Reply& r = f.wait();                            // r.failure names what went wrong
//   agent.shutdown(30s);                                  // every worker, together
//
// Start-up (the constructor) publishes this worker in the store, checks that the workers agree
// (names unique, one world size) and connects every worker to every other, each connection
// opened by a handshake that authenticates it with the job's secret (handshake.h). Each worker
// then holds one connection per peer for its own calls (their replies come back on it) and one
// from each peer for the peer's calls.
//
// Calls: every call has a deadline; a timer fails it with kTimeout when it passes, whatever the
// callee does. A connection that closes or breaks fails every call waiting on it with
// kWorkerGone naming the worker, and later calls to that worker fail at once. Requests run on a
// pool of `threads` threads; a handler completes its reply (from any thread, now or later: the
// reply is sent on the thread that completes it, so complete it from a thread that may block
// for a send, never from a callback of a connection's reader); an
// exception out of a handler is sent back as kRemoteException with its type and text; a call of
// a name the callee never registered is kUnknownFunction naming what it has. A call to oneself
// runs the handler here, without a connection.
//
// Between workers of one host (same kernel and pid namespace), each side of a connection offers
// a shared-memory ring with its first payload of 16 KiB or more (shared_ring.h); once the peer
// has mapped it, such payloads skip the kernel's copies while their frames still travel, in
// order, on the connection. A peer that cannot map it (another host, a /proc it may not read)
// says so, and everything stays on TCP.
//
// Threads that spin while they wait read their connections themselves (agent_spin.cc): a caller
// that says it waits at once (call_attached's caller_spins) reads its reply, the pool's spinning
// thread the requests; the connections' reader threads sleep meanwhile instead of being woken
// by each frame, and take over when the spinners stop.
//
// Reading: every frame's header is checked (frame.h) before its lengths are trusted; a peer that
// breaks the protocol loses its connection (its calls fail with kProtocol), nothing else. A
// connection that does not pass the handshake within `timeout` is closed.
//
// shutdown() is graceful and collective: it waits for this worker's calls to complete, then for
// every worker to reach the same point (through the store), then stops. stop() (and the
// destructor) stop at once, failing what is still waiting with kShutdown.
//
// Threads: every member may be called from any thread.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <shared_mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "ddp/store/store.h"
#include "ddp/timeouts.h"
#include "net/socket.h"
#include "rpc/call_future.h"
#include "rpc/frame.h"
#include "rpc/handshake.h"
#include "rpc/task_pool.h"
#include "rpc/worker_directory.h"

namespace ddp::rpc::transport {

struct CallerInfo {
  int rank = 0;
  std::string name;
  net::Deadline deadline;  // the caller's deadline, as far as this worker's clock knows
};

using Handler =
    std::function<void(const CallerInfo& caller, Bytes request, const CallPromise& reply)>;

struct AgentOptions {
  std::string name;
  int rank = 0;
  int world_size = 1;
  // The address the other workers reach this one at ("" = this host's name), and the address to
  // listen on ("" = every address).
  std::string host;
  std::string bind_host;
  std::string secret;  // "" = no authentication
  // Start-up, each handshake, a frame's bytes once it started, and the shut-down's wait.
  Milliseconds timeout = kDefaultTimeout;
  std::uint64_t max_message_bytes = std::uint64_t{1} << 30;
  int threads = 16;
  // The shared-memory ring each side of a connection between workers of one host writes its
  // payloads of 16 KiB and more into (shared_ring.h), made with the first such payload; a payload
  // larger than the room left goes by TCP. 0: every byte goes by TCP.
  std::size_t shared_memory_bytes = std::size_t{4} << 20;
  // call_future.h's spin_before_sleep, set for the process while this agent runs.
  std::chrono::microseconds spin_before_sleep = kDefaultSpinBeforeSleep;
  // Keys in the store: <prefix>/<instance>/...; the instance counts this process's agents, so a
  // job that starts RPC again after a shut-down (every worker alike) gets fresh keys.
  std::string store_prefix = "rpc";
  // Registered before the worker is published (register_function works later too, but a peer may
  // call before it).
  std::vector<std::pair<std::string, Handler>> functions;
};

class Agent {
 public:
  Agent(Store& store, AgentOptions options);
  ~Agent();
  Agent(const Agent&) = delete;
  Agent& operator=(const Agent&) = delete;

  // Registers (or replaces) the function `name`. Calls that arrive before it is registered get
  // kUnknownFunction.
  void register_function(const std::string& name, Handler handler);

  const WorkerInfo& self() const { return workers_[static_cast<std::size_t>(options_.rank)]; }
  const std::vector<WorkerInfo>& workers() const { return workers_; }
  const WorkerInfo* find_worker(std::string_view name) const;

  CallFuture call(int to_rank, const std::string& function, Bytes payload, Milliseconds timeout);
  // The same with attachments sent from where they lie (call_future.h). `caller_spins`: the
  // calling thread waits for the reply at once (wait() or take()); while it spins it reads the
  // reply off the connection itself, no connection reader woken for it (agent_spin.cc).
  CallFuture call_attached(int to_rank, const std::string& function, Outgoing payload,
                           Milliseconds timeout, bool caller_spins = false);

  // Runs `task` on the agent's pool (false once stopped).
  bool post(std::function<void()> task) { return pool_.post(std::move(task)); }
  Executor executor();

  // Neither from a handler or a callback (they run on the pool these join).
  void shutdown(Milliseconds timeout);
  void stop();

  // Calls of this worker not yet complete.
  std::size_t pending_calls() const;
  // Why the connection to `rank` broke ("" while it is up).
  std::string broken_reason(int rank) const;
  // Connections refused or closed for breaking the protocol, for tests and logs.
  std::int64_t refused_connections() const { return refused_.load(); }
  // Payloads sent through a shared-memory ring, and peers' rings this worker would not map.
  std::int64_t ring_payloads_sent() const { return ring_payloads_sent_.load(); }
  std::int64_t ring_offers_refused() const { return ring_offers_refused_.load(); }

 private:
  struct Connection;
  struct Pending {
    CallPromise promise;
    int to_rank = 0;
    std::string function;
    Milliseconds timeout{0};
    std::multimap<net::Deadline, std::uint64_t>::iterator deadline_entry;
    std::shared_ptr<Connection> connection;  // null for a call to this worker
    bool uncovered = false;  // counted in connection->uncovered: nobody spins for its reply
  };
  // Whether the agent still runs, for the threads that spin in its code (agent_spin.cc).
  struct Life {
    std::shared_mutex mutex;
    bool alive = true;
  };
  class CallerSpin;
  class PoolSpin;

  void accept_loop();
  void reap_finished();
  void complete_call(std::uint64_t call_id, int from_rank, Reply reply);
  void serve_inbound(std::shared_ptr<Connection> connection);
  void read_frames(const std::shared_ptr<Connection>& connection);
  // Reads and handles one frame (under connection->read_mutex); false when the connection failed.
  bool read_one_frame(const std::shared_ptr<Connection>& connection);
  // agent_spin.cc: a spinning thread reads a frame if one is there (true: it did).
  bool try_read(const std::shared_ptr<Connection>& connection, bool for_pool);
  bool park(Connection& connection);
  static void unpark(Connection& connection);
  void uncover(std::uint64_t call_id);
  static void release_cover(const Pending& pending);
  void set_up_spinning();
  std::shared_ptr<SpinHook> caller_spin(const std::shared_ptr<Connection>& connection,
                                        std::uint64_t call_id);
  void connection_failed(Connection& connection, const std::string& reason, FailureKind kind);
  void dispatch(const std::shared_ptr<Connection>& connection, std::uint64_t call_id,
                std::uint32_t timeout_ms, std::string function, Bytes payload);
  void run_handler(int caller_rank, net::Deadline deadline, const std::string& function,
                   Bytes payload, const CallPromise& reply);
  void send_frame(Connection& connection, FrameHeader header, std::string_view name,
                  const Bytes& payload, const std::vector<Attachment>& attachments,
                  net::Deadline deadline);
  bool ring_has_room(Connection& connection, std::size_t total, net::Deadline deadline);
  void offer_ring(Connection& connection, net::Deadline deadline);
  void expect_completion(std::uint64_t call_id, int from_rank);
  void read_ring_frame(const std::shared_ptr<Connection>& connection, const FrameHeader& header,
                       const Bytes& payload);
  void send_reply(const std::shared_ptr<Connection>& connection, std::uint64_t call_id,
                  const Reply& reply);
  void timer_loop();
  void fail_call(std::uint64_t call_id, FailureKind kind, const std::string& message);
  std::string who(int rank) const;

  Store& store_;
  AgentOptions options_;
  std::string prefix_;
  HandshakeSelf handshake_self_;
  FrameLimits limits_;
  std::vector<WorkerInfo> workers_;
  TaskPool pool_;
  std::shared_ptr<Life> life_ = std::make_shared<Life>();
  std::unique_ptr<PoolSpin> pool_spin_;
  // The inbound connections, fixed once start-up has them all, for the pool's spinning thread.
  std::vector<std::shared_ptr<Connection>> inbound_snapshot_;
  std::atomic<bool> inbound_ready_{false};
  // Until when (steady-clock ns) the pool's spinning thread reads the inbound connections.
  std::atomic<std::int64_t> pool_lease_until_{0};

  net::Socket listener_;
  std::thread acceptor_;
  std::atomic<bool> stopping_{false};
  std::atomic<std::int64_t> refused_{0};
  std::atomic<std::int64_t> ring_payloads_sent_{0};
  std::atomic<std::int64_t> ring_offers_refused_{0};
  std::string shared_memory_domain_;  // net::shared_memory_domain(); "" = never share

  mutable std::mutex connections_mutex_;
  std::condition_variable connections_cv_;
  std::vector<std::shared_ptr<Connection>> outbound_;  // by rank; null for self
  std::vector<std::shared_ptr<Connection>> inbound_;   // by rank, once its handshake passed
  std::vector<std::shared_ptr<Connection>> all_connections_;
  std::vector<std::string> broken_;  // by rank
  int handshakes_running_ = 0;

  mutable std::shared_mutex handlers_mutex_;
  std::map<std::string, Handler, std::less<>> handlers_;

  mutable std::mutex pending_mutex_;
  std::condition_variable pending_cv_;
  std::unordered_map<std::uint64_t, Pending> pending_;
  std::uint64_t next_call_id_ = 1;
  std::multimap<net::Deadline, std::uint64_t> deadlines_;
  std::condition_variable timer_cv_;
  // Until when the timer sleeps (max: no deadline; under pending_mutex_): a call whose deadline
  // is later need not wake it.
  net::Deadline timer_wakes_at_ = net::Deadline::max();
  bool timer_stop_ = false;
  std::thread timer_;
  std::once_flag stopped_;
};

}  // namespace ddp::rpc::transport
