// Creating an nccl group (the library, the device, the communicators through the store, streams,
// events, scratch), subgroups, point to point on a communicator of its own, and the uneven
// collectives' device seams (see nccl_group.h).
#include <algorithm>
#include <cstring>

#include <fmt/format.h>

#include "comm/nccl/nccl_device_guard.h"
#include "comm/nccl/nccl_errors.h"
#include "comm/nccl/nccl_group.h"
#include "ddp/error.h"
#include "settings/settings.h"

namespace ddp {
namespace comm::nccl {
namespace {

using std::chrono::milliseconds;

milliseconds resolve_group_timeout(milliseconds configured) {
  if (configured.count() > 0) return configured;
  if (configured.count() < 0) {
    throw ConfigError(fmt::format(
        "NcclOptions::timeout is negative ({} ms); use a positive value, or 0 for DDP_TIMEOUT / "
        "the default",
        configured.count()));
  }
  return settings::timeout();
}

// A send or recv as the p2p queue runs it.
struct P2pCall {
  bool is_recv = false;
  const void* send = nullptr;
  void* recv = nullptr;
  std::size_t count = 0;
  DType dtype = DType::kFloat32;
  int peer = -1;
  OpHeader header;  // the send's fingerprint; for a recv, the one expected from the peer
  std::chrono::milliseconds timeout{0};
  std::shared_ptr<void> caller_event;  // recorded on CallOptions::cuda_stream when posted
};

class P2pWork final : public QueuedWork {
 public:
  explicit P2pWork(P2pCall call)
      : QueuedWork(call.timeout, call.count * dtype_size(call.dtype)), call_(std::move(call)) {}
  P2pCall& call() { return call_; }
  std::string description() const override {
    return describe(call_.header, call_.peer, call_.is_recv);
  }
  const OpHeader* fingerprint() const override { return &call_.header; }

 private:
  P2pCall call_;
};

}  // namespace

// Runs the sends and receives in posting order on p2p_comm_ and p2p_stream_: the header first
// (and checked on the receiving side), then the data, so that a recv that does not match the send
// (another count, dtype or tag) is named as a mismatch before any byte lands in its buffer.
class NcclProcessGroup::P2pRunner final : public OpQueue::Runner {
 public:
  explicit P2pRunner(NcclProcessGroup& group) : group_(group) {}
  ~P2pRunner() override {
    if (done_ != nullptr) group_.lib_.EventDestroy(done_);
  }

  void set_up() {
    const NcclLibrary& lib = group_.lib_;
    void* data = nullptr;
    if (lib.Malloc(&data, sizeof(OpHeader)) != cudaSuccess) throw_setup("cudaMalloc");
    header_device_.lib = &lib;
    header_device_.data = data;
    header_device_.bytes = sizeof(OpHeader);
    if (lib.MallocHost(&data, sizeof(OpHeader)) != cudaSuccess) throw_setup("cudaMallocHost");
    header_host_.lib = &lib;
    header_host_.data = data;
    header_host_.bytes = sizeof(OpHeader);
    header_host_.pinned_host = true;
    if (lib.EventCreateWithFlags(&done_, cudaEventDisableTiming) != cudaSuccess) {
      throw_setup("cudaEventCreateWithFlags");
    }
  }

  void run(QueuedWork& work, net::Deadline deadline) override {
    NcclProcessGroup& g = group_;
    const NcclLibrary& lib = g.lib_;
    P2pCall& p = static_cast<P2pWork&>(work).call();
    // The group's error helpers take a Call: this one only names the operation.
    Call named;
    named.kind = Collective::kSend;
    named.header = p.header;
    named.timeout = p.timeout;
    named.label = work.description();
    DeviceGuard guard(lib, g.device_);
    if (p.caller_event) {
      g.check_cuda(
          named,
          lib.StreamWaitEvent(g.p2p_stream_, static_cast<CUevent_st*>(p.caller_event.get()), 0),
          "cudaStreamWaitEvent (ordering after the caller's stream)");
    }
    auto* host = static_cast<OpHeader*>(header_host_.data);
    void* device = header_device_.data;
    if (!p.is_recv) {
      *host = p.header;
      g.check_cuda(
          named,
          lib.MemcpyAsync(device, host, sizeof(OpHeader), cudaMemcpyHostToDevice, g.p2p_stream_),
          "cudaMemcpyAsync (the send's fingerprint)");
    }
    const auto transfer = [&](void* buf, std::size_t count, ncclDataType_t type) {
      return g.p2p_comm_->run(
          [&](ncclComm_t comm) {
            return p.is_recv ? lib.Recv(buf, count, type, p.peer, comm, g.p2p_stream_)
                             : lib.Send(buf, count, type, p.peer, comm, g.p2p_stream_);
          },
          deadline);
    };
    g.throw_if_failed(named, transfer(device, sizeof(OpHeader), ncclUint8),
                      "exchanging its fingerprint", *g.p2p_comm_);
    if (p.is_recv) {
      g.check_cuda(
          named,
          lib.MemcpyAsync(host, device, sizeof(OpHeader), cudaMemcpyDeviceToHost, g.p2p_stream_),
          "cudaMemcpyAsync (the send's fingerprint)");
    }
    g.check_cuda(named, lib.EventRecord(done_, g.p2p_stream_), "cudaEventRecord");
    g.wait_for_event(named, done_, *g.p2p_comm_, deadline, "exchanging its fingerprint");
    if (p.is_recv && !(*host == p.header)) {
      throw CommError(
          CommErrorKind::kMismatch,
          fmt::format("point-to-point mismatch in group '{}' (nccl backend): rank {} posted {} "
                      "but rank {} sent {}; sends and receives between two ranks match in "
                      "posting order and must agree on count, dtype and tag",
                      g.name(), g.rank(), work.description(), p.peer,
                      describe(*host, g.rank(), false)),
          g.name(), work.description(), p.header.sequence, p.peer);
    }
    if (p.count == 0) return;
    void* buf = p.is_recv ? p.recv : const_cast<void*>(p.send);
    g.throw_if_failed(named, transfer(buf, p.count, nccl_dtype(p.dtype)), "moving its data",
                      *g.p2p_comm_);
    g.check_cuda(named, lib.EventRecord(done_, g.p2p_stream_), "cudaEventRecord");
    g.wait_for_event(named, done_, *g.p2p_comm_, deadline, "moving its data");
  }

  // A point-to-point failure ends point to point (its communicator is aborted: NCCL cannot
  // cancel one operation) but not the collectives, which run on their own communicator.
  void on_poison(const std::string& reason) noexcept override {
    static_cast<void>(reason);
    if (group_.p2p_comm_) group_.p2p_comm_->abort();
  }

 private:
  [[noreturn]] void throw_setup(const char* what) {
    throw CommError(CommErrorKind::kSetup,
                    fmt::format("group '{}' (nccl backend): {} failed while setting up point to "
                                "point on CUDA device {}",
                                group_.name(), what, group_.device_),
                    group_.name(), "setting up point to point", 0, -1);
  }

  NcclProcessGroup& group_;
  DeviceBuffer header_device_;
  DeviceBuffer header_host_;
  cudaEvent_t done_ = nullptr;
};

NcclProcessGroup::NcclProcessGroup(std::shared_ptr<Store> store, const NcclLibrary& lib, int device,
                                   int rank, int size, NcclOptions options)
    : GroupFront(
          rank, size, options.group_name, options.timeout,
          OpQueue::Options{.group = options.group_name,
                           .rank = rank,
                           .size = size,
                           .flight_recorder = {.entries = settings::flight_recorder_entries(),
                                               .dump_dir = settings::dump_dir()},
                           .backend = "nccl",
                           .job_rank = settings::job_place().rank,
                           .job_world_size = settings::job_place().world_size}),
      store_(std::move(store)),
      lib_(lib),
      device_(device),
      options_(std::move(options)),
      events_(std::make_shared<CudaEventPool>(lib)),
      p2p_runner_(std::make_unique<P2pRunner>(*this)),
      p2p_queue_(*p2p_runner_,
                 OpQueue::Options{.group = options_.group_name + "#p2p",
                                  .rank = rank,
                                  .size = size,
                                  .backend = "nccl",
                                  .job_rank = settings::job_place().rank,
                                  .job_world_size = settings::job_place().world_size}),
      sends_to_(static_cast<std::size_t>(size), 0),
      recvs_from_(static_cast<std::size_t>(size), 0) {
  // Its thread starts with the first stream-ordered call, and stops in the destructor's body.
  watcher_ = std::make_unique<CompletionWatcher>(
      [this](const CompletionWatcher::Failure& failure) { on_watched_failure(failure); });
}

NcclProcessGroup::~NcclProcessGroup() {
  stop_queue();  // before the state run_call() uses goes away
  p2p_queue_.stop();
  // Stream-ordered calls still on the device finish (or fail, which aborts) first: their
  // polls use comm_, and dropping them unwatched could let a failure pass unseen.
  watcher_->drain();
  watcher_->stop();
  DeviceGuard guard(lib_, device_);
  // A poisoned group's communicators were aborted already; a healthy one's are finalised.
  p2p_comm_.reset();
  comm_.reset();
  for (cudaEvent_t event : {check_done_, call_done_}) {
    if (event != nullptr) lib_.EventDestroy(event);
  }
  events_.reset();  // its idle events, on the device (a call still holding one keeps the pool)
  for (cudaStream_t stream : {stream_, p2p_stream_}) {
    if (stream != nullptr) lib_.StreamDestroy(stream);
  }
}

void NcclProcessGroup::connect() {
  const auto deadline = net::deadline_after(group_timeout());
  const std::string prefix = next_setup_prefix(*store_, name(), size());
  Call setup;
  setup.label = "setting up the NCCL communicator";
  setup.timeout = group_timeout();
  const auto cuda = [&](cudaError_t rc, const char* what) {
    if (rc != cudaSuccess) {
      throw CommError(
          kind_of(rc),
          fmt::format(
              "rank {} of group '{}' (nccl backend, CUDA device {}): {}", rank(), name(), device_,
              describe_cuda_failure(what, rc, lib_.GetErrorName(rc), lib_.GetErrorStringCuda(rc))),
          name(), setup.label, 0, -1);
    }
  };
  cuda(lib_.StreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
  cuda(lib_.StreamCreateWithFlags(&p2p_stream_, cudaStreamNonBlocking),
       "cudaStreamCreateWithFlags");
  cuda(lib_.EventCreateWithFlags(&check_done_, cudaEventDisableTiming), "cudaEventCreateWithFlags");
  cuda(lib_.EventCreateWithFlags(&call_done_, cudaEventDisableTiming), "cudaEventCreateWithFlags");
  const std::size_t check_bytes = sizeof(OpHeader) * (static_cast<std::size_t>(size()) + 1);
  void* data = nullptr;
  cuda(lib_.Malloc(&data, check_bytes), "cudaMalloc (the fingerprint check's buffer)");
  check_device_.lib = &lib_;
  check_device_.data = data;
  check_device_.bytes = check_bytes;
  cuda(lib_.MallocHost(&data, check_bytes), "cudaMallocHost (the fingerprint check's buffer)");
  check_host_.lib = &lib_;
  check_host_.data = data;
  check_host_.bytes = check_bytes;
  check_host_.pinned_host = true;
  p2p_runner_->set_up();

  const UniqueIdBytes id = exchange_unique_id(
      *store_, prefix, name(), rank(),
      [&] {
        ncclUniqueId unique{};
        const ncclResult_t rc = lib_.GetUniqueId(&unique);
        if (rc != ncclSuccess) {
          throw CommError(kind_of(rc),
                          fmt::format("ncclGetUniqueId {}",
                                      describe_nccl_failure(rc, lib_.GetErrorString(rc), nullptr)),
                          name(), setup.label, 0, -1);
        }
        UniqueIdBytes bytes{};
        std::memcpy(bytes.data(), unique.internal, kUniqueIdBytes);
        return bytes;
      },
      deadline);
  NcclComm::Result result;
  comm_ = NcclComm::init_rank(lib_, id, size(), rank(), deadline, result);
  if (!comm_) {
    if (result.outcome == NcclComm::Outcome::kTimedOut) {
      throw CommError(
          CommErrorKind::kTimeout,
          fmt::format("rank {} of group '{}' (nccl backend, CUDA device {}): the NCCL "
                      "communicator of {} ranks was not complete within {} ms and was aborted: a "
                      "rank did not arrive (it is slower, stuck, or gone)",
                      rank(), name(), device_, size(), group_timeout().count()),
          name(), setup.label, 0, -1);
    }
    throw CommError(kind_of(result.code) == CommErrorKind::kInternal ? CommErrorKind::kSetup
                                                                     : kind_of(result.code),
                    fmt::format("rank {} of group '{}' (nccl backend, CUDA device {}): "
                                "ncclCommInitRankConfig {}",
                                rank(), name(), device_,
                                describe_nccl_failure(result.code, lib_.GetErrorString(result.code),
                                                      result.last_error.c_str())),
                    name(), setup.label, 0, -1);
  }
  p2p_comm_ = NcclComm::split(lib_, *comm_, deadline, result);
  if (!p2p_comm_) {
    throw CommError(
        result.outcome == NcclComm::Outcome::kTimedOut ? CommErrorKind::kTimeout
                                                       : CommErrorKind::kSetup,
        fmt::format("rank {} of group '{}' (nccl backend): the point-to-point "
                    "communicator (ncclCommSplit) could not be made: {}",
                    rank(), name(),
                    result.outcome == NcclComm::Outcome::kTimedOut
                        ? "a rank did not arrive in time"
                        : describe_nccl_failure(result.code, lib_.GetErrorString(result.code),
                                                result.last_error.c_str())),
        name(), setup.label, 0, -1);
  }
}

std::shared_ptr<Work> NcclProcessGroup::post_send(const void* buf, std::size_t count, DType dtype,
                                                  int dst, int tag, CallOptions options) {
  check_device_memory(buf, "send", [&] { return fmt::format("send to rank {}", dst); });
  P2pCall p{.is_recv = false, .send = buf, .count = count, .dtype = dtype, .peer = dst};
  {
    std::lock_guard lock(p2p_mutex_);
    p.header.sequence = sends_to_[static_cast<std::size_t>(dst)]++;
  }
  p.header.kind = Collective::kSend;
  p.header.dtype = static_cast<std::uint8_t>(dtype);
  p.header.algorithm = Algorithm::kDirect;
  p.header.count = count;
  p.header.root = tag;
  p.timeout = OpQueue::call_timeout(options, group_timeout());
  Call named;  // for prepare_call's event and its errors
  named.header = p.header;
  prepare_call(named, options);
  p.caller_event = std::move(named.backend_state);
  auto work = std::make_shared<P2pWork>(std::move(p));
  p2p_queue_.enqueue(work);
  return work;
}

std::shared_ptr<Work> NcclProcessGroup::post_recv(void* buf, std::size_t count, DType dtype,
                                                  int src, int tag, CallOptions options) {
  check_device_memory(buf, "receive", [&] { return fmt::format("recv from rank {}", src); });
  P2pCall p{.is_recv = true, .recv = buf, .count = count, .dtype = dtype, .peer = src};
  {
    std::lock_guard lock(p2p_mutex_);
    p.header.sequence = recvs_from_[static_cast<std::size_t>(src)]++;
  }
  p.header.kind = Collective::kSend;
  p.header.dtype = static_cast<std::uint8_t>(dtype);
  p.header.algorithm = Algorithm::kDirect;
  p.header.count = count;
  p.header.root = tag;
  p.timeout = OpQueue::call_timeout(options, group_timeout());
  Call named;
  named.header = p.header;
  prepare_call(named, options);
  p.caller_event = std::move(named.backend_state);
  auto work = std::make_shared<P2pWork>(std::move(p));
  p2p_queue_.enqueue(work);
  return work;
}

std::shared_ptr<ProcessGroup> NcclProcessGroup::make_subgroup(std::vector<int> ranks) {
  std::lock_guard lock(new_group_mutex_);
  const int index = subgroups_created_++;
  const auto it = std::find(ranks.begin(), ranks.end(), rank());
  if (it == ranks.end()) return nullptr;
  NcclOptions sub = options_;
  sub.timeout = group_timeout();
  sub.group_name = fmt::format("{}/sub{}", name(), index);
  sub.device = device_;
  // A communicator of its own with an id of its own through the store (keys under the
  // subgroup's name): only the members take part, as new_group's contract asks.
  DeviceGuard guard(lib_, device_);
  auto group = std::make_shared<NcclProcessGroup>(store_, lib_, device_,
                                                  static_cast<int>(it - ranks.begin()),
                                                  static_cast<int>(ranks.size()), std::move(sub));
  group->connect();
  group->start();
  return group;
}

// The counts of the uneven collectives: host words through device scratch, allgathered as any
// call (in the group's order), copied back once it completed. Small and rare: plain cudaMemcpy.
std::vector<std::int64_t> NcclProcessGroup::exchange_words(const std::vector<std::int64_t>& mine,
                                                           CallOptions options) {
  const std::size_t n = mine.size();
  const std::size_t all = n * static_cast<std::size_t>(size());
  auto device =
      std::static_pointer_cast<std::int64_t>(make_scratch((n + all) * sizeof(std::int64_t)));
  DeviceGuard guard(lib_, device_);
  Call named;
  named.label = "the uneven collective's count exchange";
  // Pageable memory: cudaMemcpy returns once the copy is done, so `mine` may go.
  check_cuda(
      named,
      lib_.Memcpy(device.get(), mine.data(), n * sizeof(std::int64_t), cudaMemcpyHostToDevice),
      "cudaMemcpy (the counts to the device)");
  options.blocking = false;
  allgather(device.get(), device.get() + n, n, DType::kInt64, options)->wait();
  std::vector<std::int64_t> words(all);
  check_cuda(named,
             lib_.Memcpy(words.data(), device.get() + n, all * sizeof(std::int64_t),
                         cudaMemcpyDeviceToHost),
             "cudaMemcpy (the counts to the host)");
  return words;
}

std::shared_ptr<void> NcclProcessGroup::make_scratch(std::size_t bytes) {
  DeviceGuard guard(lib_, device_);
  void* data = nullptr;
  const cudaError_t rc = lib_.Malloc(&data, std::max<std::size_t>(bytes, 1));
  if (rc != cudaSuccess) {
    Call named;
    named.label = "the uneven collective's padding";
    check_cuda(named, rc, "cudaMalloc");
  }
  const NcclLibrary* lib = &lib_;
  // cudaFree waits for the device, so a buffer a queued copy still reads is not freed under it.
  return std::shared_ptr<void>(data, [lib](void* p) { lib->Free(p); });
}

NcclProcessGroup::BlockCopier NcclProcessGroup::block_copier(const CallOptions& options) {
  const NcclLibrary* lib = &lib_;
  const auto stream = static_cast<cudaStream_t>(options.cuda_stream);
  const int device = device_;
  // On the caller's stream: ordered after what the caller queued, and before the padded call
  // (whose event is recorded on that stream after these copies).
  return [lib, stream, device](void* dst, const void* src, std::size_t bytes) {
    DeviceGuard guard(*lib, device);
    const cudaError_t rc = lib->MemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream);
    if (rc != cudaSuccess) {
      throw CommError(kind_of(rc),
                      describe_cuda_failure("cudaMemcpyAsync (an uneven collective's block)", rc,
                                            lib->GetErrorName(rc), lib->GetErrorStringCuda(rc)),
                      "", "uneven collective", 0, -1);
    }
  };
}

}  // namespace comm::nccl

std::shared_ptr<ProcessGroup> make_nccl_process_group(std::shared_ptr<Store> store, int rank,
                                                      int size, NcclOptions options) {
  if (!store) throw ConfigError("make_nccl_process_group: the store is null");
  if (size < 1) {
    throw ConfigError(
        fmt::format("make_nccl_process_group: size must be at least 1, got {}", size));
  }
  if (rank < 0 || rank >= size) {
    throw ConfigError(fmt::format("make_nccl_process_group: rank {} is outside 0..{} (size {})",
                                  rank, size - 1, size));
  }
  if (options.group_name.empty()) {
    throw ConfigError("make_nccl_process_group: NcclOptions::group_name is empty");
  }
  options.timeout = comm::nccl::resolve_group_timeout(options.timeout);
  if (options.library.empty()) options.library = settings::nccl_library();
  // Each rank checks its own machine before meeting the others: a missing library or device is
  // this rank's ConfigError at once, not a peer's timeout later.
  const int device = prepare_nccl_device(options);
  const auto& lib = comm::nccl::NcclLibrary::load(options.library);
  options.device = device;
  auto group = std::make_shared<comm::nccl::NcclProcessGroup>(std::move(store), lib, device, rank,
                                                              size, std::move(options));
  group->connect();
  group->start();
  return group;
}

int prepare_nccl_device(const NcclOptions& options) {
  const std::string library = options.library.empty() ? settings::nccl_library() : options.library;
  return comm::nccl::NcclLibrary::load(library).select_device(options.device);
}

bool nccl_backend_available() {
  return true;
}

const char* nccl_backend_unavailable_reason() {
  return "";
}

}  // namespace ddp
