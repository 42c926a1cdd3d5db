#include "ddp/launch/job_secret.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <fmt/format.h>

#include "ddp/error.h"

namespace ddp {
namespace {

std::string errno_text(int err) {
  char buf[256];
  return ::strerror_r(err, buf, sizeof buf);  // GNU variant: returns the text
}

// Closes the descriptor on every path out of read_secret_file.
struct FdGuard {
  int fd;
  ~FdGuard() {
    if (fd >= 0) ::close(fd);
  }
};

}  // namespace

std::string read_secret_file(const std::string& path, const std::string& what) {
  if (path.empty()) {
    throw ConfigError(
        fmt::format("{} is set but empty: give the path of the file holding the "
                    "job's secret",
                    what));
  }
  // O_NONBLOCK: opening a FIFO must not wait for a writer (and reading one must not wait for
  // data); whatever the path names is judged by fstat on what was opened, so a symbolic link
  // (Kubernetes mounts its secrets through them) is fine when it leads to a regular file.
  const FdGuard file{::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK)};
  if (file.fd < 0) {
    throw ConfigError(
        fmt::format("{}: cannot read the secret file '{}': {}", what, path, errno_text(errno)));
  }
  struct stat st {};
  if (::fstat(file.fd, &st) != 0) {
    throw ConfigError(
        fmt::format("{}: cannot stat the secret file '{}': {}", what, path, errno_text(errno)));
  }
  if (!S_ISREG(st.st_mode)) {
    const char* kind = S_ISFIFO(st.st_mode)   ? "a FIFO (named pipe)"
                       : S_ISDIR(st.st_mode)  ? "a directory"
                       : S_ISCHR(st.st_mode)  ? "a character device"
                       : S_ISBLK(st.st_mode)  ? "a block device"
                       : S_ISSOCK(st.st_mode) ? "a socket"
                                              : "not a regular file";
    throw ConfigError(fmt::format(
        "{}: the secret file '{}' is {}, not a regular file; every process of the job reads it, "
        "and reading a pipe or device could block or give each reader something else: write the "
        "secret into a file (e.g. `head -c 32 /dev/urandom | base64 > job.secret && chmod 600 "
        "job.secret`)",
        what, path, kind));
  }
  // Like ssh with its keys: a secret that other users of the machine (its group included) can
  // read or change protects nothing.
  if ((st.st_mode & (S_IRWXG | S_IRWXO)) != 0) {
    throw ConfigError(fmt::format(
        "{}: the secret file '{}' can be accessed by users other than its owner (mode {:04o}: "
        "its group or every user may read or write it); restrict it with `chmod 600 {}`",
        what, path, st.st_mode & 07777, path));
  }
  std::string secret;
  char buf[4096];
  for (;;) {
    const ssize_t n = ::read(file.fd, buf, sizeof buf);
    if (n < 0) {
      if (errno == EINTR) continue;
      throw ConfigError(fmt::format("{}: reading the secret file '{}' failed: {}", what, path,
                                    errno_text(errno)));
    }
    if (n == 0) break;
    secret.append(buf, static_cast<std::size_t>(n));
    if (secret.size() > kMaxSecretBytes) {
      throw ConfigError(
          fmt::format("{}: the secret file '{}' is larger than {} bytes; is it the "
                      "right file?",
                      what, path, kMaxSecretBytes));
    }
  }
  while (!secret.empty() && (secret.back() == '\n' || secret.back() == '\r'))
    secret.pop_back();
  if (secret.empty()) {
    throw ConfigError(
        fmt::format("{}: the secret file '{}' is empty; write the job's secret into "
                    "it (e.g. `head -c 32 /dev/urandom | base64 > {}`)",
                    what, path, path));
  }
  return secret;
}

std::string resolve_job_secret(const std::optional<std::string>& explicit_secret,
                               const EnvironmentLookup& lookup) {
  if (explicit_secret) {
    if (explicit_secret->empty()) {
      throw ConfigError(
          "LaunchOptions::secret is set but empty: give the job's secret, or leave it unset to "
          "use DDP_SECRET / DDP_SECRET_FILE");
    }
    return *explicit_secret;
  }
  const auto direct = lookup("DDP_SECRET");
  const auto file = lookup("DDP_SECRET_FILE");
  if (direct && direct->empty()) {
    throw ConfigError(
        "DDP_SECRET is set but empty: set it to the job's secret (the same on every process), or "
        "unset it to run without authentication");
  }
  if (!file) return direct.value_or(std::string());
  const std::string from_file = read_secret_file(*file, "DDP_SECRET_FILE");
  if (direct && *direct != from_file) {
    throw ConfigError(fmt::format(
        "DDP_SECRET and DDP_SECRET_FILE ('{}') are both set and hold different secrets; set only "
        "one of them",
        *file));
  }
  return from_file;
}

}  // namespace ddp
