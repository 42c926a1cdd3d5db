// make_external_backend_group: the front (group_front.h) over a backend written outside
// ddp::comm (ddp/comm/external_backend.h). The front stays internal; this file is the one seam
// through which a layer above reaches it.
#include <fmt/format.h>

#include "comm/group_front.h"
#include "ddp/comm/external_backend.h"
#include "ddp/error.h"
#include "ddp/timeouts.h"
#include "settings/settings.h"

namespace ddp {
namespace {

BackendCall to_backend_call(const comm::Call& call) {
  return BackendCall{.kind = call.kind,
                     .send = call.send,
                     .recv = call.recv,
                     .count = call.count,
                     .dtype = call.dtype,
                     .op = call.op,
                     .root = call.root,
                     .sequence = call.header.sequence,
                     .description = call.description()};
}

class ExternalBackendGroup final : public comm::GroupFront,
                                   public std::enable_shared_from_this<ExternalBackendGroup> {
 public:
  ExternalBackendGroup(std::unique_ptr<ExternalBackend> backend, int rank, int size,
                       const ExternalGroupOptions& options, std::chrono::milliseconds timeout)
      : GroupFront(rank, size, options.name, timeout,
                   comm::OpQueue::Options{
                       .group = options.name,
                       .rank = rank,
                       .size = size,
                       .flight_recorder = {.entries = settings::flight_recorder_entries(),
                                           .dump_dir = settings::dump_dir()},
                       .backend = std::string(backend->name()),
                       .job_rank = settings::job_place().rank,
                       .job_world_size = settings::job_place().world_size}),
        backend_(std::move(backend)) {}
  ~ExternalBackendGroup() override { stop_queue(); }  // before backend_ goes away

  void start() { start_queue(weak_from_this()); }
  std::string_view backend() const override { return backend_->name(); }

 protected:
  void prepare_call(comm::Call& call, const CallOptions& options) override {
    static_cast<void>(options);
    backend_->check(to_backend_call(call));
  }
  void run_call(comm::Call& call, net::Deadline deadline) override {
    backend_->run(to_backend_call(call), deadline);
  }
  void on_poison(const std::string& reason) noexcept override { backend_->on_poison(reason); }
  std::shared_ptr<Work> post_send(const void* buf, std::size_t count, DType dtype, int dst, int tag,
                                  CallOptions options) override {
    return backend_->send(buf, count, dtype, dst, tag,
                          comm::OpQueue::call_timeout(options, group_timeout()));
  }
  std::shared_ptr<Work> post_recv(void* buf, std::size_t count, DType dtype, int src, int tag,
                                  CallOptions options) override {
    return backend_->recv(buf, count, dtype, src, tag,
                          comm::OpQueue::call_timeout(options, group_timeout()));
  }
  std::shared_ptr<ProcessGroup> make_subgroup(std::vector<int> ranks) override {
    return backend_->new_group(ranks);
  }
  int min_tag() const override { return backend_->min_tag(); }
  int max_tag() const override { return backend_->max_tag(); }

 private:
  std::unique_ptr<ExternalBackend> backend_;
};

}  // namespace

std::shared_ptr<ProcessGroup> make_external_backend_group(std::unique_ptr<ExternalBackend> backend,
                                                          int rank, int size,
                                                          ExternalGroupOptions options) {
  if (backend == nullptr) {
    throw ConfigError("make_external_backend_group: the backend is null");
  }
  if (size < 1 || rank < 0 || rank >= size) {
    throw ConfigError(fmt::format(
        "make_external_backend_group: rank {} is outside a group of size {}", rank, size));
  }
  if (options.timeout.count() < 0) {
    throw ConfigError(fmt::format("make_external_backend_group: timeout {} ms is negative",
                                  options.timeout.count()));
  }
  const auto timeout = options.timeout.count() == 0 ? kDefaultTimeout : options.timeout;
  auto group =
      std::make_shared<ExternalBackendGroup>(std::move(backend), rank, size, options, timeout);
  group->start();
  return group;
}

}  // namespace ddp
