// The one front: every collective's checks and call record, written once for every backend.
#include "comm/group_front.h"

#include <fmt/format.h>

#include "comm/argument_checks.h"
#include "ddp/error.h"

namespace ddp::comm {

GroupFront::GroupFront(int rank, int size, std::string name, std::chrono::milliseconds timeout,
                       OpQueue::Options queue_options, SequenceObserver* observer)
    : ProcessGroup(rank, size),
      name_(std::move(name)),
      timeout_(timeout),
      observer_(observer),
      queue_(*this, std::move(queue_options)) {}

GroupFront::~GroupFront() {
  queue_.stop();  // idempotent: the backend stopped it already, before its own state went away
}

void GroupFront::check_buffer(const void* p, std::size_t count, const char* op,
                              const char* name) const {
  comm::check_buffer(p, count, op, name);
  if (count > max_count()) {
    throw ConfigError(fmt::format(
        "{}: count {} is above {} elements, the most one call of the {} backend takes; split the "
        "buffer into several calls",
        op, count, max_count(), backend()));
  }
}

void GroupFront::check_rank(int r, const char* op, const char* name) const {
  comm::check_rank(r, size(), name_, op, name);
}

void GroupFront::check_point_to_point(const void* buf, std::size_t count, DType dtype, int peer,
                                      int tag, const char* op, const char* peer_name) const {
  check_buffer(buf, count, op, "buf");
  comm::check_peer(peer, rank(), size(), name_, op, peer_name);
  check_message(dtype, tag, op);
}

void GroupFront::check_message(DType dtype, int tag, const char* op) const {
  comm::check_enums(op, dtype, std::nullopt);
  if (tag < min_tag() || tag > max_tag()) {
    throw ConfigError(fmt::format("{}: tag {} is outside {}..{}, the tags the {} backend accepts",
                                  op, tag, min_tag(), max_tag(), backend()));
  }
}

Call GroupFront::make_call(Collective kind, const void* send, void* recv, std::size_t count,
                           DType dtype, std::optional<ReduceOp> op, int root) const {
  // to_string's names are string literals, so data() is null-terminated (no string per call).
  comm::check_enums(comm::to_string(kind).data(), dtype, op);
  Call call;
  call.kind = kind;
  call.send = static_cast<const std::byte*>(send);
  call.recv = static_cast<std::byte*>(recv);
  call.count = count;
  call.dtype = dtype;
  call.op = op.value_or(ReduceOp::kSum);
  call.root = root;
  call.header.kind = kind;
  call.header.dtype = static_cast<std::uint8_t>(dtype);
  call.header.reduce_op = op ? static_cast<std::uint8_t>(*op) : comm::kNoReduceOp;
  call.header.count = count;
  call.header.root = root;
  return call;
}

std::shared_ptr<Work> GroupFront::submit(Call call, const CallOptions& options) {
  call.header.algorithm = algorithm_for(call);
  call.timeout = OpQueue::call_timeout(options, timeout_);
  prepare_call(call, options);
  return queue_.submit<CallWork>(std::move(call), options.blocking, observer_);
}

std::shared_ptr<Work> GroupFront::allreduce(const void* send, void* recv, std::size_t count,
                                            DType dtype, ReduceOp op, CallOptions options) {
  check_buffer(send, count, "allreduce", "send");
  check_buffer(recv, count, "allreduce", "recv");
  return submit(make_call(Collective::kAllreduce, send, recv, count, dtype, op, -1), options);
}

std::shared_ptr<Work> GroupFront::allreduce_segments(std::vector<BufferSegment> segments,
                                                     DType dtype, ReduceOp op,
                                                     CallOptions options) {
  if (!allreduce_segments_in_place()) {
    return ProcessGroup::allreduce_segments(std::move(segments), dtype, op, options);
  }
  std::size_t count = 0;
  for (const auto& segment : segments) {
    check_buffer(segment.data, segment.count, "allreduce_segments", "segment");
    count += segment.count;
  }
  Call call = make_call(Collective::kAllreduce, nullptr, nullptr, count, dtype, op, -1);
  call.segments = std::move(segments);
  return submit(std::move(call), options);
}

std::shared_ptr<Work> GroupFront::broadcast(void* buf, std::size_t count, DType dtype, int root,
                                            CallOptions options) {
  check_buffer(buf, count, "broadcast", "buf");
  check_rank(root, "broadcast", "root");
  return submit(make_call(Collective::kBroadcast, buf, buf, count, dtype, std::nullopt, root),
                options);
}

std::shared_ptr<Work> GroupFront::reduce(const void* send, void* recv, std::size_t count,
                                         DType dtype, ReduceOp op, int root, CallOptions options) {
  check_rank(root, "reduce", "root");
  check_buffer(send, count, "reduce", "send");
  if (rank() == root) check_buffer(recv, count, "reduce", "recv (at the root)");
  return submit(make_call(Collective::kReduce, send, recv, count, dtype, op, root), options);
}

std::shared_ptr<Work> GroupFront::allgather(const void* send, void* recv,
                                            std::size_t count_per_rank, DType dtype,
                                            CallOptions options) {
  check_buffer(send, count_per_rank, "allgather", "send");
  check_buffer(recv, count_per_rank, "allgather", "recv");
  return submit(
      make_call(Collective::kAllgather, send, recv, count_per_rank, dtype, std::nullopt, -1),
      options);
}

std::shared_ptr<Work> GroupFront::gather(const void* send, void* recv, std::size_t count_per_rank,
                                         DType dtype, int root, CallOptions options) {
  check_rank(root, "gather", "root");
  check_buffer(send, count_per_rank, "gather", "send");
  if (rank() == root) check_buffer(recv, count_per_rank, "gather", "recv (at the root)");
  return submit(
      make_call(Collective::kGather, send, recv, count_per_rank, dtype, std::nullopt, root),
      options);
}

std::shared_ptr<Work> GroupFront::scatter(const void* send, void* recv, std::size_t count_per_rank,
                                          DType dtype, int root, CallOptions options) {
  check_rank(root, "scatter", "root");
  if (rank() == root) check_buffer(send, count_per_rank, "scatter", "send (at the root)");
  check_buffer(recv, count_per_rank, "scatter", "recv");
  return submit(
      make_call(Collective::kScatter, send, recv, count_per_rank, dtype, std::nullopt, root),
      options);
}

std::shared_ptr<Work> GroupFront::reduce_scatter(const void* send, void* recv,
                                                 std::size_t count_per_rank, DType dtype,
                                                 ReduceOp op, CallOptions options) {
  check_buffer(send, count_per_rank, "reduce_scatter", "send");
  check_buffer(recv, count_per_rank, "reduce_scatter", "recv");
  return submit(make_call(Collective::kReduceScatter, send, recv, count_per_rank, dtype, op, -1),
                options);
}

std::shared_ptr<Work> GroupFront::alltoall(const void* send, void* recv, std::size_t count_per_rank,
                                           DType dtype, CallOptions options) {
  check_buffer(send, count_per_rank, "alltoall", "send");
  check_buffer(recv, count_per_rank, "alltoall", "recv");
  return submit(
      make_call(Collective::kAlltoall, send, recv, count_per_rank, dtype, std::nullopt, -1),
      options);
}

std::shared_ptr<Work> GroupFront::barrier(CallOptions options) {
  return submit(
      make_call(Collective::kBarrier, nullptr, nullptr, 0, DType::kUInt8, std::nullopt, -1),
      options);
}

std::shared_ptr<Work> GroupFront::send(const void* buf, std::size_t count, DType dtype, int dst,
                                       int tag, CallOptions options) {
  check_point_to_point(buf, count, dtype, dst, tag, "send", "dst");
  return finish_if_blocking(post_send(buf, count, dtype, dst, tag, options), options);
}

std::shared_ptr<Work> GroupFront::recv(void* buf, std::size_t count, DType dtype, int src, int tag,
                                       CallOptions options) {
  check_point_to_point(buf, count, dtype, src, tag, "recv", "src");
  return finish_if_blocking(post_recv(buf, count, dtype, src, tag, options), options);
}

std::shared_ptr<Work> GroupFront::recv_any_source(void* buf, std::size_t count, DType dtype,
                                                  int* source, int tag, CallOptions options) {
  check_buffer(buf, count, "recv_any_source", "buf");
  check_message(dtype, tag, "recv_any_source");
  if (size() == 1) {
    throw ConfigError(fmt::format(
        "recv_any_source in group '{}': the group has one rank, so no other rank can send", name_));
  }
  if (source == nullptr) {
    throw ConfigError(fmt::format(
        "recv_any_source in group '{}': `source` is null; pass where the sender's rank goes",
        name_));
  }
  return finish_if_blocking(post_recv_any_source(buf, count, dtype, source, tag, options), options);
}

std::shared_ptr<ProcessGroup> GroupFront::new_group(std::vector<int> ranks) {
  check_subgroup_ranks(ranks, size(), name_);
  std::vector<int> world(ranks.size());
  for (std::size_t i = 0; i < ranks.size(); ++i)
    world[i] = world_ranks()[static_cast<std::size_t>(ranks[i])];
  auto subgroup = make_subgroup(std::move(ranks));
  if (subgroup) subgroup->world_ranks_ = std::move(world);
  return subgroup;
}

}  // namespace ddp::comm
