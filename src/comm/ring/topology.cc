#include "comm/ring/topology.h"

#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <map>

#include <fmt/format.h>

#include "net/socket.h"

namespace ddp::comm {
namespace {

std::string first_line_of(const char* path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

}  // namespace

std::string host_identity(const std::string& explicit_id) {
  if (!explicit_id.empty()) return fmt::format("DDP_HOST_ID={}", explicit_id);
  char netns[256] = {};
  const ssize_t n = ::readlink("/proc/self/ns/net", netns, sizeof netns - 1);
  return fmt::format("{}|{}|{}", net::host_name(), first_line_of("/proc/sys/kernel/random/boot_id"),
                     n > 0 ? std::string(netns, static_cast<std::size_t>(n)) : std::string("?"));
}

Topology Topology::from_identities(const std::vector<std::string>& identity_of, int rank) {
  std::map<std::string, std::vector<int>> by_identity;
  for (std::size_t r = 0; r < identity_of.size(); ++r)
    by_identity[identity_of[r]].push_back(static_cast<int>(r));
  Topology t;
  for (auto& [identity, ranks] : by_identity)
    t.hosts.push_back(ranks);
  std::sort(t.hosts.begin(), t.hosts.end());  // by leader (each list is sorted already)
  t.local = by_identity[identity_of[static_cast<std::size_t>(rank)]];
  t.local_rank =
      static_cast<int>(std::find(t.local.begin(), t.local.end(), rank) - t.local.begin());
  return t;
}

std::size_t Topology::largest_host() const {
  std::size_t largest = 0;
  for (const auto& h : hosts)
    largest = std::max(largest, h.size());
  return largest;
}

bool Topology::equal_hosts() const {
  return std::all_of(hosts.begin(), hosts.end(),
                     [&](const auto& h) { return h.size() == hosts.front().size(); });
}

}  // namespace ddp::comm
