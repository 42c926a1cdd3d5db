// RRefs (include/ddp/torch/rpc/rref.h): the handles, the values this worker owns with the forks
// that keep them, remote(), and the built-in functions that carry the protocol between workers.
#include "ddp/torch/rpc/rref.h"

#include <atomic>
#include <compare>
#include <map>
#include <mutex>
#include <set>

#include <fmt/format.h>

#include "torch/rpc/rpc_internal.h"
#include "torch/rpc/rpc_values.h"

namespace ddp::rpc {
namespace detail {
namespace {

constexpr const char* kRemote = "__ddp_rref.remote";
constexpr const char* kFetch = "__ddp_rref.fetch";
constexpr const char* kFork = "__ddp_rref.fork";
constexpr const char* kRelease = "__ddp_rref.release";

}  // namespace

// An RRef, or one fork of it: (the worker that made it, a number unique on that worker).
struct RRefId {
  std::int64_t creator = 0;
  std::int64_t local = 0;
  auto operator<=>(const RRefId&) const = default;
};

namespace {

std::atomic<std::int64_t> g_next_local{1};

RRefId new_id(int self) {
  return {self, g_next_local++};
}

FuturePtr new_future() {
  return c10::make_intrusive<c10::ivalue::Future>(c10::AnyType::get());
}

// The values this worker owns, each with the forks that keep it.
struct Owned {
  struct Value {
    FuturePtr value = new_future();
    std::set<RRefId> forks;
  };
  std::mutex mutex;
  std::map<RRefId, Value> values;
};

Owned& owned() {
  static Owned* o = new Owned;  // never destroyed: handles may be released at static teardown
  return *o;
}

// The value of `id`, made empty when this is the first that is heard of it (a fork or a fetch
// may arrive before remote()'s call has run).
FuturePtr owned_value(const RRefId& id) {
  auto& o = owned();
  std::lock_guard lock(o.mutex);
  return o.values[id].value;
}

void add_fork(const RRefId& id, const RRefId& fork) {
  auto& o = owned();
  std::lock_guard lock(o.mutex);
  o.values[id].forks.insert(fork);
}

void remove_fork(const RRefId& id, const RRefId& fork) {
  auto& o = owned();
  std::lock_guard lock(o.mutex);
  auto it = o.values.find(id);
  if (it == o.values.end()) return;
  it->second.forks.erase(fork);
  if (it->second.forks.empty()) o.values.erase(it);
}

c10::IValue ids_tuple(const RRefId& id, const RRefId& fork) {
  return c10::ivalue::Tuple::create({id.creator, id.local, fork.creator, fork.local});
}

// (id, fork) from the four ints at `at` of `elements`; ProtocolError otherwise.
std::pair<RRefId, RRefId> ids_of(const std::vector<c10::IValue>& elements, std::size_t at) {
  for (std::size_t i = at; i < at + 4; ++i) {
    if (i >= elements.size() || !elements[i].isInt()) {
      throw ProtocolError("rpc: an RRef's ids are not four integers");
    }
  }
  return {{elements[at].toInt(), elements[at + 1].toInt()},
          {elements[at + 2].toInt(), elements[at + 3].toInt()}};
}

std::vector<c10::IValue> tuple_elements(const c10::IValue& value, std::size_t size,
                                        const char* what) {
  if (!value.isTuple() || value.toTupleRef().elements().size() != size) {
    throw ProtocolError(fmt::format("rpc: {} is not a tuple of {}", what, size));
  }
  const auto& elements = value.toTupleRef().elements();
  return std::vector<c10::IValue>(elements.begin(), elements.end());
}

}  // namespace

class RRefImpl final : public c10::RRefInterface {
 public:
  RRefImpl(int owner, std::string owner_name, int self, RRefId id, RRefId fork, FuturePtr confirmed)
      : owner_(owner),
        owner_name_(std::move(owner_name)),
        self_(self),
        id_(id),
        fork_(fork),
        confirmed_(std::move(confirmed)) {}
  ~RRefImpl() override { release(); }

  c10::worker_id_t owner() const override { return static_cast<c10::worker_id_t>(owner_); }
  std::string ownerName() const override { return owner_name_; }
  bool isOwner() const override { return owner_ == self_; }
  bool confirmedByOwner() const override {
    return confirmed_->completed() && !confirmed_->hasError();
  }
  const c10::TypePtr type() const override { return c10::AnyType::get(); }

  int owner_rank() const { return owner_; }
  const RRefId& id() const { return id_; }
  // Waits for the owner's confirmation of this fork; rethrows remote()'s failure.
  void wait_confirmed() const {
    confirmed_->wait();
    if (confirmed_->hasError()) std::rethrow_exception(confirmed_->exception_ptr());
  }

 private:
  // Releases this handle's fork once the owner has it: here, or by a message to the owner.
  void release() noexcept {
    const RRefId id = id_, fork = fork_;
    const int owner = owner_, self = self_;
    try {
      confirmed_->addCallback([id, fork, owner, self](c10::ivalue::Future& confirmed) {
        if (confirmed.hasError()) return;  // the owner never took this fork
        if (owner == self) {
          remove_fork(id, fork);
          return;
        }
        Milliseconds timeout{0};
        auto agent = agent_if_running();
        if (!agent) return;  // RPC is down: the owner's values went with it
        try {
          running_agent(&timeout);
          agent->call(owner, kRelease, encode_value(ids_tuple(id, fork), "rpc: releasing an RRef"),
                      timeout);
        } catch (const std::exception&) {
          // Shutting down meanwhile: nothing to release to.
        }
      });
    } catch (const std::exception&) {
    }
  }

  int owner_;
  std::string owner_name_;
  int self_;
  RRefId id_;
  RRefId fork_;
  FuturePtr confirmed_;
};

namespace {

RRefImpl& impl_of(const c10::intrusive_ptr<c10::RRefInterface>& any) {
  auto* impl = dynamic_cast<RRefImpl*>(any.get());
  if (impl == nullptr) {
    throw RpcError(RpcErrorKind::kRefused, "rpc: an RRef not made by ddp::rpc cannot be sent");
  }
  return *impl;
}

}  // namespace

// Sending an RRef: a fork for the receiver, which the owner knows before the message leaves.
c10::IValue fork_for_message(const c10::intrusive_ptr<c10::RRefInterface>& any) {
  RRefImpl& impl = impl_of(any);
  Milliseconds timeout{0};
  auto agent = running_agent(&timeout);
  const RRefId fork = new_id(agent->self().rank);
  if (impl.owner_rank() == agent->self().rank) {
    add_fork(impl.id(), fork);
  } else {
    const transport::Reply reply =
        agent
            ->call(impl.owner_rank(), kFork,
                   encode_value(ids_tuple(impl.id(), fork), "rpc: forking an RRef"), timeout)
            .wait();
    if (!reply.ok()) std::rethrow_exception(error_of(*reply.failure));
  }
  return c10::ivalue::Tuple::create({std::string(kRRefMarker), impl.owner_rank(), impl.id().creator,
                                     impl.id().local, fork.creator, fork.local});
}

// Receiving one: a handle holding the fork the sender made for this worker.
c10::IValue rref_from_marker(const c10::ivalue::Tuple& marker) {
  const auto& elements = marker.elements();
  if (!elements[1].isInt()) throw ProtocolError("rpc: an RRef's owner is not an integer");
  auto agent = running_agent();
  const auto owner = elements[1].toInt();
  if (owner < 0 || owner >= static_cast<std::int64_t>(agent->workers().size())) {
    throw ProtocolError(fmt::format("rpc: an RRef names owner {}, not a worker", owner));
  }
  const auto [id, fork] = ids_of(std::vector<c10::IValue>(elements.begin(), elements.end()), 2);
  auto confirmed = new_future();
  confirmed->markCompleted(c10::IValue());
  auto impl = c10::make_intrusive<RRefImpl>(static_cast<int>(owner),
                                            agent->workers()[static_cast<std::size_t>(owner)].name,
                                            agent->self().rank, id, fork, std::move(confirmed));
  return c10::IValue(c10::intrusive_ptr<c10::RRefInterface>(std::move(impl)));
}

namespace {

// The owner's side of to_here(): the value once it is there, or what the function threw.
void reply_with_value(const FuturePtr& value, const transport::CallPromise& reply,
                      const std::string& context, int caller) {
  value->addCallback([reply, context, caller](c10::ivalue::Future& done) {
    if (done.hasError()) {
      try {
        std::rethrow_exception(done.exception_ptr());
      } catch (const RpcError& e) {
        reply.fail(transport::FailureKind::kRemoteException, e.what(), e.remote_type());
      } catch (...) {
        const auto [type, what] = describe_current_exception();
        reply.fail(transport::FailureKind::kRemoteException, what, type);
      }
      return;
    }
    try {
      reply.complete(reply_of(encode_message(done.value(), context, caller)));
    } catch (...) {
      const auto [type, what] = describe_current_exception();
      reply.fail(transport::FailureKind::kRemoteException, what, type);
    }
  });
}

}  // namespace

std::vector<std::pair<std::string, transport::Handler>> rref_functions() {
  std::vector<std::pair<std::string, transport::Handler>> out;
  out.emplace_back(kRemote, [](const transport::CallerInfo& caller, transport::Bytes request,
                               const transport::CallPromise& reply) {
    std::string name;
    std::vector<c10::IValue> args;
    RRefId id, fork;
    std::int64_t autograd_context = 0;
    try {
      Decoded decoded = decode_message(
          std::move(request), fmt::format("rpc: remote() from '{}'", caller.name), caller.rank);
      autograd_context = decoded.autograd_context;
      const auto t = tuple_elements(decoded.value, 6, "remote()'s request");
      if (!t[0].isString()) throw ProtocolError("rpc: remote()'s function is not a string");
      name = t[0].toStringRef();
      const auto& elements = t[1].toTupleRef().elements();
      args.assign(elements.begin(), elements.end());
      std::tie(id, fork) = ids_of(t, 2);
    } catch (const std::exception& e) {
      reply.fail(transport::FailureKind::kBadArguments, e.what());
      return;
    }
    const Function function = find_function(name);
    auto agent = running_agent();
    if (!function) {
      reply.fail(transport::FailureKind::kUnknownFunction,
                 fmt::format("worker '{}' has no function '{}' registered for remote()",
                             agent->self().name, name));
      return;
    }
    FuturePtr value = owned_value(id);
    add_fork(id, fork);
    reply.complete({});  // the owner holds the caller's fork: its handle is confirmed
    try {
      AutogradContextScope scope(autograd_context);
      value->markCompleted(function(args));
    } catch (...) {
      const auto [type, what] = describe_current_exception();
      value->setError(std::make_exception_ptr(
          RpcError(RpcErrorKind::kRemoteException,
                   fmt::format("rpc: remote '{}' on worker '{}' threw {}: {}", name,
                               agent->self().name, type, what),
                   type)));
    }
  });
  out.emplace_back(kFetch, [](const transport::CallerInfo& caller, transport::Bytes request,
                              const transport::CallPromise& reply) {
    RRefId id, fork;
    try {
      std::tie(id, fork) =
          ids_of(tuple_elements(decode_value(request, "rpc: to_here() from '" + caller.name + "'"),
                                4, "to_here()'s request"),
                 0);
    } catch (const std::exception& e) {
      reply.fail(transport::FailureKind::kBadArguments, e.what());
      return;
    }
    reply_with_value(owned_value(id), reply, "rpc: an RRef's value for '" + caller.name + "'",
                     caller.rank);
  });
  for (const char* name : {kFork, kRelease}) {
    const bool forking = std::string(name) == kFork;
    out.emplace_back(name, [forking](const transport::CallerInfo& caller, transport::Bytes request,
                                     const transport::CallPromise& reply) {
      RRefId id, fork;
      try {
        std::tie(id, fork) =
            ids_of(tuple_elements(decode_value(request, "rpc: an RRef from '" + caller.name + "'"),
                                  4, "an RRef's ids"),
                   0);
      } catch (const std::exception& e) {
        reply.fail(transport::FailureKind::kBadArguments, e.what());
        return;
      }
      if (forking) {
        add_fork(id, fork);
      } else {
        remove_fork(id, fork);
      }
      reply.complete({});
    });
  }
  return out;
}

void clear_owned_rrefs() {
  auto& o = owned();
  std::lock_guard lock(o.mutex);
  o.values.clear();
}

}  // namespace detail

RRef RRef::from(const c10::IValue& value) {
  if (!value.isRRef()) {
    throw RpcError(RpcErrorKind::kRefused,
                   fmt::format("rpc: RRef::from: the value is a {}, not an RRef", value.tagKind()));
  }
  auto any = value.toRRef();
  auto* impl = dynamic_cast<detail::RRefImpl*>(any.get());
  if (impl == nullptr) throw RpcError(RpcErrorKind::kRefused, "rpc: an RRef not made by ddp::rpc");
  (void)impl;
  return RRef(std::move(any));
}

RRef RRef::local(c10::IValue value) {
  auto agent = detail::running_agent();
  const int self = agent->self().rank;
  const detail::RRefId id = detail::new_id(self), fork = detail::new_id(self);
  detail::owned_value(id)->markCompleted(std::move(value));
  detail::add_fork(id, fork);
  auto confirmed = detail::new_future();
  confirmed->markCompleted(c10::IValue());
  return RRef(c10::intrusive_ptr<c10::RRefInterface>(c10::make_intrusive<detail::RRefImpl>(
      self, agent->self().name, self, id, fork, std::move(confirmed))));
}

detail::RRefImpl& RRef::impl() const {
  return static_cast<detail::RRefImpl&>(*impl_);
}

WorkerInfo RRef::owner() const {
  return {impl().ownerName(), impl().owner_rank()};
}
bool RRef::is_owner() const {
  return impl().isOwner();
}
bool RRef::confirmed_by_owner() const {
  return impl().confirmedByOwner();
}
c10::IValue RRef::ivalue() const {
  return c10::IValue(impl_);
}

c10::IValue RRef::local_value() const {
  if (!impl().isOwner()) {
    throw RpcError(
        RpcErrorKind::kRefused,
        fmt::format("rpc: local_value() of an RRef owned by '{}', on another worker: use "
                    "to_here()",
                    impl().ownerName()));
  }
  impl().wait_confirmed();
  auto value = detail::owned_value(impl().id());
  value->wait();
  return value->value();
}

c10::IValue RRef::to_here(std::optional<Milliseconds> timeout) const {
  impl().wait_confirmed();
  if (impl().isOwner()) return local_value();
  Milliseconds default_timeout{0};
  auto agent = detail::running_agent(&default_timeout);
  transport::Reply reply =
      agent
          ->call(
              impl().owner_rank(), detail::kFetch,
              detail::encode_value(detail::ids_tuple(impl().id(), impl().id()), "rpc: to_here()"),
              timeout.value_or(default_timeout))
          .take();
  if (!reply.ok()) std::rethrow_exception(detail::error_of(*reply.failure));
  return detail::decode_message(std::move(reply.payload),
                                "rpc: the value of an RRef from '" + impl().ownerName() + "'",
                                impl().owner_rank())
      .value;
}

std::size_t owned_rref_count() {
  auto& o = detail::owned();
  std::lock_guard lock(o.mutex);
  return o.values.size();
}

RRef remote(const std::string& to, const std::string& function, std::vector<c10::IValue> args,
            std::optional<Milliseconds> timeout) {
  Milliseconds default_timeout{0};
  auto agent = detail::running_agent(&default_timeout);
  const auto* worker = agent->find_worker(to);
  if (worker == nullptr) {
    throw RpcError(
        RpcErrorKind::kUnknownWorker,
        fmt::format("rpc: remote '{}' on '{}': no worker is named '{}'", function, to, to));
  }
  const int self = agent->self().rank;
  const detail::RRefId id = detail::new_id(self), fork = detail::new_id(self);
  auto confirmed = detail::new_future();
  auto impl =
      c10::make_intrusive<detail::RRefImpl>(worker->rank, worker->name, self, id, fork, confirmed);
  auto payload = detail::encode_message(
      c10::ivalue::Tuple::create({function, c10::ivalue::Tuple::create(std::move(args)), id.creator,
                                  id.local, fork.creator, fork.local}),
      fmt::format("rpc: the arguments of remote '{}' on '{}'", function, to), worker->rank);
  agent
      ->call_attached(worker->rank, detail::kRemote, std::move(payload),
                      timeout.value_or(default_timeout))
      .then([confirmed](const detail::transport::Reply& reply) {
        if (reply.ok()) {
          confirmed->markCompleted(c10::IValue());
        } else {
          confirmed->setError(detail::error_of(*reply.failure));
        }
      });
  return RRef(c10::intrusive_ptr<c10::RRefInterface>(std::move(impl)));
}

}  // namespace ddp::rpc
