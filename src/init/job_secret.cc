#include "ddp/job_secret.h"

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
  const FdGuard file{::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOCTTY)};
  if (file.fd < 0) {
    throw ConfigError(
        fmt::format("{}: cannot read the secret file '{}': {}", what, path, errno_text(errno)));
  }
  struct stat st {};
  if (::fstat(file.fd, &st) != 0) {
    throw ConfigError(
        fmt::format("{}: cannot stat the secret file '{}': {}", what, path, errno_text(errno)));
  }
  // Like ssh with its keys: a secret that every user of the machine can read protects nothing.
  if (S_ISREG(st.st_mode) && (st.st_mode & (S_IROTH | S_IWOTH)) != 0) {
    throw ConfigError(fmt::format(
        "{}: the secret file '{}' can be read or written by every user (mode {:03o}); restrict "
        "it with `chmod 600 {}`",
        what, path, st.st_mode & 0777, path));
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
