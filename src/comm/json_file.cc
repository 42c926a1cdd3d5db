#include "comm/json_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <system_error>

#include <fmt/format.h>

namespace ddp::comm {

std::string error_text(int err) {
  return std::generic_category().message(err);
}

std::string json_string(std::string_view text) {
  std::string out;
  out.reserve(text.size() + 2);
  out += '"';
  for (const char c : text) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          out += fmt::format("\\u{:04x}", static_cast<unsigned>(static_cast<unsigned char>(c)));
        } else {
          out += c;
        }
    }
  }
  out += '"';
  return out;
}

std::string write_file_atomically(const std::filesystem::path& path, std::string_view text) {
  const std::string temp = fmt::format("{}.tmp.{}", path.string(), ::getpid());
  const int fd = ::open(temp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return fmt::format("cannot create {}: {}", temp, error_text(errno));
  std::size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      // write() returning 0 for a regular file means no space was left.
      const std::string why = error_text(n < 0 ? errno : ENOSPC);
      ::close(fd);
      ::unlink(temp.c_str());
      return fmt::format("cannot write {}: {}", temp, why);
    }
    done += static_cast<std::size_t>(n);
  }
  if (::close(fd) != 0) {
    const std::string why = error_text(errno);
    ::unlink(temp.c_str());
    return fmt::format("cannot write {}: {}", temp, why);
  }
  if (::rename(temp.c_str(), path.c_str()) != 0) {
    const std::string why = error_text(errno);
    ::unlink(temp.c_str());
    return fmt::format("cannot rename {} to {}: {}", temp, path.string(), why);
  }
  return {};
}

}  // namespace ddp::comm
