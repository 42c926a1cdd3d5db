#include "ddprun/launch_options.h"

#include "ddp/job_secret.h"

#include <sched.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>
#include <CLI/CLI.hpp>
#include <cmath>
#include <filesystem>
#include <ostream>
#include <string_view>
#include <thread>

namespace ddp::ddprun {
namespace {

// CLI11 checks run on the text before conversion, so the message can quote what the user wrote.
CLI::Validator whole_number(long min, long max) {
  return CLI::Validator(
      [min, max](std::string& text) -> std::string {
        long value = 0;
        std::size_t used = 0;
        try {
          value = std::stol(text, &used);
        } catch (const std::exception&) {
          used = 0;
        }
        if (used == 0 || used != text.size()) {
          return fmt::format("expected a whole number, got '{}'", text);
        }
        if (value < min || value > max) {
          return fmt::format("{} is out of range, expected {} to {}", value, min, max);
        }
        return {};
      },
      fmt::format("INT in [{}, {}]", min, max));
}

int parse_nproc(const std::string& text) {
  // torchrun also accepts "cpu"/"auto" (one worker per CPU); "gpu" has no meaning here.
  if (text == "cpu" || text == "auto") return usable_cpu_count();
  std::size_t used = 0;
  long value = 0;
  try {
    value = std::stol(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || used != text.size() || value < 1 || value > 4096) {
    throw UsageError(fmt::format(
        "--nproc-per-node: expected a whole number from 1 to 4096, 'cpu' or 'auto', got '{}'",
        text));
  }
  return static_cast<int>(value);
}

constexpr std::string_view kFooter = R"(
Workers get torchrun's environment: RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, GROUP_RANK, GROUP_WORLD_SIZE, ROLE_RANK, ROLE_WORLD_SIZE, ROLE_NAME,
MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RESTART_COUNT, TORCHELASTIC_MAX_RESTARTS,
TORCHELASTIC_RUN_ID, TORCHELASTIC_USE_AGENT_STORE=False, DDP_RESTART_COUNT, and
OMP_NUM_THREADS (CPUs / local workers) unless it is already set; with --secret-file,
DDP_SECRET_FILE (its absolute path; an inherited DDP_SECRET is removed). Unless --no-env-tuning,
they also get GLIBC_TUNABLES (malloc keeps freed memory) and, when OpenBLAS does not know
this CPU, OPENBLAS_CORETYPE, each only where not already set (docs/ddprun.md).
Output lines are prefixed with the global rank: "[3] text".
If a worker fails, the others are stopped and ddprun exits with 1 (after --max-restarts
restarts of the whole local group). Bad options exit with 2; a SIGINT/SIGTERM/SIGHUP to
ddprun is forwarded to the workers and ddprun exits with 128+signal.

Examples:
  ddprun --nproc-per-node 4 ./train --epochs 3
  ddprun --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --nproc-per-node 8 ./train
  ddprun --standalone --nproc-per-node 2 python3 train.py)";

}  // namespace

int usable_cpu_count() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (::sched_getaffinity(0, sizeof set, &set) == 0) {
    const int count = CPU_COUNT(&set);
    if (count > 0) return count;
  }
  const unsigned hardware = std::thread::hardware_concurrency();
  return hardware > 0 ? static_cast<int>(hardware) : 1;
}

std::string resolve_program(const std::string& program, const char* path_env) {
  const auto executable_file = [](const std::string& path) {
    struct stat st {};
    return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode) &&
           ::access(path.c_str(), X_OK) == 0;
  };
  if (program.empty()) throw UsageError("PROGRAM is empty");
  if (program.find('/') != std::string::npos) {
    struct stat st {};
    if (::stat(program.c_str(), &st) != 0) {
      throw UsageError(fmt::format("program '{}' does not exist", program));
    }
    if (!executable_file(program)) {
      throw UsageError(fmt::format(
          "program '{}' is not an executable file (check its permissions, or run it through its "
          "interpreter, e.g. 'ddprun python3 {}')",
          program, program));
    }
    return program;
  }
  // Same search as execvp: empty PATH entries mean the current directory.
  const std::string path = path_env != nullptr ? path_env : "/usr/local/bin:/usr/bin:/bin";
  std::size_t begin = 0;
  for (;;) {
    const std::size_t end = path.find(':', begin);
    std::string dir =
        path.substr(begin, end == std::string::npos ? std::string::npos : end - begin);
    if (dir.empty()) dir = ".";
    const std::string candidate = dir + "/" + program;
    if (executable_file(candidate)) return candidate;
    if (end == std::string::npos) break;
    begin = end + 1;
  }
  throw UsageError(fmt::format(
      "program '{}' was not found on PATH (give a path such as './{}' for a program in the "
      "current directory)",
      program, program));
}

std::optional<LaunchOptions> parse_command_line(const std::vector<std::string>& args,
                                                std::ostream& help_out) {
  LaunchOptions options;
  std::string nproc_text = "1";
  double grace_seconds = 5.0;

  CLI::App app{
      "ddprun: starts the local workers of a data-parallel job (like torchrun).\n"
      "Every worker runs PROGRAM [ARGS...]; everything from PROGRAM on is passed untouched.",
      "ddprun"};
  app.footer(std::string(kFooter));
  app.prefix_command();  // the first word that is not an option is PROGRAM; the rest is its own
  app.add_option("--nproc-per-node,--nproc_per_node", nproc_text,
                 "Workers on this node: a number, or 'cpu'/'auto' for one per CPU (default 1)");
  app.add_option("--nnodes", options.nnodes, "Number of nodes (default 1)")
      ->check(whole_number(1, 1 << 20));
  app.add_option("--node-rank,--node_rank", options.node_rank,
                 "This node's index, 0 to nnodes-1 (default 0)")
      ->check(whole_number(0, 1 << 20));
  app.add_option("--master-addr,--master_addr", options.master_addr,
                 "Host of global rank 0, which hosts the rendezvous store (default 127.0.0.1)");
  app.add_option("--master-port,--master_port", options.master_port,
                 "Port of the rendezvous store on the master; 0 picks a free one (default 29500)")
      ->check(whole_number(0, 65535));
  app.add_flag("--standalone", options.standalone,
               "Single-node job on a free local port (implies --nnodes 1 --master-port 0)");
  bool no_env_tuning = false;
  app.add_flag("--no-env-tuning", no_env_tuning,
               "Do not add GLIBC_TUNABLES (malloc keeps freed memory) and OPENBLAS_CORETYPE (when "
               "OpenBLAS does not know this CPU) to the workers' environment");
  bool no_prefix = false;
  app.add_flag("--no-prefix,--no_prefix", no_prefix,
               "Pass the workers' output through exactly as written, without the '[rank] ' in "
               "front of each line (lines stay whole); for machine-readable output");
  bool no_python = false;
  app.add_flag("--no-python,--no_python", no_python,
               "Accepted for torchrun compatibility; ddprun always runs PROGRAM directly (a "
               "Python script needs its interpreter: 'ddprun python3 train.py')");
  app.add_option("--secret-file,--secret_file", options.secret_file,
                 "File holding the job's secret (not readable by other users): turns on "
                 "authentication of the store and of every connection between workers; the "
                 "workers get its path as DDP_SECRET_FILE, never the secret itself");
  app.add_option("--max-restarts,--max_restarts", options.max_restarts,
                 "Restart the whole local group up to this many times after a failure (default 0)")
      ->check(whole_number(0, 1000000));
  app.add_option("--grace-period,--grace_period", grace_seconds,
                 "Seconds between asking workers to stop and killing them (default 5)")
      ->check(CLI::Validator(
          [](std::string& text) -> std::string {
            std::size_t used = 0;
            double value = -1;
            try {
              value = std::stod(text, &used);
            } catch (const std::exception&) {
              used = 0;
            }
            if (used == 0 || used != text.size() || !std::isfinite(value) || value < 0 ||
                value > 86400) {
              return fmt::format("expected seconds from 0 to 86400, got '{}'", text);
            }
            return {};
          },
          "SECONDS"));

  // CLI11 wants argv order reversed in a vector; parse(vector) does that for us.
  std::vector<std::string> reversed(args.rbegin(), args.rend());
  try {
    app.parse(reversed);
  } catch (const CLI::CallForHelp&) {
    help_out << app.help();
    return std::nullopt;
  } catch (const CLI::ParseError& e) {
    throw UsageError(e.what());
  }

  std::vector<std::string> command = app.remaining();
  if (!command.empty() && command.front() == "--") command.erase(command.begin());
  if (command.empty()) {
    throw UsageError(
        "missing PROGRAM: say which program the workers run, e.g. 'ddprun "
        "--nproc-per-node 2 ./train'");
  }
  if (command.front().size() > 1 && command.front()[0] == '-') {
    throw UsageError(
        fmt::format("unknown option '{}' (put '--' before PROGRAM if its name starts with '-')",
                    command.front()));
  }

  options.nproc_per_node = parse_nproc(nproc_text);
  options.grace_period = std::chrono::milliseconds(std::llround(grace_seconds * 1000.0));
  if (options.standalone) {
    if (options.nnodes != 1) {
      throw UsageError(
          fmt::format("--standalone runs on one node, but --nnodes is {}", options.nnodes));
    }
    options.master_port = 0;
  }
  if (options.node_rank >= options.nnodes) {
    throw UsageError(fmt::format("--node-rank {} must be less than --nnodes {}", options.node_rank,
                                 options.nnodes));
  }
  if (options.master_port == 0 && options.nnodes > 1) {
    throw UsageError(
        "--master-port 0 (pick a free port) works only with --nnodes 1: every node must be "
        "given the same port");
  }
  if (options.master_addr.empty()) throw UsageError("--master-addr is empty");
  if (static_cast<long>(options.nnodes) * options.nproc_per_node > (1L << 24)) {
    throw UsageError(fmt::format("--nnodes {} x --nproc-per-node {} is too many workers",
                                 options.nnodes, options.nproc_per_node));
  }

  if (!options.secret_file.empty()) {
    // Checked now, so that a bad file is a usage error before any worker starts; the workers
    // read it again, so it must be a file (not a pipe that only one reader can empty).
    try {
      read_secret_file(options.secret_file, "--secret-file");
    } catch (const ConfigError& e) {
      throw UsageError(e.what());
    }
    std::error_code ec;
    if (!std::filesystem::is_regular_file(options.secret_file, ec)) {
      throw UsageError(fmt::format(
          "--secret-file: '{}' is not a regular file; every worker reads it, so give a file "
          "(not a pipe or device)",
          options.secret_file));
    }
    options.secret_file = std::filesystem::absolute(options.secret_file).string();
  }

  options.program = command.front();
  options.program_path = resolve_program(options.program, std::getenv("PATH"));
  options.args.assign(command.begin() + 1, command.end());
  options.env_tuning = !no_env_tuning;
  options.prefix_output = !no_prefix;
  return options;
}

}  // namespace ddp::ddprun
