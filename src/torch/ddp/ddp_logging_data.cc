#include "ddp/torch/ddp/ddp_logging_data.h"

#include <nlohmann/json.hpp>

namespace ddp {

std::string DdpLoggingData::to_json() const {
  // ordered_json: the members in the order the struct declares them, as a reader expects.
  nlohmann::ordered_json out;
  out["world_size"] = world_size;
  out["rank"] = rank;
  out["backend_name"] = backend_name;
  out["bucket_cap_bytes"] = bucket_cap_bytes;
  out["first_bucket_cap_bytes"] = first_bucket_cap_bytes;
  out["broadcast_buffers"] = broadcast_buffers;
  out["find_unused_parameters"] = find_unused_parameters;
  out["gradient_as_bucket_view"] = gradient_as_bucket_view;
  out["static_graph"] = static_graph;
  out["comm_hook"] = comm_hook;
  out["num_parameter_tensors"] = num_parameter_tensors;
  out["total_parameter_size_bytes"] = total_parameter_size_bytes;
  out["dtypes"] = dtypes;
  out["bucket_sizes"] = bucket_sizes;
  out["bucket_parameter_counts"] = bucket_parameter_counts;
  out["has_rebuilt_buckets"] = has_rebuilt_buckets;
  out["shared_buckets"] = shared_buckets;
  out["shared_buckets_why_not"] = shared_buckets_why_not;
  out["unused_parameter_names"] = unused_parameter_names;
  out["unused_parameter_size"] = unused_parameter_size;
  out["iteration"] = iteration;
  out["unused_parameter_searches"] = unused_parameter_searches;
  out["forward_passes"] = forward_passes;
  out["avg_forward_compute_time"] = avg_forward_compute_time;
  out["avg_backward_compute_time"] = avg_backward_compute_time;
  out["avg_backward_comm_time"] = avg_backward_comm_time;
  out["avg_backward_compute_comm_overlap_time"] = avg_backward_compute_comm_overlap_time;
  out["last_bytes_sent"] = last_bytes_sent;
  return out.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace);
}

}  // namespace ddp
