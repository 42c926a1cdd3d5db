// DdpLoggingData: what a DistributedDataParallel is configured with, how its buckets look and
// where its time goes, like PyTorch's DistributedDataParallel._get_ddp_logging_data() (the fields
// take the names of PyTorch's DDPLoggingData where there is one; times in nanoseconds as there).
//
//   auto data = model->logging_data();
//   std::cout << data.to_json() << "\n";   // one JSON object
//
// Averages are over the synchronised backward passes so far (`iteration` of them; forward over
// the training-mode forwards) and are 0 before the first. Intervals, as in PyTorch's c10d::Logger:
// backward compute = end of forward (prepare) to the end of autograd; communication = first bucket
// launched to last bucket completed; overlap = first bucket launched to the end of autograd.
// Local to the rank: nothing is communicated. A plain value; copy it freely.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

// Exported by ddp's shared libraries, which hide the rest (src/CMakeLists.txt).
#pragma GCC visibility push(default)
namespace ddp {

struct DdpLoggingData {
  int world_size = 0;
  int rank = 0;
  std::string backend_name;  // "ring", "mpi", ... (ProcessGroup::backend())
  std::size_t bucket_cap_bytes = 0;
  std::size_t first_bucket_cap_bytes = 0;
  bool broadcast_buffers = true;
  bool find_unused_parameters = false;
  bool gradient_as_bucket_view = false;
  bool static_graph = false;
  std::string comm_hook;  // "allreduce" (default), "bf16_compress_hook", ... or "custom"
  std::int64_t num_parameter_tensors = 0;
  std::int64_t total_parameter_size_bytes = 0;
  std::vector<std::string> dtypes;  // of the parameters, each once
  // Per bucket, in launch order (after a rebuild: the rebuilt buckets).
  std::vector<std::int64_t> bucket_sizes;             // bytes
  std::vector<std::int64_t> bucket_parameter_counts;  // parameters
  bool has_rebuilt_buckets = false;
  // ddp's own: the buckets live in memory the ranks of this host share, so that their allreduces
  // read the peers' buckets where they lie (gradient_as_bucket_view on the ring backend over
  // shared memory); else why not ("" where the backend or transport has no such memory).
  bool shared_buckets = false;
  std::string shared_buckets_why_not;
  std::vector<std::string> unused_parameter_names;          // found by the last search, if any
  std::int64_t unused_parameter_size = 0;                   // their bytes
  std::int64_t iteration = 0;                               // synchronised backward passes
  std::int64_t forward_passes = 0;                          // training-mode forwards timed
  std::int64_t avg_forward_compute_time = 0;                // ns
  std::int64_t avg_backward_compute_time = 0;               // ns
  std::int64_t avg_backward_comm_time = 0;                  // ns
  std::int64_t avg_backward_compute_comm_overlap_time = 0;  // ns
  std::int64_t last_bytes_sent = 0;  // payload bytes the last backward handed to collectives
  // Autograd-graph walks for unused parameters so far (ddp's own: static_graph walks once).
  std::int64_t unused_parameter_searches = 0;

  // One JSON object with the members above under the same names.
  std::string to_json() const;
};

}  // namespace ddp
#pragma GCC visibility pop
