#include "ddprun/launch_options.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include <sys/stat.h>

#include <stdlib.h>
#include <unistd.h>

#include "ddprun/launcher.h"
#include "support/unity_namespace.h"

namespace ddp::ddprun {
namespace {
namespace DDP_UNITY_ID {

using ::testing::HasSubstr;

LaunchOptions parse(const std::vector<std::string>& args) {
  std::ostringstream help;
  auto options = parse_command_line(args, help);
  if (!options) throw std::logic_error("unexpected --help");
  return *options;
}

// The message of the UsageError that parsing `args` throws ("" when it throws none).
std::string usage_error(const std::vector<std::string>& args) {
  try {
    parse(args);
  } catch (const UsageError& e) {
    return e.what();
  }
  return "";
}

TEST(ParseCommandLine, DefaultsFollowTorchrun) {
  const LaunchOptions options = parse({"/bin/true"});
  EXPECT_EQ(options.nproc_per_node, 1);
  EXPECT_EQ(options.nnodes, 1);
  EXPECT_EQ(options.node_rank, 0);
  EXPECT_EQ(options.master_addr, "127.0.0.1");
  EXPECT_EQ(options.master_port, 29500);
  EXPECT_EQ(options.max_restarts, 0);
  EXPECT_EQ(options.grace_period, std::chrono::seconds(5));
  EXPECT_EQ(options.program, "/bin/true");
  EXPECT_TRUE(options.args.empty());
}

TEST(ParseCommandLine, EverythingAfterTheProgramIsTheProgramsOwn) {
  const LaunchOptions options =
      parse({"--nproc-per-node", "2", "/bin/echo", "--nproc-per-node", "3", "--", "-x"});
  EXPECT_EQ(options.nproc_per_node, 2);
  EXPECT_EQ(options.program, "/bin/echo");
  EXPECT_EQ(options.args, (std::vector<std::string>{"--nproc-per-node", "3", "--", "-x"}));
}

TEST(ParseCommandLine, AcceptsTorchrunSpellingsAndADoubleDash) {
  const LaunchOptions options =
      parse({"--nproc_per_node=4", "--nnodes", "3", "--node_rank", "2", "--master_addr", "h1",
             "--master_port", "1234", "--max_restarts", "5", "--grace-period", "0.25", "--",
             "/bin/echo", "a"});
  EXPECT_EQ(options.nproc_per_node, 4);
  EXPECT_EQ(options.nnodes, 3);
  EXPECT_EQ(options.node_rank, 2);
  EXPECT_EQ(options.master_addr, "h1");
  EXPECT_EQ(options.master_port, 1234);
  EXPECT_EQ(options.max_restarts, 5);
  EXPECT_EQ(options.grace_period, std::chrono::milliseconds(250));
  EXPECT_EQ(options.world_size(), 12);
  EXPECT_EQ(options.global_rank(1), 9);
  EXPECT_EQ(options.args, (std::vector<std::string>{"a"}));
}

TEST(ParseCommandLine, NoPrefixAndTorchrunsNoPythonAreAccepted) {
  EXPECT_TRUE(parse({"/bin/true"}).prefix_output);
  EXPECT_FALSE(parse({"--no-prefix", "/bin/true"}).prefix_output);
  EXPECT_FALSE(parse({"--no_prefix", "--no_python", "/bin/true"}).prefix_output);
  EXPECT_EQ(parse({"--no-python", "/bin/echo", "x"}).args, (std::vector<std::string>{"x"}));
}

TEST(ParseCommandLine, FindsTheProgramOnPath) {
  const LaunchOptions options = parse({"sh", "-c", "true"});
  EXPECT_EQ(options.program, "sh");
  EXPECT_THAT(options.program_path, HasSubstr("/sh"));
}

TEST(ParseCommandLine, StandaloneAsksForAFreePort) {
  EXPECT_EQ(parse({"--standalone", "/bin/true"}).master_port, 0);
  EXPECT_EQ(parse({"--master-port", "0", "/bin/true"}).master_port, 0);
}

TEST(ParseCommandLine, CpuMeansOneWorkerPerCpu) {
  EXPECT_EQ(parse({"--nproc-per-node", "cpu", "/bin/true"}).nproc_per_node, usable_cpu_count());
}

TEST(ParseCommandLine, HelpReturnsNothing) {
  std::ostringstream help;
  EXPECT_FALSE(parse_command_line({"--help"}, help).has_value());
  EXPECT_THAT(help.str(), HasSubstr("--nproc-per-node"));
  EXPECT_THAT(help.str(), HasSubstr("Usage: ddprun [OPTIONS] PROGRAM [ARGS...]"));
  for (const char* group : {"Job size:", "Rendezvous:", "Failures and restarts:", "Output:"}) {
    EXPECT_THAT(help.str(), HasSubstr(group));
  }
  for (const char* option : {"--log-dir", "--redirects", "--tee", "--local-ranks-filter",
                             "--no-prefix", "--no-python", "--rdzv-endpoint"}) {
    EXPECT_THAT(help.str(), HasSubstr(option));
  }
  // No line wider than a terminal.
  std::istringstream lines(help.str());
  for (std::string line; std::getline(lines, line);) {
    EXPECT_LE(line.size(), 100u) << line;
  }
}

TEST(ParseCommandLine, BadInputNamesTheOption) {
  EXPECT_THAT(usage_error({"--nproc-per-node", "0", "/bin/true"}), HasSubstr("--nproc-per-node"));
  EXPECT_THAT(usage_error({"--nproc-per-node", "two", "/bin/true"}), HasSubstr("--nproc-per-node"));
  EXPECT_THAT(usage_error({"--nnodes", "0", "/bin/true"}), HasSubstr("--nnodes"));
  EXPECT_THAT(usage_error({"--nnodes", "2", "--node-rank", "2", "/bin/true"}),
              HasSubstr("--node-rank"));
  EXPECT_THAT(usage_error({"--master-port", "70000", "/bin/true"}), HasSubstr("--master-port"));
  EXPECT_THAT(usage_error({"--nnodes", "2", "--master-port", "0", "/bin/true"}),
              HasSubstr("--master-port"));
  EXPECT_THAT(usage_error({"--standalone", "--nnodes", "2", "/bin/true"}),
              HasSubstr("--standalone"));
  EXPECT_THAT(usage_error({"--grace-period", "-1", "/bin/true"}), HasSubstr("--grace-period"));
  EXPECT_THAT(usage_error({"--max-restarts", "-1", "/bin/true"}), HasSubstr("--max-restarts"));
  EXPECT_THAT(usage_error({"--nproc-per-node"}), HasSubstr("--nproc-per-node"));
  EXPECT_THAT(usage_error({"--no-such-option", "/bin/true"}), HasSubstr("--no-such-option"));
  EXPECT_THAT(usage_error({}), HasSubstr("PROGRAM"));
  EXPECT_THAT(usage_error({"--nproc-per-node", "2"}), HasSubstr("PROGRAM"));
}

// A value with whitespace around it, an empty value, a number in another base or too large for
// any integer: refused by name, with the value as written (each was taken as something else:
// ' 2' as 2, '010' as 8, '' as "not given").
TEST(ParseCommandLine, WhitespaceEmptyValuesAndOddNumbersAreRefusedByName) {
  EXPECT_THAT(usage_error({"--nproc-per-node", " 2", "/bin/true"}),
              HasSubstr("--nproc-per-node: ' 2' has whitespace before or after it"));
  EXPECT_THAT(usage_error({"--nproc-per-node", "2 ", "/bin/true"}),
              HasSubstr("--nproc-per-node: '2 ' has whitespace"));
  EXPECT_THAT(usage_error({"--nproc-per-node", "+2", "/bin/true"}), HasSubstr("got '+2'"));
  EXPECT_THAT(usage_error({"--nproc-per-node", "99999999999999999999", "/bin/true"}),
              HasSubstr("--nproc-per-node"));
  EXPECT_THAT(usage_error({"--nnodes", " 2", "/bin/true"}),
              HasSubstr("--nnodes: ' 2' has whitespace"));
  EXPECT_THAT(usage_error({"--nnodes", "1: 2", "/bin/true"}), HasSubstr("got '1: 2'"));
  EXPECT_THAT(usage_error({"--nnodes", "99999999999999999999", "/bin/true"}),
              HasSubstr("--nnodes 99999999999999999999: 99999999999999999999 is out of range"));
  EXPECT_THAT(usage_error({"--node-rank", " 0", "/bin/true"}),
              HasSubstr("--node-rank: ' 0' has whitespace"));
  EXPECT_THAT(usage_error({"--master-port", "29500 ", "/bin/true"}),
              HasSubstr("--master-port: '29500 ' has whitespace"));
  EXPECT_THAT(
      usage_error({"--master-port", "99999999999999999999", "/bin/true"}),
      HasSubstr("--master-port: 99999999999999999999 is out of range, expected 0 to 65535"));
  EXPECT_THAT(usage_error({"--master-port", "0x10", "/bin/true"}),
              HasSubstr("--master-port: expected a whole number from 0 to 65535, got '0x10'"));
  EXPECT_THAT(usage_error({"--max-restarts", "", "/bin/true"}),
              HasSubstr("--max-restarts: expected a whole number from 0 to 1000000, got ''"));
  EXPECT_THAT(usage_error({"--agent-port", "-1", "/bin/true"}), HasSubstr("--agent-port"));
  EXPECT_THAT(usage_error({"--grace-period", " 5", "/bin/true"}),
              HasSubstr("--grace-period: ' 5' has whitespace"));
  EXPECT_THAT(usage_error({"--grace-period", "1e3", "/bin/true"}),
              HasSubstr("--grace-period: expected seconds from 0 to 86400, got '1e3'"));
  EXPECT_THAT(usage_error({"--grace-period", "inf", "/bin/true"}), HasSubstr("got 'inf'"));
  EXPECT_THAT(usage_error({"--rdzv-last-call", "", "/bin/true"}),
              HasSubstr("--rdzv-last-call: expected seconds from 0 to 3600, got ''"));
  EXPECT_THAT(usage_error({"--master-addr", " node1", "/bin/true"}),
              HasSubstr("--master-addr: ' node1' has whitespace"));
  EXPECT_THAT(usage_error({"--master-addr", "", "/bin/true"}), HasSubstr("--master-addr is empty"));
  EXPECT_THAT(usage_error({"--agent-listen-addr", "0.0.0.0 ", "/bin/true"}),
              HasSubstr("--agent-listen-addr: '0.0.0.0 ' has whitespace"));
  EXPECT_THAT(usage_error({"--rdzv-endpoint", "node1:29400 ", "/bin/true"}),
              HasSubstr("--rdzv-endpoint: 'node1:29400 ' has whitespace"));
  EXPECT_THAT(usage_error({"--rdzv-endpoint", "node1:0x10", "/bin/true"}),
              HasSubstr("has port '0x10'"));
  EXPECT_THAT(usage_error({"--rdzv-backend", "c10d ", "/bin/true"}),
              HasSubstr("--rdzv-backend: 'c10d ' has whitespace"));
  for (const char* option : {"--log-dir", "--secret-file", "--rdzv-backend", "--rdzv-endpoint",
                             "--redirects", "--tee", "--local-ranks-filter"}) {
    EXPECT_THAT(usage_error({option, "", "/bin/true"}),
                HasSubstr(std::string(option) + " is empty"));
    EXPECT_THAT(usage_error({std::string(option) + "=", "/bin/true"}),
                HasSubstr(std::string(option) + " is empty"));
  }
  // Plain decimal numbers still mean what they say (no octal).
  const LaunchOptions decimal = parse(
      {"--nproc-per-node", "010", "--master-port", "08080", "--grace-period", "0.5", "/bin/true"});
  EXPECT_EQ(decimal.nproc_per_node, 10);
  EXPECT_EQ(decimal.master_port, 8080);
  EXPECT_EQ(decimal.grace_period, std::chrono::milliseconds(500));
}

TEST(ParseCommandLine, RedirectsTeeAndFilterFollowTorchrunsValues) {
  char dir_template[] = "/tmp/ddprun-logs-XXXXXX";
  ASSERT_NE(::mkdtemp(dir_template), nullptr);
  const std::string dir = dir_template;
  const LaunchOptions plain = parse({"--nproc-per-node", "3", "/bin/true"});
  EXPECT_FALSE(plain.log_dir.enabled());
  for (int rank = 0; rank < 3; ++rank) {
    EXPECT_TRUE(plain.output.to_console(rank, kStdout));
    EXPECT_TRUE(plain.output.to_console(rank, kStderr));
  }
  // One value for every rank: 1 = stdout to the files only.
  const LaunchOptions all =
      parse({"--nproc-per-node", "2", "--log-dir", dir, "--redirects", "1", "/bin/true"});
  EXPECT_TRUE(all.log_dir.enabled());
  EXPECT_EQ(all.log_dir.run_dir(), dir + "/none");
  EXPECT_FALSE(all.output.to_console(1, kStdout));
  EXPECT_TRUE(all.output.to_console(1, kStderr));
  // Pairs (ranks not named get 0), --tee puts a redirected stream back, the filter hides ranks.
  const LaunchOptions pairs =
      parse({"--nproc_per_node", "3", "--log_dir", dir, "-r", "0:3,2:2", "--tee", "0:2",
             "--local_ranks_filter", "0,2", "--rdzv-id", "job-7", "/bin/true"});
  EXPECT_EQ(pairs.log_dir.run_dir(), dir + "/job-7");
  EXPECT_EQ(pairs.log_dir.rank_dir(1, 5), dir + "/job-7/attempt_1/5");
  EXPECT_EQ(pairs.run_id, "job-7");
  EXPECT_FALSE(pairs.output.to_console(0, kStdout));
  EXPECT_TRUE(pairs.output.to_console(0, kStderr));
  EXPECT_FALSE(pairs.output.to_console(1, kStdout));  // filtered out
  EXPECT_FALSE(pairs.output.to_console(1, kStderr));
  EXPECT_TRUE(pairs.output.to_console(2, kStdout));
  EXPECT_FALSE(pairs.output.to_console(2, kStderr));
  // The run's folder was made (and proven writable) while parsing, before any worker.
  EXPECT_TRUE(std::filesystem::is_directory(dir + "/job-7"));
  EXPECT_TRUE(std::filesystem::is_empty(dir + "/job-7"));
  std::filesystem::remove_all(dir);
}

TEST(ParseCommandLine, BadOutputOptionsAreNamed) {
  char dir_template[] = "/tmp/ddprun-logs-XXXXXX";
  ASSERT_NE(::mkdtemp(dir_template), nullptr);
  const std::string dir = dir_template;
  const auto with_logs = [&](std::vector<std::string> args) {
    args.insert(args.begin(), {"--nproc-per-node", "2", "--log-dir", dir});
    args.push_back("/bin/true");
    return usage_error(args);
  };
  EXPECT_THAT(with_logs({"--redirects", "4"}), HasSubstr("--redirects: expected 0 (none)"));
  EXPECT_THAT(with_logs({"--redirects", "both"}), HasSubstr("got 'both'"));
  EXPECT_THAT(with_logs({"--tee", "-1"}), HasSubstr("--tee"));
  EXPECT_THAT(with_logs({"--tee", "0:1,1"}), HasSubstr("'1' in '0:1,1' is not LOCAL_RANK:VALUE"));
  EXPECT_THAT(with_logs({"--tee", "0:5"}), HasSubstr("--tee: expected 0 (none)"));
  EXPECT_THAT(with_logs({"--tee", "0:"}), HasSubstr("--tee"));
  EXPECT_THAT(with_logs({"--redirects", "0:1,0:2"}), HasSubstr("local rank 0 is named twice"));
  EXPECT_THAT(with_logs({"--redirects", "2:3"}),
              HasSubstr("--redirects: local rank 2 does not exist: --nproc-per-node is 2"));
  EXPECT_THAT(with_logs({"--local-ranks-filter", "0,2"}),
              HasSubstr("--local-ranks-filter: local rank 2 does not exist"));
  EXPECT_THAT(with_logs({"--local-ranks-filter", "0,,1"}),
              HasSubstr("--local-ranks-filter: '' in '0,,1' is not a local rank"));
  EXPECT_THAT(with_logs({"--local-ranks-filter", "x"}),
              HasSubstr("'x' in 'x' is not a local rank"));
  // Files need a folder.
  EXPECT_THAT(usage_error({"--redirects", "3", "/bin/true"}), HasSubstr("give --log-dir DIR"));
  EXPECT_THAT(usage_error({"--tee", "1", "/bin/true"}), HasSubstr("give --log-dir DIR"));
  // A folder that cannot be made: inside a regular file (even root cannot).
  const std::string file = dir + "/a-file";
  std::ofstream(file) << "x";
  EXPECT_THAT(usage_error({"--log-dir", file + "/logs", "/bin/true"}),
              HasSubstr("--log-dir: cannot create the folder '" + file + "/logs/none'"));
  EXPECT_THAT(usage_error({"--log-dir", file, "/bin/true"}), HasSubstr("--log-dir"));
  EXPECT_THAT(usage_error({"--log-dir", dir, "--rdzv-id", "../up", "/bin/true"}),
              HasSubstr("--rdzv-id: '../up' is not a usable run id"));
  std::filesystem::remove_all(dir);
}

TEST(ParseCommandLine, UnwritableLogDirIsAUsageError) {
  if (::geteuid() == 0) GTEST_SKIP() << "root may write in a read-only folder";
  char dir_template[] = "/tmp/ddprun-logs-XXXXXX";
  ASSERT_NE(::mkdtemp(dir_template), nullptr);
  const std::string dir = dir_template;
  ::chmod(dir.c_str(), 0500);
  EXPECT_THAT(usage_error({"--log-dir", dir + "/logs", "/bin/true"}),
              HasSubstr("--log-dir: cannot create the folder"));
  ::chmod(dir.c_str(), 0700);
  std::filesystem::remove_all(dir);
}

TEST(ParseCommandLine, RendezvousOptionsMapOntoTheMastersAddress) {
  const LaunchOptions c10d = parse(
      {"--rdzv-backend", "c10d", "--rdzv-endpoint", "node1:1234", "--nnodes", "2", "/bin/true"});
  EXPECT_EQ(c10d.master_addr, "node1");
  EXPECT_EQ(c10d.master_port, 1234);
  const LaunchOptions no_port =
      parse({"--rdzv_backend=static", "--rdzv_endpoint=10.0.0.2", "/bin/true"});
  EXPECT_EQ(no_port.master_addr, "10.0.0.2");
  EXPECT_EQ(no_port.master_port, 29400);  // torchrun's default rendezvous port
  const LaunchOptions v6 = parse({"--rdzv-endpoint", "[::1]:29555", "/bin/true"});
  EXPECT_EQ(v6.master_addr, "::1");
  EXPECT_EQ(v6.master_port, 29555);
  EXPECT_EQ(parse({"--rdzv-id", "abc_1.2", "/bin/true"}).run_id, "abc_1.2");

  EXPECT_THAT(usage_error({"--rdzv-backend", "etcd", "/bin/true"}),
              HasSubstr("--rdzv-backend 'etcd' is not supported"));
  EXPECT_THAT(usage_error({"--rdzv-endpoint", "h:port", "/bin/true"}),
              HasSubstr("--rdzv-endpoint: 'h:port' has port 'port'"));
  EXPECT_THAT(usage_error({"--rdzv-endpoint", "h:70000", "/bin/true"}),
              HasSubstr("--rdzv-endpoint"));
  EXPECT_THAT(usage_error({"--rdzv-endpoint", ":1234", "/bin/true"}), HasSubstr("names no host"));
  EXPECT_THAT(usage_error({"--rdzv-endpoint", "::1:5", "/bin/true"}), HasSubstr("[ ]"));
  EXPECT_THAT(usage_error({"--rdzv-endpoint", "h:1", "--master-port", "2", "/bin/true"}),
              HasSubstr("give one of them"));
  EXPECT_THAT(usage_error({"--rdzv-endpoint", "h:1", "--standalone", "/bin/true"}),
              HasSubstr("--standalone"));
  EXPECT_THAT(usage_error({"--rdzv-id", "", "/bin/true"}), HasSubstr("--rdzv-id"));
  EXPECT_THAT(usage_error({"--rdzv-endpoint", "h:0", "--nnodes", "2", "/bin/true"}),
              HasSubstr("--rdzv-endpoint port 0"));
}

TEST(ParseCommandLine, AgentPortDefaultsToTheMasterPortPlusOneWithSeveralNodes) {
  EXPECT_EQ(parse({"/bin/true"}).agent_port, 0);  // one node: no restart-round store
  EXPECT_EQ(parse({"--nnodes", "2", "--master-port", "4000", "/bin/true"}).agent_port, 4001);
  EXPECT_EQ(parse({"--nnodes", "2", "--master-port", "4000", "--agent-port", "5000", "/bin/true"})
                .agent_port,
            5000);
  EXPECT_THAT(
      usage_error({"--nnodes", "2", "--master-port", "4000", "--agent-port", "4000", "/bin/true"}),
      HasSubstr("--agent-port 4000 is --master-port too"));
  EXPECT_THAT(usage_error({"--nnodes", "2", "--master-port", "65535", "/bin/true"}),
              HasSubstr("give --agent-port"));
}

TEST(ResolveProgram, ReportsMissingAndNonExecutablePrograms) {
  EXPECT_THROW(resolve_program("ddprun-no-such-program", "/bin:/usr/bin"), UsageError);
  EXPECT_THROW(resolve_program("./ddprun-no-such-program", nullptr), UsageError);
  char path[] = "/tmp/ddprun-not-executable-XXXXXX";
  const int fd = ::mkstemp(path);  // created with mode 0600: no execute bit
  ASSERT_GE(fd, 0);
  ::close(fd);
  EXPECT_THROW(resolve_program(path, nullptr), UsageError);
  ::unlink(path);
  EXPECT_THROW(resolve_program("/tmp", nullptr), UsageError);  // a directory
  EXPECT_EQ(resolve_program("sh", "/nonexistent:/bin"), "/bin/sh");
  EXPECT_EQ(resolve_program("/bin/sh", ""), "/bin/sh");
}

TEST(DescribeWaitStatus, SaysHowAProcessEnded) {
  EXPECT_EQ(describe_wait_status(3 << 8), "exited with code 3");
  EXPECT_EQ(describe_wait_status(9), "was killed by signal 9 (Killed)");
  EXPECT_EQ(describe_wait_status(15), "was killed by signal 15 (Terminated)");
}

TEST(ParseCommandLine, SecretFileIsCheckedAndMadeAbsolute) {
  char dir_template[] = "/tmp/ddprun-secret-XXXXXX";
  ASSERT_NE(::mkdtemp(dir_template), nullptr);
  const std::string dir = dir_template;
  const auto write = [&](const std::string& name, const std::string& text, mode_t mode) {
    const std::string path = dir + "/" + name;
    std::ofstream(path) << text;
    ::chmod(path.c_str(), mode);
    return path;
  };
  const std::string good = write("good", "s3cret\n", 0600);
  EXPECT_EQ(parse({"--secret-file", good, "/bin/true"}).secret_file, good);
  EXPECT_EQ(parse({"/bin/true"}).secret_file, "");
  // A relative path becomes absolute: the workers may change directory before reading it.
  const std::string cwd = std::filesystem::current_path().string();
  std::filesystem::current_path(dir);
  EXPECT_EQ(parse({"--secret-file", "good", "/bin/true"}).secret_file, good);
  std::filesystem::current_path(cwd);

  EXPECT_THAT(usage_error({"--secret-file", write("empty", "\n", 0600), "/bin/true"}),
              HasSubstr("is empty"));
  EXPECT_THAT(usage_error({"--secret-file", write("open", "s3cret\n", 0644), "/bin/true"}),
              HasSubstr("chmod 600"));
  EXPECT_THAT(usage_error({"--secret-file", dir + "/missing", "/bin/true"}),
              HasSubstr("--secret-file: cannot read the secret file"));
  // Not read at all: a device (or a FIFO, which would block) is no secret file.
  EXPECT_THAT(usage_error({"--secret-file", "/dev/null", "/bin/true"}),
              HasSubstr("'/dev/null' is a character device, not a regular file"));
  std::filesystem::remove_all(dir);
}

TEST(ParseCommandLine, NnodesMinMaxMakesAnElasticJob) {
  const LaunchOptions elastic =
      parse({"--nnodes", "1:4", "--node-rank", "0", "--master-port", "4000", "/bin/true"});
  EXPECT_EQ(elastic.min_nnodes, 1);
  EXPECT_EQ(elastic.nnodes, 4);
  EXPECT_TRUE(elastic.elastic());
  EXPECT_TRUE(elastic.serves_rounds());
  EXPECT_EQ(elastic.agent_port, 4001);
  EXPECT_EQ(elastic.rdzv_last_call, std::chrono::milliseconds(3000));
  // No --node-rank: an agent whose rank each round assigns, not the one serving the rendezvous.
  const LaunchOptions joiner = parse({"--nnodes", "2:3", "--rdzv-last-call", "0.5", "/bin/true"});
  EXPECT_EQ(joiner.node_rank, -1);
  EXPECT_FALSE(joiner.serves_rounds());
  EXPECT_EQ(joiner.rdzv_last_call, std::chrono::milliseconds(500));
  // MIN = MAX is today's static job.
  const LaunchOptions fixed = parse({"--nnodes", "2:2", "--node-rank", "1", "/bin/true"});
  EXPECT_FALSE(fixed.elastic());
  EXPECT_EQ(fixed.nnodes, 2);
  EXPECT_EQ(fixed.node_rank, 1);
}

TEST(ParseCommandLine, BadNnodesAndElasticNodeRanksAreNamed) {
  EXPECT_THAT(usage_error({"--nnodes", "3:2", "/bin/true"}),
              HasSubstr("--nnodes 3:2: MIN 3 is more than MAX 2"));
  EXPECT_THAT(usage_error({"--nnodes", "0:2", "/bin/true"}),
              HasSubstr("--nnodes 0:2: 0 is out of range"));
  EXPECT_THAT(usage_error({"--nnodes", "a:b", "/bin/true"}),
              HasSubstr("--nnodes: expected N or MIN:MAX with whole numbers"));
  EXPECT_THAT(usage_error({"--nnodes", "2:", "/bin/true"}), HasSubstr("got '2:'"));
  EXPECT_THAT(usage_error({"--nnodes", "1:2", "--node-rank", "1", "/bin/true"}),
              HasSubstr("--node-rank 1 cannot be honoured with --nnodes 1:2"));
  EXPECT_THAT(usage_error({"--standalone", "--nnodes", "1:2", "/bin/true"}),
              HasSubstr("--standalone runs on one node, but --nnodes is 1:2"));
  EXPECT_THAT(usage_error({"--nnodes", "1:2", "--rdzv-last-call", "-1", "/bin/true"}),
              HasSubstr("--rdzv-last-call"));
}

}  // namespace DDP_UNITY_ID
}  // namespace
}  // namespace ddp::ddprun
