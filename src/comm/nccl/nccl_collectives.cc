// Each collective of the front as NCCL calls on the group's communication stream (see
// nccl_group.h). Called under the communicator's lock by NcclComm::run, after the fingerprints
// agreed; returns NCCL's code (ncclInProgress is normal: the communicator is non-blocking).
// Local copies (a rank's own block) are cudaMemcpyAsync on the same stream, outside NCCL groups
// (an exception inside ncclGroupStart/End would leave the thread's group open).
#include <fmt/format.h>

#include "comm/nccl/nccl_group.h"

namespace ddp::comm::nccl {
namespace {

bool overlaps(const void* a, std::size_t a_bytes, const void* b, std::size_t b_bytes) {
  const auto x = reinterpret_cast<std::uintptr_t>(a);
  const auto y = reinterpret_cast<std::uintptr_t>(b);
  return a_bytes > 0 && b_bytes > 0 && x < y + b_bytes && y < x + a_bytes;
}

// ncclGroupStart; `body`; ncclGroupEnd, which runs whatever body returned: the first error wins.
template <class Body>
ncclResult_t grouped(const NcclLibrary& lib, Body body) {
  ncclResult_t rc = lib.GroupStart();
  if (rc != ncclSuccess) return rc;
  const ncclResult_t inside = body();
  const ncclResult_t end = lib.GroupEnd();
  return inside != ncclSuccess ? inside : end;
}

}  // namespace

void* NcclProcessGroup::executor_scratch(std::size_t bytes, const Call& call) {
  if (scratch_.bytes >= bytes) return scratch_.data;
  // Freeing waits for the device: only when a larger call needs more (the pool grows, rarely).
  scratch_.reset();
  void* data = nullptr;
  check_cuda(call, lib_.Malloc(&data, bytes), "cudaMalloc (staging for an overlapping buffer)");
  scratch_.lib = &lib_;
  scratch_.data = data;
  scratch_.bytes = bytes;
  return data;
}

ncclResult_t NcclProcessGroup::enqueue_collective(const Call& call, ncclComm_t comm) {
  const ncclDataType_t type = nccl_dtype(call.dtype);
  const std::size_t count = call.count;
  const std::size_t bytes = count * dtype_size(call.dtype);
  const int n = size();
  const int me = rank();
  const auto block = [&](const void* base, int r) {
    return static_cast<const std::byte*>(base) + static_cast<std::size_t>(r) * bytes;
  };
  const auto copy = [&](void* to, const void* from, std::size_t length) {
    if (to == from || length == 0) return;
    check_cuda(call, lib_.MemcpyAsync(to, from, length, cudaMemcpyDeviceToDevice, stream_),
               "cudaMemcpyAsync (this rank's own block)");
  };
  switch (call.kind) {
    case Collective::kAllreduce:
      if (!call.segments.empty()) {
        // Each piece reduced where it lies; one group, so NCCL launches them together.
        const ncclRedOp_t op = nccl_op(call.op);
        return grouped(lib_, [&] {
          for (const auto& segment : call.segments) {
            if (segment.count == 0) continue;
            const ncclResult_t rc =
                lib_.AllReduce(segment.data, segment.data, segment.count, type, op, comm, stream_);
            if (rc != ncclSuccess && rc != ncclInProgress) return rc;
          }
          return ncclSuccess;
        });
      }
      return lib_.AllReduce(call.send, call.recv, count, type, nccl_op(call.op), comm, stream_);
    case Collective::kBroadcast:
      return lib_.Broadcast(call.send, call.recv, count, type, call.root, comm, stream_);
    case Collective::kReduce:
      // recv is used at the root only (NCCL reads recvbuff nowhere else).
      return lib_.Reduce(call.send, call.recv, count, type, nccl_op(call.op), call.root, comm,
                         stream_);
    case Collective::kAllgather: {
      // NCCL's in place is send == this rank's block of recv; any other overlap is staged.
      const void* send = call.send;
      if (send != block(call.recv, me) &&
          overlaps(send, bytes, call.recv, bytes * static_cast<std::size_t>(n))) {
        void* staged = executor_scratch(bytes, call);
        copy(staged, send, bytes);
        send = staged;
      }
      return lib_.AllGather(send, call.recv, count, type, comm, stream_);
    }
    case Collective::kReduceScatter: {
      // NCCL's in place is recv == this rank's block of send; any other overlap is staged.
      const std::size_t all = bytes * static_cast<std::size_t>(n);
      const void* send = call.send;
      if (call.recv != block(send, me) && overlaps(send, all, call.recv, bytes)) {
        void* staged = executor_scratch(all, call);
        copy(staged, send, all);
        send = staged;
      }
      return lib_.ReduceScatter(send, call.recv, count, type, nccl_op(call.op), comm, stream_);
    }
    case Collective::kGather: {
      if (me != call.root) {
        return grouped(lib_,
                       [&] { return lib_.Send(call.send, count, type, call.root, comm, stream_); });
      }
      // The root's own block first, on the stream before the receives, so a send buffer that
      // overlaps other blocks of recv is read before they are written. A send that overlaps its
      // own block without being it is staged (cudaMemcpyAsync of overlapping ranges is undefined).
      const void* own = call.send;
      const void* own_block = block(call.recv, me);
      if (own != own_block && overlaps(own, bytes, own_block, bytes)) {
        void* staged = executor_scratch(bytes, call);
        copy(staged, call.send, bytes);
        own = staged;
      }
      copy(const_cast<std::byte*>(block(call.recv, me)), own, bytes);
      return grouped(lib_, [&] {
        for (int r = 0; r < n; ++r) {
          if (r == me) continue;
          const ncclResult_t rc =
              lib_.Recv(const_cast<std::byte*>(block(call.recv, r)), count, type, r, comm, stream_);
          if (rc != ncclSuccess && rc != ncclInProgress) return rc;
        }
        return ncclSuccess;
      });
    }
    case Collective::kScatter: {
      if (me != call.root) {
        return grouped(lib_,
                       [&] { return lib_.Recv(call.recv, count, type, call.root, comm, stream_); });
      }
      const ncclResult_t rc = grouped(lib_, [&] {
        for (int r = 0; r < n; ++r) {
          if (r == me) continue;
          const ncclResult_t sent = lib_.Send(block(call.send, r), count, type, r, comm, stream_);
          if (sent != ncclSuccess && sent != ncclInProgress) return sent;
        }
        return ncclSuccess;
      });
      if (rc != ncclSuccess && rc != ncclInProgress) return rc;
      // After the sends on the same stream: a recv that overlaps other blocks of send must not
      // change them before they are sent. (cudaMemcpyAsync of overlapping ranges is undefined:
      // staged when the own block overlaps recv.)
      const void* own = block(call.send, me);
      if (own != call.recv && overlaps(own, bytes, call.recv, bytes)) {
        void* staged = executor_scratch(bytes, call);
        copy(staged, own, bytes);
        own = staged;
      }
      copy(call.recv, own, bytes);
      return rc;
    }
    case Collective::kAlltoall: {
      // In place (or overlapping): the receives would overwrite blocks not yet sent; stage the
      // send buffer on the device first.
      const std::size_t all = bytes * static_cast<std::size_t>(n);
      const void* source = call.send;
      if (overlaps(call.send, all, call.recv, all)) {
        void* staged = executor_scratch(all, call);
        copy(staged, call.send, all);
        source = staged;
      }
      copy(const_cast<std::byte*>(block(call.recv, me)), block(source, me), bytes);
      return grouped(lib_, [&] {
        for (int r = 0; r < n; ++r) {
          if (r == me) continue;
          ncclResult_t rc = lib_.Send(block(source, r), count, type, r, comm, stream_);
          if (rc != ncclSuccess && rc != ncclInProgress) return rc;
          rc =
              lib_.Recv(const_cast<std::byte*>(block(call.recv, r)), count, type, r, comm, stream_);
          if (rc != ncclSuccess && rc != ncclInProgress) return rc;
        }
        return ncclSuccess;
      });
    }
    case Collective::kBarrier:
    case Collective::kSend:
      break;
  }
  return ncclInvalidUsage;  // barrier runs as the fingerprint check; send/recv never come here
}

}  // namespace ddp::comm::nccl
