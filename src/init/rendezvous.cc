#include "ddp/launch/rendezvous.h"

#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <functional>
#include <random>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "ddp/error.h"
#include "ddp/store/prefix_store.h"
#include "ddp/store/tcp_store.h"
#include "init/agent_store.h"
#include "init/resolved_rendezvous.h"
#include "net/socket.h"
#include "settings/settings.h"
#include "store/c10d_store_client.h"

namespace ddp {
namespace {

std::string seconds_text(Milliseconds timeout) {
  return fmt::format("{:g} s", static_cast<double>(timeout.count()) / 1000.0);
}

// A token that identifies this process among all processes of the job.
std::string process_token() {
  std::random_device random;
  return fmt::format("{} pid {} ({:08x})", net::host_name(), ::getpid(), random());
}

// Marks an error value that is a timeout (others are configuration errors).
constexpr std::string_view kTimeoutTag = "timeout: ";

std::string to_string(const Bytes& bytes) {
  return {bytes.begin(), bytes.end()};
}

// The keys one rendezvous attempt uses. Restarted jobs get a fresh generation.
struct Keys {
  std::string base;
  std::string rank(int r) const { return fmt::format("{}/rank/{}", base, r); }
  std::string world_size() const { return base + "/world_size"; }
  std::string arrived() const { return base + "/arrived"; }
  std::string complete() const { return base + "/complete"; }
  std::string error() const { return base + "/error"; }
};

// Where rank 0's store listens: where it was asked to, else MASTER_ADDR's interface. Debian maps
// a host's own name to 127.0.1.1, so a MASTER_ADDR that names this host can resolve to a loopback
// address here while the other hosts reach it through the network: a job that spans hosts then
// listens on every interface instead (the peers could never reach a loopback address).
std::string store_listen_host(const LaunchEnvironment& env) {
  if (env.store_listen_addr) return *env.store_listen_addr;
  const bool spans_hosts = env.local_world_size < env.world_size;
  if (spans_hosts && net::resolves_only_to_loopback(env.master_addr)) return "";
  return env.master_addr;
}

// Says what a rank waits for while the rendezvous takes longer than `interval`, and again every
// interval: one line from local rank 0 of each node, so that a node's log shows why it stalls
// without one line per rank.
class WaitWarnings {
 public:
  WaitWarnings(const LaunchEnvironment& env, Milliseconds interval, Milliseconds timeout,
               std::function<void(const std::string&)> sink)
      : env_(env),
        interval_(env.local_rank == 0 ? interval : Milliseconds(0)),
        timeout_(timeout),
        sink_(std::move(sink)),
        start_(net::Clock::now()),
        next_(start_ + interval_) {
    if (!sink_) sink_ = [](const std::string& line) { std::fprintf(stderr, "%s\n", line.c_str()); };
  }

  // The next moment a warning is due (the far future when warnings are off).
  net::Clock::time_point next() const {
    return interval_.count() > 0 ? next_ : net::Clock::time_point::max();
  }
  bool due() const { return net::Clock::now() >= next(); }

  // Emits `what` ("for ...") with the time waited so far, and schedules the next warning.
  void warn(const std::string& what) {
    const auto waited = std::chrono::duration_cast<Milliseconds>(net::Clock::now() - start_);
    const std::string line = fmt::format(
        "ddp: rank {}: the rendezvous has waited {} {}; it gives up after {} "
        "(DDP_TIMEOUT)",
        env_.rank, seconds_text(waited), what, seconds_text(timeout_));
    try {
      sink_(line);
    } catch (...) {
      // A failing warning sink must not turn a slow start into a failed one.
    }
    while (next_ <= net::Clock::now())
      next_ += interval_;
  }

 private:
  const LaunchEnvironment& env_;
  Milliseconds interval_;
  Milliseconds timeout_;
  std::function<void(const std::string&)> sink_;
  net::Clock::time_point start_;
  net::Clock::time_point next_;
};

// "1, 4, 5" or, for a long list, its start and how many more.
std::string rank_list(const std::vector<int>& ranks) {
  constexpr std::size_t kShown = 16;
  if (ranks.size() <= kShown) return fmt::format("{}", fmt::join(ranks, ", "));
  return fmt::format("{}, ... ({} more)", fmt::join(ranks.begin(), ranks.begin() + kShown, ", "),
                     ranks.size() - kShown);
}

// The nodes of `ranks` when the job has the same number of ranks on every node (as ddprun and
// torchrun start them), e.g. " on node(s) 1, 3"; "" for a one-node job or an uneven layout.
std::string node_list(const std::vector<int>& ranks, const LaunchEnvironment& env) {
  if (env.local_world_size <= 0 || env.local_world_size >= env.world_size ||
      env.world_size % env.local_world_size != 0) {
    return "";
  }
  std::vector<int> nodes;
  for (const int rank : ranks) {
    const int node = rank / env.local_world_size;
    if (nodes.empty() || nodes.back() != node) nodes.push_back(node);
  }
  return fmt::format(" on node(s) {} (of {})", rank_list(nodes),
                     env.world_size / env.local_world_size);
}

std::shared_ptr<Store> connect_store(const LaunchEnvironment& env, Milliseconds timeout,
                                     Milliseconds connect_timeout) {
  const bool is_server = env.rank == 0;
  try {
    return std::make_shared<TcpStore>(
        env.master_addr, env.master_port,
        TcpStoreOptions{.is_server = is_server,
                        .timeout = timeout,
                        .connect_timeout = connect_timeout,
                        .listen_host = is_server ? store_listen_host(env) : std::string(),
                        .auth_secret = env.secret});
  } catch (const ConfigError& e) {
    if (is_server) {
      throw ConfigError(fmt::format("rank 0 cannot start the rendezvous store on {}:{}: {}",
                                    env.store_listen_addr.value_or(env.master_addr),
                                    env.master_port, e.what()));
    }
    throw;
  } catch (const StoreError& e) {
    throw StoreError(fmt::format(
        "rank {} was not let into the rendezvous store at {}:{}: {}; every process of the job "
        "needs the same DDP_SECRET or DDP_SECRET_FILE (or none of them)",
        env.rank, env.master_addr, env.master_port, e.what()));
  } catch (const TimeoutError& e) {
    throw TimeoutError(fmt::format(
        "rank {} could not reach the rendezvous store at {}:{} within {}: is rank 0 running, and "
        "do MASTER_ADDR and MASTER_PORT point at its host? ({})",
        env.rank, env.master_addr, env.master_port, seconds_text(timeout), e.what()));
  }
}

// connect_store within `timeout`, in slices that end when a warning is due, so that a rank that
// waits for rank 0's store says so.
std::shared_ptr<Store> connect_store_warning(const LaunchEnvironment& env, Milliseconds timeout,
                                             WaitWarnings& warnings) {
  const auto deadline = net::deadline_after(timeout);
  for (;;) {
    const auto slice_end = std::min(deadline, warnings.next());
    const auto slice = std::max(
        Milliseconds(1), std::chrono::duration_cast<Milliseconds>(slice_end - net::Clock::now()));
    try {
      return connect_store(env, timeout, slice);
    } catch (const TimeoutError&) {
      if (slice_end >= deadline || net::Clock::now() >= deadline) throw;
      if (!warnings.due()) {
        // A connect that gave up before its slice ended: try again, without spinning.
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
        continue;
      }
      warnings.warn(fmt::format(
          "for the rendezvous store at {}:{}, which global rank 0 hosts (is rank 0 running, and "
          "do MASTER_ADDR and MASTER_PORT point at its host?)",
          env.master_addr, env.master_port));
    }
  }
}

// torchrun's agent store (init/agent_store.h): every rank is a client; ddp's keys live under
// `prefix`. The store is torchrun's and has no authentication, so a job secret cannot be honoured
// there: refused, naming the two ways out.
std::shared_ptr<Store> connect_agent_store(const LaunchEnvironment& env, const std::string& prefix,
                                           Milliseconds timeout) {
  if (!env.secret.empty()) {
    throw ConfigError(fmt::format(
        "rank {}: a job secret is set (DDP_SECRET or DDP_SECRET_FILE) but torchrun's own store "
        "at {}:{} (TORCHELASTIC_USE_AGENT_STORE=True), which ddp joins through, has no "
        "authentication. Run torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its "
        "environment (rank 0 then hosts ddp's authenticated store on MASTER_PORT), launch with "
        "ddprun, or unset the secret",
        env.rank, env.master_addr, env.master_port));
  }
  const std::string where =
      fmt::format("torchrun's store at {}:{} (TORCHELASTIC_USE_AGENT_STORE=True)", env.master_addr,
                  env.master_port);
  try {
    auto client = std::make_shared<C10dStoreClient>(
        env.master_addr, env.master_port,
        C10dStoreOptions{.timeout = timeout, .connect_timeout = timeout});
    return std::make_shared<PrefixStore>(prefix, std::move(client));
  } catch (const TimeoutError& e) {
    throw TimeoutError(fmt::format("rank {} could not join through {} within {}: {}", env.rank,
                                   where, seconds_text(timeout), e.what()));
  } catch (const StoreError& e) {
    throw StoreError(fmt::format(
        "rank {} could not join through {}: {}. If MASTER_PORT is not torchrun's store, unset "
        "TORCHELASTIC_USE_AGENT_STORE; to have rank 0 host ddp's own store instead, run torchrun "
        "with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1",
        env.rank, where, e.what()));
  }
}

// Records `message` for every other rank to see, then throws it here.
[[noreturn]] void fail_everywhere(Store& store, const Keys& keys, const std::string& message) {
  try {
    store.set(keys.error(), message);
  } catch (const Error&) {
    // The store itself failing must not hide the original problem.
  }
  throw ConfigError(message);
}

std::vector<int> missing_ranks(Store& store, const Keys& keys, int world_size) {
  std::vector<int> missing;
  for (int r = 0; r < world_size; ++r) {
    const std::vector<std::string> key{keys.rank(r)};
    if (!store.check(key)) missing.push_back(r);
  }
  return missing;
}

void wait_for_world(Store& store, const Keys& keys, const LaunchEnvironment& env,
                    Milliseconds timeout, WaitWarnings& warnings) {
  const auto deadline = net::deadline_after(timeout);
  const std::vector<std::string> complete{keys.complete()};
  const std::vector<std::string> error{keys.error()};
  auto pause = std::chrono::milliseconds(1);
  try {
    for (;;) {
      if (store.check(complete)) return;
      if (store.check(error)) {
        store.add(keys.error() + "/seen", 1);
        const std::string value = to_string(store.get(keys.error(), timeout));
        if (value.starts_with(kTimeoutTag)) throw TimeoutError(value.substr(kTimeoutTag.size()));
        throw ConfigError(value);
      }
      if (net::Clock::now() >= deadline) break;
      if (warnings.due()) {
        const auto missing = missing_ranks(store, keys, env.world_size);
        warnings.warn(fmt::format("for {} of {} ranks: missing rank(s) {}{}", missing.size(),
                                  env.world_size, rank_list(missing), node_list(missing, env)));
      }
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::milliseconds(50));
    }
    const auto missing = missing_ranks(store, keys, env.world_size);
    const std::string message = fmt::format(
        "only {} of {} ranks joined the rendezvous at {}:{} within {}; missing rank(s): {}. "
        "Check that every process was started with the same WORLD_SIZE and MASTER_ADDR/PORT",
        env.world_size - static_cast<int>(missing.size()), env.world_size, env.master_addr,
        env.master_port, seconds_text(timeout), fmt::join(missing, ", "));
    if (env.rank == 0) {
      // Rank 0 hosts the store: tell the ranks that did arrive, and give them a moment to read it
      // before the store goes away with this process.
      store.compare_set(keys.error(), "", std::string(kTimeoutTag) + message);
      const int arrived_others = env.world_size - static_cast<int>(missing.size()) - 1;
      const auto linger = net::deadline_after(std::chrono::seconds(2));
      while (store.add(keys.error() + "/seen", 0) < arrived_others && net::Clock::now() < linger) {
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
    }
    throw TimeoutError(message);
  } catch (const StoreError& e) {
    throw StoreError(fmt::format(
        "rank {} lost the rendezvous store at {}:{} while waiting for the other ranks: rank 0, "
        "which hosts it, has stopped (see its own error) ({})",
        env.rank, env.master_addr, env.master_port, e.what()));
  }
}

}  // namespace

Milliseconds resolve_timeout(std::optional<Milliseconds> explicit_timeout,
                             const EnvironmentLookup& lookup) {
  if (explicit_timeout) {
    if (explicit_timeout->count() <= 0) {
      throw ConfigError("the timeout must be positive (InitOptions::timeout)");
    }
    return *explicit_timeout;
  }
  return settings::timeout(lookup);
}

World rendezvous(const InitOptions& options) {
  return rendezvous(options, resolve_launch_environment(options.launch));
}

World rendezvous(const InitOptions& options, LaunchEnvironment environment) {
  World world;
  world.environment = std::move(environment);
  world.timeout = resolve_timeout(options.timeout);
  const auto& env = world.environment;

  WaitWarnings warnings(env,
                        options.wait_warning ? *options.wait_warning : settings::wait_warning(),
                        world.timeout, options.warn);
  const auto agent_prefix =
      init::torchrun_agent_store_prefix(options.launch, env, process_environment);
  if (options.store) {
    world.store = options.store;
  } else if (agent_prefix) {
    world.store = connect_agent_store(env, *agent_prefix, world.timeout);
  } else if (env.rank == 0) {
    world.store = connect_store(env, world.timeout, world.timeout);  // it starts the server
  } else {
    world.store = connect_store_warning(env, world.timeout, warnings);
  }
  Store& store = *world.store;
  const Keys keys{fmt::format("ddp/rendezvous/{}", env.restart_count)};

  const std::string token = process_token();
  const std::string holder = store.compare_set(keys.rank(env.rank), "", token);
  if (holder != token) {
    // In torchrun's store, which outlives its workers, the other claim is most likely a worker
    // of an earlier round under the same restart count (see docs/store.md, torchrun's store).
    const std::string agent_hint =
        agent_prefix
            ? fmt::format(
                  ". Under torchrun's store ({}/) the other claim is most likely a worker of an "
                  "earlier round left under the same TORCHELASTIC_RESTART_COUNT: torchrun "
                  "restarted the workers without counting a restart (an elastic membership "
                  "change, or nodes whose restart counts differ). Run torchrun with "
                  "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (rank 0 then hosts a fresh ddp store "
                  "every round), or launch with ddprun",
                  *agent_prefix)
            : std::string();
    fail_everywhere(store, keys,
                    fmt::format("two processes claim rank {}: {} and {}; every process of the job "
                                "needs its own RANK (check the launcher's variables){}",
                                env.rank, holder, token, agent_hint));
  }
  const std::string size_text = std::to_string(env.world_size);
  const std::string agreed_size = store.compare_set(keys.world_size(), "", size_text);
  if (agreed_size != size_text) {
    fail_everywhere(store, keys,
                    fmt::format("rank {} was launched with WORLD_SIZE={} but another rank with "
                                "WORLD_SIZE={}; every process must be given the same world size",
                                env.rank, size_text, agreed_size));
  }
  if (store.add(keys.arrived(), 1) == env.world_size) store.set(keys.complete(), "1");
  wait_for_world(store, keys, env, world.timeout, warnings);
  return world;
}

}  // namespace ddp
