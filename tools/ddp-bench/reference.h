// Buffer layouts of the collectives and the reference ddp-bench checks their results against.
//
//   Layout layout = layout_for(Collective::kAllgather, 1 << 20, DType::kFloat32, world_size);
//   fill_input(spec, rank, send, layout.send_count);
//   poison(spec.dtype, recv, layout.recv_count);        // so a collective that wrote nothing fails
//   ... run the collective ...
//   std::uint64_t wrong = count_wrong(spec, rank, recv, layout);
//
// Inputs are small whole numbers chosen per rank and per element so that every reduction of
// every dtype is exact or within one rounding (sums stay below 256 for world sizes up to 32, so
// bfloat16 holds them exactly; products are of ones and twos), and so that a block delivered to
// the wrong rank or position has different values. Floating-point reductions are compared with a
// relative tolerance of a few units in the last place of the dtype (times the world size for the
// 16-bit types, whose partial sums may be rounded between steps); data movement and integer
// reductions must match exactly (integers wrap like the dtype). Pure functions: any thread.
// Nothing throws except on a DType/Collective outside its enum (std::invalid_argument).
#pragma once

#include <cstddef>
#include <cstdint>

#include "ddp-bench/bench_options.h"
#include "ddp/comm/types.h"

namespace ddp::bench {

// Element counts of one collective at one message size. For the blocked collectives (allgather,
// gather, scatter, reduce_scatter, alltoall) `total_count` is a multiple of the world size and
// `block_count` = total_count / world size is what each rank contributes or receives per block.
struct Layout {
  std::size_t total_count = 0;  // elements in the whole message (the "count" column)
  std::size_t block_count = 0;  // elements per rank block (= total_count when not blocked)
  std::size_t send_count = 0;   // elements in a rank's send buffer
  std::size_t recv_count = 0;   // elements in a rank's receive buffer
  std::size_t bytes = 0;        // total_count * dtype size (the "bytes" column)
};

// The layout for a requested size in bytes: the largest message of whole elements (whole
// blocks, for blocked collectives) that fits, but at least one element per rank. Barrier: 0.
Layout layout_for(Collective collective, std::size_t requested_bytes, DType dtype, int world_size);

// busbw / algbw, the factor that makes bandwidths comparable across world sizes (as
// nccl-tests): 2(N-1)/N for allreduce; (N-1)/N for reduce_scatter, allgather, gather, scatter and
// alltoall (each rank moves all but its own block); 1 for broadcast, reduce and sendrecv (each
// rank sends and receives the whole message); 0 for barrier.
double bus_bandwidth_factor(Collective collective, int world_size);

// What is being checked: the collective, its dtype and reduction, the group and root.
struct CheckSpec {
  Collective collective = Collective::kAllreduce;
  DType dtype = DType::kFloat32;
  ReduceOp reduce_op = ReduceOp::kSum;
  int world_size = 1;
  int root = 0;
};

// Writes rank `rank`'s input into `send` (`count` elements of spec.dtype).
void fill_input(const CheckSpec& spec, int rank, void* send, std::size_t count);

// Fills `buf` with a value no correct result has (NaN for floating point, -1 for integers).
void poison(DType dtype, void* buf, std::size_t count);

// The value element `index` of rank `rank`'s receive buffer must hold after the collective.
double expected_value(const CheckSpec& spec, int rank, const Layout& layout, std::size_t index);

// Number of elements of `recv` (layout.recv_count elements; for broadcast, the buffer itself)
// that differ from expected_value. 0 on ranks that receive nothing (reduce/gather off the root,
// barrier).
std::uint64_t count_wrong(const CheckSpec& spec, int rank, const void* recv, const Layout& layout);

// Element `index` of a buffer of `dtype`, as a double, and back (integers wrap, 16-bit floats
// round to nearest even).
double load_value(DType dtype, const void* buf, std::size_t index);
void store_value(DType dtype, void* buf, std::size_t index, double value);

}  // namespace ddp::bench
