// The job's secret: where it comes from (explicit, DDP_SECRET, DDP_SECRET_FILE), what is refused,
// and that resolve_launch_environment carries it and the store's listen address.
#include "ddp/launch/job_secret.h"

#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>
#include <chrono>
#include <fstream>
#include <future>
#include <map>

#include "ddp/error.h"
#include "ddp/launch/launch_environment.h"
#include "support/temp_dir.h"
#include "support/unity_namespace.h"

namespace ddp::test {
namespace {
namespace DDP_UNITY_ID {

using ::testing::HasSubstr;
using ::testing::Not;
using Env = std::map<std::string, std::string>;

EnvironmentLookup lookup_in(const Env& env) {
  return [env](const std::string& name) -> std::optional<std::string> {
    const auto it = env.find(name);
    if (it == env.end()) return std::nullopt;
    return it->second;
  };
}

std::string write_file(const TempDir& dir, const std::string& name, const std::string& text,
                       mode_t mode = 0600) {
  const std::string path = dir.file(name);
  std::ofstream(path, std::ios::binary) << text;
  ::chmod(path.c_str(), mode);
  return path;
}

// The ConfigError's message ("" when nothing is thrown).
std::string config_error(const std::optional<std::string>& explicit_secret, const Env& env) {
  try {
    resolve_job_secret(explicit_secret, lookup_in(env));
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

TEST(JobSecret, NoSourceMeansNoSecret) {
  EXPECT_EQ(resolve_job_secret(std::nullopt, lookup_in({})), "");
}

TEST(JobSecret, ReadsDdpSecret) {
  EXPECT_EQ(resolve_job_secret(std::nullopt, lookup_in({{"DDP_SECRET", "s3cr3t"}})), "s3cr3t");
}

TEST(JobSecret, ReadsTheFileWithoutItsTrailingNewline) {
  TempDir dir;
  const auto path = write_file(dir, "secret", "from file\r\n\n");
  EXPECT_EQ(resolve_job_secret(std::nullopt, lookup_in({{"DDP_SECRET_FILE", path}})), "from file");
  // Inner newlines and spaces are part of the secret.
  const auto inner = write_file(dir, "inner", " a\nb \n");
  EXPECT_EQ(read_secret_file(inner, "test"), " a\nb ");
}

TEST(JobSecret, ExplicitValueWinsOverTheEnvironment) {
  TempDir dir;
  const auto path = write_file(dir, "secret", "file\n");
  EXPECT_EQ(resolve_job_secret(std::string("explicit"),
                               lookup_in({{"DDP_SECRET", "env"}, {"DDP_SECRET_FILE", path}})),
            "explicit");
}

TEST(JobSecret, BothVariablesMustAgree) {
  TempDir dir;
  const auto path = write_file(dir, "secret", "one\n");
  EXPECT_EQ(resolve_job_secret(std::nullopt,
                               lookup_in({{"DDP_SECRET", "one"}, {"DDP_SECRET_FILE", path}})),
            "one");
  const auto message =
      config_error(std::nullopt, {{"DDP_SECRET", "two"}, {"DDP_SECRET_FILE", path}});
  EXPECT_THAT(message, HasSubstr("DDP_SECRET and DDP_SECRET_FILE"));
  EXPECT_THAT(message, HasSubstr("different"));
  EXPECT_THAT(message, Not(HasSubstr("two")));  // never print a secret
}

TEST(JobSecret, EmptySecretsAreRefused) {
  TempDir dir;
  const auto empty = write_file(dir, "empty", "");
  const auto newline = write_file(dir, "newline", "\n");
  EXPECT_THAT(config_error(std::nullopt, {{"DDP_SECRET_FILE", empty}}),
              HasSubstr("secret file '" + empty + "' is empty"));
  EXPECT_THAT(config_error(std::nullopt, {{"DDP_SECRET_FILE", newline}}), HasSubstr("is empty"));
  EXPECT_THAT(config_error(std::nullopt, {{"DDP_SECRET", ""}}),
              HasSubstr("DDP_SECRET is set but empty"));
  EXPECT_THAT(config_error(std::string(), {}), HasSubstr("LaunchOptions::secret"));
  EXPECT_THAT(config_error(std::nullopt, {{"DDP_SECRET_FILE", ""}}),
              HasSubstr("DDP_SECRET_FILE is set but empty"));
}

TEST(JobSecret, UnreadableOrExposedFilesAreRefused) {
  TempDir dir;
  EXPECT_THAT(config_error(std::nullopt, {{"DDP_SECRET_FILE", dir.file("missing")}}),
              HasSubstr("cannot read the secret file"));
  const auto exposed = write_file(dir, "exposed", "secret\n", 0644);
  const auto message = config_error(std::nullopt, {{"DDP_SECRET_FILE", exposed}});
  EXPECT_THAT(message, HasSubstr("users other than its owner"));
  EXPECT_THAT(message, HasSubstr("chmod 600"));
  // Its group is other users too (docs/security.md): 0660 and 0640 were accepted before issue 24.
  for (const mode_t mode : {0660, 0640, 0620, 0604, 0602, 0610, 0601}) {
    const auto path = write_file(dir, fmt::format("mode{:o}", mode), "secret\n", mode);
    const auto refused = config_error(std::nullopt, {{"DDP_SECRET_FILE", path}});
    EXPECT_THAT(refused, HasSubstr("DDP_SECRET_FILE"));
    EXPECT_THAT(refused, HasSubstr("'" + path + "'"));
    EXPECT_THAT(refused, HasSubstr(fmt::format("mode {:04o}", mode)));
    EXPECT_THAT(refused, HasSubstr("chmod 600 " + path));
  }
  for (const mode_t mode : {0600, 0400}) {
    const auto path = write_file(dir, fmt::format("ok{:o}", mode), "secret\n", mode);
    EXPECT_EQ(read_secret_file(path, "test"), "secret") << fmt::format("mode {:o}", mode);
  }
  const auto huge = write_file(dir, "huge", std::string(kMaxSecretBytes + 1, 'x'));
  EXPECT_THAT(config_error(std::nullopt, {{"DDP_SECRET_FILE", huge}}), HasSubstr("larger than"));
}

TEST(JobSecret, AFifoIsRefusedWithoutWaitingForAWriter) {
  // Reading a FIFO blocks until someone writes: the job used to hang at start.
  TempDir dir;
  const std::string fifo = dir.file("secret.fifo");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  auto refused = std::async(std::launch::async, [&] {
    return config_error(std::nullopt, {{"DDP_SECRET_FILE", fifo}});
  });
  if (refused.wait_for(std::chrono::seconds(5)) != std::future_status::ready) {
    // Unblock the reader so that the test ends, then fail.
    const int fd = ::open(fifo.c_str(), O_WRONLY | O_NONBLOCK);
    if (fd >= 0) ::close(fd);
    refused.wait();
    FAIL() << "reading a FIFO as the secret file did not return within 5 s";
  }
  const std::string message = refused.get();
  EXPECT_THAT(message, HasSubstr("DDP_SECRET_FILE"));
  EXPECT_THAT(message, HasSubstr("'" + fifo + "'"));
  EXPECT_THAT(message, HasSubstr("FIFO"));
  EXPECT_THAT(message, HasSubstr("not a regular file"));
}

TEST(JobSecret, DevicesAndFoldersAreRefusedAsNotRegularFiles) {
  TempDir dir;
  EXPECT_THAT(config_error(std::nullopt, {{"DDP_SECRET_FILE", "/dev/null"}}),
              HasSubstr("'/dev/null' is a character device, not a regular file"));
  EXPECT_THAT(config_error(std::nullopt, {{"DDP_SECRET_FILE", dir.path().string()}}),
              HasSubstr("is a directory, not a regular file"));
  // A symbolic link to a good file is fine (Kubernetes mounts secrets through links).
  const auto target = write_file(dir, "target", "linked\n");
  const std::string link = dir.file("link");
  ASSERT_EQ(::symlink(target.c_str(), link.c_str()), 0);
  EXPECT_EQ(read_secret_file(link, "test"), "linked");
}

TEST(JobSecret, LaunchEnvironmentCarriesTheSecretAndTheStoreAddress) {
  const Env env = {{"RANK", "0"},
                   {"WORLD_SIZE", "2"},
                   {"MASTER_ADDR", "10.1.2.3"},
                   {"MASTER_PORT", "29400"},
                   {"DDP_SECRET", "abc"}};
  const auto e = resolve_launch_environment({}, lookup_in(env));
  EXPECT_EQ(e.secret, "abc");
  EXPECT_FALSE(e.store_listen_addr.has_value());  // MASTER_ADDR's interface (rendezvous.cc)

  Env asked = env;
  asked["DDP_STORE_LISTEN_ADDR"] = "0.0.0.0";
  EXPECT_EQ(resolve_launch_environment({}, lookup_in(asked)).store_listen_addr, "0.0.0.0");
  EXPECT_EQ(
      resolve_launch_environment({.secret = "opt", .store_listen_addr = "::"}, lookup_in(asked))
          .store_listen_addr,
      "::");
  EXPECT_EQ(resolve_launch_environment({.secret = "opt"}, lookup_in(env)).secret, "opt");
  asked["DDP_STORE_LISTEN_ADDR"] = "";
  EXPECT_THROW(resolve_launch_environment({}, lookup_in(asked)), ConfigError);
  EXPECT_EQ(resolve_launch_environment({}, lookup_in({})).secret, "");
}

}  // namespace DDP_UNITY_ID
}  // namespace
}  // namespace ddp::test
