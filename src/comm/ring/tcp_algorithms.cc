// The ring backend's TCP algorithms (costs in docs/algorithms.md).
#include "comm/ring/tcp_algorithms.h"

#include <algorithm>
#include <bit>
#include <cstring>

#include <fmt/format.h>

#include "ddp/comm/comm_error.h"

namespace ddp::comm {

TcpContext::TcpContext(const std::string& group, int rank, int size, std::size_t chunk_bytes,
                       std::chrono::microseconds spin)
    : group_(group), rank_(rank), size_(size), spin_(spin), chunk_(chunk_bytes) {}

Exchange& TcpContext::begin(const Call& a) {
  exchange_.reset(
      a.header, a.dtype,
      ExchangeContext{&group_, rank_, op_text_ = a.description(), peer_fds_.data(), size_,
                      idle_check_ ? &idle_check_ : nullptr, wait_warning_, &warn_});
  return exchange_;
}

void TcpContext::finish(const Call& a, net::Deadline deadline) {
  exchange_.run(deadline, spin_, a.timeout);
}

Algorithm tcp_allreduce_algorithm(std::size_t bytes, std::size_t count, int size,
                                  std::size_t small_message_bytes) {
  // With two ranks both algorithms move the same bytes and the ring only wins once splitting
  // the reduction pays for its extra step (measured: docs/algorithms.md), hence 2x there.
  const std::size_t small_limit = small_message_bytes * (size == 2 ? 2 : 1);
  return bytes <= small_limit || count < static_cast<std::size_t>(size)
             ? Algorithm::kRecursiveDoubling
             : Algorithm::kRing;
}

Algorithm tcp_broadcast_algorithm(std::size_t bytes, std::size_t small_message_bytes) {
  return bytes <= small_message_bytes ? Algorithm::kBinomialTree : Algorithm::kChain;
}

void run_tcp(TcpContext& tcp, const Call& a, net::Deadline deadline) {
  // For the connections this call is the first to need (TcpContext::fd).
  tcp.set_current(&a, deadline);
  struct ClearCurrent {
    TcpContext& tcp;
    ~ClearCurrent() { tcp.set_current(nullptr, {}); }
  } clear_current{tcp};
  switch (a.kind) {
    case Collective::kAllreduce:
      if (tcp.size() == 1) {
        if (a.send != a.recv && a.count > 0) {
          std::memcpy(a.recv, a.send, a.count * dtype_size(a.dtype));
        }
        return;
      }
      if (a.header.algorithm == Algorithm::kRing) return allreduce_ring(tcp, a, deadline);
      return allreduce_recursive_doubling(tcp, a, deadline);
    case Collective::kBarrier:
      if (tcp.size() == 1) return;
      return allreduce_recursive_doubling(tcp, a, deadline);
    case Collective::kBroadcast:
      if (tcp.size() == 1) return;
      return broadcast_tree(tcp, a, deadline);
    case Collective::kReduce:
      return reduce_chain(tcp, a, deadline);
    case Collective::kAllgather:
      return allgather_ring(tcp, a, deadline);
    case Collective::kReduceScatter:
      return reduce_scatter_ring(tcp, a, deadline);
    case Collective::kGather:
      return gather_direct(tcp, a, deadline);
    case Collective::kScatter:
      return scatter_direct(tcp, a, deadline);
    case Collective::kAlltoall:
      return alltoall_direct(tcp, a, deadline);
    case Collective::kSend:  // point to point runs on connections of its own (ring/p2p)
      break;
  }
  throw CommError(
      CommErrorKind::kInternal,
      fmt::format("rank {}: {} has no TCP collective path", tcp.rank(), a.description()),
      tcp.group(), a.description(), a.header.sequence, -1);
}

// Ring allreduce: reduce-scatter then allgather as one pipelined stream per direction. The
// buffer is cut into `size` segments; at step k rank r sends segment r-k to the next rank and
// receives segment r-k-1 from the previous one. Steps 0..N-2 reduce what arrives (dst = own input
// op incoming, in chunks), steps N-1..2N-3 copy final segments straight into place. What is sent
// at step k >= 1 is exactly what was received at step k-1, gated byte by byte, so forwarding
// starts as soon as the first chunk is reduced. Per rank: 2(N-1)/N * S bytes each way.
void allreduce_ring(TcpContext& tcp, const Call& a, net::Deadline deadline) {
  const int n = tcp.size();
  const int r = tcp.rank();
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
  tcp.begin(a);
  tcp.exchange().add_send_stream(next, tcp.fd(next));
  tcp.exchange().add_send_piece(a.send + seg_offset(r), seg_bytes(r));
  for (int k = 1; k <= 2 * n - 3; ++k) {
    const int s = seg(r - k);
    tcp.exchange().add_send_piece(a.recv + seg_offset(s), seg_bytes(s), k - 1);
  }
  tcp.exchange().add_recv_stream(prev, tcp.fd(prev), tcp.chunk(), tcp.chunk_bytes());
  for (int k = 0; k <= n - 2; ++k) {
    const int s = seg(r - k - 1);
    const int divisor = (k == n - 2 && a.op == ReduceOp::kAvg) ? avg_n : 0;
    tcp.exchange().add_recv_reduce(a.recv + seg_offset(s), a.send + seg_offset(s), seg_bytes(s),
                                   a.op, divisor);
  }
  for (int k = n - 1; k <= 2 * n - 3; ++k) {
    const int s = seg(r - (k - (n - 1)));
    tcp.exchange().add_recv_copy(a.recv + seg_offset(s), seg_bytes(s));
  }
  tcp.finish(a, deadline);
}

// Recursive doubling: log2(P) steps (P = largest power of two <= N); at step j rank v exchanges
// its whole current vector with v ^ 2^j and both reduce. The N-P extra ranks first hand their
// input to a neighbour and get the result back at the end. Per rank: log2(P) * S bytes each way.
// Also the barrier (S = 0: headers only).
void allreduce_recursive_doubling(TcpContext& tcp, const Call& a, net::Deadline deadline) {
  const int n = tcp.size();
  const int r = tcp.rank();
  const std::size_t bytes = a.count * dtype_size(a.dtype);
  const int p = static_cast<int>(std::bit_floor(static_cast<unsigned>(n)));
  const int rem = n - p;
  std::byte* temp_a = tcp.temp_a(bytes);
  std::byte* temp_b = tcp.temp_b(bytes);
  const std::byte* cur = a.send;
  if (r < 2 * rem) {
    if (r % 2 == 0) {
      tcp.begin(a);
      tcp.exchange().add_send_stream(r + 1, tcp.fd(r + 1));
      tcp.exchange().add_send_piece(a.send, bytes);
      tcp.finish(a, deadline);
      tcp.begin(a);
      tcp.exchange().add_recv_stream(r + 1, tcp.fd(r + 1));
      tcp.exchange().add_recv_copy(a.recv, bytes);
      tcp.finish(a, deadline);
      return;
    }
    tcp.begin(a);
    tcp.exchange().add_recv_stream(r - 1, tcp.fd(r - 1), tcp.chunk(), tcp.chunk_bytes());
    tcp.exchange().add_recv_reduce(temp_a, a.send, bytes, a.op, 0);
    tcp.finish(a, deadline);
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
    tcp.begin(a);
    tcp.exchange().add_send_stream(partner, tcp.fd(partner));
    tcp.exchange().add_send_piece(cur, bytes);
    tcp.exchange().add_recv_stream(partner, tcp.fd(partner), tcp.chunk(), tcp.chunk_bytes());
    tcp.exchange().add_recv_reduce(
        out, cur, bytes, a.op,
        last && a.op == ReduceOp::kAvg ? (a.avg_divisor > 0 ? a.avg_divisor : n) : 0);
    tcp.finish(a, deadline);
    cur = out;
  }
  if (r < 2 * rem) {
    tcp.begin(a);
    tcp.exchange().add_send_stream(r - 1, tcp.fd(r - 1));
    tcp.exchange().add_send_piece(a.recv, bytes);
    tcp.finish(a, deadline);
  }
}

// Broadcast down a tree rooted at `root`, forwarding each chunk as soon as it arrives: a chain
// (pipelined; every link carries S once, latency N-1 hops) for large messages, a binomial tree
// (ceil(log2 N) hops; the root sends S to each of its children) for small ones.
void broadcast_tree(TcpContext& tcp, const Call& a, net::Deadline deadline) {
  const int n = tcp.size();
  const int v = (tcp.rank() - a.root + n) % n;
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
  tcp.begin(a);
  int gate = -1;
  if (parent >= 0) {
    tcp.exchange().add_recv_stream(real(parent), tcp.fd(real(parent)));
    gate = tcp.exchange().add_recv_copy(a.recv, bytes);
  }
  for (int i = 0; i < child_count; ++i) {
    tcp.exchange().add_send_stream(real(children[i]), tcp.fd(real(children[i])));
    tcp.exchange().add_send_piece(a.recv, bytes, gate);
  }
  tcp.finish(a, deadline);
}

// Reduce along a chain ending at the root: the farthest rank sends its input, each rank on the
// way reduces what arrives with its own input (chunk by chunk) and forwards it at once.
// Every link carries S once; latency N-1 hops.
void reduce_chain(TcpContext& tcp, const Call& a, net::Deadline deadline) {
  const int n = tcp.size();
  const std::size_t bytes = a.count * dtype_size(a.dtype);
  if (n == 1) {
    if (a.send != a.recv && bytes > 0) std::memcpy(a.recv, a.send, bytes);
    return;
  }
  const int v = (tcp.rank() - a.root + n) % n;
  auto real = [&](int virtual_rank) { return (virtual_rank + a.root) % n; };
  tcp.begin(a);
  if (v == n - 1) {
    tcp.exchange().add_send_stream(real(v - 1), tcp.fd(real(v - 1)));
    tcp.exchange().add_send_piece(a.send, bytes);
  } else {
    std::byte* out = v == 0 ? a.recv : tcp.temp_a(bytes);
    tcp.exchange().add_recv_stream(real(v + 1), tcp.fd(real(v + 1)), tcp.chunk(),
                                   tcp.chunk_bytes());
    const int gate = tcp.exchange().add_recv_reduce(out, a.send, bytes, a.op,
                                                    v == 0 && a.op == ReduceOp::kAvg ? n : 0);
    if (v > 0) {
      tcp.exchange().add_send_stream(real(v - 1), tcp.fd(real(v - 1)));
      tcp.exchange().add_send_piece(out, bytes, gate);
    }
  }
  tcp.finish(a, deadline);
}

// Ring allgather: N-1 steps; at step k rank r forwards block r-k (its own first) to the next
// rank and receives block r-k-1 straight into place. Per rank: (N-1) * block bytes each way.
void allgather_ring(TcpContext& tcp, const Call& a, net::Deadline deadline) {
  const int n = tcp.size();
  const int r = tcp.rank();
  const std::size_t block = a.count * dtype_size(a.dtype);
  auto slot = [&](int k) { return a.recv + static_cast<std::size_t>(((k % n) + n) % n) * block; };
  if (a.send != slot(r) && block > 0) std::memcpy(slot(r), a.send, block);
  if (n == 1) return;
  const int next = (r + 1) % n;
  const int prev = (r + n - 1) % n;
  tcp.begin(a);
  tcp.exchange().add_send_stream(next, tcp.fd(next));
  tcp.exchange().add_send_piece(slot(r), block);
  for (int k = 1; k <= n - 2; ++k)
    tcp.exchange().add_send_piece(slot(r - k), block, k - 1);
  tcp.exchange().add_recv_stream(prev, tcp.fd(prev));
  for (int k = 0; k <= n - 2; ++k)
    tcp.exchange().add_recv_copy(slot(r - k - 1), block);
  tcp.finish(a, deadline);
}

// Ring reduce-scatter: N-1 steps; at step k rank r sends block r-k-1 (its input, then partial
// sums) and receives block r-k-2, reducing it with its own input; the last block it reduces is
// its own (r) and lands in recv. Per rank: (N-1) * block bytes each way.
void reduce_scatter_ring(TcpContext& tcp, const Call& a, net::Deadline deadline) {
  const int n = tcp.size();
  const int r = tcp.rank();
  const std::size_t block = a.count * dtype_size(a.dtype);
  if (n == 1) {
    if (a.send != a.recv && block > 0) std::memcpy(a.recv, a.send, block);
    return;
  }
  std::byte* partial = tcp.temp_a(block * static_cast<std::size_t>(n));
  auto index = [&](int k) { return static_cast<std::size_t>(((k % n) + n) % n); };
  const int next = (r + 1) % n;
  const int prev = (r + n - 1) % n;
  tcp.begin(a);
  tcp.exchange().add_send_stream(next, tcp.fd(next));
  tcp.exchange().add_send_piece(a.send + index(r - 1) * block, block);
  for (int k = 1; k <= n - 2; ++k) {
    tcp.exchange().add_send_piece(partial + index(r - k - 1) * block, block, k - 1);
  }
  tcp.exchange().add_recv_stream(prev, tcp.fd(prev), tcp.chunk(), tcp.chunk_bytes());
  for (int k = 0; k <= n - 2; ++k) {
    const std::size_t i = index(r - k - 2);
    const bool last = k == n - 2;
    tcp.exchange().add_recv_reduce(last ? a.recv : partial + i * block, a.send + i * block, block,
                                   a.op, last && a.op == ReduceOp::kAvg ? n : 0);
  }
  tcp.finish(a, deadline);
}

// Gather: every rank sends its block straight to the root, which receives them all at once.
void gather_direct(TcpContext& tcp, const Call& a, net::Deadline deadline) {
  const int n = tcp.size();
  const std::size_t block = a.count * dtype_size(a.dtype);
  if (tcp.rank() == a.root) {
    std::byte* own = a.recv + static_cast<std::size_t>(a.root) * block;
    if (own != a.send && block > 0) std::memcpy(own, a.send, block);
    if (n == 1) return;
    tcp.begin(a);
    for (int peer = 0; peer < n; ++peer) {
      if (peer == a.root) continue;
      tcp.exchange().add_recv_stream(peer, tcp.fd(peer));
      tcp.exchange().add_recv_copy(a.recv + static_cast<std::size_t>(peer) * block, block);
    }
    tcp.finish(a, deadline);
    return;
  }
  tcp.begin(a);
  tcp.exchange().add_send_stream(a.root, tcp.fd(a.root));
  tcp.exchange().add_send_piece(a.send, block);
  tcp.finish(a, deadline);
}

// Scatter: the root sends block j straight to rank j, to all at once.
void scatter_direct(TcpContext& tcp, const Call& a, net::Deadline deadline) {
  const int n = tcp.size();
  const std::size_t block = a.count * dtype_size(a.dtype);
  if (tcp.rank() == a.root) {
    const std::byte* own = a.send + static_cast<std::size_t>(a.root) * block;
    if (own != a.recv && block > 0) std::memmove(a.recv, own, block);
    if (n == 1) return;
    tcp.begin(a);
    for (int peer = 0; peer < n; ++peer) {
      if (peer == a.root) continue;
      tcp.exchange().add_send_stream(peer, tcp.fd(peer));
      tcp.exchange().add_send_piece(a.send + static_cast<std::size_t>(peer) * block, block);
    }
    tcp.finish(a, deadline);
    return;
  }
  tcp.begin(a);
  tcp.exchange().add_recv_stream(a.root, tcp.fd(a.root));
  tcp.exchange().add_recv_copy(a.recv, block);
  tcp.finish(a, deadline);
}

// Alltoall: every rank sends block j to rank j and receives block j from rank j, all pairs at
// once over the full mesh. Per rank: (N-1) * block bytes each way.
void alltoall_direct(TcpContext& tcp, const Call& a, net::Deadline deadline) {
  const int n = tcp.size();
  const int r = tcp.rank();
  const std::size_t block = a.count * dtype_size(a.dtype);
  const std::byte* source = a.send;
  if (a.send == a.recv && block > 0) {
    std::byte* copy = tcp.temp_a(block * static_cast<std::size_t>(n));
    std::memcpy(copy, a.send, block * static_cast<std::size_t>(n));
    source = copy;
  }
  const auto own = static_cast<std::size_t>(r) * block;
  if (source + own != a.recv + own && block > 0) std::memcpy(a.recv + own, source + own, block);
  if (n == 1) return;
  tcp.begin(a);
  for (int peer = 0; peer < n; ++peer) {
    if (peer == r) continue;
    tcp.exchange().add_send_stream(peer, tcp.fd(peer));
    tcp.exchange().add_send_piece(source + static_cast<std::size_t>(peer) * block, block);
  }
  for (int peer = 0; peer < n; ++peer) {
    if (peer == r) continue;
    tcp.exchange().add_recv_stream(peer, tcp.fd(peer));
    tcp.exchange().add_recv_copy(a.recv + static_cast<std::size_t>(peer) * block, block);
  }
  tcp.finish(a, deadline);
}

}  // namespace ddp::comm
