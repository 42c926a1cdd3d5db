#include "ddprun/launch_options.h"

#include "ddp/launch/job_secret.h"
#include "ddp/launch/rendezvous.h"

#include <sched.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>
#include <CLI/CLI.hpp>
#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <filesystem>
#include <ostream>
#include <string_view>
#include <thread>
#include <tuple>

namespace ddp::ddprun {
namespace {

bool all_digits(std::string_view text) {
  return !text.empty() &&
         std::all_of(text.begin(), text.end(), [](char c) { return c >= '0' && c <= '9'; });
}

bool has_space_around(std::string_view text) {
  return !text.empty() && (std::isspace(static_cast<unsigned char>(text.front())) ||
                           std::isspace(static_cast<unsigned char>(text.back())));
}

// A value with whitespace around it is a quoting slip (' 2', 'host '), not what was meant: refused
// by name, with the value as written, rather than trimmed by one parser and kept by another.
void refuse_space_around(std::string_view option, std::string_view text) {
  if (has_space_around(text)) {
    throw UsageError(fmt::format("{}: '{}' has whitespace before or after it; give the value alone",
                                 option, text));
  }
}

// Options are parsed from text here, never converted by CLI11, whose integers take C's prefixes
// ("010" is 8, "0x10" is 16) and leading whitespace. Digits only: no sign, no spaces, no prefix;
// a number too large for a long is out of range like any other.
long parse_whole_number(std::string_view option, std::string_view text, long min, long max) {
  refuse_space_around(option, text);
  if (!all_digits(text)) {
    throw UsageError(
        fmt::format("{}: expected a whole number from {} to {}, got '{}'", option, min, max, text));
  }
  long value = 0;
  const auto result = std::from_chars(text.data(), text.data() + text.size(), value);
  if (result.ec == std::errc::result_out_of_range || value < min || value > max) {
    throw UsageError(
        fmt::format("{}: {} is out of range, expected {} to {}", option, text, min, max));
  }
  return value;
}

// Seconds as a plain decimal number from 0 to `max` ("5", "0.5", "2."): no sign, exponent, hex,
// "inf" or spaces.
double parse_seconds(std::string_view option, std::string_view text, double max) {
  refuse_space_around(option, text);
  const std::size_t point = text.find('.');
  const std::string_view whole = text.substr(0, point);
  const std::string_view fraction =
      point == std::string_view::npos ? std::string_view() : text.substr(point + 1);
  const bool plain =
      all_digits(whole) && whole.size() <= 12 && (fraction.empty() || all_digits(fraction));
  const double value = plain ? std::stod(std::string(text)) : -1;
  if (!plain || value > max) {
    throw UsageError(fmt::format("{}: expected seconds from 0 to {}, got '{}'", option, max, text));
  }
  return value;
}

// An option given with an empty value ("--log-dir ''", "--log-dir="): refused by name rather
// than taken as not given.
void refuse_empty(const CLI::Option* option, std::string_view value, std::string_view what) {
  if (option->count() > 0 && value.empty()) {
    throw UsageError(fmt::format("{} is empty: {}", option->get_name(), what));
  }
}

int parse_nproc(const std::string& text) {
  // torchrun also accepts "cpu"/"auto" (one worker per CPU); "gpu" has no meaning here.
  if (text == "cpu" || text == "auto") return usable_cpu_count();
  refuse_space_around("--nproc-per-node", text);
  try {
    return static_cast<int>(parse_whole_number("--nproc-per-node", text, 1, 4096));
  } catch (const UsageError&) {
    throw UsageError(fmt::format(
        "--nproc-per-node: expected a whole number from 1 to 4096, 'cpu' or 'auto', got '{}'",
        text));
  }
}

constexpr std::string_view kFooter =
    R"(Workers get torchrun's environment: RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK,
GROUP_WORLD_SIZE, ROLE_RANK, ROLE_WORLD_SIZE, ROLE_NAME, MASTER_ADDR, MASTER_PORT,
TORCHELASTIC_RESTART_COUNT, TORCHELASTIC_MAX_RESTARTS, TORCHELASTIC_RUN_ID,
TORCHELASTIC_USE_AGENT_STORE=False, DDP_RESTART_COUNT, and OMP_NUM_THREADS (CPUs / local
workers) unless it is already set; with --secret-file, DDP_SECRET_FILE (an inherited DDP_SECRET
is removed); with --log-dir, DDP_DUMP_DIR (the attempt's folder) unless it is already set.
Unless --no-env-tuning, they also get GLIBC_TUNABLES and, when OpenBLAS does not know this CPU,
OPENBLAS_CORETYPE, each only where not already set (docs/ddprun.md).

Output lines are prefixed with the global rank, "[3] text", unless --no-prefix. With --log-dir
DIR, each worker's output is also written to DIR/<run-id>/attempt_<k>/<rank>/{stdout,stderr}.log.
If a worker fails, the others are stopped and ddprun exits with 1 (after --max-restarts
restarts of the whole job: with --nnodes > 1 every node restarts together, through node 0's
ddprun on --agent-port). With --nnodes MIN:MAX, nodes may leave (a failed round) and join (a
round that costs no restart) between rounds; the job ends below MIN nodes or without node 0.
Bad options exit with 2; a SIGINT/SIGTERM/SIGHUP to ddprun is forwarded to the workers and
ddprun exits with 128+signal.

Examples:
  ddprun --nproc-per-node 4 ./train --epochs 3
  ddprun --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --nproc-per-node 8 ./train
  ddprun --nnodes 1:4 --node-rank 0 --master-addr 10.0.0.1 ./train  (elastic; the others
      run the same without --node-rank)
  ddprun --standalone --nproc-per-node 2 python3 train.py
  ddprun --no-prefix --nproc-per-node 2 ddp-bench --json | python3 -c 'import json, sys; ...'
  ddprun --log-dir logs --redirects 3 --local-ranks-filter 0 --nproc-per-node 4 ./train)";

// ddprun's help: the usage line names PROGRAM [ARGS...] (CLI11 2.1 cannot be told otherwise),
// and descriptions are wrapped to the terminal's usual width.
class HelpFormatter : public CLI::Formatter {
 public:
  static constexpr std::size_t kColumn = 32;
  static constexpr std::size_t kWidth = 100;

  HelpFormatter() { column_width(kColumn); }

  std::string make_usage(const CLI::App* app, std::string name) const override {
    return fmt::format("Usage: {} [OPTIONS] PROGRAM [ARGS...]\n\n{}\n\n", name,
                       app->get_description());
  }
  std::string make_description(const CLI::App*) const override { return {}; }  // in the usage

  // One blank line between groups (CLI11 2.1 puts two).
  std::string make_group(std::string group, bool is_positional,
                         std::vector<const CLI::Option*> opts) const override {
    std::string out = group + ":\n";
    for (const CLI::Option* option : opts)
      out += make_option(option, is_positional);
    return out;
  }

  std::string make_option_desc(const CLI::Option* option) const override {
    // Word-wrapped; format_help indents each continuation line to the column.
    const std::string& text = option->get_description();
    std::string out;
    std::size_t line_length = 0;
    std::size_t begin = 0;
    while (begin < text.size()) {
      std::size_t end = text.find(' ', begin);
      if (end == std::string::npos) end = text.size();
      const std::string_view word(text.data() + begin, end - begin);
      if (line_length > 0 && line_length + 1 + word.size() > kWidth - kColumn) {
        out += '\n';
        line_length = 0;
      } else if (line_length > 0) {
        out += ' ';
        ++line_length;
      }
      out += word;
      line_length += word.size();
      begin = end + 1;
    }
    return out;
  }
};

// torchrun's --rdzv-endpoint: HOST, HOST:PORT or [IPv6]:PORT; torchrun's default port is 29400.
std::pair<std::string, int> parse_endpoint(const std::string& text) {
  const auto bad = [&](std::string_view why) {
    return UsageError(fmt::format(
        "--rdzv-endpoint: '{}' {}; expected HOST or HOST:PORT (e.g. 10.0.0.1:29400, [::1]:29400)",
        text, why));
  };
  refuse_space_around("--rdzv-endpoint", text);
  std::string host = text;
  std::string port_text;
  if (text.starts_with('[')) {
    const std::size_t close = text.find(']');
    if (close == std::string::npos) throw bad("has no ']' after the IPv6 address");
    host = text.substr(1, close - 1);
    if (close + 1 < text.size()) {
      if (text[close + 1] != ':') throw bad("has something other than ':PORT' after ']'");
      port_text = text.substr(close + 2);
      if (port_text.empty()) throw bad("has no port after ':'");
    }
  } else if (const std::size_t colon = text.rfind(':'); colon != std::string::npos) {
    if (text.find(':') != colon) throw bad("has several ':' (put an IPv6 address in [ ])");
    host = text.substr(0, colon);
    port_text = text.substr(colon + 1);
    if (port_text.empty()) throw bad("has no port after ':'");
  }
  if (host.empty()) throw bad("names no host");
  int port = 29400;
  if (!port_text.empty()) {
    long value = -1;
    if (all_digits(port_text) && port_text.size() <= 5) value = std::stol(port_text);
    if (value < 0 || value > 65535) {
      throw bad(fmt::format("has port '{}', not a number from 0 to 65535", port_text));
    }
    port = static_cast<int>(value);
  }
  return {host, port};
}

// --nnodes: N (MIN = MAX = N) or torchrun's MIN:MAX (elastic membership, docs/ddprun.md).
std::pair<int, int> parse_nnodes(const std::string& text) {
  refuse_space_around("--nnodes", text);
  const auto number = [&](const std::string& part) {
    if (!all_digits(part)) {
      throw UsageError(fmt::format(
          "--nnodes: expected N or MIN:MAX with whole numbers (e.g. 2, or 1:4 for an elastic job "
          "of 1 to 4 nodes), got '{}'",
          text));
    }
    long value = -1;
    const auto result = std::from_chars(part.data(), part.data() + part.size(), value);
    if (result.ec == std::errc::result_out_of_range || value < 1 || value > (1 << 20)) {
      throw UsageError(
          fmt::format("--nnodes {}: {} is out of range, every node count must be from 1 to {}",
                      text, part, 1 << 20));
    }
    return static_cast<int>(value);
  };
  const std::size_t colon = text.find(':');
  if (colon == std::string::npos) {
    const int n = number(text);
    return {n, n};
  }
  const int min = number(text.substr(0, colon));
  const int max = number(text.substr(colon + 1));
  if (min > max) {
    throw UsageError(fmt::format(
        "--nnodes {}: MIN {} is more than MAX {}; write MIN:MAX with MIN <= MAX", text, min, max));
  }
  return {min, max};
}

void check_run_id(const std::string& id) {
  // It names a folder under --log-dir, so it must be one plain path component.
  const bool plain =
      !id.empty() && id.size() <= 128 && id != "." && id != ".." &&
      std::all_of(id.begin(), id.end(), [](char c) {
        return std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.';
      });
  if (!plain) {
    throw UsageError(fmt::format(
        "--rdzv-id: '{}' is not a usable run id; use 1 to 128 letters, digits, '-', '_' or '.' "
        "(it names the run's folder under --log-dir)",
        id));
  }
}

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
  // Numbers are bound as text and parsed after (parse_whole_number, parse_seconds).
  std::string nproc_text = "1";
  std::string node_rank_text = "0";
  std::string master_port_text = "29500";
  std::string last_call_text = "3";
  std::string max_restarts_text = "0";
  std::string agent_port_text = "0";
  std::string grace_text = "5";

  CLI::App app{
      "ddprun: starts the local workers of a data-parallel job (like torchrun).\n"
      "Every worker runs PROGRAM [ARGS...]; everything from PROGRAM on is passed untouched.",
      "ddprun"};
  app.formatter(std::make_shared<HelpFormatter>());
  app.footer(std::string(kFooter));
  app.prefix_command();  // the first word that is not an option is PROGRAM; the rest is its own
  app.set_help_flag();   // added again at the end, so that the groups come first

  constexpr const char* kJobSize = "Job size";
  app.add_option("--nproc-per-node,--nproc_per_node", nproc_text,
                 "Workers on this node: a number, or 'cpu'/'auto' for one per CPU (default 1)")
      ->type_name("N")
      ->group(kJobSize);
  std::string nnodes_text = "1";
  app.add_option("--nnodes", nnodes_text,
                 "Number of nodes (default 1), or MIN:MAX for an elastic job: each round runs "
                 "with the nodes that are there, at least MIN and at most MAX")
      ->type_name("N|MIN:MAX")
      ->group(kJobSize);
  auto* node_rank =
      app.add_option("--node-rank,--node_rank", node_rank_text,
                     "This node's index, 0 to nnodes-1 (default 0); with --nnodes MIN:MAX, "
                     "give --node-rank 0 to the node on --master-addr (it serves the "
                     "rendezvous) and none to the others (their ranks are assigned per round)")
          ->type_name("R")
          ->group(kJobSize);

  constexpr const char* kRendezvous = "Rendezvous";
  auto* master_addr =
      app.add_option("--master-addr,--master_addr", options.master_addr,
                     "Host of global rank 0, which hosts the rendezvous store (default 127.0.0.1)")
          ->type_name("HOST")
          ->group(kRendezvous);
  auto* master_port =
      app.add_option("--master-port,--master_port", master_port_text,
                     "Port of the rendezvous store on the master; 0 picks a free one (default "
                     "29500)")
          ->type_name("PORT")
          ->group(kRendezvous);
  app.add_flag("--standalone", options.standalone,
               "Single-node job on a free local port (implies --nnodes 1 --master-port 0)")
      ->group(kRendezvous);
  std::string rdzv_backend;
  auto* rdzv_backend_option =
      app.add_option("--rdzv-backend,--rdzv_backend", rdzv_backend,
                     "torchrun's rendezvous backend: 'c10d' or 'static' (both mean ddp's store on "
                     "global rank 0; others are not supported)")
          ->type_name("NAME")
          ->group(kRendezvous);
  std::string rdzv_endpoint;
  auto* rdzv_endpoint_option =
      app.add_option("--rdzv-endpoint,--rdzv_endpoint", rdzv_endpoint,
                     "HOST[:PORT] of the rendezvous store, as --master-addr and "
                     "--master-port (port default 29400, torchrun's)")
          ->type_name("HOST:PORT")
          ->group(kRendezvous);
  app.add_option("--rdzv-last-call,--rdzv_last_call", last_call_text,
                 "With --nnodes MIN:MAX: a round closes this many seconds after its last "
                 "newcomer once MIN nodes are in (at once with MAX); torchrun's "
                 "last_call_timeout (default 3)")
      ->type_name("SECONDS")
      ->group(kRendezvous);
  app.add_option("--rdzv-id,--rdzv_id", options.run_id,
                 "The job's run id: TORCHELASTIC_RUN_ID and the folder under --log-dir (default "
                 "'none')")
      ->type_name("ID")
      ->group(kRendezvous);
  auto* secret_file_option =
      app.add_option("--secret-file,--secret_file", options.secret_file,
                     "File holding the job's secret (not readable by other users): turns on "
                     "authentication of the store and of every connection between workers; the "
                     "workers get its path as DDP_SECRET_FILE, never the secret itself")
          ->type_name("PATH")
          ->group(kRendezvous);

  constexpr const char* kRestarts = "Failures and restarts";
  app.add_option("--max-restarts,--max_restarts", max_restarts_text,
                 "Restart the whole job (every node, together) up to this many times after a "
                 "worker fails (default 0)")
      ->type_name("K")
      ->group(kRestarts);
  auto* agent_port =
      app.add_option("--agent-port,--agent_port", agent_port_text,
                     "With --nnodes > 1 and --max-restarts: port on --master-addr where node 0's "
                     "ddprun serves the restart rounds to the other nodes' ddprun (default: "
                     "--master-port + 1)")
          ->type_name("PORT")
          ->group(kRestarts);
  app.add_option("--agent-listen-addr,--agent_listen_addr", options.agent_listen_addr,
                 "Address node 0's ddprun serves the restart rounds on (default: "
                 "DDP_STORE_LISTEN_ADDR when set, else --master-addr's interface only, as the "
                 "workers' store; 0.0.0.0 = every IPv4 address, :: = every address)")
      ->type_name("ADDR")
      ->group(kRestarts);
  app.add_option("--grace-period,--grace_period", grace_text,
                 "Seconds between asking workers to stop and killing them (default 5)")
      ->type_name("SECONDS")
      ->group(kRestarts);

  constexpr const char* kOutput = "Output";
  bool no_prefix = false;
  app.add_flag("--no-prefix,--no_prefix", no_prefix,
               "Pass the workers' output through exactly as written, without the '[rank] ' in "
               "front of each line (lines stay whole); for machine-readable output")
      ->group(kOutput);
  std::string log_dir;
  auto* log_dir_option =
      app.add_option("--log-dir,--log_dir", log_dir,
                     "Also write each worker's stdout and stderr to "
                     "DIR/<run-id>/attempt_<k>/<rank>/{stdout,stderr}.log, and give the workers "
                     "DDP_DUMP_DIR=DIR/<run-id>/attempt_<k> unless it is set")
          ->type_name("DIR")
          ->group(kOutput);
  OutputRoutingText routing_text;
  auto* redirects =
      app.add_option(
             "-r,--redirects", routing_text.redirects,
             "Streams sent to the --log-dir files only, not the console: 0 none, 1 stdout, 2 "
             "stderr, 3 both; or LOCAL_RANK:VALUE pairs, e.g. 0:1,1:3 (default 0)")
          ->type_name("STREAMS")
          ->group(kOutput);
  auto* tee =
      app.add_option(
             "-t,--tee", routing_text.tee,
             "Streams written to both the console and the --log-dir files (the files always "
             "get every stream; this undoes --redirects), same values as --redirects")
          ->type_name("STREAMS")
          ->group(kOutput);
  auto* ranks_filter =
      app.add_option(
             "--local-ranks-filter,--local_ranks_filter", routing_text.local_ranks_filter,
             "Only these local ranks' output reaches the console, e.g. 0,2 (files keep all)")
          ->type_name("RANKS")
          ->group(kOutput);

  constexpr const char* kWorkers = "Workers";
  bool no_env_tuning = false;
  app.add_flag("--no-env-tuning", no_env_tuning,
               "Do not add GLIBC_TUNABLES (malloc keeps freed memory) and OPENBLAS_CORETYPE (when "
               "OpenBLAS does not know this CPU) to the workers' environment")
      ->group(kWorkers);
  bool no_python = false;
  app.add_flag("--no-python,--no_python", no_python,
               "Accepted for torchrun compatibility; ddprun always runs PROGRAM directly (a "
               "Python script needs its interpreter: 'ddprun python3 train.py')")
      ->group(kWorkers);
  app.set_help_flag("-h,--help", "Print this help and exit")->group(kWorkers);

  // CLI11 takes "--log-dir=" (nothing after '=') as "--log-dir" with the next argument as its
  // value, so that PROGRAM, or the next option, silently became the value. Refused here, among
  // ddprun's own arguments (up to PROGRAM or "--"; those after are PROGRAM's own).
  for (std::size_t i = 0; i < args.size(); ++i) {
    const std::string& arg = args[i];
    if (arg == "--" || arg.size() < 2 || arg[0] != '-') break;
    const std::size_t equals = arg.find('=');
    const CLI::Option* option = app.get_option_no_throw(arg.substr(0, equals));
    if (option == nullptr) continue;  // CLI11 names an unknown option
    if (equals == std::string::npos) {
      if (option->get_items_expected_min() > 0) ++i;  // its value
    } else if (equals + 1 == arg.size()) {
      throw UsageError(fmt::format("{} is empty: give a value after '=', or leave {} out",
                                   option->get_name(), option->get_name()));
    }
  }

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

  // Given but empty: refused by name (each was taken as not given, silently).
  refuse_empty(log_dir_option, log_dir,
               "give the folder for the workers' output files, or leave --log-dir out");
  refuse_empty(secret_file_option, options.secret_file,
               "give the path of the file holding the job's secret, or leave --secret-file out");
  refuse_empty(rdzv_backend_option, rdzv_backend, "give c10d or static, or leave it out");
  refuse_empty(rdzv_endpoint_option, rdzv_endpoint, "give HOST or HOST:PORT, or leave it out");
  refuse_empty(redirects, routing_text.redirects,
               "give 0, 1, 2 or 3, or LOCAL_RANK:VALUE pairs, or leave it out");
  refuse_empty(tee, routing_text.tee,
               "give 0, 1, 2 or 3, or LOCAL_RANK:VALUE pairs, or leave it out");
  refuse_empty(ranks_filter, routing_text.local_ranks_filter,
               "give the local ranks to show (e.g. 0,2), or leave it out");
  // Names and numbers with whitespace around them (paths may have it: a folder can be called so).
  refuse_space_around("--master-addr", options.master_addr);
  refuse_space_around("--rdzv-backend", rdzv_backend);
  if (options.agent_listen_addr) {
    refuse_space_around("--agent-listen-addr", *options.agent_listen_addr);
  }

  options.nproc_per_node = parse_nproc(nproc_text);
  std::tie(options.min_nnodes, options.nnodes) = parse_nnodes(nnodes_text);
  options.node_rank =
      static_cast<int>(parse_whole_number("--node-rank", node_rank_text, 0, 1 << 20));
  options.master_port =
      static_cast<int>(parse_whole_number("--master-port", master_port_text, 0, 65535));
  options.max_restarts =
      static_cast<int>(parse_whole_number("--max-restarts", max_restarts_text, 0, 1000000));
  if (agent_port->count() > 0) {
    options.agent_port =
        static_cast<int>(parse_whole_number("--agent-port", agent_port_text, 1, 65535));
  }
  options.rdzv_last_call = std::chrono::milliseconds(
      std::llround(parse_seconds("--rdzv-last-call", last_call_text, 3600) * 1000.0));
  options.grace_period = std::chrono::milliseconds(
      std::llround(parse_seconds("--grace-period", grace_text, 86400) * 1000.0));
  if (!rdzv_backend.empty() && rdzv_backend != "c10d" && rdzv_backend != "static") {
    throw UsageError(
        fmt::format("--rdzv-backend '{}' is not supported: ddprun's rendezvous is ddp's store on "
                    "global rank 0, "
                    "which --rdzv-backend c10d or static (or no --rdzv-backend) selects, with "
                    "--rdzv-endpoint HOST:PORT",
                    rdzv_backend));
  }
  if (!rdzv_endpoint.empty()) {
    if (master_addr->count() > 0 || master_port->count() > 0) {
      throw UsageError(
          "--rdzv-endpoint and --master-addr/--master-port both say where the rendezvous store "
          "is; give one of them");
    }
    if (options.standalone) {
      throw UsageError("--standalone picks a free local port itself; drop --rdzv-endpoint");
    }
    std::tie(options.master_addr, options.master_port) = parse_endpoint(rdzv_endpoint);
  }
  check_run_id(options.run_id);
  if (options.standalone) {
    if (options.nnodes != 1) {
      throw UsageError(
          fmt::format("--standalone runs on one node, but --nnodes is {}", nnodes_text));
    }
    options.master_port = 0;
  }
  if (options.elastic()) {
    // Ranks are assigned per round; the only fixed role is the agent that serves the rendezvous.
    if (node_rank->count() > 0 && options.node_rank != 0) {
      throw UsageError(fmt::format(
          "--node-rank {} cannot be honoured with --nnodes {}: an elastic job assigns node ranks "
          "per round (the nodes that are there, in the order they came); give --node-rank 0 to "
          "the node on --master-addr, which serves the rendezvous, and no --node-rank to the "
          "others",
          options.node_rank, nnodes_text));
    }
    if (node_rank->count() == 0) options.node_rank = -1;
  } else if (options.node_rank >= options.nnodes) {
    throw UsageError(fmt::format("--node-rank {} must be less than --nnodes {}", options.node_rank,
                                 options.nnodes));
  }
  if (options.master_port == 0 && options.nnodes > 1) {
    throw UsageError(fmt::format(
        "{} 0 (pick a free port) works only with --nnodes 1: every node must be given the same "
        "port",
        rdzv_endpoint.empty() ? "--master-port" : "--rdzv-endpoint port"));
  }
  if (options.master_addr.empty()) throw UsageError("--master-addr is empty");
  if (options.agent_listen_addr && options.agent_listen_addr->empty()) {
    throw UsageError(
        "--agent-listen-addr is empty: give an address of this host (e.g. 0.0.0.0 for every IPv4 "
        "address), or leave it out to listen on --master-addr's interface");
  }
  if (options.agent_port == 0 && options.nnodes > 1) {
    if (options.master_port >= 65535) {
      throw UsageError(
          "--master-port 65535 leaves no port for the restart rounds; give "
          "--agent-port");
    }
    options.agent_port = options.master_port + 1;
  }
  if (options.agent_port != 0 && options.agent_port == options.master_port) {
    throw UsageError(fmt::format(
        "--agent-port {} is --master-port too: the workers' store and the restart rounds need "
        "two ports",
        options.agent_port));
  }
  if (static_cast<long>(options.nnodes) * options.nproc_per_node > (1L << 24)) {
    throw UsageError(fmt::format("--nnodes {} x --nproc-per-node {} is too many workers",
                                 options.nnodes, options.nproc_per_node));
  }

  if (!options.secret_file.empty()) {
    // Checked now, so that a bad file is a usage error before any worker starts; the workers
    // read it again, so it must be a regular file (read_secret_file refuses a pipe or a device,
    // without waiting on it).
    try {
      read_secret_file(options.secret_file, "--secret-file");
    } catch (const ConfigError& e) {
      throw UsageError(e.what());
    }
    options.secret_file = std::filesystem::absolute(options.secret_file).string();
  } else {
    // An inherited DDP_SECRET / DDP_SECRET_FILE reaches every worker: a bad one is named once,
    // here, rather than by every worker (or by the restart rounds) later.
    try {
      resolve_job_secret(std::nullopt);
    } catch (const ConfigError& e) {
      throw UsageError(e.what());
    }
  }

  try {
    // The library's parser, so that ddprun and its workers accept the same values.
    options.timeout = resolve_timeout(std::nullopt);
  } catch (const ConfigError& e) {
    throw UsageError(e.what());
  }

  options.program = command.front();
  options.program_path = resolve_program(options.program, std::getenv("PATH"));
  options.args.assign(command.begin() + 1, command.end());
  options.env_tuning = !no_env_tuning;
  options.prefix_output = !no_prefix;
  options.output = parse_output_routing(routing_text, options.nproc_per_node);
  if (log_dir.empty() && options.output.wants_files()) {
    throw UsageError(
        "--redirects and --tee write the workers' output to files: give --log-dir DIR too");
  }
  if (!log_dir.empty()) {
    // Checked now, so that an unusable folder is a usage error before any worker starts.
    try {
      options.log_dir = LogDir(log_dir, options.run_id);
      options.log_dir.check_writable();
    } catch (const ConfigError& e) {
      throw UsageError(e.what());
    }
  }
  return options;
}

}  // namespace ddp::ddprun
