#include "ddp/launch/launch_environment.h"

#include <charconv>
#include <cstdlib>
#include <string_view>
#include <vector>

#include <fmt/format.h>

#include "ddp/error.h"
#include "ddp/launch/job_secret.h"
#include "init/agent_store.h"
#include "settings/settings.h"

namespace ddp {
namespace {

// One field of the launch description and where it came from, so errors name the right variable.
struct Field {
  std::optional<long long> value;
  std::string source;  // variable name, or "options.<field>"
};

long long parse_integer(const std::string& name, const std::string& text, const char* meaning) {
  long long value = 0;
  const char* begin = text.data();
  const char* end = begin + text.size();
  const auto [ptr, ec] = std::from_chars(begin, end, value);
  if (text.empty() || ec != std::errc() || ptr != end) {
    throw ConfigError(
        fmt::format("{}='{}' is not an integer: it must be {}; check how the job was launched "
                    "(ddprun/torchrun, mpirun or srun set it)",
                    name, text, meaning));
  }
  return value;
}

class Reader {
 public:
  explicit Reader(const EnvironmentLookup& lookup) : lookup_(lookup) {}

  bool has(const std::string& name) const { return lookup_(name).has_value(); }

  Field integer(const std::string& name, const char* meaning) const {
    const auto text = lookup_(name);
    if (!text) return {std::nullopt, name};
    return {parse_integer(name, *text, meaning), name};
  }

  std::optional<std::string> text(const std::string& name) const { return lookup_(name); }

 private:
  const EnvironmentLookup& lookup_;
};

void require(const Field& field, const std::string& launcher, const std::string& hint) {
  if (!field.value) {
    throw ConfigError(fmt::format("{} is not set although the job looks launched by {}: {}",
                                  field.source, launcher, hint));
  }
}

// SLURM_TASKS_PER_NODE looks like "2(x3),1": two tasks on each of three nodes, then one.
std::optional<long long> slurm_tasks_on_node(const std::string& spec, long long node_id) {
  long long node = 0;
  std::string_view rest(spec);
  while (!rest.empty()) {
    const auto comma = rest.find(',');
    std::string_view item = rest.substr(0, comma);
    rest = comma == std::string_view::npos ? std::string_view() : rest.substr(comma + 1);
    long long tasks = 0;
    long long repeat = 1;
    auto [ptr, ec] = std::from_chars(item.data(), item.data() + item.size(), tasks);
    if (ec != std::errc()) return std::nullopt;
    std::string_view tail(ptr, item.data() + item.size() - ptr);
    if (tail.starts_with("(x") && tail.ends_with(")")) {
      auto [p2, ec2] = std::from_chars(tail.data() + 2, tail.data() + tail.size() - 1, repeat);
      if (ec2 != std::errc()) return std::nullopt;
    } else if (!tail.empty()) {
      return std::nullopt;
    }
    if (node_id < node + repeat) return tasks;
    node += repeat;
  }
  return std::nullopt;
}

}  // namespace

std::optional<std::string> process_environment(const std::string& name) {
  return settings::environment(name);
}

LaunchEnvironment resolve_launch_environment(const LaunchOptions& options,
                                             const EnvironmentLookup& lookup) {
  const Reader env(lookup);
  Field rank, world, local_rank, local_world;
  bool one_node_known = false;  // whether the launcher told us all ranks share this host
  LaunchEnvironment result;

  constexpr const char* kRankMeaning = "this process's rank, from 0 to the world size - 1";
  constexpr const char* kSizeMeaning = "the number of processes in the job (at least 1)";
  constexpr const char* kLocalRankMeaning = "this process's index on its host";
  constexpr const char* kLocalSizeMeaning = "the number of processes on this host";

  if (env.has("RANK") || env.has("WORLD_SIZE")) {
    result.launcher = "ddprun/torchrun";
    rank = env.integer("RANK", kRankMeaning);
    world = env.integer("WORLD_SIZE", kSizeMeaning);
    local_rank = env.integer("LOCAL_RANK", kLocalRankMeaning);
    local_world = env.integer("LOCAL_WORLD_SIZE", kLocalSizeMeaning);
    const std::string hint = "set RANK and WORLD_SIZE together (ddprun and torchrun set both)";
    if (!options.rank) require(rank, result.launcher, hint);
    if (!options.world_size) require(world, result.launcher, hint);
  } else if (env.has("OMPI_COMM_WORLD_SIZE") || env.has("OMPI_COMM_WORLD_RANK")) {
    result.launcher = "mpirun";
    rank = env.integer("OMPI_COMM_WORLD_RANK", kRankMeaning);
    world = env.integer("OMPI_COMM_WORLD_SIZE", kSizeMeaning);
    local_rank = env.integer("OMPI_COMM_WORLD_LOCAL_RANK", kLocalRankMeaning);
    local_world = env.integer("OMPI_COMM_WORLD_LOCAL_SIZE", kLocalSizeMeaning);
    const std::string hint = "start the program with OpenMPI's mpirun, which sets it";
    require(rank, result.launcher, hint);
    require(world, result.launcher, hint);
    one_node_known = true;
  } else if (env.has("SLURM_PROCID") || env.has("SLURM_NTASKS")) {
    result.launcher = "srun";
    rank = env.integer("SLURM_PROCID", kRankMeaning);
    world = env.integer("SLURM_NTASKS", kSizeMeaning);
    local_rank = env.integer("SLURM_LOCALID", kLocalRankMeaning);
    const std::string hint = "start the program with srun (not only sbatch/salloc), which sets it";
    require(rank, result.launcher, hint);
    require(world, result.launcher, hint);
    local_world = env.integer("SLURM_NTASKS_PER_NODE", kLocalSizeMeaning);
    if (!local_world.value) {
      if (const auto spec = env.text("SLURM_TASKS_PER_NODE")) {
        const auto node_id = env.integer("SLURM_NODEID", "this node's index in the job");
        local_world = {slurm_tasks_on_node(*spec, node_id.value.value_or(0)),
                       "SLURM_TASKS_PER_NODE"};
        if (!local_world.value) {
          throw ConfigError(fmt::format(
              "SLURM_TASKS_PER_NODE='{}' is not in SLURM's format (e.g. '2(x3),1')", *spec));
        }
      }
    }
    one_node_known = true;
  } else {
    result.launcher = (options.rank || options.world_size) ? "options" : "none";
  }

  // Explicit options win over the environment, field by field.
  if (options.rank) rank = {*options.rank, "options.rank"};
  if (options.world_size) world = {*options.world_size, "options.world_size"};
  if (options.local_rank) local_rank = {*options.local_rank, "options.local_rank"};
  if (options.local_world_size) {
    local_world = {*options.local_world_size, "options.local_world_size"};
  }
  if (result.launcher == "options" && (!rank.value || !world.value)) {
    throw ConfigError(
        "options.rank and options.world_size must be given together when no launcher "
        "variables are set (or start the program with ddprun, torchrun, mpirun or srun)");
  }

  const long long world_size = world.value.value_or(1);
  const long long my_rank = rank.value.value_or(0);
  if (world_size < 1) {
    throw ConfigError(
        fmt::format("{}={} but the world needs at least one process; launch with "
                    "a positive number of processes",
                    world.source, world_size));
  }
  if (world_size > 1'000'000) {
    throw ConfigError(
        fmt::format("{}={} is not a plausible number of processes", world.source, world_size));
  }
  if (my_rank < 0 || my_rank >= world_size) {
    throw ConfigError(fmt::format("{}={} is outside the world: with {}={} ranks run from 0 to {}",
                                  rank.source, my_rank, world.source, world_size, world_size - 1));
  }

  // Without local information, assume one host: that is the only safe reading for a
  // hand-launched job, and it only affects shared-memory decisions, never correctness.
  if (!local_world.value) local_world = {world_size, world.source};
  const long long my_local_world = *local_world.value;
  const long long my_local_rank = local_rank.value.value_or(my_rank % my_local_world);
  if (my_local_world < 1 || my_local_world > world_size) {
    throw ConfigError(fmt::format("{}={} must be between 1 and {}={}", local_world.source,
                                  my_local_world, world.source, world_size));
  }
  if (my_local_rank < 0 || my_local_rank >= my_local_world) {
    throw ConfigError(fmt::format(
        "{}={} is outside this host's processes: with {}={} it must be "
        "between 0 and {}",
        local_rank.source, my_local_rank, local_world.source, my_local_world, my_local_world - 1));
  }
  one_node_known = one_node_known && my_local_world == world_size;

  // Master address and port.
  const auto addr_env = env.text("MASTER_ADDR");
  const Field port_env =
      env.integer("MASTER_PORT", "the TCP port of the rendezvous store on the master (1-65535)");
  std::optional<std::string> addr = options.master_addr ? options.master_addr : addr_env;
  Field port = options.master_port ? Field{*options.master_port, "options.master_port"} : port_env;
  if (world_size > 1 && (!addr || !port.value) && !one_node_known && result.launcher != "options") {
    const char* missing = !addr ? "MASTER_ADDR" : "MASTER_PORT";
    throw ConfigError(fmt::format(
        "{} is not set: a job of {} processes launched by {} needs MASTER_ADDR (the host of rank "
        "0) and MASTER_PORT (a free TCP port there){}",
        missing, world_size, result.launcher,
        result.launcher == "mpirun" ? "; export them and pass them on with mpirun -x MASTER_ADDR "
                                      "-x MASTER_PORT"
                                    : ""));
  }
  if (addr && addr->empty()) {
    throw ConfigError("MASTER_ADDR is set but empty: set it to the host name or address of rank 0");
  }
  result.master_addr = addr.value_or("127.0.0.1");
  const long long default_port = world_size == 1 ? 0 : 29500;
  const long long master_port = port.value.value_or(default_port);
  if (master_port < 0 || master_port > 65535) {
    throw ConfigError(
        fmt::format("{}={} is not a TCP port: use 1-65535", port.source, master_port));
  }
  if (master_port == 0 && world_size > 1) {
    throw ConfigError(fmt::format(
        "{}=0 only works for a job of one process (the others could not find the port); "
        "choose a port, or let `ddprun --master-port 0` choose one for every worker",
        port.source));
  }

  const Field restarts =
      env.integer("TORCHELASTIC_RESTART_COUNT", "how many times the job was restarted");
  result.rank = static_cast<int>(my_rank);
  result.world_size = static_cast<int>(world_size);
  result.local_rank = static_cast<int>(my_local_rank);
  result.local_world_size = static_cast<int>(my_local_world);
  result.master_port = static_cast<std::uint16_t>(master_port);
  result.restart_count = static_cast<int>(restarts.value.value_or(0));

  // The store listens where rank 0 is reached (MASTER_ADDR), not on every interface, unless
  // asked to.
  const auto listen =
      options.store_listen_addr ? options.store_listen_addr : env.text("DDP_STORE_LISTEN_ADDR");
  if (listen && listen->empty()) {
    throw ConfigError(fmt::format(
        "{} is set but empty: give an address of this host (e.g. 0.0.0.0 for every "
        "IPv4 address), or unset it to listen on MASTER_ADDR's interface",
        options.store_listen_addr ? "options.store_listen_addr" : "DDP_STORE_LISTEN_ADDR"));
  }
  result.store_listen_addr = listen;
  result.secret = resolve_job_secret(options.secret, lookup);
  return result;
}

namespace init {

std::optional<std::string> torchrun_agent_store_prefix(const LaunchOptions& options,
                                                       const LaunchEnvironment& env,
                                                       const EnvironmentLookup& lookup) {
  if (options.master_port || options.master_addr) return std::nullopt;
  if (env.launcher != "ddprun/torchrun") return std::nullopt;
  if (lookup("TORCHELASTIC_USE_AGENT_STORE").value_or("") != "True") return std::nullopt;
  return fmt::format("ddp/torchrun/attempt_{}/world_{}", env.restart_count, env.world_size);
}

}  // namespace init
}  // namespace ddp
