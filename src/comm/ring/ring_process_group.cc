// The ring backend's glue: options, the group's calls, choosing the transport and algorithm of
// each, failure handling. The parts live beside it: mesh (bootstrap), topology (which ranks share
// a host), tcp_algorithms, hierarchical, shm/ (the shared-memory domain); the queue and its
// threads are comm::OpQueue.
#include "ddp/ring_process_group.h"

#include <sys/socket.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <functional>
#include <optional>
#include <thread>

#include <fmt/format.h>

#include "comm/argument_checks.h"
#include "comm/op_queue.h"
#include "comm/ring/exchange.h"
#include "comm/ring/hierarchical.h"
#include "comm/ring/mesh.h"
#include "comm/ring/mesh_handshake.h"
#include "comm/ring/op_args.h"
#include "comm/ring/p2p/p2p_engine.h"
#include "comm/ring/shm/shm_domain.h"
#include "comm/ring/tcp_algorithms.h"
#include "comm/ring/topology.h"
#include "comm/wire.h"
#include "ddp/error.h"
#include "net/socket.h"
#include "settings/settings.h"
#include "store/auth.h"

namespace ddp {
namespace {

using comm::Algorithm;
using comm::OpArgs;
using comm::OpHeader;
using std::chrono::milliseconds;

milliseconds resolve_group_timeout(milliseconds configured) {
  if (configured.count() > 0) return configured;
  if (configured.count() < 0) {
    throw ConfigError(
        fmt::format("RingOptions::timeout is negative ({} ms); use a positive "
                    "value, or 0 for DDP_TIMEOUT / the default",
                    configured.count()));
  }
  return settings::timeout();  // DDP_TIMEOUT, else the default
}

// RingOptions::spin: negative = 50 us when every rank can have a core of its own, else none.
std::chrono::microseconds resolve_spin(std::chrono::microseconds configured, int size) {
  if (configured.count() >= 0) return configured;
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  return static_cast<unsigned>(size) <= cores ? std::chrono::microseconds(50)
                                              : std::chrono::microseconds(0);
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
  if (const std::string value = settings::transport(); !value.empty()) {
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

// DDP_FLIGHT_RECORDER_ENTRIES and DDP_DUMP_DIR, read where the group is made.
comm::FlightRecorderOptions flight_recorder_options() {
  return {.entries = settings::flight_recorder_entries(), .dump_dir = settings::dump_dir()};
}

std::string advertise_host(const RingOptions& options) {
  if (!options.advertise_host.empty()) return options.advertise_host;
  if (std::string env = settings::advertise_address(); !env.empty()) return env;
  return net::host_name();
}

class RingProcessGroup;

class RingWork final : public comm::QueuedWork {
 public:
  explicit RingWork(OpArgs args)
      : QueuedWork(args.timeout, args.count * dtype_size(args.dtype)), args_(std::move(args)) {}
  const OpArgs& args() const { return args_; }
  OpArgs take_arguments() { return std::move(args_); }
  std::string description() const override { return args_.description(); }
  const OpHeader* fingerprint() const override { return &args_.header; }

 protected:
  void on_sequenced(std::uint64_t sequence) override { args_.header.sequence = sequence; }

 private:
  OpArgs args_;
};

class RingProcessGroup final : public ProcessGroup,
                               public comm::OpQueue::Runner,
                               public std::enable_shared_from_this<RingProcessGroup> {
 public:
  RingProcessGroup(std::shared_ptr<Store> store, int rank, int size, RingOptions options);
  ~RingProcessGroup() override;

  void start() { queue_.start(weak_from_this()); }
  void connect_mesh();
  void start_p2p();
  // Poisons this group from its parent (a hierarchical step failed elsewhere): leaves `reason`
  // in the store and shuts the connections, so the peers fail now. Executor thread only.
  void abort_from_parent(const std::string& reason);
  std::string transport_description() const { return transport_text_; }

  std::string_view backend() const override { return "ring"; }
  // From the host identities exchanged at creation (a group of one rank: 0 of 1).
  int local_rank() const override { return topology_.local_rank; }
  int local_size() const override {
    return topology_.local.empty() ? 1 : static_cast<int>(topology_.local.size());
  }
  using ProcessGroup::allreduce;

  std::shared_ptr<Work> allreduce(const void* send, void* recv, std::size_t count, DType dtype,
                                  ReduceOp op, CallOptions options) override {
    check_buffer(send, count, "allreduce", "send");
    check_buffer(recv, count, "allreduce", "recv");
    const Algorithm algorithm =
        mode_ == Mode::kShm ? Algorithm::kSharedMemory
        : mode_ == Mode::kHierarchical
            ? Algorithm::kHierarchical
            : comm::tcp_allreduce_algorithm(bytes_of(count, dtype, "allreduce"), count, size(),
                                            options_.small_message_bytes);
    return enqueue(make_args(Collective::kAllreduce, send, recv, count, dtype, op, -1, algorithm),
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
    OpArgs args = make_args(Collective::kAllreduce, nullptr, nullptr, count, dtype, op, -1,
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
                            : comm::tcp_broadcast_algorithm(bytes_of(count, dtype, "broadcast"),
                                                            options_.small_message_bytes);
    return enqueue(
        make_args(Collective::kBroadcast, buf, buf, count, dtype, std::nullopt, root, algorithm),
        options);
  }

  std::shared_ptr<Work> reduce(const void* send, void* recv, std::size_t count, DType dtype,
                               ReduceOp op, int root, CallOptions options) override {
    check_rank(root, "reduce", "root");
    check_buffer(send, count, "reduce", "send");
    if (rank() == root) check_buffer(recv, count, "reduce", "recv (at the root)");
    return enqueue(make_args(Collective::kReduce, send, recv, count, dtype, op, root,
                             shm_or(Algorithm::kChain)),
                   options);
  }

  std::shared_ptr<Work> allgather(const void* send, void* recv, std::size_t count_per_rank,
                                  DType dtype, CallOptions options) override {
    check_buffer(send, count_per_rank, "allgather", "send");
    check_buffer(recv, count_per_rank, "allgather", "recv");
    return enqueue(make_args(Collective::kAllgather, send, recv, count_per_rank, dtype,
                             std::nullopt, -1, shm_or(Algorithm::kRing)),
                   options);
  }

  std::shared_ptr<Work> gather(const void* send, void* recv, std::size_t count_per_rank,
                               DType dtype, int root, CallOptions options) override {
    check_rank(root, "gather", "root");
    check_buffer(send, count_per_rank, "gather", "send");
    if (rank() == root) check_buffer(recv, count_per_rank, "gather", "recv (at the root)");
    return enqueue(make_args(Collective::kGather, send, recv, count_per_rank, dtype, std::nullopt,
                             root, Algorithm::kDirect),
                   options);
  }

  std::shared_ptr<Work> scatter(const void* send, void* recv, std::size_t count_per_rank,
                                DType dtype, int root, CallOptions options) override {
    check_rank(root, "scatter", "root");
    if (rank() == root) check_buffer(send, count_per_rank, "scatter", "send (at the root)");
    check_buffer(recv, count_per_rank, "scatter", "recv");
    return enqueue(make_args(Collective::kScatter, send, recv, count_per_rank, dtype, std::nullopt,
                             root, Algorithm::kDirect),
                   options);
  }

  std::shared_ptr<Work> reduce_scatter(const void* send, void* recv, std::size_t count_per_rank,
                                       DType dtype, ReduceOp op, CallOptions options) override {
    check_buffer(send, count_per_rank, "reduce_scatter", "send");
    check_buffer(recv, count_per_rank, "reduce_scatter", "recv");
    return enqueue(make_args(Collective::kReduceScatter, send, recv, count_per_rank, dtype, op, -1,
                             shm_or(Algorithm::kRing)),
                   options);
  }

  std::shared_ptr<Work> alltoall(const void* send, void* recv, std::size_t count_per_rank,
                                 DType dtype, CallOptions options) override {
    check_buffer(send, count_per_rank, "alltoall", "send");
    check_buffer(recv, count_per_rank, "alltoall", "recv");
    return enqueue(make_args(Collective::kAlltoall, send, recv, count_per_rank, dtype, std::nullopt,
                             -1, Algorithm::kDirect),
                   options);
  }

  std::shared_ptr<Work> barrier(CallOptions options) override {
    return enqueue(make_args(Collective::kBarrier, nullptr, nullptr, 0, DType::kUInt8, std::nullopt,
                             -1, shm_or(Algorithm::kRecursiveDoubling)),
                   options);
  }

  std::shared_ptr<Work> send(const void* buf, std::size_t count, DType dtype, int dst, int tag,
                             CallOptions options) override {
    check_buffer(buf, count, "send", "buf");
    check_peer(dst, "send", "dst");
    // Not queued: see start_p2p.
    return comm::finish_if_blocking(p2p_->send(buf, count, dtype, dst, tag, options), options);
  }

  std::shared_ptr<Work> recv(void* buf, std::size_t count, DType dtype, int src, int tag,
                             CallOptions options) override {
    check_buffer(buf, count, "recv", "buf");
    check_peer(src, "recv", "src");
    return comm::finish_if_blocking(p2p_->recv(buf, count, dtype, src, tag, options), options);
  }

  std::shared_ptr<ProcessGroup> new_group(std::vector<int> ranks) override;

  // comm::OpQueue::Runner: the queue runs operations through these.
  void run(comm::QueuedWork& work, net::Deadline deadline) override;
  void on_poison(const std::string& reason) noexcept override;

 private:
  enum class Mode {
    kTcp,           // everything over TCP
    kShm,           // one host: the shared-memory domain runs the collectives it has
    kHierarchical,  // several hosts, several ranks on some: allreduce inside hosts, then across
  };
  Algorithm shm_or(Algorithm tcp) const {
    return mode_ == Mode::kShm ? Algorithm::kSharedMemory : tcp;
  }
  void set_up_locality(Transport transport, net::Deadline deadline);
  void run_shm(const OpArgs& a, net::Deadline deadline);
  OpArgs make_args(Collective kind, const void* send, void* recv, std::size_t count, DType dtype,
                   std::optional<ReduceOp> op, int root, Algorithm algorithm) const;
  std::shared_ptr<Work> enqueue(OpArgs args, CallOptions options);
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

  // Runs `args` on the executing thread (the algorithm its header names); throws CommError.
  void run_op(const OpArgs& args, net::Deadline deadline);

  // A call that one rank runs over shared memory and another over TCP is invisible to both
  // transports' own checks; these two look across (see docs/algorithms.md, "Transports").
  void check_domain_for_other_call();
  void check_sockets_for_other_call();
  [[noreturn]] void fail_cross_transport_mismatch(int peer, const OpHeader& theirs);
  std::byte* scratch(std::size_t bytes) {
    if (shm_scratch_.size() < bytes) shm_scratch_.resize(bytes);
    return shm_scratch_.data();
  }

  std::shared_ptr<Store> store_;
  RingOptions options_;
  std::string name_;
  std::string prefix_;  // store keys of this incarnation of the group
  milliseconds timeout_;
  std::chrono::microseconds spin_{0};
  std::vector<net::Socket> peers_;

  std::atomic<int> subgroups_created_{0};

  // Touched only by the thread holding the executor role: the TCP algorithms' exchange and
  // scratch pool, and the shared-memory dispatch's temporary, reused across operations.
  comm::TcpContext tcp_;
  std::vector<std::byte> shm_scratch_;
  // DDP_WAIT_WARN_SECONDS: a collective waiting this long for a peer says so (0: never).
  milliseconds wait_warning_{0};

  // Locality (fixed at creation): which ranks share a host, and what runs where.
  Mode mode_ = Mode::kTcp;
  std::string transport_text_ = "tcp";
  comm::Topology topology_;
  // The ranks of this host that share memory (kShm: all; kHierarchical: this host's), or null.
  std::unique_ptr<comm::shm::ShmDomain> domain_;
  // kHierarchical: this rank's cross-host group (no worker thread of its own: its algorithms
  // run on this group's executor through hierarchy_.cross), and what the allreduce runs over.
  std::shared_ptr<RingProcessGroup> cross_;
  comm::Hierarchy hierarchy_;
  // The operation the executor is running (for the cross-transport checks), and the check the
  // TCP steps call while they sleep.
  const OpArgs* current_ = nullptr;

  // Order, threads, completion and poisoning of this group's operations; runs them through run().
  comm::OpQueue queue_;
  // Point to point (start_p2p): declared last, so it is gone before what its callbacks use.
  std::unique_ptr<comm::p2p::P2pEngine> p2p_;
};

RingProcessGroup::RingProcessGroup(std::shared_ptr<Store> store, int rank, int size,
                                   RingOptions options)
    : ProcessGroup(rank, size),
      store_(std::move(store)),
      options_(std::move(options)),
      name_(options_.group_name),
      timeout_(resolve_group_timeout(options_.timeout)),
      spin_(resolve_spin(options_.spin, size)),
      peers_(static_cast<std::size_t>(size)),
      tcp_(name_, rank, size, options_.chunk_bytes, spin_),
      wait_warning_(settings::wait_warning()),
      queue_(*this, comm::OpQueue::Options{.group = name_,
                                           .rank = rank,
                                           .size = size,
                                           .worker_linger = options_.worker_linger,
                                           .spin = spin_,
                                           .flight_recorder = flight_recorder_options(),
                                           .backend = "ring",
                                           .job_rank = settings::job_place().rank,
                                           .job_world_size = settings::job_place().world_size}) {
  tcp_.set_wait_warning(wait_warning_, options_.log);
}

RingProcessGroup::~RingProcessGroup() {
  queue_.stop();  // before the state run() uses goes away
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
  store_->set(
      fmt::format("{}host/{}", prefix_, rank()),
      fmt::format("{}\n{}", transport_name(transport), comm::host_identity(settings::host_id())));

  peers_ =
      comm::connect_full_mesh(*store_,
                              comm::MeshParams{.group = name_,
                                               .prefix = prefix_,
                                               .rank = rank(),
                                               .size = size(),
                                               .advertise_host = advertise_host(options_),
                                               .socket_buffer_bytes = options_.socket_buffer_bytes,
                                               .secret = options_.secret,
                                               .log = options_.log,
                                               .timeout = timeout_},
                              deadline);
  std::vector<int> fds;
  for (const auto& socket : peers_)
    fds.push_back(socket.valid() ? socket.fd() : -1);
  tcp_.set_peer_fds(std::move(fds));
  set_up_locality(transport, deadline);
}

// Reads every rank's host identity and transport, groups the ranks by host and, with `auto`,
// sets up the shared-memory domain (one host) or the hierarchical allreduce (several hosts).
void RingProcessGroup::set_up_locality(Transport transport, net::Deadline deadline) {
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
  }
  topology_ = comm::Topology::from_identities(identity_of, rank());
  const auto& hosts = topology_.hosts;
  const auto& local = topology_.local;
  const int local_rank = topology_.local_rank;
  if (transport == Transport::kTcp || topology_.largest_host() == 1) {
    transport_text_ = hosts.size() == 1 ? "tcp" : fmt::format("tcp ({} hosts)", hosts.size());
    return;
  }
  comm::shm::ShmOptions shm{.group = name_};
  shm.wait_warning = wait_warning_;
  shm.warn = options_.log;
  // A host's domain numbers its ranks 0..L-1: let its errors name this group's ranks.
  if (hosts.size() > 1) shm.ranks = local;
  shm.on_nap = [this] { check_sockets_for_other_call(); };
  if (options_.shm_slot_bytes != 0) {
    shm.slot_bytes = options_.shm_slot_bytes;
    shm.small_bytes = std::min(shm.small_bytes, shm.slot_bytes);
  }
  if (hosts.size() == 1) {
    domain_ = comm::shm::ShmDomain::create(*store_, prefix_ + "shm", rank(), size(), shm, deadline);
    tcp_.set_idle_check([this] { check_domain_for_other_call(); });
    mode_ = Mode::kShm;
    transport_text_ = "shm";
    return;
  }
  mode_ = Mode::kHierarchical;
  hierarchy_.group = name_;
  hierarchy_.group_size = size();
  hierarchy_.local = local;
  hierarchy_.local_rank = local_rank;
  hierarchy_.slices = topology_.equal_hosts();
  hierarchy_.small_message_bytes = options_.small_message_bytes;
  if (local.size() > 1) {
    domain_ =
        comm::shm::ShmDomain::create(*store_, fmt::format("{}shm/host{}", prefix_, local[0]),
                                     local_rank, static_cast<int>(local.size()), shm, deadline);
    tcp_.set_idle_check([this] { check_domain_for_other_call(); });
    hierarchy_.domain = domain_.get();
  }
  // Cross-host group: the ranks with this rank's local index (slices), or the leaders.
  if (hierarchy_.slices || local_rank == 0) {
    auto& members = hierarchy_.cross_members;
    for (const auto& h : hosts)
      members.push_back(h[static_cast<std::size_t>(local_rank)]);
    RingOptions cross_options = options_;
    cross_options.timeout = timeout_;
    cross_options.transport = Transport::kTcp;
    cross_options.group_name = fmt::format("{}/cross{}", name_, local_rank);
    const int index =
        static_cast<int>(std::find(members.begin(), members.end(), rank()) - members.begin());
    cross_ = std::make_shared<RingProcessGroup>(store_, index, static_cast<int>(members.size()),
                                                std::move(cross_options));
    hierarchy_.cross = &cross_->tcp_;
    try {
      cross_->connect_mesh();
    } catch (const CommError& e) {
      const int peer = e.peer() >= 0 ? members[static_cast<std::size_t>(e.peer())] : -1;
      throw CommError(fmt::format("{} [{}]", e.what(), hierarchy_.cross_ranks_note(e.peer())),
                      name_, e.op(), e.sequence(), peer);
    }
  }
  std::string sizes;
  for (const auto& h : hosts)
    sizes += fmt::format("{}{}", sizes.empty() ? "" : "+", h.size());
  transport_text_ = fmt::format("hierarchical({} hosts, {} ranks, {})", hosts.size(), sizes,
                                hierarchy_.slices ? "slices" : "leaders");
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
    fail_cross_transport_mismatch(topology_.local[static_cast<std::size_t>(local_peer)], theirs);
  }
}

// This rank waits in a shared-memory call: a peer that sent this group a header with the same
// sequence number over TCP runs a different collective.
void RingProcessGroup::check_sockets_for_other_call() {
  if (current_ == nullptr) return;
  for (int peer = 0; peer < size(); ++peer) {
    const auto& fds = tcp_.peer_fds();
    const int fd = fds.empty() ? -1 : fds[static_cast<std::size_t>(peer)];
    if (fd < 0) continue;
    OpHeader got;
    const ssize_t n = ::recv(fd, &got, sizeof got, MSG_PEEK | MSG_DONTWAIT);
    if (n == static_cast<ssize_t>(sizeof got) && got.magic == comm::kHeaderMagic &&
        got.sequence == current_->header.sequence && !(got == current_->header)) {
      fail_cross_transport_mismatch(peer, got);
    }
  }
}

void RingProcessGroup::abort_from_parent(const std::string& reason) {
  queue_.poison(std::make_exception_ptr(CommError(reason, name_, "abort", 0, -1)));
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

OpArgs RingProcessGroup::make_args(Collective kind, const void* send, void* recv, std::size_t count,
                                   DType dtype, std::optional<ReduceOp> op, int root,
                                   Algorithm algorithm) const {
  // to_string's names are string literals, so data() is null-terminated (no string per call).
  comm::check_enums(comm::to_string(kind).data(), dtype, op);
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
  args.timeout = comm::OpQueue::call_timeout(options, timeout_);
  return queue_.submit<RingWork>(std::move(args), options.blocking);
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

// Runs one operation for the queue; turns a peer's failure into a CommError that carries the
// reason the peer left in the store, if any.
void RingProcessGroup::run(comm::QueuedWork& work, net::Deadline deadline) {
  const OpArgs& args = static_cast<RingWork&>(work).args();
  current_ = &args;
  struct ClearCurrent {
    const OpArgs*& current;
    ~ClearCurrent() { current = nullptr; }
  } clear_current{current_};
  try {
    run_op(args, deadline);
  } catch (const comm::shm::ShmPeerError& e) {
    // A local peer died or aborted: the domain's message names it; add the reason it left in the
    // store when the text does not carry it already.
    std::string message = e.what();
    const std::string reason =
        message.find("aborted the group") == std::string::npos ? abort_reason_of(e.peer()) : "";
    if (!reason.empty()) message += fmt::format("; rank {} reported: {}", e.peer(), reason);
    throw CommError(message, e.group(), e.op(), e.sequence(), e.peer());
  } catch (const comm::PeerClosedError& e) {
    const std::string reason = abort_reason_of(e.peer());
    std::string message = e.what();
    message += reason.empty() ? fmt::format(" (rank {} left no reason: it probably died)", e.peer())
                              : fmt::format("; rank {} reported: {}", e.peer(), reason);
    throw CommError(message, e.group(), e.op(), e.sequence(), e.peer());
  }
}

// Sends and receives run on their own connections (TCP whatever the transport) and progress thread
// (src/comm/ring/p2p), never in this group's queue: they progress independently of each other and
// of the collectives, so a cycle of sends posted before receives cannot deadlock.
void RingProcessGroup::start_p2p() {
  if (size() == 1) return;
  // Set up as the mesh, under a group name of its own (a p2p connection cannot pass for a mesh
  // connection, or the reverse) and store keys of its own.
  auto sockets =
      comm::connect_full_mesh(*store_,
                              comm::MeshParams{.group = name_ + "#p2p",
                                               .prefix = prefix_ + "p2p/",
                                               .rank = rank(),
                                               .size = size(),
                                               .advertise_host = advertise_host(options_),
                                               .socket_buffer_bytes = options_.socket_buffer_bytes,
                                               .secret = options_.secret,
                                               .log = options_.log,
                                               .timeout = timeout_},
                              net::deadline_after(timeout_));
  // The progress thread polls them.
  for (auto& socket : sockets) {
    if (socket.valid()) socket.set_nonblocking(true);
  }
  p2p_ = std::make_unique<comm::p2p::P2pEngine>(
      std::move(sockets),
      comm::p2p::EngineOptions{.group = name_,
                               .rank = rank(),
                               .timeout = timeout_,
                               .spin = spin_,
                               .reason_of = [this](int peer) { return abort_reason_of(peer); }});
}

// The group is poisoned (the queue failed what was pending): leave the reason in the store for
// the peers, and shut the connections so that peers blocked on this rank fail now instead of at
// their deadline.
void RingProcessGroup::on_poison(const std::string& reason) noexcept {
  try {
    store_->set(fmt::format("{}abort/{}", prefix_, rank()), reason);
  } catch (const std::exception&) {
    // Best effort: the store may be gone with the rank that hosted it.
  }
  for (auto& socket : peers_) {
    if (socket.valid()) ::shutdown(socket.fd(), SHUT_RDWR);
  }
  // Local peers waiting in the segment, and remote ones waiting in the cross-host ring, fail now.
  try {
    if (domain_) domain_->abort(reason);
    if (cross_) cross_->abort_from_parent(reason);
    if (p2p_)
      p2p_->abort(std::make_exception_ptr(CommError(reason, name_, "point to point", 0, -1)));
  } catch (const std::exception&) {
    // Best effort, as the store above.
  }
}

void RingProcessGroup::run_op(const OpArgs& a, net::Deadline deadline) {
  if (a.header.algorithm == Algorithm::kSharedMemory) return run_shm(a, deadline);
  if (a.header.algorithm == Algorithm::kHierarchical) {
    return comm::allreduce_hierarchical(hierarchy_, a, deadline);
  }
  comm::run_tcp(tcp_, a, deadline);
}

// The collectives of a one-host group, through the shared-memory domain (docs/shared-memory.md).
void RingProcessGroup::run_shm(const OpArgs& a, net::Deadline deadline) {
  auto& d = *domain_;
  switch (a.kind) {
    case Collective::kAllreduce:
      if (!a.segments.empty()) {
        return d.allreduce_segments(a.segments, a.dtype, a.op, a.header, deadline);
      }
      return d.allreduce(a.send, a.recv, a.count, a.dtype, a.op, a.header, deadline);
    case Collective::kBroadcast:
      return d.broadcast(a.recv, a.count, a.dtype, a.root, a.header, deadline);
    case Collective::kReduce:
      return d.reduce(a.send, a.recv, a.count, a.dtype, a.op, a.root, a.header, deadline);
    case Collective::kAllgather:
      return d.allgather(a.send, a.recv, a.count, a.dtype, a.header, deadline);
    case Collective::kReduceScatter: {
      // The domain reads every block of `send` until the end: an overlapping recv goes through a
      // pooled temporary.
      const std::size_t block = a.count * dtype_size(a.dtype);
      const std::byte* send_end = a.send + block * static_cast<std::size_t>(size());
      const bool overlaps = a.recv < send_end && a.send < a.recv + block;
      if (!overlaps) {
        return d.reduce_scatter(a.send, a.recv, a.count, a.dtype, a.op, a.header, deadline);
      }
      std::byte* temp = scratch(block);
      d.reduce_scatter(a.send, temp, a.count, a.dtype, a.op, a.header, deadline);
      std::memcpy(a.recv, temp, block);
      return;
    }
    case Collective::kBarrier:
      return d.barrier(a.header, deadline);
    default:
      throw CommError(fmt::format("rank {}: {} has no shared-memory path", rank(), a.description()),
                      name_, a.description(), a.header.sequence, -1);
  }
}

std::shared_ptr<ProcessGroup> RingProcessGroup::new_group(std::vector<int> ranks) {
  comm::check_subgroup_ranks(ranks, size(), name_);
  const int index = subgroups_created_++;
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
