#include "ddp_backend.h"

#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <numeric>
#include <utility>

#include "c10d_store_bridge.h"
#include "ddp/comm/ring_process_group.h"
#include "ddp/error.h"
#include "ddp/launch/job_secret.h"
#include "tensor_buffers.h"

namespace torch_ddp {
namespace {

// monitoredBarrier's messages travel on a tag of their own, far from the tags programs use.
constexpr int kMonitoredBarrierTag = std::numeric_limits<int>::max() - 1;

// Runs an engine call, turning ddp's exceptions into c10's: a ConfigError (bad arguments, caught
// before anything was sent) is a RuntimeError, any other failure a DistBackendError.
template <class Call>
auto engine(const std::string& call, Call&& run) {
  try {
    return run();
  } catch (const ddp::ConfigError& e) {
    TORCH_CHECK(false, "ddp backend: ", call, ": ", e.what());
  } catch (const c10::Error&) {
    throw;
  } catch (const std::exception&) {
    std::rethrow_exception(as_backend_error(std::current_exception(), call));
  }
}

std::vector<std::size_t> counts_of(const std::vector<at::Tensor>& tensors, std::size_t scale = 1) {
  std::vector<std::size_t> counts;
  counts.reserve(tensors.size());
  for (const auto& t : tensors)
    counts.push_back(static_cast<std::size_t>(t.numel()) * scale);
  return counts;
}

// The pairs of a coalesced gather or scatter: as many `bigger` as `smaller` (at least one), all
// dense CPU tensors, bigger[i] of smaller[i]'s dtype and holding `world` x its elements; with
// `one_dtype`, every pair of smaller[0]'s dtype.
void check_coalesced_pairs(const std::vector<at::Tensor>& bigger,
                           const std::vector<at::Tensor>& smaller, int world,
                           const std::string& call, bool one_dtype) {
  TORCH_CHECK(!smaller.empty() && bigger.size() == smaller.size(), "ddp backend: ", call, " got ",
              bigger.size(), " and ", smaller.size(),
              " tensors; it takes as many outputs as inputs, at least one");
  for (std::size_t i = 0; i < smaller.size(); ++i) {
    check_cpu_dense(smaller[i], fmt::format("{}'s tensor {}", call, i));
    check_cpu_dense(bigger[i], fmt::format("{}'s tensor {}", call, i));
    TORCH_CHECK(bigger[i].scalar_type() == smaller[i].scalar_type(), "ddp backend: ", call,
                ": pair ", i, " is ", dtype_name(bigger[i].scalar_type()), " and ",
                dtype_name(smaller[i].scalar_type()), "; a pair shares one dtype");
    TORCH_CHECK(!one_dtype || smaller[i].scalar_type() == smaller[0].scalar_type(),
                "ddp backend: ", call, "'s tensors must share one dtype: pair ", i, " is ",
                dtype_name(smaller[i].scalar_type()), ", pair 0 is ",
                dtype_name(smaller[0].scalar_type()));
    TORCH_CHECK(bigger[i].numel() == smaller[i].numel() * world, "ddp backend: ", call, ": pair ",
                i, " has ", bigger[i].numel(), " and ", smaller[i].numel(),
                " elements; the larger must hold the group's ", world, " blocks of the smaller");
  }
}

// The elements of `tensors` one after another in one new contiguous tensor.
at::Tensor packed(const std::vector<at::Tensor>& tensors) {
  std::vector<at::Tensor> flat;
  flat.reserve(tensors.size());
  for (const auto& t : tensors)
    flat.push_back(t.reshape(-1));
  return at::cat(flat);
}

// Copies consecutive pieces of `flat` into `tensors` (each its own shape).
void unpack(const at::Tensor& flat, std::vector<at::Tensor>& tensors) {
  int64_t offset = 0;
  for (auto& t : tensors) {
    t.copy_(flat.narrow(0, offset, t.numel()).view(t.sizes()));
    offset += t.numel();
  }
}

// Elements per unit of a movement buffer: 1, or the element size when the dtype moves as bytes.
std::size_t unit_scale(const at::Tensor& tensor) {
  const Buffer probe = movement_buffer(tensor.numel() > 0 ? tensor : tensor.new_empty({1}));
  return probe.count / std::max<int64_t>(1, tensor.numel() > 0 ? tensor.numel() : 1);
}

void check_root(int root, int size, const std::string& call) {
  TORCH_CHECK(root >= 0 && root < size, "ddp backend: ", call, "'s root rank ", root,
              " is not a rank of this group (0..", size - 1, ")");
}

}  // namespace

struct DdpBackend::Step {
  std::shared_ptr<ddp::Work> work;
  std::function<void()> finish;  // after the whole call succeeded, in step order
  std::vector<at::Tensor> keep_alive;
};

c10::intrusive_ptr<c10d::Backend> DdpBackend::create(const c10::intrusive_ptr<c10d::Store>& store,
                                                     int rank, int size,
                                                     std::chrono::milliseconds timeout,
                                                     const std::string& group_name) {
  TORCH_CHECK(store, "ddp backend: no store was given");
  TORCH_CHECK(size > 0 && rank >= 0 && rank < size, "ddp backend: rank ", rank,
              " is not a rank of a group of ", size);
  auto group = engine("creating group '" + group_name + "'", [&] {
    ddp::RingOptions options;
    options.timeout = timeout;
    options.group_name = "torch_ddp";  // the store is the group's own prefix store already
    options.secret = ddp::resolve_job_secret(std::nullopt);
    return ddp::make_ring_process_group(std::make_shared<C10dStoreBridge>(store), rank, size,
                                        options);
  });
  return c10::make_intrusive<DdpBackend>(std::move(group), timeout, group_name);
}

DdpBackend::DdpBackend(std::shared_ptr<ddp::ProcessGroup> group, std::chrono::milliseconds timeout,
                       std::string group_name)
    : c10d::Backend(group->rank(), group->size()),
      group_(std::move(group)),
      timeout_(timeout),
      group_name_(std::move(group_name)),
      completer_(std::make_shared<FutureCompleter>()) {}

DdpBackend::~DdpBackend() = default;

c10::intrusive_ptr<c10d::Backend::Options> DdpBackend::getBackendOptions() {
  auto options = c10::make_intrusive<Options>("ddp", timeout_);
  options->group_name = group_name_;
  return options;
}

ddp::CallOptions DdpBackend::call_options(std::chrono::milliseconds timeout, bool async_op) const {
  ddp::CallOptions options;
  if (timeout > std::chrono::milliseconds(0)) options.timeout = timeout;
  // async_op=False: the caller waits at once, so the engine may run the call on this thread.
  options.blocking = !async_op;
  return options;
}

c10::intrusive_ptr<c10d::Work> DdpBackend::run(c10d::OpType type, const std::string& call,
                                               std::vector<Step> steps,
                                               std::vector<at::Tensor> outputs,
                                               std::shared_ptr<int> source) {
  DdpWork::Spec spec;
  spec.source = std::move(source);
  spec.rank = getRank();
  spec.type = type;
  spec.call = call;
  spec.outputs = std::move(outputs);
  spec.completer = completer_;
  spec.timeout = timeout_;
  std::vector<std::function<void()>> finishes;
  for (auto& step : steps) {
    if (step.work) spec.parts.push_back(std::move(step.work));
    if (step.finish) finishes.push_back(std::move(step.finish));
    for (auto& t : step.keep_alive)
      spec.keep_alive.push_back(std::move(t));
  }
  if (!finishes.empty()) {
    spec.finish = [finishes = std::move(finishes)] {
      for (const auto& finish : finishes)
        finish();
    };
  }
  ++sequence_;
  return DdpWork::start(std::move(spec));
}

// ---- one-tensor collectives ----

c10::intrusive_ptr<c10d::Work> DdpBackend::broadcast(std::vector<at::Tensor>& tensors,
                                                     const c10d::BroadcastOptions& opts) {
  check_count(tensors, 1, "broadcast");
  check_cpu_dense(tensors[0], "broadcast's tensor");
  const int root = static_cast<int>(opts.rootRank);
  check_root(root, getSize(), "broadcast");
  auto c = contiguous_of(tensors[0]);
  const Buffer b = movement_buffer(c.tensor);
  Step step{engine("broadcast",
                   [&] {
                     return group_->broadcast(b.data, b.count, b.dtype, root,
                                              call_options(opts.timeout, opts.asyncOp));
                   }),
            nullptr,
            {c.tensor}};
  if (c.is_copy) step.finish = [dst = tensors[0], src = c.tensor]() mutable { dst.copy_(src); };
  return run(c10d::OpType::BROADCAST, "broadcast", {std::move(step)}, tensors);
}

c10::intrusive_ptr<c10d::Work> DdpBackend::allreduce(std::vector<at::Tensor>& tensors,
                                                     const c10d::AllreduceOptions& opts) {
  check_count(tensors, 1, "allreduce");
  if (tensors[0].defined() && tensors[0].is_sparse()) return sparse_allreduce(tensors[0], opts);
  check_cpu_dense(tensors[0], "allreduce's tensor");
  auto c = contiguous_of(tensors[0]);
  if (opts.reduceOp == c10d::ReduceOp::PREMUL_SUM) {
    c = {premultiplied(c.tensor, opts.reduceOp, "allreduce"), true};  // written back on success
  }
  const Reduction r = reduction_buffer(c.tensor, opts.reduceOp, "allreduce");
  Step step{engine("allreduce",
                   [&] {
                     return group_->allreduce(r.buffer.data, r.buffer.count, r.buffer.dtype, r.op,
                                              call_options(opts.timeout, opts.asyncOp));
                   }),
            nullptr,
            {c.tensor}};
  if (c.is_copy) step.finish = [dst = tensors[0], src = c.tensor]() mutable { dst.copy_(src); };
  return run(c10d::OpType::ALLREDUCE, "allreduce", {std::move(step)}, tensors);
}

c10::intrusive_ptr<c10d::Work> DdpBackend::sparse_allreduce(at::Tensor& tensor,
                                                            const c10d::AllreduceOptions& opts) {
  // As gloo does it: every rank's (coalesced) indices and values are gathered, and the sum is
  // their concatenation coalesced, written into the tensor. Three collectives run back to back
  // on the calling thread (the sizes of the second and third come from the first).
  TORCH_CHECK(tensor.device().is_cpu(), "ddp backend: all_reduce of a sparse tensor on ",
              tensor.device(), ": the ddp backend takes CPU tensors");
  TORCH_CHECK(opts.reduceOp == c10d::ReduceOp::SUM,
              "ddp backend: all_reduce of a sparse tensor "
              "takes ReduceOp.SUM only (as gloo)");
  const auto options = call_options(opts.timeout, /*async_op=*/false);
  const at::Tensor input = tensor.coalesce();
  const at::Tensor indices = input._indices().contiguous();  // [sparse_dim, nnz], int64
  const at::Tensor values = input._values().contiguous();    // [nnz, dense dims...]
  const int64_t sparse_dim = indices.size(0);
  const int64_t per_value = values.numel() / std::max<int64_t>(1, input._nnz());
  const int size = getSize();
  std::vector<int64_t> nnz(size);
  int64_t mine = input._nnz();
  engine("all_reduce (sparse)",
         [&] { return group_->allgather(&mine, nnz.data(), 1, ddp::DType::kInt64, options); });
  std::vector<std::size_t> index_counts(size), value_counts(size);
  int64_t total = 0;
  for (int r = 0; r < size; ++r) {
    index_counts[r] = static_cast<std::size_t>(sparse_dim * nnz[r]);
    total += nnz[r];
  }
  at::Tensor all_indices = at::empty({sparse_dim * total}, indices.options());
  std::vector<int64_t> value_shape = values.sizes().vec();
  value_shape[0] = total;
  at::Tensor all_values = at::empty(value_shape, values.options());
  const Buffer vb = movement_buffer(values);
  const std::size_t scale =
      values.numel() > 0 ? vb.count / values.numel() : unit_scale(values.reshape(-1));
  for (int r = 0; r < size; ++r) {
    value_counts[r] = static_cast<std::size_t>(nnz[r] * per_value) * scale;
  }
  engine("all_reduce (sparse)", [&] {
    return group_->allgather_v(indices.data_ptr(), index_counts[getRank()], all_indices.data_ptr(),
                               index_counts, ddp::DType::kInt64, options);
  });
  engine("all_reduce (sparse)", [&] {
    return group_->allgather_v(vb.data, value_counts[getRank()], all_values.data_ptr(),
                               value_counts, vb.dtype, options);
  });
  std::vector<at::Tensor> index_parts;
  int64_t offset = 0;
  for (int r = 0; r < size; ++r) {
    index_parts.push_back(
        all_indices.narrow(0, offset * sparse_dim, nnz[r] * sparse_dim).view({sparse_dim, nnz[r]}));
    offset += nnz[r];
  }
  at::Tensor sum =
      at::sparse_coo_tensor(at::cat(index_parts, 1), all_values, input.sizes()).coalesce();
  tensor.copy_(sum);
  ++sequence_;
  DdpWork::Spec spec;
  spec.rank = getRank();
  spec.type = c10d::OpType::ALLREDUCE;
  spec.call = "all_reduce (sparse)";
  spec.outputs = {tensor};
  spec.completer = completer_;
  spec.timeout = timeout_;
  return DdpWork::start(std::move(spec));
}

c10::intrusive_ptr<c10d::Work> DdpBackend::allreduce_coalesced(
    std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) {
  TORCH_CHECK(!tensors.empty(), "ddp backend: allreduce_coalesced got no tensors");
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    check_cpu_dense(tensors[i], fmt::format("allreduce_coalesced's tensor {}", i));
    TORCH_CHECK(tensors[i].scalar_type() == tensors[0].scalar_type(),
                "ddp backend: allreduce_coalesced's tensors must share one dtype: tensor ", i,
                " is ", dtype_name(tensors[i].scalar_type()), ", tensor 0 is ",
                dtype_name(tensors[0].scalar_type()));
  }
  // One collective over the tensors packed together, unpacked on success: one message instead of
  // one per tensor.
  at::Tensor flat = premultiplied(packed(tensors), opts.reduceOp, "allreduce_coalesced");
  const Reduction r = reduction_buffer(flat, opts.reduceOp, "allreduce_coalesced");
  Step step{engine("allreduce_coalesced",
                   [&] {
                     return group_->allreduce(r.buffer.data, r.buffer.count, r.buffer.dtype, r.op,
                                              call_options(opts.timeout, opts.asyncOp));
                   }),
            [flat, outs = tensors]() mutable { unpack(flat, outs); },
            {flat}};
  return run(c10d::OpType::ALLREDUCE_COALESCED, "allreduce_coalesced", {std::move(step)}, tensors);
}

c10::intrusive_ptr<c10d::Work> DdpBackend::reduce(std::vector<at::Tensor>& tensors,
                                                  const c10d::ReduceOptions& opts) {
  check_count(tensors, 1, "reduce");
  check_cpu_dense(tensors[0], "reduce's tensor");
  const int root = static_cast<int>(opts.rootRank);
  check_root(root, getSize(), "reduce");
  auto c = contiguous_of(tensors[0]);
  if (opts.reduceOp == c10d::ReduceOp::PREMUL_SUM) {
    c = {premultiplied(c.tensor, opts.reduceOp, "reduce"), true};  // written back at the root
  }
  const Reduction r = reduction_buffer(c.tensor, opts.reduceOp, "reduce");
  // The result lands at the root only; the other ranks' tensors are left as they were (gloo
  // leaves them as scratch; as they were is the stricter promise).
  at::Tensor result = getRank() == root ? c.tensor : at::Tensor();
  Step step{engine("reduce",
                   [&] {
                     return group_->reduce(
                         r.buffer.data, getRank() == root ? r.buffer.data : nullptr, r.buffer.count,
                         r.buffer.dtype, r.op, root, call_options(opts.timeout, opts.asyncOp));
                   }),
            nullptr,
            {c.tensor}};
  if (c.is_copy && getRank() == root) {
    step.finish = [dst = tensors[0], src = c.tensor]() mutable { dst.copy_(src); };
  }
  return run(c10d::OpType::REDUCE, "reduce", {std::move(step)}, tensors);
}

// ---- gathers ----

DdpBackend::Step DdpBackend::allgather_step(const std::string& call,
                                            std::vector<at::Tensor>& outputs,
                                            const at::Tensor& input,
                                            const ddp::CallOptions& options) {
  check_cpu_dense(input, call + "'s input");
  TORCH_CHECK(static_cast<int>(outputs.size()) == getSize(), "ddp backend: ", call, " takes ",
              getSize(), " output tensors (one per rank), got ", outputs.size());
  for (std::size_t i = 0; i < outputs.size(); ++i) {
    check_cpu_dense(outputs[i], fmt::format("{}'s output {}", call, i));
    TORCH_CHECK(outputs[i].scalar_type() == input.scalar_type(), "ddp backend: ", call,
                "'s output ", i, " is ", dtype_name(outputs[i].scalar_type()), " but the input is ",
                dtype_name(input.scalar_type()));
  }
  TORCH_CHECK(outputs[getRank()].numel() == input.numel(), "ddp backend: ", call, "'s output ",
              getRank(), " (this rank's) has ", outputs[getRank()].numel(),
              " elements but the input has ", input.numel());
  at::Tensor in = input.contiguous();
  at::Tensor flat =
      at::empty({std::accumulate(outputs.begin(), outputs.end(), int64_t{0},
                                 [](int64_t n, const at::Tensor& t) { return n + t.numel(); })},
                input.options().memory_format(at::MemoryFormat::Contiguous));
  const Buffer b = movement_buffer(in);
  const std::size_t scale = unit_scale(in);
  const auto counts = counts_of(outputs, scale);
  const bool even =
      std::all_of(counts.begin(), counts.end(), [&](std::size_t n) { return n == counts[0]; });
  auto work = engine(call, [&] {
    if (even) return group_->allgather(b.data, flat.data_ptr(), b.count, b.dtype, options);
    return group_->allgather_v(b.data, b.count, flat.data_ptr(), counts, b.dtype, options);
  });
  return {std::move(work), [flat, outs = outputs]() mutable { unpack(flat, outs); }, {in, flat}};
}

DdpBackend::Step DdpBackend::allgather_base_step(const std::string& call, at::Tensor& output,
                                                 const at::Tensor& input,
                                                 const ddp::CallOptions& options) {
  check_output_matches_input(output, input, call);
  TORCH_CHECK(output.numel() == input.numel() * getSize(), "ddp backend: ", call, "'s output has ",
              output.numel(), " elements; it must hold the group's ", getSize(), " inputs of ",
              input.numel());
  at::Tensor in = input.contiguous();
  auto out = contiguous_of(output);
  const Buffer b = movement_buffer(in);
  auto work = engine(call, [&] {
    return group_->allgather(b.data, out.tensor.data_ptr(), b.count, b.dtype, options);
  });
  Step step{std::move(work), nullptr, {in, out.tensor}};
  if (out.is_copy) step.finish = [dst = output, src = out.tensor]() mutable { dst.copy_(src); };
  return step;
}

c10::intrusive_ptr<c10d::Work> DdpBackend::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllgatherOptions& opts) {
  check_count(inputs, 1, "allgather");
  TORCH_CHECK(outputs.size() == 1, "ddp backend: allgather takes one list of outputs, got ",
              outputs.size());
  std::vector<Step> steps;
  steps.push_back(
      allgather_step("allgather", outputs[0], inputs[0], call_options(opts.timeout, opts.asyncOp)));
  return run(c10d::OpType::ALLGATHER, "allgather", std::move(steps), outputs[0]);
}

c10::intrusive_ptr<c10d::Work> DdpBackend::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                           const c10d::AllgatherOptions& opts) {
  std::vector<Step> steps;
  steps.push_back(allgather_base_step("all_gather_into_tensor", output, input,
                                      call_options(opts.timeout, opts.asyncOp)));
  return run(c10d::OpType::_ALLGATHER_BASE, "all_gather_into_tensor", std::move(steps), {output});
}

c10::intrusive_ptr<c10d::Work> DdpBackend::allgather_coalesced(
    std::vector<std::vector<at::Tensor>>& output_lists, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  TORCH_CHECK(output_lists.size() == static_cast<std::size_t>(getSize()),
              "ddp backend: allgather_coalesced takes one output list per rank (", getSize(),
              "), got ", output_lists.size());
  // c10d's layout: output_lists[rank][i] receives input i of that rank.
  std::vector<Step> steps;
  std::vector<at::Tensor> outputs;
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    std::vector<at::Tensor> per_rank;
    for (auto& list : output_lists) {
      TORCH_CHECK(list.size() == inputs.size(),
                  "ddp backend: allgather_coalesced's output lists "
                  "must hold one tensor per input (",
                  inputs.size(), "), one holds ", list.size());
      per_rank.push_back(list[i]);
    }
    steps.push_back(allgather_step(fmt::format("allgather_coalesced (input {})", i), per_rank,
                                   inputs[i], call_options(opts.timeout, opts.asyncOp)));
  }
  for (auto& list : output_lists)
    outputs.insert(outputs.end(), list.begin(), list.end());
  return run(c10d::OpType::ALLGATHER_COALESCED, "allgather_coalesced", std::move(steps), outputs);
}

c10::intrusive_ptr<c10d::Work> DdpBackend::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  TORCH_CHECK(outputs.size() == inputs.size(), "ddp backend: allgather_into_tensor_coalesced got ",
              outputs.size(), " outputs for ", inputs.size(), " inputs");
  const std::string call = "allgather_into_tensor_coalesced";
  check_coalesced_pairs(outputs, inputs, getSize(), call, /*one_dtype=*/false);
  // One allgather of the inputs' bytes taken together (their dtypes may differ, as
  // _coalescing_manager allows): block r of the result holds rank r's part of every output (one
  // call record and message schedule instead of one per tensor).
  const int64_t world = getSize();
  std::vector<at::Tensor> bytes;
  bytes.reserve(inputs.size());
  for (const auto& input : inputs)
    bytes.push_back(input.contiguous().reshape(-1).view(at::kByte));
  at::Tensor in = at::cat(bytes);
  at::Tensor out = at::empty({world * in.numel()}, in.options());
  Step step = allgather_base_step(call, out, in, call_options(opts.timeout, opts.asyncOp));
  step.finish = [out, outputs, world]() mutable {
    const at::Tensor blocks = out.view({world, -1});
    int64_t offset = 0;
    for (auto& output : outputs) {
      const int64_t n = output.numel() / std::max<int64_t>(1, world) * output.element_size();
      output.copy_(
          blocks.narrow(1, offset, n).contiguous().view(output.scalar_type()).view(output.sizes()));
      offset += n;
    }
  };
  std::vector<Step> steps;
  steps.push_back(std::move(step));
  return run(c10d::OpType::COALESCED, call, std::move(steps), outputs);
}

c10::intrusive_ptr<c10d::Work> DdpBackend::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                                  std::vector<at::Tensor>& inputs,
                                                  const c10d::GatherOptions& opts) {
  check_count(inputs, 1, "gather");
  check_cpu_dense(inputs[0], "gather's input");
  const int root = static_cast<int>(opts.rootRank);
  check_root(root, getSize(), "gather");
  at::Tensor in = inputs[0].contiguous();
  const Buffer b = movement_buffer(in);
  at::Tensor flat;
  std::vector<at::Tensor> result;
  if (getRank() == root) {
    TORCH_CHECK(outputs.size() == 1, "ddp backend: gather's root takes one list of outputs, got ",
                outputs.size());
    TORCH_CHECK(static_cast<int>(outputs[0].size()) == getSize(),
                "ddp backend: gather's root "
                "takes ",
                getSize(), " output tensors (one per rank), got ", outputs[0].size());
    check_same_type_and_size(outputs[0], inputs[0], "gather's output");
    result = outputs[0];
    flat = at::empty({in.numel() * getSize()}, in.options());
  } else {
    TORCH_CHECK(outputs.empty() || (outputs.size() == 1 && outputs[0].empty()),
                "ddp backend: gather's outputs belong on the root rank (", root, ") only; rank ",
                getRank(), " passed some");
  }
  auto work = engine("gather", [&] {
    return group_->gather(b.data, flat.defined() ? flat.data_ptr() : nullptr, b.count, b.dtype,
                          root, call_options(opts.timeout, opts.asyncOp));
  });
  Step step{std::move(work), nullptr, {in}};
  if (flat.defined()) {
    step.keep_alive.push_back(flat);
    step.finish = [flat, outs = result]() mutable { unpack(flat, outs); };
  }
  return run(c10d::OpType::GATHER, "gather", {std::move(step)}, result);
}

c10::intrusive_ptr<c10d::Work> DdpBackend::scatter(std::vector<at::Tensor>& outputs,
                                                   std::vector<std::vector<at::Tensor>>& inputs,
                                                   const c10d::ScatterOptions& opts) {
  check_count(outputs, 1, "scatter");
  check_cpu_dense(outputs[0], "scatter's output");
  const int root = static_cast<int>(opts.rootRank);
  check_root(root, getSize(), "scatter");
  auto out = contiguous_of(outputs[0]);
  const Buffer b = movement_buffer(out.tensor);
  at::Tensor flat;
  if (getRank() == root) {
    TORCH_CHECK(inputs.size() == 1, "ddp backend: scatter's root takes one list of inputs, got ",
                inputs.size());
    TORCH_CHECK(static_cast<int>(inputs[0].size()) == getSize(),
                "ddp backend: scatter's root "
                "takes ",
                getSize(), " input tensors (one per rank), got ", inputs[0].size());
    check_same_type_and_size(inputs[0], outputs[0], "scatter's input");
    flat = packed(inputs[0]);
  } else {
    TORCH_CHECK(inputs.empty() || (inputs.size() == 1 && inputs[0].empty()),
                "ddp backend: scatter's inputs belong on the root rank (", root, ") only; rank ",
                getRank(), " passed some");
  }
  auto work = engine("scatter", [&] {
    return group_->scatter(flat.defined() ? flat.data_ptr() : nullptr, b.data, b.count, b.dtype,
                           root, call_options(opts.timeout, opts.asyncOp));
  });
  Step step{std::move(work), nullptr, {out.tensor}};
  if (flat.defined()) step.keep_alive.push_back(flat);
  if (out.is_copy) step.finish = [dst = outputs[0], src = out.tensor]() mutable { dst.copy_(src); };
  return run(c10d::OpType::SCATTER, "scatter", {std::move(step)}, outputs);
}

// ---- reduce-scatter ----

DdpBackend::Step DdpBackend::reduce_scatter_base_step(const std::string& call, at::Tensor& output,
                                                      const at::Tensor& input,
                                                      const c10d::ReduceOp& op,
                                                      const ddp::CallOptions& options) {
  check_output_matches_input(output, input, call);
  TORCH_CHECK(input.numel() == output.numel() * getSize(), "ddp backend: ", call, "'s input has ",
              input.numel(), " elements; it must hold ", getSize(), " blocks of the output's ",
              output.numel());
  // The engine reads the input as the ranks' blocks in order and leaves it as it was.
  at::Tensor in = premultiplied(input.contiguous(), op, call);
  auto out = contiguous_of(output);
  const Reduction r_in = reduction_buffer(in, op, call);
  const Reduction r_out = reduction_buffer(out.tensor, op, call);
  auto work = engine(call, [&] {
    return group_->reduce_scatter(r_in.buffer.data, r_out.buffer.data, r_out.buffer.count,
                                  r_in.buffer.dtype, r_in.op, options);
  });
  Step step{std::move(work), nullptr, {in, out.tensor}};
  if (out.is_copy) step.finish = [dst = output, src = out.tensor]() mutable { dst.copy_(src); };
  return step;
}

c10::intrusive_ptr<c10d::Work> DdpBackend::reduce_scatter(
    std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  check_count(outputs, 1, "reduce_scatter");
  TORCH_CHECK(inputs.size() == 1, "ddp backend: reduce_scatter takes one list of inputs, got ",
              inputs.size());
  TORCH_CHECK(static_cast<int>(inputs[0].size()) == getSize(), "ddp backend: reduce_scatter takes ",
              getSize(), " input tensors (one per rank), got ", inputs[0].size());
  check_cpu_dense(outputs[0], "reduce_scatter's output");
  for (std::size_t i = 0; i < inputs[0].size(); ++i) {
    check_cpu_dense(inputs[0][i], fmt::format("reduce_scatter's input {}", i));
    TORCH_CHECK(inputs[0][i].scalar_type() == outputs[0].scalar_type(),
                "ddp backend: "
                "reduce_scatter's input ",
                i, " is ", dtype_name(inputs[0][i].scalar_type()), " but the output is ",
                dtype_name(outputs[0].scalar_type()));
  }
  TORCH_CHECK(inputs[0][getRank()].numel() == outputs[0].numel(),
              "ddp backend: reduce_scatter's "
              "input ",
              getRank(), " (this rank's block) has ", inputs[0][getRank()].numel(),
              " elements but the output has ", outputs[0].numel());
  at::Tensor flat = premultiplied(packed(inputs[0]), opts.reduceOp, "reduce_scatter");
  auto out = contiguous_of(outputs[0]);
  const Reduction r_in = reduction_buffer(flat, opts.reduceOp, "reduce_scatter");
  const std::size_t scale = r_in.buffer.count / std::max<std::size_t>(1, flat.numel());
  auto counts = counts_of(inputs[0], flat.numel() > 0 ? scale : 1);
  const bool even =
      std::all_of(counts.begin(), counts.end(), [&](std::size_t n) { return n == counts[0]; });
  const auto options = call_options(opts.timeout, opts.asyncOp);
  auto work = engine("reduce_scatter", [&] {
    if (even) {
      return group_->reduce_scatter(r_in.buffer.data, out.tensor.data_ptr(), counts[0],
                                    r_in.buffer.dtype, r_in.op, options);
    }
    return group_->reduce_scatter_v(r_in.buffer.data, out.tensor.data_ptr(), counts,
                                    r_in.buffer.dtype, r_in.op, options);
  });
  Step step{std::move(work), nullptr, {flat, out.tensor}};
  if (out.is_copy) step.finish = [dst = outputs[0], src = out.tensor]() mutable { dst.copy_(src); };
  return run(c10d::OpType::REDUCE_SCATTER, "reduce_scatter", {std::move(step)}, outputs);
}

c10::intrusive_ptr<c10d::Work> DdpBackend::_reduce_scatter_base(
    at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) {
  std::vector<Step> steps;
  steps.push_back(reduce_scatter_base_step("reduce_scatter_tensor", output, input, opts.reduceOp,
                                           call_options(opts.timeout, opts.asyncOp)));
  return run(c10d::OpType::_REDUCE_SCATTER_BASE, "reduce_scatter_tensor", std::move(steps),
             {output});
}

c10::intrusive_ptr<c10d::Work> DdpBackend::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  TORCH_CHECK(outputs.size() == inputs.size(), "ddp backend: reduce_scatter_tensor_coalesced got ",
              outputs.size(), " outputs for ", inputs.size(), " inputs");
  const std::string call = "reduce_scatter_tensor_coalesced";
  check_coalesced_pairs(inputs, outputs, getSize(), call, /*one_dtype=*/false);
  const bool one_dtype = std::all_of(outputs.begin(), outputs.end(), [&](const at::Tensor& t) {
    return t.scalar_type() == outputs[0].scalar_type();
  });
  if (!one_dtype) {
    // A reduction needs one dtype: tensors of several (as _coalescing_manager allows) take one
    // call each.
    std::vector<Step> steps;
    for (std::size_t i = 0; i < inputs.size(); ++i) {
      steps.push_back(reduce_scatter_base_step(fmt::format("{} ({})", call, i), outputs[i],
                                               inputs[i], opts.reduceOp,
                                               call_options(opts.timeout, opts.asyncOp)));
    }
    return run(c10d::OpType::COALESCED, call, std::move(steps), outputs);
  }
  // One reduce-scatter: block r of the send buffer is block r of every input, one after the
  // other, so the block this rank receives is its block of every output.
  const int64_t world = getSize();
  std::vector<at::Tensor> blocks;
  blocks.reserve(inputs.size());
  for (const auto& input : inputs)
    blocks.push_back(input.reshape({world, -1}));
  at::Tensor in = at::cat(blocks, 1).reshape(-1);
  at::Tensor out = at::empty({in.numel() / std::max<int64_t>(1, world)}, in.options());
  Step step = reduce_scatter_base_step(call, out, in, opts.reduceOp,
                                       call_options(opts.timeout, opts.asyncOp));
  step.finish = [out, outputs]() mutable {
    int64_t offset = 0;
    for (auto& output : outputs) {
      output.copy_(out.narrow(0, offset, output.numel()).view_as(output));
      offset += output.numel();
    }
  };
  std::vector<Step> steps;
  steps.push_back(std::move(step));
  return run(c10d::OpType::COALESCED, call, std::move(steps), outputs);
}

// ---- all-to-all ----

c10::intrusive_ptr<c10d::Work> DdpBackend::alltoall_base(at::Tensor& output, at::Tensor& input,
                                                         std::vector<int64_t>& output_split_sizes,
                                                         std::vector<int64_t>& input_split_sizes,
                                                         const c10d::AllToAllOptions& opts) {
  check_output_matches_input(output, input, "all_to_all_single");
  const int size = getSize();
  at::Tensor in = input.contiguous();
  auto out = contiguous_of(output);
  const Buffer b_in = movement_buffer(in);
  const Buffer b_out = movement_buffer(out.tensor);
  // Splits count rows of dim 0; the engine counts elements (or bytes).
  auto per_row = [](const at::Tensor& t, const Buffer& b) -> std::size_t {
    return t.dim() == 0 || t.size(0) == 0 ? 0 : b.count / t.size(0);
  };
  auto counts = [&](const std::vector<int64_t>& splits, const at::Tensor& t, const Buffer& b,
                    const char* which) {
    std::vector<std::size_t> c(size);
    if (splits.empty()) {
      TORCH_CHECK(t.dim() > 0 && t.size(0) % size == 0, "ddp backend: all_to_all_single's ", which,
                  " has ", t.dim() > 0 ? t.size(0) : 0, " rows, which the group's ", size,
                  " ranks cannot split evenly: pass ", which, "_split_sizes");
      std::fill(c.begin(), c.end(), b.count / size);
      return c;
    }
    TORCH_CHECK(static_cast<int>(splits.size()) == size, "ddp backend: all_to_all_single's ", which,
                "_split_sizes has ", splits.size(), " entries; it needs one per rank (", size, ")");
    int64_t rows = 0;
    for (int r = 0; r < size; ++r) {
      TORCH_CHECK(splits[r] >= 0, "ddp backend: all_to_all_single's ", which, "_split_sizes[", r,
                  "] is negative (", splits[r], ")");
      rows += splits[r];
      c[r] = static_cast<std::size_t>(splits[r]) * per_row(t, b);
    }
    TORCH_CHECK(rows == (t.dim() > 0 ? t.size(0) : 0), "ddp backend: all_to_all_single's ", which,
                "_split_sizes sum to ", rows, " rows but the ", which, " has ",
                t.dim() > 0 ? t.size(0) : 0);
    return c;
  };
  const auto send_counts = counts(input_split_sizes, in, b_in, "input");
  const auto recv_counts = counts(output_split_sizes, out.tensor, b_out, "output");
  const auto options = call_options(opts.timeout, opts.asyncOp);
  const bool even = input_split_sizes.empty() && output_split_sizes.empty();
  auto work = engine("all_to_all_single", [&] {
    if (even) {
      return group_->alltoall(b_in.data, b_out.data, b_in.count / size, b_in.dtype, options);
    }
    return group_->alltoall_v(b_in.data, send_counts, b_out.data, recv_counts, b_in.dtype, options);
  });
  Step step{std::move(work), nullptr, {in, out.tensor}};
  if (out.is_copy) step.finish = [dst = output, src = out.tensor]() mutable { dst.copy_(src); };
  return run(c10d::OpType::ALLTOALL_BASE, "all_to_all_single", {std::move(step)}, {output});
}

c10::intrusive_ptr<c10d::Work> DdpBackend::alltoall(std::vector<at::Tensor>& outputs,
                                                    std::vector<at::Tensor>& inputs,
                                                    const c10d::AllToAllOptions& opts) {
  const int size = getSize();
  TORCH_CHECK(static_cast<int>(inputs.size()) == size && static_cast<int>(outputs.size()) == size,
              "ddp backend: all_to_all takes one input and one output tensor per rank (", size,
              "), got ", inputs.size(), " inputs and ", outputs.size(), " outputs");
  for (int r = 0; r < size; ++r) {
    check_cpu_dense(inputs[r], fmt::format("all_to_all's input {}", r));
    check_cpu_dense(outputs[r], fmt::format("all_to_all's output {}", r));
    TORCH_CHECK(inputs[r].scalar_type() == inputs[0].scalar_type() &&
                    outputs[r].scalar_type() == inputs[0].scalar_type(),
                "ddp backend: all_to_all's tensors must share one dtype (",
                dtype_name(inputs[0].scalar_type()), ")");
  }
  at::Tensor send = packed(inputs);
  at::Tensor recv =
      at::empty({std::accumulate(outputs.begin(), outputs.end(), int64_t{0},
                                 [](int64_t n, const at::Tensor& t) { return n + t.numel(); })},
                send.options());
  const Buffer b = movement_buffer(send);
  const std::size_t scale = send.numel() > 0 ? b.count / send.numel() : unit_scale(inputs[0]);
  const auto options = call_options(opts.timeout, opts.asyncOp);
  auto work = engine("all_to_all", [&] {
    return group_->alltoall_v(send.data_ptr(), counts_of(inputs, scale), recv.data_ptr(),
                              counts_of(outputs, scale), b.dtype, options);
  });
  Step step{
      std::move(work), [recv, outs = outputs]() mutable { unpack(recv, outs); }, {send, recv}};
  return run(c10d::OpType::ALLTOALL, "all_to_all", {std::move(step)}, outputs);
}

// ---- barriers ----

c10::intrusive_ptr<c10d::Work> DdpBackend::barrier(const c10d::BarrierOptions& opts) {
  auto work =
      engine("barrier", [&] { return group_->barrier(call_options(opts.timeout, opts.asyncOp)); });
  return run(c10d::OpType::BARRIER, "barrier", {Step{std::move(work), nullptr, {}}}, {});
}

void DdpBackend::monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) {
  // As gloo's, in gloo's words (callers match on them): every rank reports to rank 0, which waits
  // for each within the timeout and names the ranks that did not come; then rank 0 releases
  // them. The messages travel point to point on a tag of their own, so a rank that never arrives
  // cannot be mistaken for one that did. A timeout of 0 is spent before anything is waited for.
  const auto start = std::chrono::steady_clock::now();
  const auto timeout =
      opts.timeout >= std::chrono::milliseconds(0) ? opts.timeout : timeout_;  // -1 = unset
  const auto deadline = start + timeout;
  auto left = [&] {
    return std::chrono::duration_cast<std::chrono::milliseconds>(deadline -
                                                                 std::chrono::steady_clock::now());
  };
  auto elapsed_ms = [&] {
    return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() -
                                                                 start)
        .count();
  };
  auto p2p_options = [&] {
    ddp::CallOptions options;  // 0 would mean "the group's timeout" to the engine
    options.timeout = std::max(left(), std::chrono::milliseconds(1));
    return options;
  };
  auto token = at::zeros({1}, at::kByte);
  const int size = getSize();
  if (getRank() != 0) {
    try {
      group_->send(token.data_ptr(), 1, ddp::DType::kUInt8, 0, kMonitoredBarrierTag, p2p_options())
          ->wait();
      group_->recv(token.data_ptr(), 1, ddp::DType::kUInt8, 0, kMonitoredBarrierTag, p2p_options())
          ->wait();
    } catch (const std::exception& e) {
      C10_THROW_ERROR(DistBackendError,
                      fmt::format("Rank {} successfully reached monitoredBarrier, but received "
                                  "errors while waiting for send/recv from rank 0. Please check "
                                  "rank 0's logs for the rank that failed. (ddp: {})",
                                  getRank(), e.what()));
    }
    return;
  }
  if (left() <= std::chrono::milliseconds(0)) {
    C10_THROW_ERROR(
        DistBackendError,
        fmt::format("[Rank 0]: Rank 0 timed out in monitoredBarrier after {} ms", elapsed_ms()));
  }
  std::vector<at::Tensor> tokens;
  std::vector<std::shared_ptr<ddp::Work>> arrivals;
  for (int r = 1; r < size; ++r) {
    tokens.push_back(at::zeros({1}, at::kByte));
    arrivals.push_back(engine("monitored_barrier", [&] {
      return group_->recv(tokens.back().data_ptr(), 1, ddp::DType::kUInt8, r, kMonitoredBarrierTag,
                          p2p_options());
    }));
  }
  std::vector<int> missing;
  for (int r = 1; r < size; ++r) {
    auto& arrival = arrivals[r - 1];
    const bool arrived =
        arrival->wait_for(std::max(left(), std::chrono::milliseconds(0))) && !arrival->error();
    if (!arrived) {
      missing.push_back(r);
      if (!wait_all_ranks) break;
    }
  }
  if (!missing.empty()) {
    if (wait_all_ranks) {
      C10_THROW_ERROR(DistBackendError,
                      fmt::format("[Rank 0]: Ranks {} failed to pass monitoredBarrier in {} ms",
                                  fmt::join(missing, ", "), timeout.count()));
    }
    C10_THROW_ERROR(DistBackendError,
                    fmt::format("[Rank 0]: Rank {} failed to pass monitoredBarrier in {} ms",
                                missing[0], timeout.count()));
  }
  std::vector<std::shared_ptr<ddp::Work>> releases;
  for (int r = 1; r < size; ++r) {
    releases.push_back(engine("monitored_barrier", [&] {
      return group_->send(token.data_ptr(), 1, ddp::DType::kUInt8, r, kMonitoredBarrierTag,
                          p2p_options());
    }));
  }
  for (auto& release : releases) {
    engine("monitored_barrier", [&] {
      release->wait();
      return 0;
    });
  }
}

// ---- point to point ----

c10::intrusive_ptr<c10d::Work> DdpBackend::send(std::vector<at::Tensor>& tensors, int dst_rank,
                                                int tag) {
  check_count(tensors, 1, "send");
  check_cpu_dense(tensors[0], "send's tensor");
  TORCH_CHECK(dst_rank >= 0 && dst_rank < getSize() && dst_rank != getRank(),
              "ddp backend: send to rank ", dst_rank,
              ": the destination must be another rank of "
              "this group (0..",
              getSize() - 1, ", not ", getRank(), ")");
  at::Tensor in = tensors[0].contiguous();
  const Buffer b = movement_buffer(in);
  auto work = engine("send", [&] {
    return group_->send(b.data, b.count, b.dtype, dst_rank, tag, ddp::CallOptions{});
  });
  return run(c10d::OpType::SEND, "send", {Step{std::move(work), nullptr, {in}}}, tensors);
}

c10::intrusive_ptr<c10d::Work> DdpBackend::recv(std::vector<at::Tensor>& tensors, int src_rank,
                                                int tag) {
  check_count(tensors, 1, "recv");
  check_cpu_dense(tensors[0], "recv's tensor");
  TORCH_CHECK(src_rank >= 0 && src_rank < getSize() && src_rank != getRank(),
              "ddp backend: recv from rank ", src_rank,
              ": the source must be another rank of "
              "this group (0..",
              getSize() - 1, ", not ", getRank(), ")");
  auto out = contiguous_of(tensors[0]);
  const Buffer b = movement_buffer(out.tensor);
  auto work = engine("recv", [&] {
    return group_->recv(b.data, b.count, b.dtype, src_rank, tag, ddp::CallOptions{});
  });
  Step step{std::move(work), nullptr, {out.tensor}};
  if (out.is_copy) step.finish = [dst = tensors[0], src = out.tensor]() mutable { dst.copy_(src); };
  return run(c10d::OpType::RECV, "recv", {std::move(step)}, tensors);
}

c10::intrusive_ptr<c10d::Work> DdpBackend::recvAnysource(std::vector<at::Tensor>& tensors,
                                                         int tag) {
  check_count(tensors, 1, "recv");
  check_cpu_dense(tensors[0], "recv's tensor");
  auto out = contiguous_of(tensors[0]);
  const Buffer b = movement_buffer(out.tensor);
  auto source = std::make_shared<int>(-1);
  auto work = engine("recv", [&] {
    return group_->recv_any_source(b.data, b.count, b.dtype, source.get(), tag, ddp::CallOptions{});
  });
  Step step{std::move(work), nullptr, {out.tensor}};
  if (out.is_copy) step.finish = [dst = tensors[0], src = out.tensor]() mutable { dst.copy_(src); };
  return run(c10d::OpType::RECVANYSOURCE, "recv", {std::move(step)}, tensors, std::move(source));
}

}  // namespace torch_ddp
