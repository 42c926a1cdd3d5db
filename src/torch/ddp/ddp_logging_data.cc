// DdpLoggingData: gathered from DistributedDataParallel and its Reducer (logging_data), and as
// JSON.
#include "ddp/torch/ddp/ddp_logging_data.h"

#include <algorithm>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "ddp/torch/ddp/distributed_data_parallel.h"
#include "ddp/torch/ddp/reducer.h"
#include "torch/ddp/distributed_data_parallel_internal.h"

namespace ddp {

DdpLoggingData DistributedDataParallelBase::logging_data() const {
  DdpLoggingData data;
  data.world_size = group_->size();
  data.rank = group_->rank();
  data.backend_name = std::string(group_->backend());
  const auto& options = reducer_->options();
  data.bucket_cap_bytes = options.bucket_cap_bytes;
  data.first_bucket_cap_bytes = options.first_bucket_cap_bytes;
  data.broadcast_buffers = options_.broadcast_buffers;
  data.find_unused_parameters = options.find_unused_parameters;
  data.gradient_as_bucket_view = options.gradient_as_bucket_view;
  data.static_graph = options.static_graph;
  data.comm_hook = reducer_->comm_hook_name();

  std::vector<torch::Tensor> params;
  std::vector<std::string> names;
  detail::collect_trainable(wrapped_, params, names);
  std::map<std::string, std::int64_t> bytes_by_name;
  for (std::size_t i = 0; i < params.size(); ++i) {
    const auto bytes = static_cast<std::int64_t>(params[i].nbytes());
    data.total_parameter_size_bytes += bytes;
    bytes_by_name[names[i]] = bytes;
    const std::string dtype = c10::toString(params[i].scalar_type());
    if (std::find(data.dtypes.begin(), data.dtypes.end(), dtype) == data.dtypes.end()) {
      data.dtypes.push_back(dtype);
    }
  }
  data.num_parameter_tensors = static_cast<std::int64_t>(params.size());
  for (const auto bytes : reducer_->bucket_sizes_bytes())
    data.bucket_sizes.push_back(static_cast<std::int64_t>(bytes));
  for (const auto& bucket : reducer_->bucket_assignment())
    data.bucket_parameter_counts.push_back(static_cast<std::int64_t>(bucket.size()));
  data.has_rebuilt_buckets = reducer_->buckets_rebuilt();
  data.shared_buckets = reducer_->buckets_shared();
  data.shared_buckets_why_not = reducer_->shared_buckets_why_not();
  data.unused_parameter_names = reducer_->unused_parameter_names();
  for (const auto& name : data.unused_parameter_names) {
    if (const auto it = bytes_by_name.find(name); it != bytes_by_name.end()) {
      data.unused_parameter_size += it->second;
    }
  }
  const ReducerStats stats = reducer_->stats();
  data.iteration = stats.iterations;
  data.unused_parameter_searches = stats.unused_parameter_searches;
  data.forward_passes = timed_forwards_;
  if (timed_forwards_ > 0) data.avg_forward_compute_time = forward_time_.count() / timed_forwards_;
  if (stats.iterations > 0) {
    data.avg_backward_compute_time = stats.backward_compute.count() / stats.iterations;
    data.avg_backward_comm_time = stats.backward_comm.count() / stats.iterations;
    data.avg_backward_compute_comm_overlap_time =
        stats.backward_compute_comm_overlap.count() / stats.iterations;
  }
  data.last_bytes_sent = static_cast<std::int64_t>(reducer_->last_timeline().bytes_sent);
  return data;
}

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
