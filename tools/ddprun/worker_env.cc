#include "ddprun/worker_env.h"

#include <algorithm>
#include <string_view>
#include <type_traits>

extern char** environ;

namespace ddp::ddprun {

Environment current_environment() {
  Environment env;
  for (char** entry = environ; entry != nullptr && *entry != nullptr; ++entry) {
    const std::string_view text(*entry);
    const auto eq = text.find('=');
    if (eq == std::string_view::npos) continue;
    env.emplace(std::string(text.substr(0, eq)), std::string(text.substr(eq + 1)));
  }
  return env;
}

void apply_worker_variables(Environment& env, const LaunchOptions& options,
                            const WorkerSlot& slot) {
  const auto set = [&env](const char* key, auto value) {
    if constexpr (std::is_convertible_v<decltype(value), std::string>) {
      env[key] = std::string(value);
    } else {
      env[key] = std::to_string(value);
    }
  };
  const RoundPlacement node =
      slot.placement.value_or(RoundPlacement{.node_rank = options.node_rank,
                                             .nnodes = options.nnodes,
                                             .first_rank = options.global_rank(0),
                                             .world_size = options.world_size()});
  const int rank = node.first_rank + slot.local_rank;
  set("RANK", rank);
  set("LOCAL_RANK", slot.local_rank);
  set("WORLD_SIZE", node.world_size);
  set("LOCAL_WORLD_SIZE", options.nproc_per_node);
  // One role ("default") and one group per node, as torchrun's rendezvous; an elastic job's
  // groups are the round's members.
  set("GROUP_RANK", node.node_rank);
  set("GROUP_WORLD_SIZE", node.nnodes);
  set("ROLE_NAME", "default");
  set("ROLE_RANK", rank);
  set("ROLE_WORLD_SIZE", node.world_size);
  set("MASTER_ADDR", options.master_addr);
  set("MASTER_PORT", slot.master_port);
  set("TORCHELASTIC_RESTART_COUNT", slot.restart_count);
  set("TORCHELASTIC_MAX_RESTARTS", options.max_restarts);
  set("TORCHELASTIC_RUN_ID", options.run_id);
  // ddprun hosts no store: global rank 0 must start the server itself (PyTorch reads this too).
  set("TORCHELASTIC_USE_AGENT_STORE", "False");
  set("DDP_RESTART_COUNT", slot.restart_count);
  if (!options.secret_file.empty()) {
    // The path, not the secret: a worker's environment is readable in /proc by its user, and the
    // secret stays in the one file the operator protected. The flag wins over the shell's
    // DDP_SECRET, like every other flag over inherited variables.
    env.erase("DDP_SECRET");
    set("DDP_SECRET_FILE", options.secret_file);
  }
  if (!slot.dump_dir.empty() && !env.contains("DDP_DUMP_DIR")) {
    // The flight recorder dumps next to the logs of the same attempt (docs/ddprun.md).
    set("DDP_DUMP_DIR", slot.dump_dir);
  }
  if (env.find("OMP_NUM_THREADS") == env.end()) {
    set("OMP_NUM_THREADS", std::max(1, slot.cpu_count / std::max(1, options.nproc_per_node)));
  }
}

std::vector<std::string> to_envp_strings(const Environment& env) {
  std::vector<std::string> strings;
  strings.reserve(env.size());
  for (const auto& [key, value] : env)
    strings.push_back(key + "=" + value);
  return strings;
}

}  // namespace ddp::ddprun
