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

namespace ddp::ddprun {
namespace {

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
  EXPECT_THAT(usage_error({"--secret-file", "/dev/null", "/bin/true"}), HasSubstr("empty"));
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace ddp::ddprun
