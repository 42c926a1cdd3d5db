// The ring backend: bootstrap, the per-group queue and worker, failure handling, and the
// algorithms (prose and costs in docs/algorithms.md).
#include "ddp/ring_process_group.h"

#include <sys/socket.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <optional>
#include <thread>

#include <fmt/format.h>

#include "comm/exchange.h"
#include "comm/reduce_kernels.h"
#include "comm/wire.h"
#include "ddp/error.h"
#include "net/socket.h"

namespace ddp {
namespace {

using comm::Algorithm;
using comm::OpHeader;
using comm::OpKind;
using std::chrono::milliseconds;

milliseconds resolve_group_timeout(milliseconds configured) {
  if (configured.count() > 0) return configured;
  if (configured.count() < 0) {
    throw ConfigError(
        fmt::format("RingOptions::timeout is negative ({} ms); use a positive "
                    "value, or 0 for DDP_TIMEOUT / the default",
                    configured.count()));
  }
  if (const char* env = std::getenv("DDP_TIMEOUT"); env != nullptr && *env != '\0') {
    char* end = nullptr;
    const double seconds = std::strtod(env, &end);
    if (end == env || *end != '\0' || !(seconds > 0) || seconds > 1e9) {
      throw ConfigError(fmt::format(
          "DDP_TIMEOUT='{}' is not a positive number of seconds (e.g. DDP_TIMEOUT=60)", env));
    }
    return milliseconds(static_cast<long long>(seconds * 1000.0 + 0.5));
  }
  return kDefaultTimeout;
}

std::string advertise_host(const RingOptions& options) {
  if (!options.advertise_host.empty()) return options.advertise_host;
  if (const char* env = std::getenv("DDP_ADVERTISE_ADDR"); env != nullptr && *env != '\0') {
    return env;
  }
  return net::host_name();
}

// The handshake each connection starts with, in both directions.
struct Hello {
  std::uint32_t magic = comm::kHandshakeMagic;
  std::uint32_t version = comm::kProtocolVersion;
  std::int32_t size = 0;
  std::int32_t from_rank = 0;
  std::int32_t to_rank = 0;
  std::uint32_t name_length = 0;
};

class RingProcessGroup;

struct OpArgs {
  OpKind kind = OpKind::kAllreduce;
  const std::byte* send = nullptr;
  std::byte* recv = nullptr;
  std::size_t count = 0;
  DType dtype = DType::kFloat32;
  ReduceOp op = ReduceOp::kSum;
  int root = 0;
  int peer = -1;  // p2p
  bool is_recv = false;
  milliseconds timeout{0};
  OpHeader header;    // sent (and for collectives, expected)
  OpHeader expected;  // p2p recv: what the sender's header must be
  std::string description;
};

class RingWork final : public Work {
 public:
  RingWork(OpArgs args, std::weak_ptr<RingProcessGroup> group)
      : Work(args.description, args.timeout), args_(std::move(args)), group_(std::move(group)) {}
  const OpArgs& args() const { return args_; }

 protected:
  void help_until_completed() override;

 private:
  OpArgs args_;
  std::weak_ptr<RingProcessGroup> group_;
};

class RingProcessGroup final : public ProcessGroup,
                               public std::enable_shared_from_this<RingProcessGroup> {
 public:
  RingProcessGroup(std::shared_ptr<Store> store, int rank, int size, RingOptions options);
  ~RingProcessGroup() override;

  void start() {
    worker_ = std::thread([this] { worker_loop(); });
  }
  void connect_mesh();

  std::string_view backend() const override { return "ring"; }
  using ProcessGroup::allreduce;

  std::shared_ptr<Work> allreduce(const void* send, void* recv, std::size_t count, DType dtype,
                                  ReduceOp op, CallOptions options) override {
    check_buffer(send, count, "allreduce", "send");
    check_buffer(recv, count, "allreduce", "recv");
    // With two ranks both algorithms move the same bytes and the ring only wins once splitting
    // the reduction pays for its extra step (measured: docs/algorithms.md), hence 2x there.
    const std::size_t small_limit = options_.small_message_bytes * (size() == 2 ? 2 : 1);
    const Algorithm algorithm = bytes_of(count, dtype, "allreduce") <= small_limit ||
                                        count < static_cast<std::size_t>(size())
                                    ? Algorithm::kRecursiveDoubling
                                    : Algorithm::kRing;
    return enqueue(make_args(OpKind::kAllreduce, send, recv, count, dtype, op, -1, algorithm),
                   options);
  }

  std::shared_ptr<Work> broadcast(void* buf, std::size_t count, DType dtype, int root,
                                  CallOptions options) override {
    check_buffer(buf, count, "broadcast", "buf");
    check_rank(root, "broadcast", "root");
    const Algorithm algorithm = bytes_of(count, dtype, "broadcast") <= options_.small_message_bytes
                                    ? Algorithm::kBinomialTree
                                    : Algorithm::kChain;
    return enqueue(
        make_args(OpKind::kBroadcast, buf, buf, count, dtype, std::nullopt, root, algorithm),
        options);
  }

  std::shared_ptr<Work> reduce(const void* send, void* recv, std::size_t count, DType dtype,
                               ReduceOp op, int root, CallOptions options) override {
    check_rank(root, "reduce", "root");
    check_buffer(send, count, "reduce", "send");
    if (rank() == root) check_buffer(recv, count, "reduce", "recv (at the root)");
    return enqueue(
        make_args(OpKind::kReduce, send, recv, count, dtype, op, root, Algorithm::kChain), options);
  }

  std::shared_ptr<Work> allgather(const void* send, void* recv, std::size_t count_per_rank,
                                  DType dtype, CallOptions options) override {
    check_buffer(send, count_per_rank, "allgather", "send");
    check_buffer(recv, count_per_rank, "allgather", "recv");
    return enqueue(make_args(OpKind::kAllgather, send, recv, count_per_rank, dtype, std::nullopt,
                             -1, Algorithm::kRing),
                   options);
  }

  std::shared_ptr<Work> gather(const void* send, void* recv, std::size_t count_per_rank,
                               DType dtype, int root, CallOptions options) override {
    check_rank(root, "gather", "root");
    check_buffer(send, count_per_rank, "gather", "send");
    if (rank() == root) check_buffer(recv, count_per_rank, "gather", "recv (at the root)");
    return enqueue(make_args(OpKind::kGather, send, recv, count_per_rank, dtype, std::nullopt, root,
                             Algorithm::kDirect),
                   options);
  }

  std::shared_ptr<Work> scatter(const void* send, void* recv, std::size_t count_per_rank,
                                DType dtype, int root, CallOptions options) override {
    check_rank(root, "scatter", "root");
    if (rank() == root) check_buffer(send, count_per_rank, "scatter", "send (at the root)");
    check_buffer(recv, count_per_rank, "scatter", "recv");
    return enqueue(make_args(OpKind::kScatter, send, recv, count_per_rank, dtype, std::nullopt,
                             root, Algorithm::kDirect),
                   options);
  }

  std::shared_ptr<Work> reduce_scatter(const void* send, void* recv, std::size_t count_per_rank,
                                       DType dtype, ReduceOp op, CallOptions options) override {
    check_buffer(send, count_per_rank, "reduce_scatter", "send");
    check_buffer(recv, count_per_rank, "reduce_scatter", "recv");
    return enqueue(make_args(OpKind::kReduceScatter, send, recv, count_per_rank, dtype, op, -1,
                             Algorithm::kRing),
                   options);
  }

  std::shared_ptr<Work> alltoall(const void* send, void* recv, std::size_t count_per_rank,
                                 DType dtype, CallOptions options) override {
    check_buffer(send, count_per_rank, "alltoall", "send");
    check_buffer(recv, count_per_rank, "alltoall", "recv");
    return enqueue(make_args(OpKind::kAlltoall, send, recv, count_per_rank, dtype, std::nullopt, -1,
                             Algorithm::kDirect),
                   options);
  }

  std::shared_ptr<Work> barrier(CallOptions options) override {
    return enqueue(make_args(OpKind::kBarrier, nullptr, nullptr, 0, DType::kUInt8, std::nullopt, -1,
                             Algorithm::kRecursiveDoubling),
                   options);
  }

  std::shared_ptr<Work> send(const void* buf, std::size_t count, DType dtype, int dst, int tag,
                             CallOptions options) override {
    check_buffer(buf, count, "send", "buf");
    check_peer(dst, "send", "dst");
    auto args =
        make_args(OpKind::kSend, buf, nullptr, count, dtype, std::nullopt, tag, Algorithm::kDirect);
    args.peer = dst;
    return enqueue(std::move(args), options);
  }

  std::shared_ptr<Work> recv(void* buf, std::size_t count, DType dtype, int src, int tag,
                             CallOptions options) override {
    check_buffer(buf, count, "recv", "buf");
    check_peer(src, "recv", "src");
    auto args =
        make_args(OpKind::kSend, nullptr, buf, count, dtype, std::nullopt, tag, Algorithm::kDirect);
    args.peer = src;
    args.is_recv = true;
    return enqueue(std::move(args), options);
  }

  std::shared_ptr<ProcessGroup> new_group(std::vector<int> ranks) override;

  // Runs queued operations on the calling thread until `work` is done, unless another thread is
  // already running them.
  void run_inline_until(RingWork& work);

 private:
  OpArgs make_args(OpKind kind, const void* send, void* recv, std::size_t count, DType dtype,
                   std::optional<ReduceOp> op, int root, Algorithm algorithm) const;
  std::shared_ptr<Work> enqueue(OpArgs args, CallOptions options);
  void worker_loop();
  void execute(RingWork& work);
  void fail(RingWork& work, std::exception_ptr error);
  std::string abort_reason_of(int peer);

  void check_buffer(const void* p, std::size_t count, const char* op, const char* name) const;
  std::size_t bytes_of(std::size_t count, DType dtype, const char* op) const {
    if (static_cast<std::uint8_t>(dtype) > static_cast<std::uint8_t>(DType::kInt64)) {
      throw ConfigError(fmt::format("{}: invalid DType value {}", op, static_cast<int>(dtype)));
    }
    return count * dtype_size(dtype);
  }
  void check_rank(int r, const char* op, const char* name) const;
  void check_peer(int r, const char* op, const char* name) const;

  // Algorithms. Each runs on the executing thread and throws CommError.
  void run_op(const OpArgs& args, net::Deadline deadline);
  void allreduce_ring(const OpArgs& a, net::Deadline deadline);
  void allreduce_recursive_doubling(const OpArgs& a, net::Deadline deadline);
  void broadcast_tree(const OpArgs& a, net::Deadline deadline);
  void reduce_chain(const OpArgs& a, net::Deadline deadline);
  void allgather_ring(const OpArgs& a, net::Deadline deadline);
  void reduce_scatter_ring(const OpArgs& a, net::Deadline deadline);
  void gather_direct(const OpArgs& a, net::Deadline deadline);
  void scatter_direct(const OpArgs& a, net::Deadline deadline);
  void alltoall_direct(const OpArgs& a, net::Deadline deadline);
  void point_to_point(const OpArgs& a, net::Deadline deadline);

  void begin(const OpArgs& a) {
    exchange_.reset(a.header, a.dtype,
                    comm::ExchangeContext{&name_, rank(), a.description, peer_fds_.data(), size()});
  }
  void finish(const OpArgs& a, net::Deadline deadline) {
    exchange_.run(deadline, spin_, a.timeout);
  }
  int fd(int peer) const { return peers_[static_cast<std::size_t>(peer)].fd(); }
  std::byte* scratch(std::vector<std::byte>& pool, std::size_t bytes) {
    if (pool.size() < bytes) pool.resize(bytes);
    return pool.data();
  }

  std::shared_ptr<Store> store_;
  RingOptions options_;
  std::string name_;
  std::string prefix_;  // store keys of this incarnation of the group
  milliseconds timeout_;
  std::chrono::microseconds spin_{0};
  std::vector<net::Socket> peers_;
  std::vector<int> peer_fds_;  // peers_[i].fd(), -1 for this rank

  // Issue order: sequence numbers are assigned under queue_mutex_.
  std::mutex queue_mutex_;
  std::condition_variable queue_cv_;
  std::deque<std::shared_ptr<RingWork>> queue_;
  bool stopping_ = false;
  std::uint64_t next_sequence_ = 0;
  std::vector<std::uint64_t> send_sequence_;  // p2p, per peer
  std::vector<std::uint64_t> recv_sequence_;
  int subgroups_created_ = 0;

  // Whether a thread (the worker, or a waiter, see Work::wait) is running operations. Guarded by
  // queue_mutex_.
  bool executing_ = false;
  std::thread worker_;

  std::atomic<bool> poisoned_{false};
  std::mutex poison_mutex_;
  std::exception_ptr poison_;

  // Touched only by the thread holding the executor role: the scratch pool, reused across
  // operations.
  comm::Exchange exchange_;
  std::vector<std::byte> chunk_;
  std::vector<std::byte> temp_a_;
  std::vector<std::byte> temp_b_;
};

void RingWork::help_until_completed() {
  if (auto group = group_.lock()) group->run_inline_until(*this);
}

RingProcessGroup::RingProcessGroup(std::shared_ptr<Store> store, int rank, int size,
                                   RingOptions options)
    : ProcessGroup(rank, size),
      store_(std::move(store)),
      options_(std::move(options)),
      name_(options_.group_name),
      timeout_(resolve_group_timeout(options_.timeout)),
      peers_(static_cast<std::size_t>(size)),
      send_sequence_(static_cast<std::size_t>(size), 0),
      recv_sequence_(static_cast<std::size_t>(size), 0) {
  if (options_.spin.count() < 0) {
    const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
    spin_ = static_cast<unsigned>(size) <= cores ? std::chrono::microseconds(50)
                                                 : std::chrono::microseconds(0);
  } else {
    spin_ = options_.spin;
  }
  chunk_.resize(options_.chunk_bytes);
}

RingProcessGroup::~RingProcessGroup() {
  {
    std::lock_guard lock(queue_mutex_);
    stopping_ = true;
  }
  queue_cv_.notify_all();
  if (worker_.joinable()) {
    if (worker_.get_id() == std::this_thread::get_id()) {
      worker_.detach();  // dropped from a callback on the worker; it exits on its own
    } else {
      worker_.join();
    }
  }
}

void RingProcessGroup::connect_mesh() {
  const auto deadline = net::deadline_after(timeout_);
  const std::int64_t joined = store_->add(fmt::format("ring/{}/joins", name_), 1);
  prefix_ = fmt::format("ring/{}/{}/", name_, (joined - 1) / size());
  if (size() == 1) return;

  net::Socket listener = net::listen_tcp("", 0);
  listener.set_buffer_sizes(options_.socket_buffer_bytes);
  const std::string address = fmt::format("{}:{}", advertise_host(options_), listener.local_port());
  store_->set(fmt::format("{}addr/{}", prefix_, rank()), address);

  auto make_hello = [&](int to) {
    Hello hello;
    hello.size = size();
    hello.from_rank = rank();
    hello.to_rank = to;
    hello.name_length = static_cast<std::uint32_t>(name_.size());
    return hello;
  };
  auto send_hello = [&](net::Socket& socket, int to) {
    const Hello hello = make_hello(to);
    socket.send_all(&hello, sizeof hello, deadline);
    socket.send_all(name_.data(), name_.size(), deadline);
  };
  // Reads the peer's hello and checks it; returns the peer's rank.
  auto receive_hello = [&](net::Socket& socket, int expected_from) {
    Hello hello;
    socket.recv_all(&hello, sizeof hello, deadline);
    auto fail = [&](const std::string& what) -> CommError {
      return CommError(fmt::format("rank {} of group '{}': handshake with {} failed: {}", rank(),
                                   name_, socket.peer(), what),
                       name_, "connect", 0, expected_from);
    };
    if (hello.magic != comm::kHandshakeMagic) {
      throw fail(
          fmt::format("the peer does not speak the ddp ring protocol (magic {:#x}, "
                      "expected {:#x}); is another program using this port?",
                      hello.magic, comm::kHandshakeMagic));
    }
    if (hello.version != comm::kProtocolVersion) {
      throw fail(
          fmt::format("protocol version {} but this rank speaks version {}; run the same "
                      "ddp build on every rank",
                      hello.version, comm::kProtocolVersion));
    }
    if (hello.name_length > 4096) throw fail("group name longer than 4096 bytes");
    std::string name(hello.name_length, '\0');
    socket.recv_all(name.data(), name.size(), deadline);
    if (name != name_) {
      throw fail(
          fmt::format("the peer belongs to group '{}', this rank to group '{}'", name, name_));
    }
    if (hello.size != size()) {
      throw fail(
          fmt::format("the peer's group has {} ranks, this rank's has {}", hello.size, size()));
    }
    if (hello.to_rank != rank()) {
      throw fail(
          fmt::format("rank {} wanted to reach rank {} but reached rank {} (stale address "
                      "in the store?)",
                      hello.from_rank, hello.to_rank, rank()));
    }
    if (expected_from >= 0 && hello.from_rank != expected_from) {
      throw fail(
          fmt::format("expected rank {} but rank {} answered", expected_from, hello.from_rank));
    }
    if (hello.from_rank < 0 || hello.from_rank >= size() || hello.from_rank == rank() ||
        peers_[static_cast<std::size_t>(hello.from_rank)].valid()) {
      throw fail(fmt::format("unexpected or duplicate connection from rank {}", hello.from_rank));
    }
    return static_cast<int>(hello.from_rank);
  };

  // Lower ranks accept, higher ranks connect: rank r connects to every rank below it.
  for (int peer = 0; peer < rank(); ++peer) {
    const std::string key = fmt::format("{}addr/{}", prefix_, peer);
    const auto left = std::chrono::duration_cast<milliseconds>(deadline - net::Clock::now());
    const std::string peer_address = store_->get_string(key, std::max(left, milliseconds(1)));
    const auto colon = peer_address.rfind(':');
    if (colon == std::string::npos) {
      throw CommError(fmt::format("rank {} of group '{}': store key '{}' holds '{}', not "
                                  "host:port",
                                  rank(), name_, key, peer_address),
                      name_, "connect", 0, peer);
    }
    const std::string host = peer_address.substr(0, colon);
    const auto port = static_cast<std::uint16_t>(std::stoi(peer_address.substr(colon + 1)));
    net::Socket socket;
    try {
      socket = net::connect_tcp(host, port, deadline);
    } catch (const Error& e) {
      throw CommError(fmt::format("rank {} of group '{}' cannot connect to rank {} at {}: {}",
                                  rank(), name_, peer, peer_address, e.what()),
                      name_, "connect", 0, peer);
    }
    socket.set_buffer_sizes(options_.socket_buffer_bytes);
    socket.set_no_delay(true);
    send_hello(socket, peer);
    receive_hello(socket, peer);
    peers_[static_cast<std::size_t>(peer)] = std::move(socket);
  }
  for (int accepted = 0; accepted < size() - 1 - rank(); ++accepted) {
    net::Socket socket;
    try {
      socket = net::accept_tcp(listener, deadline);
    } catch (const TimeoutError&) {
      std::string missing;
      for (int peer = rank() + 1; peer < size(); ++peer) {
        if (!peers_[static_cast<std::size_t>(peer)].valid()) {
          missing += fmt::format("{}{}", missing.empty() ? "" : ", ", peer);
        }
      }
      throw CommError(fmt::format("rank {} of group '{}' timed out after {} ms waiting for "
                                  "ranks {} to connect; did every rank create the group?",
                                  rank(), name_, timeout_.count(), missing),
                      name_, "connect", 0, -1);
    }
    socket.set_no_delay(true);
    const int peer = receive_hello(socket, -1);
    send_hello(socket, peer);
    peers_[static_cast<std::size_t>(peer)] = std::move(socket);
  }
  for (const auto& socket : peers_)
    peer_fds_.push_back(socket.valid() ? socket.fd() : -1);
}

void RingProcessGroup::check_buffer(const void* p, std::size_t count, const char* op,
                                    const char* name) const {
  if (p == nullptr && count > 0) {
    throw ConfigError(
        fmt::format("{}: the {} buffer is null but count is {}; pass a buffer of "
                    "at least count elements",
                    op, name, count));
  }
}

void RingProcessGroup::check_rank(int r, const char* op, const char* name) const {
  if (r < 0 || r >= size()) {
    throw ConfigError(fmt::format("{}: {} {} is not a rank of group '{}' (ranks 0..{})", op, name,
                                  r, name_, size() - 1));
  }
}

void RingProcessGroup::check_peer(int r, const char* op, const char* name) const {
  check_rank(r, op, name);
  if (r == rank()) {
    throw ConfigError(
        fmt::format("{}: {} {} is this rank itself; point-to-point needs another "
                    "rank",
                    op, name, r));
  }
}

OpArgs RingProcessGroup::make_args(OpKind kind, const void* send, void* recv, std::size_t count,
                                   DType dtype, std::optional<ReduceOp> op, int root,
                                   Algorithm algorithm) const {
  if (static_cast<std::uint8_t>(dtype) > static_cast<std::uint8_t>(DType::kInt64)) {
    throw ConfigError(
        fmt::format("{}: invalid DType value {}", comm::to_string(kind), static_cast<int>(dtype)));
  }
  if (op && static_cast<std::uint8_t>(*op) > static_cast<std::uint8_t>(ReduceOp::kProduct)) {
    throw ConfigError(
        fmt::format("{}: invalid ReduceOp value {}", comm::to_string(kind), static_cast<int>(*op)));
  }
  OpArgs args;
  args.kind = kind;
  args.send = static_cast<const std::byte*>(send);
  args.recv = static_cast<std::byte*>(recv);
  args.count = count;
  args.dtype = dtype;
  args.op = op.value_or(ReduceOp::kSum);
  args.root = root;
  args.header.kind = kind;
  args.header.dtype = static_cast<std::uint8_t>(dtype);
  args.header.reduce_op = op ? static_cast<std::uint8_t>(*op) : comm::kNoReduceOp;
  args.header.algorithm = algorithm;
  args.header.count = count;
  args.header.root = root;
  return args;
}

std::shared_ptr<Work> RingProcessGroup::enqueue(OpArgs args, CallOptions options) {
  if (options.timeout.count() < 0) {
    throw ConfigError(
        fmt::format("CallOptions::timeout is negative ({} ms)", options.timeout.count()));
  }
  args.timeout = options.timeout.count() > 0 ? options.timeout : timeout_;
  std::shared_ptr<RingWork> work;
  bool queued = false;
  bool wake_worker = false;
  {
    std::lock_guard lock(queue_mutex_);
    if (args.kind == OpKind::kSend) {
      const auto peer = static_cast<std::size_t>(args.peer);
      if (args.is_recv) {
        args.header.sequence = recv_sequence_[peer]++;
        args.expected = args.header;
      } else {
        args.header.sequence = send_sequence_[peer]++;
      }
      args.description = comm::describe(args.header, args.peer, args.is_recv);
    } else {
      args.header.sequence = next_sequence_++;
      args.description = comm::describe(args.header);
    }
    work = std::make_shared<RingWork>(std::move(args), weak_from_this());
    if (!poisoned_.load(std::memory_order_acquire)) {
      queue_.push_back(work);
      queued = true;
      wake_worker = !executing_;
    }
  }
  if (queued) {
    // Only an idle worker needs waking: an executor picks the new work up after its current one.
    if (wake_worker) queue_cv_.notify_one();
  } else {
    std::exception_ptr error;
    {
      std::lock_guard poison_lock(poison_mutex_);
      error = poison_;
    }
    work->complete(error);
  }
  return work;
}

// One thread at a time holds the executor role (executing_, under queue_mutex_): the worker, or a
// thread waiting for its own work (see Work::wait). The worker only wakes for work nobody runs, so
// a caller that waits at once runs its operation itself without a hand-off.
void RingProcessGroup::worker_loop() {
  std::unique_lock lock(queue_mutex_);
  for (;;) {
    queue_cv_.wait(lock, [&] { return (!queue_.empty() || stopping_) && !executing_; });
    if (queue_.empty()) return;  // stopping, and nothing left to run
    executing_ = true;
    while (!queue_.empty()) {
      std::shared_ptr<RingWork> next = std::move(queue_.front());
      queue_.pop_front();
      lock.unlock();
      execute(*next);
      next.reset();  // callbacks may hold the last references; drop them outside the lock
      lock.lock();
    }
    executing_ = false;
  }
}

void RingProcessGroup::run_inline_until(RingWork& work) {
  {
    std::unique_lock lock(queue_mutex_);
    if (executing_ || work.is_completed()) {
      lock.unlock();
      // Another thread runs it: poll briefly for completion before the caller sleeps.
      const auto until = net::Clock::now() + spin_;
      while (!work.is_completed() && net::Clock::now() < until) {
      }
      return;
    }
    executing_ = true;
  }
  for (;;) {
    std::shared_ptr<RingWork> next;
    {
      std::lock_guard lock(queue_mutex_);
      if (work.is_completed() || queue_.empty()) {
        executing_ = false;
        // Whatever was queued behind this work is the worker's again.
        if (!queue_.empty() || stopping_) queue_cv_.notify_one();
        return;
      }
      next = std::move(queue_.front());
      queue_.pop_front();
    }
    execute(*next);
  }
}

std::string RingProcessGroup::abort_reason_of(int peer) {
  if (peer < 0) return {};
  try {
    const std::string key = fmt::format("{}abort/{}", prefix_, peer);
    const std::vector<std::string> keys{key};
    if (!store_->check(keys)) return {};
    return store_->get_string(key, milliseconds(200));
  } catch (const std::exception&) {
    return {};
  }
}

void RingProcessGroup::execute(RingWork& work) {
  if (poisoned_.load(std::memory_order_acquire)) {
    std::exception_ptr error;
    {
      std::lock_guard lock(poison_mutex_);
      error = poison_;
    }
    work.complete(error);
    return;
  }
  const OpArgs& args = work.args();
  try {
    run_op(args, net::deadline_after(args.timeout));
  } catch (const comm::PeerClosedError& e) {
    const std::string reason = abort_reason_of(e.peer());
    std::string message = e.what();
    message += reason.empty() ? fmt::format(" (rank {} left no reason: it probably died)", e.peer())
                              : fmt::format("; rank {} reported: {}", e.peer(), reason);
    fail(work,
         std::make_exception_ptr(CommError(message, e.group(), e.op(), e.sequence(), e.peer())));
    return;
  } catch (const CommError&) {
    fail(work, std::current_exception());
    return;
  } catch (const std::exception& e) {
    fail(work,
         std::make_exception_ptr(CommError(fmt::format("rank {}: {} in group '{}' failed: {}",
                                                       rank(), args.description, name_, e.what()),
                                           name_, args.description, args.header.sequence, -1)));
    return;
  }
  work.complete();
}

// Poisons the group with the first error: fails `work` and everything queued, leaves the reason
// in the store for the peers, and shuts the connections so that peers blocked on this rank fail
// now instead of at their deadline.
void RingProcessGroup::fail(RingWork& work, std::exception_ptr error) {
  {
    std::lock_guard lock(poison_mutex_);
    if (!poison_) poison_ = error;
    error = poison_;
  }
  poisoned_.store(true, std::memory_order_release);
  work.complete(error);
  std::deque<std::shared_ptr<RingWork>> pending;
  {
    std::lock_guard lock(queue_mutex_);
    pending.swap(queue_);
  }
  for (auto& w : pending)
    w->complete(error);
  std::string text;
  try {
    std::rethrow_exception(error);
  } catch (const std::exception& e) {
    text = e.what();
  }
  try {
    store_->set(fmt::format("{}abort/{}", prefix_, rank()), text);
  } catch (const std::exception&) {
    // Best effort: the store may be gone with the rank that hosted it.
  }
  for (auto& socket : peers_) {
    if (socket.valid()) ::shutdown(socket.fd(), SHUT_RDWR);
  }
}

void RingProcessGroup::run_op(const OpArgs& a, net::Deadline deadline) {
  switch (a.kind) {
    case OpKind::kAllreduce:
      if (size() == 1) {
        if (a.send != a.recv && a.count > 0) {
          std::memcpy(a.recv, a.send, a.count * dtype_size(a.dtype));
        }
        return;
      }
      if (a.header.algorithm == Algorithm::kRing) return allreduce_ring(a, deadline);
      return allreduce_recursive_doubling(a, deadline);
    case OpKind::kBarrier:
      if (size() == 1) return;
      return allreduce_recursive_doubling(a, deadline);
    case OpKind::kBroadcast:
      if (size() == 1) return;
      return broadcast_tree(a, deadline);
    case OpKind::kReduce:
      return reduce_chain(a, deadline);
    case OpKind::kAllgather:
      return allgather_ring(a, deadline);
    case OpKind::kReduceScatter:
      return reduce_scatter_ring(a, deadline);
    case OpKind::kGather:
      return gather_direct(a, deadline);
    case OpKind::kScatter:
      return scatter_direct(a, deadline);
    case OpKind::kAlltoall:
      return alltoall_direct(a, deadline);
    case OpKind::kSend:
      return point_to_point(a, deadline);
  }
}

// Ring allreduce: reduce-scatter then allgather as one pipelined stream per direction. The
// buffer is cut into `size` segments; at step k rank r sends segment r-k to the next rank and
// receives segment r-k-1 from the previous one. Steps 0..N-2 reduce what arrives (dst = own input
// op incoming, in chunks), steps N-1..2N-3 copy final segments straight into place. What is sent
// at step k >= 1 is exactly what was received at step k-1, gated byte by byte, so forwarding
// starts as soon as the first chunk is reduced. Per rank: 2(N-1)/N * S bytes each way.
void RingProcessGroup::allreduce_ring(const OpArgs& a, net::Deadline deadline) {
  const int n = size();
  const int r = rank();
  const std::size_t esz = dtype_size(a.dtype);
  const std::size_t base = a.count / static_cast<std::size_t>(n);
  const std::size_t extra = a.count % static_cast<std::size_t>(n);
  auto seg = [&](int k) { return ((k % n) + n) % n; };
  auto seg_offset = [&](int i) {
    const auto u = static_cast<std::size_t>(i);
    return (u * base + std::min(u, extra)) * esz;
  };
  auto seg_bytes = [&](int i) {
    return (base + (static_cast<std::size_t>(i) < extra ? 1 : 0)) * esz;
  };
  const int next = (r + 1) % n;
  const int prev = (r + n - 1) % n;
  begin(a);
  exchange_.add_send_stream(next, fd(next));
  exchange_.add_send_piece(a.send + seg_offset(r), seg_bytes(r));
  for (int k = 1; k <= 2 * n - 3; ++k) {
    const int s = seg(r - k);
    exchange_.add_send_piece(a.recv + seg_offset(s), seg_bytes(s), k - 1);
  }
  exchange_.add_recv_stream(prev, fd(prev), chunk_.data(), chunk_.size());
  for (int k = 0; k <= n - 2; ++k) {
    const int s = seg(r - k - 1);
    const int divisor = (k == n - 2 && a.op == ReduceOp::kAvg) ? n : 0;
    exchange_.add_recv_reduce(a.recv + seg_offset(s), a.send + seg_offset(s), seg_bytes(s), a.op,
                              divisor);
  }
  for (int k = n - 1; k <= 2 * n - 3; ++k) {
    const int s = seg(r - (k - (n - 1)));
    exchange_.add_recv_copy(a.recv + seg_offset(s), seg_bytes(s));
  }
  finish(a, deadline);
}

// Recursive doubling: log2(P) steps (P = largest power of two <= N); at step j rank v exchanges
// its whole current vector with v ^ 2^j and both reduce. The N-P extra ranks first hand their
// input to a neighbour and get the result back at the end. Per rank: log2(P) * S bytes each way.
// Also the barrier (S = 0: headers only).
void RingProcessGroup::allreduce_recursive_doubling(const OpArgs& a, net::Deadline deadline) {
  const int n = size();
  const int r = rank();
  const std::size_t bytes = a.count * dtype_size(a.dtype);
  const int p = static_cast<int>(std::bit_floor(static_cast<unsigned>(n)));
  const int rem = n - p;
  std::byte* temp_a = scratch(temp_a_, bytes);
  std::byte* temp_b = scratch(temp_b_, bytes);
  const std::byte* cur = a.send;
  if (r < 2 * rem) {
    if (r % 2 == 0) {
      begin(a);
      exchange_.add_send_stream(r + 1, fd(r + 1));
      exchange_.add_send_piece(a.send, bytes);
      finish(a, deadline);
      begin(a);
      exchange_.add_recv_stream(r + 1, fd(r + 1));
      exchange_.add_recv_copy(a.recv, bytes);
      finish(a, deadline);
      return;
    }
    begin(a);
    exchange_.add_recv_stream(r - 1, fd(r - 1), chunk_.data(), chunk_.size());
    exchange_.add_recv_reduce(temp_a, a.send, bytes, a.op, 0);
    finish(a, deadline);
    cur = temp_a;
  }
  if (cur == a.recv && bytes > 0) {
    // In place: the vector being sent must not be the one being written.
    std::memcpy(temp_a, a.recv, bytes);
    cur = temp_a;
  }
  const int v = r < 2 * rem ? r / 2 : r - rem;
  const int steps = std::countr_zero(static_cast<unsigned>(p));
  for (int j = 0; j < steps; ++j) {
    const int partner_v = v ^ (1 << j);
    const int partner = partner_v < rem ? 2 * partner_v + 1 : partner_v + rem;
    const bool last = j == steps - 1;
    std::byte* out = last ? a.recv : (cur == temp_a ? temp_b : temp_a);
    begin(a);
    exchange_.add_send_stream(partner, fd(partner));
    exchange_.add_send_piece(cur, bytes);
    exchange_.add_recv_stream(partner, fd(partner), chunk_.data(), chunk_.size());
    exchange_.add_recv_reduce(out, cur, bytes, a.op, last && a.op == ReduceOp::kAvg ? n : 0);
    finish(a, deadline);
    cur = out;
  }
  if (r < 2 * rem) {
    begin(a);
    exchange_.add_send_stream(r - 1, fd(r - 1));
    exchange_.add_send_piece(a.recv, bytes);
    finish(a, deadline);
  }
}

// Broadcast down a tree rooted at `root`, forwarding each chunk as soon as it arrives: a chain
// (pipelined; every link carries S once, latency N-1 hops) for large messages, a binomial tree
// (ceil(log2 N) hops; the root sends S to each of its children) for small ones.
void RingProcessGroup::broadcast_tree(const OpArgs& a, net::Deadline deadline) {
  const int n = size();
  const int v = (rank() - a.root + n) % n;
  auto real = [&](int virtual_rank) { return (virtual_rank + a.root) % n; };
  const std::size_t bytes = a.count * dtype_size(a.dtype);
  int parent = -1;
  int children[32];
  int child_count = 0;
  if (a.header.algorithm == Algorithm::kChain) {
    if (v > 0) parent = v - 1;
    if (v + 1 < n) children[child_count++] = v + 1;
  } else {
    int mask = 1;
    while (mask < n) {
      if (v & mask) {
        parent = v - mask;
        break;
      }
      mask <<= 1;
    }
    for (mask >>= 1; mask > 0; mask >>= 1) {
      if (v + mask < n) children[child_count++] = v + mask;
    }
  }
  begin(a);
  int gate = -1;
  if (parent >= 0) {
    exchange_.add_recv_stream(real(parent), fd(real(parent)));
    gate = exchange_.add_recv_copy(a.recv, bytes);
  }
  for (int i = 0; i < child_count; ++i) {
    exchange_.add_send_stream(real(children[i]), fd(real(children[i])));
    exchange_.add_send_piece(a.recv, bytes, gate);
  }
  finish(a, deadline);
}

// Reduce along a chain ending at the root: the farthest rank sends its input, each rank on the
// way reduces what arrives with its own input (chunk by chunk) and forwards it at once.
// Every link carries S once; latency N-1 hops.
void RingProcessGroup::reduce_chain(const OpArgs& a, net::Deadline deadline) {
  const int n = size();
  const std::size_t bytes = a.count * dtype_size(a.dtype);
  if (n == 1) {
    if (a.send != a.recv && bytes > 0) std::memcpy(a.recv, a.send, bytes);
    return;
  }
  const int v = (rank() - a.root + n) % n;
  auto real = [&](int virtual_rank) { return (virtual_rank + a.root) % n; };
  begin(a);
  if (v == n - 1) {
    exchange_.add_send_stream(real(v - 1), fd(real(v - 1)));
    exchange_.add_send_piece(a.send, bytes);
  } else {
    std::byte* out = v == 0 ? a.recv : scratch(temp_a_, bytes);
    exchange_.add_recv_stream(real(v + 1), fd(real(v + 1)), chunk_.data(), chunk_.size());
    const int gate = exchange_.add_recv_reduce(out, a.send, bytes, a.op,
                                               v == 0 && a.op == ReduceOp::kAvg ? n : 0);
    if (v > 0) {
      exchange_.add_send_stream(real(v - 1), fd(real(v - 1)));
      exchange_.add_send_piece(out, bytes, gate);
    }
  }
  finish(a, deadline);
}

// Ring allgather: N-1 steps; at step k rank r forwards block r-k (its own first) to the next
// rank and receives block r-k-1 straight into place. Per rank: (N-1) * block bytes each way.
void RingProcessGroup::allgather_ring(const OpArgs& a, net::Deadline deadline) {
  const int n = size();
  const int r = rank();
  const std::size_t block = a.count * dtype_size(a.dtype);
  auto slot = [&](int k) { return a.recv + static_cast<std::size_t>(((k % n) + n) % n) * block; };
  if (a.send != slot(r) && block > 0) std::memcpy(slot(r), a.send, block);
  if (n == 1) return;
  const int next = (r + 1) % n;
  const int prev = (r + n - 1) % n;
  begin(a);
  exchange_.add_send_stream(next, fd(next));
  exchange_.add_send_piece(slot(r), block);
  for (int k = 1; k <= n - 2; ++k)
    exchange_.add_send_piece(slot(r - k), block, k - 1);
  exchange_.add_recv_stream(prev, fd(prev));
  for (int k = 0; k <= n - 2; ++k)
    exchange_.add_recv_copy(slot(r - k - 1), block);
  finish(a, deadline);
}

// Ring reduce-scatter: N-1 steps; at step k rank r sends block r-k-1 (its input, then partial
// sums) and receives block r-k-2, reducing it with its own input; the last block it reduces is
// its own (r) and lands in recv. Per rank: (N-1) * block bytes each way.
void RingProcessGroup::reduce_scatter_ring(const OpArgs& a, net::Deadline deadline) {
  const int n = size();
  const int r = rank();
  const std::size_t block = a.count * dtype_size(a.dtype);
  if (n == 1) {
    if (a.send != a.recv && block > 0) std::memcpy(a.recv, a.send, block);
    return;
  }
  std::byte* partial = scratch(temp_a_, block * static_cast<std::size_t>(n));
  auto index = [&](int k) { return static_cast<std::size_t>(((k % n) + n) % n); };
  const int next = (r + 1) % n;
  const int prev = (r + n - 1) % n;
  begin(a);
  exchange_.add_send_stream(next, fd(next));
  exchange_.add_send_piece(a.send + index(r - 1) * block, block);
  for (int k = 1; k <= n - 2; ++k) {
    exchange_.add_send_piece(partial + index(r - k - 1) * block, block, k - 1);
  }
  exchange_.add_recv_stream(prev, fd(prev), chunk_.data(), chunk_.size());
  for (int k = 0; k <= n - 2; ++k) {
    const std::size_t i = index(r - k - 2);
    const bool last = k == n - 2;
    exchange_.add_recv_reduce(last ? a.recv : partial + i * block, a.send + i * block, block, a.op,
                              last && a.op == ReduceOp::kAvg ? n : 0);
  }
  finish(a, deadline);
}

// Gather: every rank sends its block straight to the root, which receives them all at once.
void RingProcessGroup::gather_direct(const OpArgs& a, net::Deadline deadline) {
  const int n = size();
  const std::size_t block = a.count * dtype_size(a.dtype);
  if (rank() == a.root) {
    std::byte* own = a.recv + static_cast<std::size_t>(a.root) * block;
    if (own != a.send && block > 0) std::memcpy(own, a.send, block);
    if (n == 1) return;
    begin(a);
    for (int peer = 0; peer < n; ++peer) {
      if (peer == a.root) continue;
      exchange_.add_recv_stream(peer, fd(peer));
      exchange_.add_recv_copy(a.recv + static_cast<std::size_t>(peer) * block, block);
    }
    finish(a, deadline);
    return;
  }
  begin(a);
  exchange_.add_send_stream(a.root, fd(a.root));
  exchange_.add_send_piece(a.send, block);
  finish(a, deadline);
}

// Scatter: the root sends block j straight to rank j, to all at once.
void RingProcessGroup::scatter_direct(const OpArgs& a, net::Deadline deadline) {
  const int n = size();
  const std::size_t block = a.count * dtype_size(a.dtype);
  if (rank() == a.root) {
    const std::byte* own = a.send + static_cast<std::size_t>(a.root) * block;
    if (own != a.recv && block > 0) std::memmove(a.recv, own, block);
    if (n == 1) return;
    begin(a);
    for (int peer = 0; peer < n; ++peer) {
      if (peer == a.root) continue;
      exchange_.add_send_stream(peer, fd(peer));
      exchange_.add_send_piece(a.send + static_cast<std::size_t>(peer) * block, block);
    }
    finish(a, deadline);
    return;
  }
  begin(a);
  exchange_.add_recv_stream(a.root, fd(a.root));
  exchange_.add_recv_copy(a.recv, block);
  finish(a, deadline);
}

// Alltoall: every rank sends block j to rank j and receives block j from rank j, all pairs at
// once over the full mesh. Per rank: (N-1) * block bytes each way.
void RingProcessGroup::alltoall_direct(const OpArgs& a, net::Deadline deadline) {
  const int n = size();
  const int r = rank();
  const std::size_t block = a.count * dtype_size(a.dtype);
  const std::byte* source = a.send;
  if (a.send == a.recv && block > 0) {
    std::byte* copy = scratch(temp_a_, block * static_cast<std::size_t>(n));
    std::memcpy(copy, a.send, block * static_cast<std::size_t>(n));
    source = copy;
  }
  const auto own = static_cast<std::size_t>(r) * block;
  if (source + own != a.recv + own && block > 0) std::memcpy(a.recv + own, source + own, block);
  if (n == 1) return;
  begin(a);
  for (int peer = 0; peer < n; ++peer) {
    if (peer == r) continue;
    exchange_.add_send_stream(peer, fd(peer));
    exchange_.add_send_piece(source + static_cast<std::size_t>(peer) * block, block);
  }
  for (int peer = 0; peer < n; ++peer) {
    if (peer == r) continue;
    exchange_.add_recv_stream(peer, fd(peer));
    exchange_.add_recv_copy(a.recv + static_cast<std::size_t>(peer) * block, block);
  }
  finish(a, deadline);
}

void RingProcessGroup::point_to_point(const OpArgs& a, net::Deadline deadline) {
  const std::size_t bytes = a.count * dtype_size(a.dtype);
  begin(a);
  if (a.is_recv) {
    exchange_.add_recv_stream(a.peer, fd(a.peer));
    exchange_.set_expected(a.expected);
    exchange_.add_recv_copy(a.recv, bytes);
  } else {
    exchange_.add_send_stream(a.peer, fd(a.peer));
    exchange_.add_send_piece(a.send, bytes);
  }
  finish(a, deadline);
}

std::shared_ptr<ProcessGroup> RingProcessGroup::new_group(std::vector<int> ranks) {
  if (ranks.empty()) {
    throw ConfigError(fmt::format("new_group on group '{}': the rank list is empty", name_));
  }
  for (std::size_t i = 0; i < ranks.size(); ++i) {
    check_rank(ranks[i], "new_group", "rank");
    if (i > 0 && ranks[i] <= ranks[i - 1]) {
      throw ConfigError(
          fmt::format("new_group on group '{}': ranks must be sorted and unique, "
                      "got {} after {}",
                      name_, ranks[i], ranks[i - 1]));
    }
  }
  int index;
  {
    std::lock_guard lock(queue_mutex_);
    index = subgroups_created_++;
  }
  const auto it = std::find(ranks.begin(), ranks.end(), rank());
  if (it == ranks.end()) return nullptr;
  RingOptions sub = options_;
  sub.timeout = timeout_;
  sub.group_name = fmt::format("{}/sub{}", name_, index);
  return make_ring_process_group(store_, static_cast<int>(it - ranks.begin()),
                                 static_cast<int>(ranks.size()), sub);
}

}  // namespace

std::shared_ptr<ProcessGroup> make_ring_process_group(std::shared_ptr<Store> store, int rank,
                                                      int size, RingOptions options) {
  if (!store) throw ConfigError("make_ring_process_group: the store is null");
  if (size < 1) {
    throw ConfigError(
        fmt::format("make_ring_process_group: size must be at least 1, got {}", size));
  }
  if (rank < 0 || rank >= size) {
    throw ConfigError(fmt::format("make_ring_process_group: rank {} is outside 0..{} (size {})",
                                  rank, size - 1, size));
  }
  if (options.group_name.empty()) {
    throw ConfigError("make_ring_process_group: RingOptions::group_name is empty");
  }
  if (options.chunk_bytes < 64) {
    throw ConfigError(
        fmt::format("RingOptions::chunk_bytes must be at least 64, got {}", options.chunk_bytes));
  }
  auto group = std::make_shared<RingProcessGroup>(std::move(store), rank, size, std::move(options));
  group->connect_mesh();
  group->start();
  return group;
}

}  // namespace ddp
