// ForwardingGroup: a test fixture that forwards every ProcessGroup call to another group. Tests
// derive from it and override the calls they want to observe or change (recording which buffers
// a layer hands the engine, pretending ranks share hosts, ...), instead of each writing the
// forwarding out again.
#pragma once

#include <memory>
#include <string_view>
#include <utility>
#include <vector>

#include "ddp/comm/process_group.h"

namespace ddp::test {

class ForwardingGroup : public ProcessGroup {
 public:
  explicit ForwardingGroup(std::shared_ptr<ProcessGroup> inner)
      : ProcessGroup(inner->rank(), inner->size()), inner_(std::move(inner)) {}

  std::string_view backend() const override { return inner_->backend(); }
  int local_rank() const override { return inner_->local_rank(); }
  int local_size() const override { return inner_->local_size(); }
  bool allreduce_segments_in_place() const override {
    return inner_->allreduce_segments_in_place();
  }
  using ProcessGroup::allreduce;
  std::shared_ptr<Work> allreduce(const void* s, void* r, std::size_t n, DType d, ReduceOp op,
                                  CallOptions o) override {
    return inner_->allreduce(s, r, n, d, op, o);
  }
  std::shared_ptr<Work> allreduce_segments(std::vector<BufferSegment> segments, DType d,
                                           ReduceOp op, CallOptions o) override {
    return inner_->allreduce_segments(std::move(segments), d, op, o);
  }
  std::shared_ptr<Work> broadcast(void* b, std::size_t n, DType d, int root,
                                  CallOptions o) override {
    return inner_->broadcast(b, n, d, root, o);
  }
  std::shared_ptr<Work> reduce(const void* s, void* r, std::size_t n, DType d, ReduceOp op,
                               int root, CallOptions o) override {
    return inner_->reduce(s, r, n, d, op, root, o);
  }
  std::shared_ptr<Work> allgather(const void* s, void* r, std::size_t n, DType d,
                                  CallOptions o) override {
    return inner_->allgather(s, r, n, d, o);
  }
  std::shared_ptr<Work> gather(const void* s, void* r, std::size_t n, DType d, int root,
                               CallOptions o) override {
    return inner_->gather(s, r, n, d, root, o);
  }
  std::shared_ptr<Work> scatter(const void* s, void* r, std::size_t n, DType d, int root,
                                CallOptions o) override {
    return inner_->scatter(s, r, n, d, root, o);
  }
  std::shared_ptr<Work> reduce_scatter(const void* s, void* r, std::size_t n, DType d, ReduceOp op,
                                       CallOptions o) override {
    return inner_->reduce_scatter(s, r, n, d, op, o);
  }
  std::shared_ptr<Work> alltoall(const void* s, void* r, std::size_t n, DType d,
                                 CallOptions o) override {
    return inner_->alltoall(s, r, n, d, o);
  }
  std::shared_ptr<Work> barrier(CallOptions o) override { return inner_->barrier(o); }
  std::shared_ptr<Work> send(const void* b, std::size_t n, DType d, int dst, int tag,
                             CallOptions o) override {
    return inner_->send(b, n, d, dst, tag, o);
  }
  std::shared_ptr<Work> recv(void* b, std::size_t n, DType d, int src, int tag,
                             CallOptions o) override {
    return inner_->recv(b, n, d, src, tag, o);
  }
  std::shared_ptr<ProcessGroup> new_group(std::vector<int> ranks) override {
    return inner_->new_group(std::move(ranks));
  }

 protected:
  ProcessGroup& inner() { return *inner_; }

 private:
  std::shared_ptr<ProcessGroup> inner_;
};

}  // namespace ddp::test
