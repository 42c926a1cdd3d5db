// Creating a ring group: its options, the TCP mesh, which ranks share a host (shared memory, TCP
// or hierarchical), the cross-host mesh, point to point, subgroups.
#include <algorithm>
#include <thread>

#include <fmt/format.h>

#include "auth/hmac.h"
#include "comm/ring/mesh.h"
#include "comm/ring/p2p/p2p_connector.h"
#include "comm/ring/ring_group.h"
#include "ddp/error.h"
#include "net/descriptors.h"
#include "settings/settings.h"

namespace ddp {
namespace {

using std::chrono::milliseconds;

// Descriptors the program around a group may want besides those it has open when the group is
// created (a checkpoint, a dataset's files, a log), in the estimate of check_descriptor_limit.
constexpr std::size_t kProgramHeadroom = 16;

milliseconds resolve_group_timeout(milliseconds configured) {
  if (configured.count() > 0) return configured;
  if (configured.count() < 0) {
    throw ConfigError(
        fmt::format("RingOptions::timeout is negative ({} ms); use a positive "
                    "value, or 0 for DDP_TIMEOUT / the default",
                    configured.count()));
  }
  return settings::timeout();  // DDP_TIMEOUT, else the default
}

// RingOptions::spin: negative = 50 us when every rank can have a core of its own, else none.
std::chrono::microseconds resolve_spin(std::chrono::microseconds configured, int size) {
  if (configured.count() >= 0) return configured;
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  return static_cast<unsigned>(size) <= cores ? std::chrono::microseconds(50)
                                              : std::chrono::microseconds(0);
}

Transport resolve_transport(const RingOptions& options) {
  if (options.transport) {
    if (*options.transport != Transport::kAuto && *options.transport != Transport::kTcp) {
      throw ConfigError(
          fmt::format("RingOptions::transport has an invalid value {}; use "
                      "Transport::kAuto or Transport::kTcp",
                      static_cast<int>(*options.transport)));
    }
    return *options.transport;
  }
  if (const std::string value = settings::transport(); !value.empty()) {
    if (value == "auto") return Transport::kAuto;
    if (value == "tcp") return Transport::kTcp;
    throw ConfigError(fmt::format(
        "DDP_TRANSPORT='{}' is not a transport; use DDP_TRANSPORT=auto (shared memory inside a "
        "host, TCP between hosts) or DDP_TRANSPORT=tcp (TCP only)",
        value));
  }
  return Transport::kAuto;
}

std::string_view transport_name(Transport t) {
  return t == Transport::kTcp ? "tcp" : "auto";
}

std::string advertise_host(const RingOptions& options) {
  if (!options.advertise_host.empty()) return options.advertise_host;
  if (std::string env = settings::advertise_address(); !env.empty()) return env;
  return net::host_name();
}

comm::MeshParams mesh_params(const RingOptions& options, std::string group, std::string prefix,
                             int rank, int size, milliseconds timeout) {
  return comm::MeshParams{.group = std::move(group),
                          .prefix = std::move(prefix),
                          .rank = rank,
                          .size = size,
                          .advertise_host = advertise_host(options),
                          .socket_buffer_bytes = options.socket_buffer_bytes,
                          .secret = options.secret,
                          .log = options.log,
                          .timeout = timeout};
}

}  // namespace

namespace comm {

RingProcessGroup::RingProcessGroup(std::shared_ptr<Store> store, int rank, int size,
                                   RingOptions options)
    : GroupFront(
          rank, size, options.group_name, resolve_group_timeout(options.timeout),
          OpQueue::Options{.group = options.group_name,
                           .rank = rank,
                           .size = size,
                           .worker_linger = options.worker_linger,
                           .spin = resolve_spin(options.spin, size),
                           .flight_recorder = {.entries = settings::flight_recorder_entries(),
                                               .dump_dir = settings::dump_dir()},
                           .backend = "ring",
                           .job_rank = settings::job_place().rank,
                           .job_world_size = settings::job_place().world_size}),
      store_(std::move(store)),
      options_(std::move(options)),
      spin_(resolve_spin(options_.spin, size)),
      wait_warning_(settings::wait_warning()),
      mesh_(name(), rank, size, options_.chunk_bytes, spin_) {
  mesh_.context().set_wait_warning(wait_warning_, options_.log);
}

RingProcessGroup::~RingProcessGroup() {
  stop_queue();  // before the state run_call() uses goes away
}

void RingProcessGroup::connect() {
  const auto deadline = net::deadline_after(group_timeout());
  const Transport transport = resolve_transport(options_);
  if (size() > 1) {
    // Before anything is opened or written to the store: too low a limit is named at once,
    // instead of as connections that fail (or are never accepted) until the timeout.
    open_before_ = net::open_descriptor_count();
    check_descriptor_limit(/*local=*/1, /*cross_peers=*/0,
                           /*may_share=*/transport == Transport::kTcp ? 1 : size());
  }
  const std::int64_t joined = store_->add(fmt::format("ring/{}/joins", name()), 1);
  prefix_ = fmt::format("ring/{}/{}/", name(), (joined - 1) / size());
  if (size() == 1) {
    transport_text_ = "none (1 rank)";
    return;
  }
  store_->set(fmt::format("{}host/{}", prefix_, rank()),
              fmt::format("{}\n{}", transport_name(transport), host_identity(settings::host_id())));
  mesh_.connect(*store_, mesh_params(options_, name(), prefix_, rank(), size(), group_timeout()),
                deadline);
  set_up_locality(transport, deadline);
}

// Reads every rank's host identity and transport, groups the ranks by host and, with `auto`,
// sets up the shared-memory domain (one host) or the hierarchical allreduce (several hosts).
void RingProcessGroup::set_up_locality(Transport transport, net::Deadline deadline) {
  std::vector<std::string> identity_of(static_cast<std::size_t>(size()));
  for (int r = 0; r < size(); ++r) {
    const std::string key = fmt::format("{}host/{}", prefix_, r);
    const auto left = std::chrono::duration_cast<milliseconds>(deadline - net::Clock::now());
    const std::string value = store_->get_string(key, std::max(left, milliseconds(1)));
    const auto newline = value.find('\n');
    const std::string theirs = value.substr(0, newline);
    if (theirs != transport_name(transport)) {
      throw ConfigError(
          fmt::format("group '{}': rank {} uses transport '{}' but rank {} uses '{}'; set "
                      "RingOptions::transport or DDP_TRANSPORT to the same value on every rank",
                      name(), rank(), transport_name(transport), r, theirs));
    }
    identity_of[static_cast<std::size_t>(r)] =
        newline == std::string::npos ? std::string() : value.substr(newline + 1);
  }
  topology_ = Topology::from_identities(identity_of, rank());
  const auto& hosts = topology_.hosts;
  const auto& local = topology_.local;
  const int local_rank = topology_.local_rank;
  if (transport == Transport::kTcp || topology_.largest_host() == 1) {
    transport_text_ = hosts.size() == 1 ? "tcp" : fmt::format("tcp ({} hosts)", hosts.size());
    return;
  }
  shm::ShmOptions shm{.group = name()};
  shm.wait_warning = wait_warning_;
  shm.warn = options_.log;
  // A host's domain numbers its ranks 0..L-1: let its errors name this group's ranks.
  if (hosts.size() > 1) shm.ranks = local;
  shm.on_nap = [this] { check_for_other_call(mesh_); };
  if (options_.shm_slot_bytes != 0) {
    shm.slot_bytes = options_.shm_slot_bytes;
    shm.small_bytes = std::min(shm.small_bytes, shm.slot_bytes);
  }
  const int cross_peers = hosts.size() > 1 && (topology_.equal_hosts() || local_rank == 0)
                              ? static_cast<int>(hosts.size()) - 1
                              : 0;
  check_descriptor_limit(static_cast<int>(local.size()), cross_peers,
                         static_cast<int>(local.size()));
  if (hosts.size() == 1) {
    domain_ = shm::ShmDomain::create(*store_, prefix_ + "shm", rank(), size(), shm, deadline);
    mesh_.context().set_idle_check([this] { check_for_other_call(*domain_); });
    mode_ = Mode::kShm;
    transport_text_ = "shm";
    return;
  }
  mode_ = Mode::kHierarchical;
  hierarchy_.group = name();
  hierarchy_.group_size = size();
  hierarchy_.local = local;
  hierarchy_.local_rank = local_rank;
  hierarchy_.slices = topology_.equal_hosts();
  hierarchy_.small_message_bytes = options_.small_message_bytes;
  if (local.size() > 1) {
    domain_ = shm::ShmDomain::create(*store_, fmt::format("{}shm/host{}", prefix_, local[0]),
                                     local_rank, static_cast<int>(local.size()), shm, deadline);
    mesh_.context().set_idle_check([this] { check_for_other_call(*domain_); });
    hierarchy_.domain = domain_.get();
  }
  if (hierarchy_.slices || local_rank == 0) connect_cross_host_mesh(deadline);
  std::string sizes;
  for (const auto& h : hosts)
    sizes += fmt::format("{}{}", sizes.empty() ? "" : "+", h.size());
  transport_text_ = fmt::format("hierarchical({} hosts, {} ranks, {})", hosts.size(), sizes,
                                hierarchy_.slices ? "slices" : "leaders");
}

// What one group may hold open at once, by kind, beside what the process had open before:
//   a socket to every peer for collectives (the usual calls connect a few peers; alltoall, gather
//   and scatter connect the rest on first use) and one for point to point (connected on first
//   use), and one to each cross-host peer (hierarchical);
//   two listening sockets (the collective mesh's until every rank above connected, point to
//   point's for life), and the cross-host mesh's;
//   two eventfds (point to point's connector and engine);
//   a pidfd for each other rank on this host (a dead peer is seen at once), and the segment's
//   memfd while the host's ranks join it;
// plus kProgramHeadroom for the program. The store's connection is among those open before.
void RingProcessGroup::check_descriptor_limit(int local, int cross_peers, int may_share) const {
  const auto peers = static_cast<std::size_t>(size() - 1);
  const auto cross = static_cast<std::size_t>(cross_peers);
  const std::size_t sockets = 2 * peers + cross;
  const std::size_t listeners = 2 + (cross > 0 ? 1 : 0);
  const std::size_t eventfds = 2;
  // A pidfd for each other rank of the host, and the segment.
  const auto shared_memory = [](int ranks) {
    return ranks > 1 ? static_cast<std::size_t>(ranks) : std::size_t{0};
  };
  const std::size_t needed =
      open_before_ + sockets + listeners + eventfds + shared_memory(local) + kProgramHeadroom;
  const std::size_t limit = net::ensure_open_files_limit(needed);
  if (limit >= needed) return;
  std::string parts = fmt::format(
      "{} open already, {} sockets for its {} peers (collectives and point to point{}), {} "
      "listening sockets, {} eventfds",
      open_before_, sockets, peers, cross > 0 ? ", and across hosts" : "", listeners, eventfds);
  if (local > 1) {
    parts += fmt::format(
        ", {} pidfds for the other ranks of this host and 1 for the shared "
        "segment",
        local - 1);
  }
  parts += fmt::format(", and {} for the program", kProgramHeadroom);
  // Before the ranks of this host are known, the advice covers their sharing it (a second
  // failure with a larger number would be no help).
  const std::size_t advised =
      needed - shared_memory(local) + shared_memory(std::max(local, may_share));
  if (advised > needed) {
    parts += fmt::format("; {} more if all {} ranks share this host", advised - needed, may_share);
  }
  throw CommError(
      CommErrorKind::kSetup,
      fmt::format("rank {} of group '{}' cannot create the group: this process may open {} file "
                  "descriptors (ulimit -n; its hard limit is {}), but a group of {} ranks needs "
                  "about {} here ({}); start the ranks with ulimit -n {} or more (a hard limit "
                  "is raised in /etc/security/limits.conf, systemd's LimitNOFILE or docker's "
                  "--ulimit nofile)",
                  rank(), name(), limit, net::hard_open_files_limit(), size(), needed, parts,
                  advised),
      name(), "connect", 0, -1);
}

// The cross-host step's own TCP mesh among the ranks of this rank's local index on every host
// (slices) or the leaders: connections of its own, so its messages never meet this group's.
// It runs on this group's executor; this group's failure shuts it (on_poison).
void RingProcessGroup::connect_cross_host_mesh(net::Deadline deadline) {
  const int local_rank = topology_.local_rank;
  auto& members = hierarchy_.cross_members;
  for (const auto& h : topology_.hosts)
    members.push_back(h[static_cast<std::size_t>(local_rank)]);
  const int cross_size = static_cast<int>(members.size());
  const int cross_rank =
      static_cast<int>(std::find(members.begin(), members.end(), rank()) - members.begin());
  const std::string cross_name = fmt::format("{}/cross{}", name(), local_rank);
  cross_mesh_ = std::make_unique<TcpMesh>(cross_name, cross_rank, cross_size, options_.chunk_bytes,
                                          resolve_spin(options_.spin, cross_size));
  cross_mesh_->context().set_wait_warning(wait_warning_, options_.log);
  hierarchy_.cross = &cross_mesh_->context();
  try {
    cross_mesh_->connect(
        *store_,
        mesh_params(options_, cross_name, fmt::format("{}cross{}/", prefix_, local_rank),
                    cross_rank, cross_size, group_timeout()),
        deadline);
  } catch (const CommError& e) {
    const int peer = e.peer() >= 0 ? members[static_cast<std::size_t>(e.peer())] : -1;
    throw CommError(e.kind(),
                    fmt::format("{} [{}]", e.what(), hierarchy_.cross_ranks_note(e.peer())), name(),
                    e.op(), e.sequence(), peer);
  }
}

// Sends and receives run on their own connections (TCP whatever the transport) and progress thread
// (src/comm/ring/p2p), never in this group's queue: they progress independently of each other and
// of the collectives, so a cycle of sends posted before receives cannot deadlock.
void RingProcessGroup::start_p2p() {
  if (size() == 1) return;
  // Connected on first use (p2p_connector.h), with the mesh's handshake under a group name of its
  // own (a p2p connection cannot pass for a mesh connection, or the reverse) and store keys of
  // its own. Here it only listens and publishes its address.
  auto connector = std::make_unique<p2p::P2pConnector>(
      *store_,
      mesh_params(options_, name() + "#p2p", prefix_ + "p2p/", rank(), size(), group_timeout()),
      net::deadline_after(group_timeout()));
  p2p_ = std::make_unique<p2p::P2pEngine>(
      size(), std::move(connector),
      p2p::EngineOptions{.group = name(),
                         .rank = rank(),
                         .timeout = group_timeout(),
                         .spin = spin_,
                         .reason_of = [this](int peer) { return abort_reason_of(peer); }});
}

std::shared_ptr<ProcessGroup> RingProcessGroup::make_subgroup(std::vector<int> ranks) {
  const int index = subgroups_created_++;
  const auto it = std::find(ranks.begin(), ranks.end(), rank());
  if (it == ranks.end()) return nullptr;
  RingOptions sub = options_;
  sub.timeout = group_timeout();
  sub.group_name = fmt::format("{}/sub{}", name(), index);
  return make_ring_process_group(store_, static_cast<int>(it - ranks.begin()),
                                 static_cast<int>(ranks.size()), sub);
}

}  // namespace comm

std::string ring_transport_of(const ProcessGroup& group) {
  const auto* ring = dynamic_cast<const comm::RingProcessGroup*>(&group);
  return ring != nullptr ? ring->transport_description() : std::string();
}

int ring_collective_connections_of(const ProcessGroup& group) {
  const auto* ring = dynamic_cast<const comm::RingProcessGroup*>(&group);
  return ring != nullptr ? ring->collective_connections() : -1;
}

int ring_point_to_point_connections_of(const ProcessGroup& group) {
  const auto* ring = dynamic_cast<const comm::RingProcessGroup*>(&group);
  return ring != nullptr ? ring->point_to_point_connections() : -1;
}

std::shared_ptr<ProcessGroup> make_ring_process_group(std::shared_ptr<Store> store, int rank,
                                                      int size, RingOptions options) {
  if (!store) throw ConfigError("make_ring_process_group: the store is null");
  if (size < 1) {
    throw ConfigError(
        fmt::format("make_ring_process_group: size must be at least 1, got {}", size));
  }
  if (rank < 0 || rank >= size) {
    throw ConfigError(fmt::format("make_ring_process_group: rank {} is outside 0..{} (size {})",
                                  rank, size - 1, size));
  }
  if (options.group_name.empty()) {
    throw ConfigError("make_ring_process_group: RingOptions::group_name is empty");
  }
  if (!options.secret.empty()) auth::require_auth();
  if (options.chunk_bytes < 64) {
    throw ConfigError(
        fmt::format("RingOptions::chunk_bytes must be at least 64, got {}", options.chunk_bytes));
  }
  auto group =
      std::make_shared<comm::RingProcessGroup>(std::move(store), rank, size, std::move(options));
  group->connect();
  group->start_p2p();
  group->start();
  return group;
}

}  // namespace ddp
