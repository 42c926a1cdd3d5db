// The ring backend: bootstrap, the per-group queue and worker, failure handling, and the
// algorithms (prose and costs in docs/algorithms.md).
#include "ddp/ring_process_group.h"

#include <sched.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <fstream>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <thread>

#include <fmt/format.h>

#include "comm/argument_checks.h"
#include "comm/exchange.h"
#include "comm/mesh_handshake.h"
#include "comm/p2p/p2p_connect.h"
#include "comm/p2p/p2p_engine.h"
#include "comm/reduce_kernels.h"
#include "comm/shm/shm_domain.h"
#include "comm/wire.h"
#include "ddp/error.h"
#include "ddp/rendezvous.h"
#include "net/socket.h"
#include "store/auth.h"

namespace ddp {
namespace {

// Lazy wake-up of the worker (RingProcessGroup::worker_idle_wait).
constexpr auto kPromptWait = std::chrono::microseconds(50);  // waited "at once"
constexpr int kPromptWaitsForLazyWake = 2;
constexpr std::size_t kLazyWakeMaxBytes = std::size_t{1} << 20;
constexpr auto kLazyWakePoll = std::chrono::milliseconds(1);
constexpr auto kLazyWakeIdle = std::chrono::milliseconds(50);

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
  return resolve_timeout(std::nullopt);  // DDP_TIMEOUT, else the default (rendezvous.h)
}

Transport resolve_transport(const RingOptions& options) {
  if (options.transport) {
    if (*options.transport != Transport::kAuto && *options.transport != Transport::kTcp) {
      throw ConfigError(
          fmt::format("RingOptions::transport has an invalid value {}; use "
                      "Transport::kAuto or Transport::kTcp",
                      static_cast<int>(*options.transport)));
    }
    return *options.transport;
  }
  if (const char* env = std::getenv("DDP_TRANSPORT"); env != nullptr && *env != '\0') {
    const std::string value = env;
    if (value == "auto") return Transport::kAuto;
    if (value == "tcp") return Transport::kTcp;
    throw ConfigError(fmt::format(
        "DDP_TRANSPORT='{}' is not a transport; use DDP_TRANSPORT=auto (shared memory inside a "
        "host, TCP between hosts) or DDP_TRANSPORT=tcp (TCP only)",
        value));
  }
  return Transport::kAuto;
}

std::string_view transport_name(Transport t) {
  return t == Transport::kTcp ? "tcp" : "auto";
}

std::string first_line_of(const char* path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

// What makes two ranks "on one host": the same kernel (boot id; the host name alone can repeat
// across containers) and the same network namespace, so that namespaces on one kernel, used as
// hosts by tests and some container setups, count as different hosts.
std::string host_identity() {
  // An explicit identity wins: for setups where the detection is wrong, and for tests that give
  // ranks of one machine different "hosts" to run the hierarchical path.
  if (const char* env = std::getenv("DDP_HOST_ID"); env != nullptr && *env != '\0') {
    return fmt::format("DDP_HOST_ID={}", env);
  }
  char netns[256] = {};
  const ssize_t n = ::readlink("/proc/self/ns/net", netns, sizeof netns - 1);
  return fmt::format("{}|{}|{}", net::host_name(), first_line_of("/proc/sys/kernel/random/boot_id"),
                     n > 0 ? std::string(netns, static_cast<std::size_t>(n)) : std::string("?"));
}

std::string advertise_host(const RingOptions& options) {
  if (!options.advertise_host.empty()) return options.advertise_host;
  if (const char* env = std::getenv("DDP_ADVERTISE_ADDR"); env != nullptr && *env != '\0') {
    return env;
  }
  return net::host_name();
}

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
  int avg_divisor = 0;  // avg: divide by this instead of the group size (hierarchical steps)
  milliseconds timeout{0};
  OpHeader header;    // sent (and for collectives, expected)
  OpHeader expected;  // p2p recv: what the sender's header must be
  std::string label;  // replaces the description (the steps of a hierarchical allreduce)
  std::vector<BufferSegment> segments;  // allreduce_segments over shared memory (send/recv null)

  // Formatted when needed (errors, TCP steps), not on every call: it allocates.
  std::string description() const {
    if (!label.empty()) return label;
    return kind == OpKind::kSend ? comm::describe(header, peer, is_recv) : comm::describe(header);
  }
};

class RingWork final : public Work {
 public:
  RingWork(OpArgs args, std::weak_ptr<RingProcessGroup> group)
      : Work(args.timeout),
        args_(std::move(args)),
        group_(std::move(group)),
        enqueued_at_(net::Clock::now()) {}
  const OpArgs& args() const { return args_; }
  std::string description() const override { return args_.description(); }
  net::Clock::time_point enqueued_at() const { return enqueued_at_; }

 protected:
  void help_until_completed() override;

 private:
  OpArgs args_;
  std::weak_ptr<RingProcessGroup> group_;
  net::Clock::time_point enqueued_at_;
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
  void start_p2p();
  // Poisons this group from its parent (a hierarchical step failed elsewhere): leaves `reason`
  // in the store and shuts the connections, so the peers fail now. Executor thread only.
  void abort_from_parent(const std::string& reason);
  std::string transport_description() const { return transport_text_; }

  std::string_view backend() const override { return "ring"; }
  using ProcessGroup::allreduce;

  std::shared_ptr<Work> allreduce(const void* send, void* recv, std::size_t count, DType dtype,
                                  ReduceOp op, CallOptions options) override {
    check_buffer(send, count, "allreduce", "send");
    check_buffer(recv, count, "allreduce", "recv");
    const Algorithm algorithm =
        mode_ == Mode::kShm ? Algorithm::kSharedMemory
        : mode_ == Mode::kHierarchical
            ? Algorithm::kHierarchical
            : tcp_allreduce_algorithm(bytes_of(count, dtype, "allreduce"), count);
    return enqueue(make_args(OpKind::kAllreduce, send, recv, count, dtype, op, -1, algorithm),
                   options);
  }

  std::shared_ptr<Work> allreduce_segments(std::vector<BufferSegment> segments, DType dtype,
                                           ReduceOp op, CallOptions options) override {
    // Only the shared-memory domain reads and writes the pieces where they lie; the TCP and
    // hierarchical algorithms work on one buffer, packed by the base class.
    if (mode_ != Mode::kShm) {
      return ProcessGroup::allreduce_segments(std::move(segments), dtype, op, options);
    }
    std::size_t count = 0;
    for (const auto& segment : segments) {
      check_buffer(segment.data, segment.count, "allreduce_segments", "segment");
      count += segment.count;
    }
    OpArgs args = make_args(OpKind::kAllreduce, nullptr, nullptr, count, dtype, op, -1,
                            Algorithm::kSharedMemory);
    args.segments = std::move(segments);
    return enqueue(std::move(args), options);
  }

  std::shared_ptr<Work> broadcast(void* buf, std::size_t count, DType dtype, int root,
                                  CallOptions options) override {
    check_buffer(buf, count, "broadcast", "buf");
    check_rank(root, "broadcast", "root");
    const Algorithm algorithm =
        mode_ == Mode::kShm ? Algorithm::kSharedMemory
        : bytes_of(count, dtype, "broadcast") <= options_.small_message_bytes
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
        make_args(OpKind::kReduce, send, recv, count, dtype, op, root, shm_or(Algorithm::kChain)),
        options);
  }

  std::shared_ptr<Work> allgather(const void* send, void* recv, std::size_t count_per_rank,
                                  DType dtype, CallOptions options) override {
    check_buffer(send, count_per_rank, "allgather", "send");
    check_buffer(recv, count_per_rank, "allgather", "recv");
    return enqueue(make_args(OpKind::kAllgather, send, recv, count_per_rank, dtype, std::nullopt,
                             -1, shm_or(Algorithm::kRing)),
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
                             shm_or(Algorithm::kRing)),
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
                             shm_or(Algorithm::kRecursiveDoubling)),
                   options);
  }

  std::shared_ptr<Work> send(const void* buf, std::size_t count, DType dtype, int dst, int tag,
                             CallOptions options) override {
    check_buffer(buf, count, "send", "buf");
    check_peer(dst, "send", "dst");
    return p2p_->send(buf, count, dtype, dst, tag, options);  // not queued: see start_p2p
  }

  std::shared_ptr<Work> recv(void* buf, std::size_t count, DType dtype, int src, int tag,
                             CallOptions options) override {
    check_buffer(buf, count, "recv", "buf");
    check_peer(src, "recv", "src");
    return p2p_->recv(buf, count, dtype, src, tag, options);
  }

  std::shared_ptr<ProcessGroup> new_group(std::vector<int> ranks) override;

  // Runs queued operations on the calling thread until `work` is done, unless another thread is
  // already running them.
  void run_inline_until(RingWork& work);

 private:
  enum class Mode {
    kTcp,           // everything over TCP
    kShm,           // one host: the shared-memory domain runs the collectives it has
    kHierarchical,  // several hosts, several ranks on some: allreduce inside hosts, then across
  };
  Algorithm shm_or(Algorithm tcp) const {
    return mode_ == Mode::kShm ? Algorithm::kSharedMemory : tcp;
  }
  Algorithm tcp_allreduce_algorithm(std::size_t bytes, std::size_t count) const {
    // With two ranks both algorithms move the same bytes and the ring only wins once splitting
    // the reduction pays for its extra step (measured: docs/algorithms.md), hence 2x there.
    const std::size_t small_limit = options_.small_message_bytes * (size() == 2 ? 2 : 1);
    return bytes <= small_limit || count < static_cast<std::size_t>(size())
               ? Algorithm::kRecursiveDoubling
               : Algorithm::kRing;
  }
  void set_up_locality(Transport transport, net::Deadline deadline);
  void run_shm(const OpArgs& a, net::Deadline deadline);
  void allreduce_hierarchical(const OpArgs& a, net::Deadline deadline);
  void cross_host_allreduce(std::byte* buf, std::size_t count, const OpArgs& a,
                            net::Deadline deadline);
  OpArgs make_args(OpKind kind, const void* send, void* recv, std::size_t count, DType dtype,
                   std::optional<ReduceOp> op, int root, Algorithm algorithm) const;
  std::shared_ptr<Work> enqueue(OpArgs args, CallOptions options);
  void worker_loop();
  bool worker_should_run(net::Clock::time_point now) const;
  void worker_idle_wait(std::unique_lock<std::mutex>& lock);
  void linger(std::unique_lock<std::mutex>& lock);
  // Runs `work` on this thread; its deadline counts from `start` (now, or just before).
  void execute(RingWork& work, net::Clock::time_point start = net::Clock::now());
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
    exchange_.reset(
        a.header, a.dtype,
        comm::ExchangeContext{&name_, rank(), op_text_ = a.description(), peer_fds_.data(), size(),
                              domain_ && a.kind != OpKind::kSend ? &idle_check_ : nullptr});
  }
  // A call that one rank runs over shared memory and another over TCP is invisible to both
  // transports' own checks; these two look across (see docs/algorithms.md, "Transports").
  void check_domain_for_other_call();
  void check_sockets_for_other_call();
  [[noreturn]] void fail_cross_transport_mismatch(int peer, const OpHeader& theirs);
  std::string cross_ranks_note(int cross_peer) const;
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
  bool worker_lingering_ = false;  // the worker polls the queue for a moment after its last work
  // Lazy wake-up (see worker_idle_wait): how many operations in a row a caller waited for at once
  // and ran itself; whether the idle worker polls the queue instead of sleeping until notified;
  // whether queued work was left to its caller without notifying the worker.
  int prompt_waits_ = 0;
  bool worker_polling_ = false;
  bool work_left_to_caller_ = false;
  net::Clock::time_point last_enqueue_{};
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
  std::vector<std::byte> temp_hier_;

  // Locality (fixed at creation). hosts_: the ranks of each host, sorted, hosts ordered by their
  // lowest rank (the host's leader); local_: this rank's host.
  Mode mode_ = Mode::kTcp;
  std::string transport_text_ = "tcp";
  std::vector<std::vector<int>> hosts_;
  std::vector<int> local_;
  int local_rank_ = 0;
  // The ranks of this host that share memory (kShm: all; kHierarchical: local_), or null.
  std::unique_ptr<comm::shm::ShmDomain> domain_;
  // kHierarchical, equal ranks per host: every local rank i allreduces 1/N_local of the data
  // with the ranks of local index i on the other hosts; otherwise only the leaders do.
  bool slices_ = false;
  // kHierarchical: this rank's cross-host group (no worker thread of its own: its algorithms
  // run on this group's executor), and the ranks of this group it holds, by its rank.
  std::shared_ptr<RingProcessGroup> cross_;
  std::vector<int> cross_members_;
  // The operation the executor is running (for the cross-transport checks), and the check the
  // TCP steps call while they sleep.
  const OpArgs* current_ = nullptr;
  std::string op_text_;  // the description of the TCP step running (the exchange refers to it)
  std::function<void()> idle_check_;
  // Point to point (start_p2p): declared last, so it is gone before what its callbacks use.
  comm::HandshakeParams handshake_;
  std::unique_ptr<comm::p2p::P2pEngine> p2p_;
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
  const Transport transport = resolve_transport(options_);
  if (size() == 1) {
    transport_text_ = "none (1 rank)";
    return;
  }
  store_->set(fmt::format("{}host/{}", prefix_, rank()),
              fmt::format("{}\n{}", transport_name(transport), host_identity()));

  net::Socket listener = net::listen_tcp("", 0);
  listener.set_buffer_sizes(options_.socket_buffer_bytes);
  const std::string address = fmt::format("{}:{}", advertise_host(options_), listener.local_port());
  store_->set(fmt::format("{}addr/{}", prefix_, rank()), address);

  comm::HandshakeParams handshake{.group = name_,
                                  .size = size(),
                                  .rank = rank(),
                                  .secret = options_.secret,
                                  .session = {},
                                  .log = options_.log};
  if (!handshake.log) {
    handshake.log = [](const std::string& line) { std::fprintf(stderr, "%s\n", line.c_str()); };
  }
  if (!options_.secret.empty()) {
    // The group instance's id, bound into every handshake MAC: the first rank to get here draws
    // it, the others read it.
    const auto nonce = store::random_nonce();
    std::string mine;
    for (const auto byte : nonce)
      mine += fmt::format("{:02x}", byte);
    handshake.session = store_->compare_set(prefix_ + "auth/session", "", mine);
  }
  handshake_ = handshake;

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
    comm::connect_handshake(socket, handshake, peer, deadline);
    peers_[static_cast<std::size_t>(peer)] = std::move(socket);
  }
  // Garbage, bad hellos and failed authentications are refused there without ending the wait.
  auto accepted = comm::accept_peers(listener, handshake, deadline, timeout_);
  for (int peer = rank() + 1; peer < size(); ++peer) {
    peers_[static_cast<std::size_t>(peer)] = std::move(accepted[static_cast<std::size_t>(peer)]);
  }
  for (const auto& socket : peers_)
    peer_fds_.push_back(socket.valid() ? socket.fd() : -1);
  set_up_locality(transport, deadline);
}

// Sends and receives run on their own connections (TCP whatever the transport) and progress thread
// (src/comm/p2p), never in this group's queue: they progress independently of each other and of
// the collectives, so a cycle of sends posted before receives cannot deadlock.
void RingProcessGroup::start_p2p() {
  if (size() == 1) return;
  comm::HandshakeParams params = handshake_;
  params.group = name_ + "#p2p";  // a p2p connection cannot pass for a mesh one
  auto sockets = comm::p2p::connect_p2p_peers(*store_, params,
                                              {.key_prefix = prefix_ + "p2p/",
                                               .advertise_host = advertise_host(options_),
                                               .socket_buffer_bytes = options_.socket_buffer_bytes,
                                               .timeout = timeout_},
                                              net::deadline_after(timeout_));
  p2p_ = std::make_unique<comm::p2p::P2pEngine>(
      std::move(sockets),
      comm::p2p::EngineOptions{.group = name_,
                               .rank = rank(),
                               .timeout = timeout_,
                               .spin = spin_,
                               .reason_of = [this](int peer) { return abort_reason_of(peer); }});
}

// Reads every rank's host identity and transport, groups the ranks by host and, with `auto`,
// sets up the shared-memory domain (one host) or the hierarchical allreduce (several hosts).
void RingProcessGroup::set_up_locality(Transport transport, net::Deadline deadline) {
  std::map<std::string, std::vector<int>> by_identity;
  std::vector<std::string> identity_of(static_cast<std::size_t>(size()));
  for (int r = 0; r < size(); ++r) {
    const std::string key = fmt::format("{}host/{}", prefix_, r);
    const auto left = std::chrono::duration_cast<milliseconds>(deadline - net::Clock::now());
    const std::string value = store_->get_string(key, std::max(left, milliseconds(1)));
    const auto newline = value.find('\n');
    const std::string theirs = value.substr(0, newline);
    if (theirs != transport_name(transport)) {
      throw ConfigError(
          fmt::format("group '{}': rank {} uses transport '{}' but rank {} uses '{}'; set "
                      "RingOptions::transport or DDP_TRANSPORT to the same value on every rank",
                      name_, rank(), transport_name(transport), r, theirs));
    }
    identity_of[static_cast<std::size_t>(r)] =
        newline == std::string::npos ? std::string() : value.substr(newline + 1);
    by_identity[identity_of[static_cast<std::size_t>(r)]].push_back(r);
  }
  for (auto& [identity, ranks] : by_identity)
    hosts_.push_back(ranks);
  std::sort(hosts_.begin(), hosts_.end());  // by leader (each list is sorted already)
  local_ = by_identity[identity_of[static_cast<std::size_t>(rank())]];
  local_rank_ = static_cast<int>(std::find(local_.begin(), local_.end(), rank()) - local_.begin());
  std::size_t largest = 0;
  bool equal = true;
  for (const auto& h : hosts_) {
    largest = std::max(largest, h.size());
    equal = equal && h.size() == hosts_.front().size();
  }
  if (transport == Transport::kTcp || largest == 1) {
    transport_text_ = hosts_.size() == 1 ? "tcp" : fmt::format("tcp ({} hosts)", hosts_.size());
    return;
  }
  comm::shm::ShmOptions shm{.group = name_};
  // A host's domain numbers its ranks 0..L-1: let its errors name this group's ranks.
  if (hosts_.size() > 1) shm.ranks = local_;
  shm.on_nap = [this] { check_sockets_for_other_call(); };
  idle_check_ = [this] { check_domain_for_other_call(); };
  if (options_.shm_slot_bytes != 0) {
    shm.slot_bytes = options_.shm_slot_bytes;
    shm.small_bytes = std::min(shm.small_bytes, shm.slot_bytes);
  }
  if (hosts_.size() == 1) {
    domain_ = comm::shm::ShmDomain::create(*store_, prefix_ + "shm", rank(), size(), shm, deadline);
    mode_ = Mode::kShm;
    transport_text_ = "shm";
    return;
  }
  mode_ = Mode::kHierarchical;
  slices_ = equal;
  if (local_.size() > 1) {
    domain_ =
        comm::shm::ShmDomain::create(*store_, fmt::format("{}shm/host{}", prefix_, local_[0]),
                                     local_rank_, static_cast<int>(local_.size()), shm, deadline);
  }
  // Cross-host group: the ranks with this rank's local index (slices), or the leaders.
  if (slices_ || local_rank_ == 0) {
    for (const auto& h : hosts_)
      cross_members_.push_back(h[static_cast<std::size_t>(local_rank_)]);
    RingOptions cross_options = options_;
    cross_options.timeout = timeout_;
    cross_options.transport = Transport::kTcp;
    cross_options.group_name = fmt::format("{}/cross{}", name_, local_rank_);
    const int index = static_cast<int>(
        std::find(cross_members_.begin(), cross_members_.end(), rank()) - cross_members_.begin());
    cross_ = std::make_shared<RingProcessGroup>(
        store_, index, static_cast<int>(cross_members_.size()), std::move(cross_options));
    try {
      cross_->connect_mesh();
    } catch (const CommError& e) {
      const int peer = e.peer() >= 0 ? cross_members_[static_cast<std::size_t>(e.peer())] : -1;
      throw CommError(fmt::format("{} [{}]", e.what(), cross_ranks_note(e.peer())), name_, e.op(),
                      e.sequence(), peer);
    }
  }
  std::string sizes;
  for (const auto& h : hosts_)
    sizes += fmt::format("{}{}", sizes.empty() ? "" : "+", h.size());
  transport_text_ = fmt::format("hierarchical({} hosts, {} ranks, {})", hosts_.size(), sizes,
                                slices_ ? "slices" : "leaders");
}

// For errors of the cross-host group, whose members are numbered 0..H-1: which ranks of this
// group they are, e.g. "rank 1 of 'default/cross0' is rank 2 of 'default'".
std::string RingProcessGroup::cross_ranks_note(int cross_peer) const {
  if (cross_peer >= 0 && static_cast<std::size_t>(cross_peer) < cross_members_.size()) {
    return fmt::format("rank {} of '{}' is rank {} of '{}'", cross_peer, cross_->name_,
                       cross_members_[static_cast<std::size_t>(cross_peer)], name_);
  }
  std::string members;
  for (std::size_t i = 0; i < cross_members_.size(); ++i)
    members += fmt::format("{}{} is rank {}", i == 0 ? "" : ", ", i, cross_members_[i]);
  return fmt::format("ranks of '{}' in '{}': {}", cross_->name_, name_, members);
}

void RingProcessGroup::fail_cross_transport_mismatch(int peer, const OpHeader& theirs) {
  const OpHeader& mine = current_->header;
  throw CommError(
      fmt::format("collective mismatch in group '{}': rank {} called {} [{}] but rank {} called "
                  "{} [{}]; every rank must issue the same collectives in the same order with "
                  "the same count, dtype, op and root",
                  name_, rank(), comm::describe(mine), comm::to_string(mine.algorithm), peer,
                  comm::describe(theirs), comm::to_string(theirs.algorithm)),
      name_, current_->description(), mine.sequence, peer);
}

// This rank runs a TCP step of a collective: a local peer in a shared-memory call with the same
// sequence number runs a different collective (it would never send what this step waits for).
void RingProcessGroup::check_domain_for_other_call() {
  if (current_ == nullptr || !domain_) return;
  OpHeader theirs;
  const int local_peer = domain_->peer_with_other_call(current_->header, theirs);
  if (local_peer >= 0) {
    fail_cross_transport_mismatch(local_[static_cast<std::size_t>(local_peer)], theirs);
  }
}

// This rank waits in a shared-memory call: a peer that sent this group a header with the same
// sequence number over TCP runs a different collective.
void RingProcessGroup::check_sockets_for_other_call() {
  if (current_ == nullptr) return;
  for (int peer = 0; peer < size(); ++peer) {
    const int fd = peer_fds_.empty() ? -1 : peer_fds_[static_cast<std::size_t>(peer)];
    if (fd < 0) continue;
    OpHeader got;
    const ssize_t n = ::recv(fd, &got, sizeof got, MSG_PEEK | MSG_DONTWAIT);
    if (n == static_cast<ssize_t>(sizeof got) && got.magic == comm::kHeaderMagic &&
        got.kind != OpKind::kSend && got.sequence == current_->header.sequence &&
        !(got == current_->header)) {
      fail_cross_transport_mismatch(peer, got);
    }
  }
}

void RingProcessGroup::abort_from_parent(const std::string& reason) {
  {
    std::lock_guard lock(poison_mutex_);
    if (!poison_) poison_ = std::make_exception_ptr(CommError(reason, name_, "abort", 0, -1));
  }
  poisoned_.store(true, std::memory_order_release);
  try {
    store_->set(fmt::format("{}abort/{}", prefix_, rank()), reason);
  } catch (const std::exception&) {
    // Best effort, as in fail().
  }
  for (auto& socket : peers_) {
    if (socket.valid()) ::shutdown(socket.fd(), SHUT_RDWR);
  }
}

void RingProcessGroup::check_buffer(const void* p, std::size_t count, const char* op,
                                    const char* name) const {
  comm::check_buffer(p, count, op, name);
}

void RingProcessGroup::check_rank(int r, const char* op, const char* name) const {
  comm::check_rank(r, size(), name_, op, name);
}

void RingProcessGroup::check_peer(int r, const char* op, const char* name) const {
  comm::check_peer(r, rank(), size(), name_, op, name);
}

OpArgs RingProcessGroup::make_args(OpKind kind, const void* send, void* recv, std::size_t count,
                                   DType dtype, std::optional<ReduceOp> op, int root,
                                   Algorithm algorithm) const {
  comm::check_enums(std::string(comm::to_string(kind)).c_str(), dtype, op);
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
    } else {
      args.header.sequence = next_sequence_++;
    }
    const std::size_t bytes = args.count * dtype_size(args.dtype);
    work = std::make_shared<RingWork>(std::move(args), weak_from_this());
    if (!poisoned_.load(std::memory_order_acquire)) {
      const bool idle = queue_.empty() && !executing_ && !worker_lingering_;
      queue_.push_back(work);
      queued = true;
      last_enqueue_ = work->enqueued_at();
      if (idle && worker_polling_ && prompt_waits_ >= kPromptWaitsForLazyWake &&
          bytes <= kLazyWakeMaxBytes) {
        work_left_to_caller_ = true;  // the polling worker takes it if the caller does not
      } else {
        // A second operation behind one left to its caller means the caller is not waiting.
        wake_worker = idle || (work_left_to_caller_ && !executing_);
        work_left_to_caller_ = false;
      }
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
    worker_idle_wait(lock);
    if (queue_.empty()) return;  // stopping, and nothing left to run
    if (work_left_to_caller_) {
      // Its caller did not come for it within the poll interval: stop guessing that callers wait
      // at once, until they show it again.
      work_left_to_caller_ = false;
      prompt_waits_ = 0;
    }
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
    linger(lock);
  }
}

bool RingProcessGroup::worker_should_run(net::Clock::time_point now) const {
  if (executing_) return false;
  if (queue_.empty() || stopping_) return stopping_ || !queue_.empty();
  return !work_left_to_caller_ || now - queue_.front()->enqueued_at() >= kLazyWakePoll;
}

// Waking the idle worker for every operation costs a futex wake-up and a context switch, and on a
// busy host a thread that competes with the peers for the cores: for a caller that waits at once
// (allreduce(...)->wait()), and so runs the operation itself (run_inline_until), that is pure
// overhead, 60 µs of a 1 MiB shared-memory allreduce and most of a 64 KiB one (docs/benchmarks.md).
// So once kPromptWaitsForLazyWake operations in a row were waited for at once, enqueue leaves new
// work of up to kLazyWakeMaxBytes on an idle group to its caller, and the idle worker polls the
// queue every kLazyWakePoll instead of sleeping until notified: work nobody came for by then is
// the worker's, and the guess is dropped. A group idle for kLazyWakeIdle stops polling (its next
// operation wakes the worker as before).
void RingProcessGroup::worker_idle_wait(std::unique_lock<std::mutex>& lock) {
  for (;;) {
    const auto now = net::Clock::now();
    if (worker_should_run(now)) return;
    const bool poll = prompt_waits_ >= kPromptWaitsForLazyWake && !stopping_ &&
                      (work_left_to_caller_ || now - last_enqueue_ < kLazyWakeIdle);
    if (!poll) {
      worker_polling_ = false;
      queue_cv_.wait(lock);
      continue;
    }
    worker_polling_ = true;
    queue_cv_.wait_for(lock, kLazyWakePoll);
    worker_polling_ = false;
  }
}

// After its last work the worker stays awake for RingOptions::worker_linger, yielding the core, so
// that back-to-back calls (a training step's buckets, a benchmark loop) need no futex wake-up: on a
// busy two-core host the wake-up and its context switch cost more than a small collective. New
// work is left for a moment to a caller that waits for it at once (it runs it inline, without a
// hand-off); the worker takes it only if nobody has.
void RingProcessGroup::linger(std::unique_lock<std::mutex>& lock) {
  constexpr auto kLeaveToCaller = std::chrono::microseconds(20);
  // Callers that wait at once run their work themselves: a lingering worker would only compete
  // with them for the cores (and, having taken one operation, go on taking the next ones, each a
  // hand-off: 1 KiB over shared memory took 54 µs instead of 1.3 in that state).
  if (options_.worker_linger.count() <= 0 || prompt_waits_ >= kPromptWaitsForLazyWake) return;
  worker_lingering_ = true;
  const auto until = net::Clock::now() + options_.worker_linger;
  std::optional<net::Clock::time_point> work_seen;
  while (!stopping_ && !executing_) {
    const auto now = net::Clock::now();
    if (!queue_.empty()) {
      if (!work_seen) work_seen = now;
      if (now - *work_seen >= kLeaveToCaller) break;
    } else if (now >= until) {
      break;
    }
    lock.unlock();
    sched_yield();
    lock.lock();
  }
  worker_lingering_ = false;
}

void RingProcessGroup::run_inline_until(RingWork& work) {
  std::unique_lock lock(queue_mutex_);
  // A caller that comes for its work at once can be left to run the next ones itself (also when
  // the worker got to this one first).
  auto now = net::Clock::now();
  if (now - work.enqueued_at() < kPromptWait) {
    if (prompt_waits_ < kPromptWaitsForLazyWake) ++prompt_waits_;
  } else {
    prompt_waits_ = 0;
  }
  if (executing_ || work.is_completed()) {
    lock.unlock();
    // Another thread runs it: poll briefly for completion before the caller sleeps, yielding the
    // core, which that very thread may be waiting for (a busy-waiting caller on a host with no
    // idle core held its own worker off for the whole poll: 1 KiB allreduces of 55 µs).
    const auto until = net::Clock::now() + spin_;
    while (!work.is_completed() && net::Clock::now() < until) {
      sched_yield();
    }
    return;
  }
  executing_ = true;
  work_left_to_caller_ = false;  // whatever this thread leaves queued is the worker's
  while (!work.is_completed() && !queue_.empty()) {
    std::shared_ptr<RingWork> next = std::move(queue_.front());
    queue_.pop_front();
    lock.unlock();
    execute(*next, now);
    next.reset();  // callbacks may hold the last references; drop them outside the lock
    lock.lock();
    now = net::Clock::now();
  }
  executing_ = false;
  // Whatever was queued behind this work is the worker's again.
  if (!queue_.empty() || stopping_) queue_cv_.notify_one();
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

void RingProcessGroup::execute(RingWork& work, net::Clock::time_point start) {
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
  current_ = &args;
  struct ClearCurrent {
    const OpArgs*& current;
    ~ClearCurrent() { current = nullptr; }
  } clear_current{current_};
  try {
    run_op(args, net::deadline_after(args.timeout, start));
  } catch (const comm::shm::ShmPeerError& e) {
    // A local peer died or aborted: the domain's message names it; add the reason it left in the
    // store when the text does not carry it already.
    std::string message = e.what();
    const std::string reason =
        message.find("aborted the group") == std::string::npos ? abort_reason_of(e.peer()) : "";
    if (!reason.empty()) message += fmt::format("; rank {} reported: {}", e.peer(), reason);
    fail(work,
         std::make_exception_ptr(CommError(message, e.group(), e.op(), e.sequence(), e.peer())));
    return;
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
                                                       rank(), args.description(), name_, e.what()),
                                           name_, args.description(), args.header.sequence, -1)));
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
  // Local peers waiting in the segment, and remote ones waiting in the cross-host ring, fail now.
  if (domain_) domain_->abort(text);
  if (cross_) cross_->abort_from_parent(text);
  if (p2p_) p2p_->abort(error);
}

void RingProcessGroup::run_op(const OpArgs& a, net::Deadline deadline) {
  if (a.header.algorithm == Algorithm::kSharedMemory) return run_shm(a, deadline);
  if (a.header.algorithm == Algorithm::kHierarchical) return allreduce_hierarchical(a, deadline);
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
  const int avg_n = a.avg_divisor > 0 ? a.avg_divisor : n;
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
    const int divisor = (k == n - 2 && a.op == ReduceOp::kAvg) ? avg_n : 0;
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
    exchange_.add_recv_reduce(
        out, cur, bytes, a.op,
        last && a.op == ReduceOp::kAvg ? (a.avg_divisor > 0 ? a.avg_divisor : n) : 0);
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

// The collectives of a one-host group, through the shared-memory domain (docs/shared-memory.md).
void RingProcessGroup::run_shm(const OpArgs& a, net::Deadline deadline) {
  auto& d = *domain_;
  switch (a.kind) {
    case OpKind::kAllreduce:
      if (!a.segments.empty()) {
        return d.allreduce_segments(a.segments, a.dtype, a.op, a.header, deadline);
      }
      return d.allreduce(a.send, a.recv, a.count, a.dtype, a.op, a.header, deadline);
    case OpKind::kBroadcast:
      return d.broadcast(a.recv, a.count, a.dtype, a.root, a.header, deadline);
    case OpKind::kReduce:
      return d.reduce(a.send, a.recv, a.count, a.dtype, a.op, a.root, a.header, deadline);
    case OpKind::kAllgather:
      return d.allgather(a.send, a.recv, a.count, a.dtype, a.header, deadline);
    case OpKind::kReduceScatter: {
      // The domain reads every block of `send` until the end: an overlapping recv goes through a
      // pooled temporary.
      const std::size_t block = a.count * dtype_size(a.dtype);
      const std::byte* send_end = a.send + block * static_cast<std::size_t>(size());
      const bool overlaps = a.recv < send_end && a.send < a.recv + block;
      if (!overlaps) {
        return d.reduce_scatter(a.send, a.recv, a.count, a.dtype, a.op, a.header, deadline);
      }
      std::byte* temp = scratch(temp_a_, block);
      d.reduce_scatter(a.send, temp, a.count, a.dtype, a.op, a.header, deadline);
      std::memcpy(a.recv, temp, block);
      return;
    }
    case OpKind::kBarrier:
      return d.barrier(a.header, deadline);
    default:
      throw CommError(fmt::format("rank {}: {} has no shared-memory path", rank(), a.description()),
                      name_, a.description(), a.header.sequence, -1);
  }
}

// Allreduce of the cross-host group on `buf` (in place), with this operation's sequence number;
// an average divides by the whole group's size. Errors name this group's ranks.
void RingProcessGroup::cross_host_allreduce(std::byte* buf, std::size_t count, const OpArgs& a,
                                            net::Deadline deadline) {
  OpArgs x;
  x.kind = OpKind::kAllreduce;
  x.send = buf;
  x.recv = buf;
  x.count = count;
  x.dtype = a.dtype;
  x.op = a.op;
  x.avg_divisor = size();
  x.timeout = a.timeout;
  x.header = a.header;
  x.header.count = count;
  x.header.algorithm = cross_->tcp_allreduce_algorithm(count * dtype_size(a.dtype), count);
  x.label = fmt::format("{} (step across hosts, group '{}')", a.description(), cross_->name_);
  try {
    cross_->run_op(x, deadline);
  } catch (const comm::PeerClosedError& e) {
    const int peer = e.peer() >= 0 ? cross_members_[static_cast<std::size_t>(e.peer())] : -1;
    throw comm::PeerClosedError(fmt::format("{} [{}]", e.what(), cross_ranks_note(e.peer())), name_,
                                a.description(), a.header.sequence, peer);
  } catch (const CommError& e) {
    // The cross-host group numbers its members 0..H-1: name this group's ranks too.
    const int peer = e.peer() >= 0 ? cross_members_[static_cast<std::size_t>(e.peer())] : -1;
    throw CommError(fmt::format("{} [{}]", e.what(), cross_ranks_note(e.peer())), name_,
                    a.description(), a.header.sequence, peer);
  }
}

// Hierarchical allreduce for groups spanning hosts (costs in docs/algorithms.md):
//  - leaders: reduce inside each host to its leader over shared memory, allreduce among the
//    leaders over TCP, broadcast inside each host;
//  - slices (every host has the same number L of ranks, message above the small-message size):
//    reduce_scatter inside each host so that local rank i holds the host's sum of slice i,
//    allreduce slice i with the ranks of local index i on the other hosts (L rings at once, each
//    carrying 1/L of the data), allgather inside each host; the count % L elements left over
//    take the leaders' path.
// Each element is reduced in one fixed order (local ranks in rank order, then hosts by the
// cross-host algorithm, which gives the same bits to all of its ranks) and then copied, so every
// rank gets bit-identical results. avg sums and divides once, by the whole group's size.
void RingProcessGroup::allreduce_hierarchical(const OpArgs& a, net::Deadline deadline) {
  const std::size_t esz = dtype_size(a.dtype);
  const ReduceOp local_op = a.op == ReduceOp::kAvg ? ReduceOp::kSum : a.op;
  const auto local_size = local_.size();
  auto header = [&](OpKind kind, std::size_t count, int root) {
    OpHeader h = a.header;
    h.kind = kind;
    h.count = count;
    h.root = root;
    return h;
  };
  auto leaders_path = [&](std::size_t first, std::size_t count) {
    const std::byte* in = a.send + first * esz;
    std::byte* out = a.recv + first * esz;
    if (domain_) {
      domain_->reduce(in, out, count, a.dtype, local_op, 0, header(OpKind::kReduce, count, 0),
                      deadline);
    } else if (in != out && count > 0) {
      std::memcpy(out, in, count * esz);
    }
    if (local_rank_ == 0) cross_host_allreduce(out, count, a, deadline);
    if (domain_) {
      domain_->broadcast(out, count, a.dtype, 0, header(OpKind::kBroadcast, count, 0), deadline);
    }
  };
  const std::size_t per = a.count / local_size;
  if (!slices_ || local_size == 1 || a.count * esz <= options_.small_message_bytes || per == 0) {
    return leaders_path(0, a.count);
  }
  std::byte* slice = scratch(temp_hier_, per * esz);
  domain_->reduce_scatter(a.send, slice, per, a.dtype, local_op,
                          header(OpKind::kReduceScatter, per, -1), deadline);
  cross_host_allreduce(slice, per, a, deadline);
  domain_->allgather(slice, a.recv, per, a.dtype, header(OpKind::kAllgather, per, -1), deadline);
  const std::size_t tail = a.count - per * local_size;
  if (tail > 0) leaders_path(per * local_size, tail);
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
  comm::check_subgroup_ranks(ranks, size(), name_);
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

std::string ring_transport_of(const ProcessGroup& group) {
  const auto* ring = dynamic_cast<const RingProcessGroup*>(&group);
  return ring != nullptr ? ring->transport_description() : std::string();
}

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
  if (!options.secret.empty()) store::require_auth();
  if (options.chunk_bytes < 64) {
    throw ConfigError(
        fmt::format("RingOptions::chunk_bytes must be at least 64, got {}", options.chunk_bytes));
  }
  auto group = std::make_shared<RingProcessGroup>(std::move(store), rank, size, std::move(options));
  group->connect_mesh();
  group->start_p2p();
  group->start();
  return group;
}

}  // namespace ddp
