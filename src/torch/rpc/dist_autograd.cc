// Distributed autograd (include/ddp/torch/rpc/dist_autograd.h): the contexts each worker holds,
// what a message records in them, the backward pass of one worker and the built-in functions
// that carry gradients and releases between workers.
#include "ddp/torch/rpc/dist_autograd.h"

#include <atomic>
#include <map>
#include <mutex>
#include <set>

#include <fmt/format.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/variable.h>

#include "ddp/torch/rpc/rpc_error.h"
#include "torch/rpc/rpc_internal.h"
#include "torch/rpc/rpc_values.h"

namespace ddp::rpc {
namespace detail {
namespace {

constexpr const char* kBackward = "__ddp_autograd.backward";
constexpr const char* kReleaseContext = "__ddp_autograd.release";
// Deeper than this a value is not walked (the pickler refuses it anyway).
constexpr int kMaxWalkDepth = 200;

thread_local std::int64_t t_current = 0;

struct Received {
  at::Tensor tensor;
  int from = 0;
  std::int64_t message = 0;
  std::int64_t index = 0;  // among the message's tensors that require grad
};

struct AutogradContext {
  explicit AutogradContext(std::int64_t context_id) : id(context_id) {}
  const std::int64_t id;
  std::mutex mutex;
  std::map<std::int64_t, std::vector<at::Tensor>> sends;  // by message: the tensors sent
  std::map<const c10::TensorImpl*, Received> received;
  std::map<const c10::TensorImpl*, std::pair<at::Tensor, at::Tensor>> gradients;
  std::set<int> workers;  // those it was sent to or received from
};

struct Contexts {
  std::mutex mutex;
  std::map<std::int64_t, std::shared_ptr<AutogradContext>> by_id;
};

Contexts& contexts() {
  static Contexts* c = new Contexts;  // never destroyed: RPC's threads may outlive teardown
  return *c;
}

std::atomic<std::int64_t> g_next_context{1};
// One local pass at a time on a worker: a pass borrows its leaves' .grad (see local_pass), and
// two contexts' passes (two trainers' backwards on the server) may reach the same leaves.
std::mutex g_pass_mutex;
std::atomic<std::int64_t> g_next_message{1};

std::shared_ptr<AutogradContext> find_context(std::int64_t id) {
  auto& c = contexts();
  std::lock_guard lock(c.mutex);
  auto it = c.by_id.find(id);
  return it == c.by_id.end() ? nullptr : it->second;
}

std::shared_ptr<AutogradContext> context_or_new(std::int64_t id) {
  auto& c = contexts();
  std::lock_guard lock(c.mutex);
  auto& slot = c.by_id[id];
  if (!slot) slot = std::make_shared<AutogradContext>(id);
  return slot;
}

std::shared_ptr<AutogradContext> require_context(std::int64_t id, const char* what) {
  auto context = find_context(id);
  if (!context) {
    auto agent = agent_if_running();
    throw RpcError(RpcErrorKind::kRefused,
                   fmt::format("rpc: {}: worker '{}' has no distributed autograd context {} (it "
                               "ended, or was never created here)",
                               what, agent ? agent->self().name : std::string("?"), id));
  }
  return context;
}

// The tensors of `value` in the order the pickler writes them (rpc_values.h), so that sender and
// receiver number them alike.
void collect_tensors(const c10::IValue& v, std::vector<at::Tensor>& out, int depth) {
  if (depth > kMaxWalkDepth) return;
  if (v.isTensor()) {
    out.push_back(v.toTensor());
  } else if (v.isTuple()) {
    for (const auto& e : v.toTupleRef().elements())
      collect_tensors(e, out, depth + 1);
  } else if (v.isList()) {
    for (const auto& e : v.toListRef())
      collect_tensors(e, out, depth + 1);
  } else if (v.isGenericDict()) {
    for (const auto& entry : v.toGenericDict()) {
      collect_tensors(entry.key(), out, depth + 1);
      collect_tensors(entry.value(), out, depth + 1);
    }
  }
}

// The leaves (tensors with a gradient accumulator) that the graphs of `outputs` reach.
std::vector<at::Tensor> reachable_leaves(const std::vector<at::Tensor>& outputs) {
  std::vector<at::Tensor> leaves;
  std::set<const torch::autograd::Node*> seen;
  // shared_ptr in libtorch 1.13, intrusive_ptr in 2.x.
  std::vector<decltype(torch::autograd::Edge::function)> stack;
  for (const auto& output : outputs) {
    auto edge = torch::autograd::impl::gradient_edge(output);
    if (edge.function) stack.push_back(edge.function);
  }
  while (!stack.empty()) {
    auto node = std::move(stack.back());
    stack.pop_back();
    if (!seen.insert(node.get()).second) continue;
    if (auto* accumulate = dynamic_cast<torch::autograd::AccumulateGrad*>(node.get())) {
      leaves.push_back(accumulate->variable);
      continue;
    }
    for (const auto& next : node->next_edges()) {
      if (next.function) stack.push_back(next.function);
    }
  }
  return leaves;
}

// This worker's part of a backward: the local graph from `outputs`, the leaves' gradients into
// the context, and the received tensors' gradients back to their senders (who go on from there).
void local_pass(const std::shared_ptr<AutogradContext>& context,
                const std::vector<at::Tensor>& outputs, const std::vector<at::Tensor>& grads) {
  const std::vector<at::Tensor> leaves = reachable_leaves(outputs);
  if (leaves.empty()) return;
  // (sender, message) -> the gradients of the tensors it sent, by index.
  std::map<std::pair<int, std::int64_t>, std::map<std::int64_t, at::Tensor>> back;
  {
    std::lock_guard pass(g_pass_mutex);
    std::vector<at::Tensor> saved;
    saved.reserve(leaves.size());
    for (const auto& leaf : leaves) {
      saved.push_back(leaf.grad());
      leaf.mutable_grad().reset();
    }
    auto restore = [&] {
      for (std::size_t i = 0; i < leaves.size(); ++i)
        leaves[i].mutable_grad() = saved[i];
    };
    try {
      torch::autograd::backward(outputs, grads, /*retain_graph=*/true, /*create_graph=*/false,
                                leaves);
    } catch (...) {
      restore();
      throw;
    }
    {
      std::lock_guard lock(context->mutex);
      for (const auto& leaf : leaves) {
        const at::Tensor& grad = leaf.grad();
        if (!grad.defined()) continue;
        auto received = context->received.find(leaf.unsafeGetTensorImpl());
        if (received != context->received.end()) {
          auto& slot = back[{received->second.from, received->second.message}];
          auto& sum = slot[received->second.index];
          sum = sum.defined() ? sum + grad : grad.detach().clone();
          continue;
        }
        auto& slot = context->gradients[leaf.unsafeGetTensorImpl()];
        if (slot.second.defined()) {
          slot.second.add_(grad);
        } else {
          slot = {leaf, grad.detach().clone()};
        }
      }
    }
    restore();
  }  // the pass's lock: sending gradients on waits for other workers' passes
  Milliseconds timeout{0};
  auto agent = running_agent(&timeout);
  std::vector<std::pair<int, transport::CallFuture>> calls;
  for (auto& [where, by_index] : back) {
    c10::impl::GenericList indices(c10::IntType::get());
    c10::impl::GenericList tensors(c10::AnyType::get());
    for (auto& [index, grad] : by_index) {
      indices.push_back(index);
      tensors.push_back(grad);
    }
    calls.emplace_back(
        where.first,
        agent->call(
            where.first, kBackward,
            encode_value(c10::ivalue::Tuple::create({context->id, where.second, indices, tensors}),
                         "rpc: gradients of distributed autograd"),
            timeout));
  }
  for (auto& [to, call] : calls) {
    const transport::Reply& reply = call.wait();
    if (!reply.ok()) std::rethrow_exception(error_of(*reply.failure));
  }
}

void release_context(std::int64_t id, int except) {
  std::shared_ptr<AutogradContext> context;
  {
    auto& c = contexts();
    std::lock_guard lock(c.mutex);
    auto it = c.by_id.find(id);
    if (it == c.by_id.end()) return;  // released already: the walk over the workers ends here
    context = std::move(it->second);
    c.by_id.erase(it);
  }
  auto agent = agent_if_running();
  if (!agent) return;
  std::set<int> workers;
  {
    std::lock_guard lock(context->mutex);
    workers = context->workers;
  }
  Milliseconds timeout{0};
  try {
    running_agent(&timeout);
    for (int worker : workers) {
      if (worker == except || worker == agent->self().rank) continue;
      agent->call(worker, kReleaseContext,
                  encode_value(c10::ivalue::Tuple::create({id}), "rpc: ending an autograd context"),
                  timeout);
    }
  } catch (const std::exception&) {
    // RPC went down meanwhile: the contexts went with it.
  }
}

}  // namespace

std::int64_t current_autograd_context() {
  return t_current;
}

std::unique_lock<std::mutex> lock_leaf_gradients() {
  return std::unique_lock(g_pass_mutex);
}

AutogradContextScope::AutogradContextScope(std::int64_t id) : previous_(t_current) {
  t_current = id;
}
AutogradContextScope::~AutogradContextScope() {
  t_current = previous_;
}

c10::IValue record_send(const c10::IValue& value, int to_rank) {
  if (t_current == 0) return c10::IValue();
  auto context = find_context(t_current);
  if (!context) return c10::IValue();
  std::vector<at::Tensor> tensors;
  collect_tensors(value, tensors, 0);
  c10::impl::GenericList indices(c10::IntType::get());
  std::vector<at::Tensor> sent;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    if (tensors[i].requires_grad()) {
      indices.push_back(static_cast<std::int64_t>(i));
      sent.push_back(tensors[i]);
    }
  }
  // Even with no tensor that requires grad, the receiver learns the context: what it runs and
  // returns (a module's output, from parameters of its own) belongs to the same backward.
  const std::int64_t message = sent.empty() ? 0 : g_next_message++;
  {
    std::lock_guard lock(context->mutex);
    if (!sent.empty()) context->sends[message] = std::move(sent);
    context->workers.insert(to_rank);
  }
  return c10::ivalue::Tuple::create({context->id, message, indices});
}

std::int64_t record_receive(const c10::IValue& record, const c10::IValue& value, int from_rank) {
  if (!record.isTuple() || record.toTupleRef().elements().size() != 3) {
    throw ProtocolError("rpc: a message's autograd record is not (context, message, indices)");
  }
  const auto& r = record.toTupleRef().elements();
  if (!r[0].isInt() || !r[1].isInt() || !r[2].isList()) {
    throw ProtocolError("rpc: a message's autograd record has fields of the wrong kinds");
  }
  auto context = context_or_new(r[0].toInt());
  std::vector<at::Tensor> tensors;
  collect_tensors(value, tensors, 0);
  const auto indices = r[2].toListRef();
  std::lock_guard lock(context->mutex);
  for (std::size_t j = 0; j < indices.size(); ++j) {
    if (!indices[j].isInt() || indices[j].toInt() < 0 ||
        indices[j].toInt() >= static_cast<std::int64_t>(tensors.size())) {
      throw ProtocolError("rpc: a message's autograd record names a tensor it does not carry");
    }
    at::Tensor& tensor = tensors[static_cast<std::size_t>(indices[j].toInt())];
    if (!tensor.is_floating_point() && !tensor.is_complex()) {
      throw ProtocolError("rpc: a message says an integer tensor requires grad");
    }
    tensor.requires_grad_(true);
    context->received[tensor.unsafeGetTensorImpl()] =
        Received{tensor, from_rank, r[1].toInt(), static_cast<std::int64_t>(j)};
  }
  context->workers.insert(from_rank);
  return context->id;
}

std::vector<std::pair<std::string, transport::Handler>> autograd_functions() {
  std::vector<std::pair<std::string, transport::Handler>> out;
  out.emplace_back(kBackward, [](const transport::CallerInfo& caller, transport::Bytes request,
                                 const transport::CallPromise& reply) {
    c10::IValue decoded;
    try {
      decoded = decode_value(std::move(request), "rpc: gradients from '" + caller.name + "'");
      if (!decoded.isTuple() || decoded.toTupleRef().elements().size() != 4) {
        throw ProtocolError("rpc: gradients are not (context, message, indices, tensors)");
      }
    } catch (const std::exception& e) {
      reply.fail(transport::FailureKind::kBadArguments, e.what());
      return;
    }
    const auto& e = decoded.toTupleRef().elements();
    auto context = require_context(e[0].toInt(), "distributed backward");
    std::vector<at::Tensor> sent;
    {
      std::lock_guard lock(context->mutex);
      auto it = context->sends.find(e[1].toInt());
      if (it == context->sends.end()) {
        throw Error(
            fmt::format("rpc: gradients from '{}' for message {}, which this worker never "
                        "sent in context {}",
                        caller.name, e[1].toInt(), context->id));
      }
      sent = it->second;
    }
    std::vector<at::Tensor> outputs, grads;
    const auto indices = e[2].toListRef();
    const auto tensors = e[3].toListRef();
    for (std::size_t i = 0; i < indices.size() && i < tensors.size(); ++i) {
      const auto index = indices[i].toInt();
      if (index < 0 || index >= static_cast<std::int64_t>(sent.size())) {
        throw Error("rpc: a gradient for a tensor this worker did not send");
      }
      outputs.push_back(sent[static_cast<std::size_t>(index)]);
      grads.push_back(tensors[i].toTensor());
    }
    local_pass(context, outputs, grads);
    reply.complete({});
  });
  out.emplace_back(kReleaseContext, [](const transport::CallerInfo& caller,
                                       transport::Bytes request,
                                       const transport::CallPromise& reply) {
    const c10::IValue decoded = decode_value(request, "rpc: a release from '" + caller.name + "'");
    if (!decoded.isTuple() || decoded.toTupleRef().elements().empty() ||
        !decoded.toTupleRef().elements()[0].isInt()) {
      reply.fail(transport::FailureKind::kBadArguments, "rpc: a release is (context)");
      return;
    }
    release_context(decoded.toTupleRef().elements()[0].toInt(), caller.rank);
    reply.complete({});
  });
  return out;
}

void clear_autograd_contexts() {
  auto& c = contexts();
  std::lock_guard lock(c.mutex);
  c.by_id.clear();
}

}  // namespace detail

namespace dist_autograd {

Context::Context() : previous_(detail::t_current) {
  auto agent = detail::running_agent();
  // Unique across workers: the creator's rank in the high bits.
  id_ = (static_cast<std::int64_t>(agent->self().rank) << 40) | detail::g_next_context++;
  detail::context_or_new(id_);
  detail::t_current = id_;
}

Context::~Context() {
  detail::t_current = previous_;
  try {
    detail::release_context(id_, /*except=*/-1);
  } catch (...) {
  }
}

void backward(std::int64_t context_id, const std::vector<at::Tensor>& roots) {
  auto context = detail::require_context(context_id, "dist_autograd::backward");
  std::vector<at::Tensor> grads;
  for (const auto& root : roots) {
    if (root.numel() != 1) {
      throw ConfigError(
          fmt::format("dist_autograd::backward: a root has {} elements; roots are "
                      "scalars (a loss)",
                      root.numel()));
    }
    grads.push_back(at::ones_like(root));
  }
  detail::AutogradContextScope scope(context_id);
  detail::local_pass(context, roots, grads);
}

std::vector<std::pair<at::Tensor, at::Tensor>> get_gradients(std::int64_t context_id) {
  auto context = detail::require_context(context_id, "dist_autograd::get_gradients");
  std::lock_guard lock(context->mutex);
  std::vector<std::pair<at::Tensor, at::Tensor>> out;
  for (const auto& [impl, pair] : context->gradients)
    out.push_back(pair);
  return out;
}

std::size_t context_count() {
  auto& c = detail::contexts();
  std::lock_guard lock(c.mutex);
  return c.by_id.size();
}

}  // namespace dist_autograd
}  // namespace ddp::rpc
