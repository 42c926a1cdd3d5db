// The hierarchical allreduce across real "hosts": two network namespaces joined by a veth pair
// (10.200.0.1/24 and 10.200.0.2/24, with 1 ms of netem delay each way when the kernel has netem),
// two ranks in each. The ranks share the kernel, so inside a namespace they use shared memory and
// across namespaces TCP over the veth pair. Needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN); skips with
// the reason otherwise. The namespaces carry this process's pid in their names and are deleted at
// the end, also when the test fails. No traffic leaves them.
#include <gtest/gtest.h>
#include <unistd.h>

#include <string>
#include <vector>

#include <fmt/format.h>

#include "support/subprocess.h"

namespace ddp::test {
namespace {

using namespace std::chrono_literals;

// Runs a command; returns its exit status and output.
ExitStatus run(const std::vector<std::string>& argv) {
  return Subprocess::start(argv).wait(30s);
}

std::string joined(const std::vector<std::string>& argv) {
  std::string s;
  for (const auto& a : argv)
    s += (s.empty() ? "" : " ") + a;
  return s;
}

// Two namespaces and the veth pair between them; deleted by the destructor.
class TwoHosts {
 public:
  TwoHosts() {
    const int pid = static_cast<int>(::getpid());
    ns_[0] = fmt::format("ddpA{}", pid);
    ns_[1] = fmt::format("ddpB{}", pid);
    veth_[0] = fmt::format("ddpva{}", pid);
    veth_[1] = fmt::format("ddpvb{}", pid);
  }
  ~TwoHosts() {
    // Deleting a namespace deletes its end of the veth pair, and with it the other end.
    for (int i = 0; i < 2; ++i) {
      if (created_[i]) run({"ip", "netns", "del", ns_[i]});
    }
  }

  // "" on success, else why the namespaces could not be made (the test then skips).
  std::string create_namespaces() {
    for (int i = 0; i < 2; ++i) {
      const auto r = run({"ip", "netns", "add", ns_[i]});
      if (r.exit_code != 0) return fmt::format("'ip netns add {}' failed: {}", ns_[i], r.output);
      created_[i] = true;
    }
    return "";
  }

  // Throws-free: returns the first failing command's description, or "".
  std::string wire_up() {
    const std::vector<std::vector<std::string>> commands = {
        {"ip", "link", "add", veth_[0], "type", "veth", "peer", "name", veth_[1]},
        {"ip", "link", "set", veth_[0], "netns", ns_[0]},
        {"ip", "link", "set", veth_[1], "netns", ns_[1]},
        {"ip", "-n", ns_[0], "addr", "add", "10.200.0.1/24", "dev", veth_[0]},
        {"ip", "-n", ns_[1], "addr", "add", "10.200.0.2/24", "dev", veth_[1]},
        {"ip", "-n", ns_[0], "link", "set", "lo", "up"},
        {"ip", "-n", ns_[1], "link", "set", "lo", "up"},
        {"ip", "-n", ns_[0], "link", "set", veth_[0], "up"},
        {"ip", "-n", ns_[1], "link", "set", veth_[1], "up"},
    };
    for (const auto& c : commands) {
      const auto r = run(c);
      if (r.exit_code != 0) return fmt::format("'{}' failed: {}", joined(c), r.output);
    }
    return "";
  }

  // Adds 1 ms of delay on both ends; false when the kernel has no netem.
  bool add_delay() {
    for (int i = 0; i < 2; ++i) {
      const auto r = run(
          {"tc", "-n", ns_[i], "qdisc", "add", "dev", veth_[i], "root", "netem", "delay", "1ms"});
      if (r.exit_code != 0) return false;
    }
    return true;
  }

  const std::string& ns(int i) const { return ns_[i]; }

 private:
  std::string ns_[2];
  std::string veth_[2];
  bool created_[2] = {false, false};
};

TEST(Netns, HierarchicalAllreduceAcrossTwoNamespacesWithTwoRanksEach) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to create network namespaces (ip netns add)";
  TwoHosts hosts;
  if (const std::string why = hosts.create_namespaces(); !why.empty()) {
    GTEST_SKIP() << "cannot create network namespaces: " << why;
  }
  const std::string wiring = hosts.wire_up();
  ASSERT_EQ(wiring, "") << "setting up the veth pair failed";
  const bool delayed = hosts.add_delay();
  std::cout << (delayed ? "netem: 1 ms delay on both ends of the veth pair\n"
                        : "netem unavailable: running without added delay\n");

  const std::string address[2] = {"10.200.0.1", "10.200.0.2"};
  const std::string port = "29517";
  const int size = 4;
  std::vector<Subprocess> ranks;
  for (int rank = 0; rank < size; ++rank) {
    const int host = rank / 2;
    ranks.push_back(
        Subprocess::start({"ip", "netns", "exec", hosts.ns(host), built_program("netns_rank"),
                           std::to_string(rank), std::to_string(size), address[0], port},
                          {{"DDP_ADVERTISE_ADDR", address[host]},
                           {"DDP_TRANSPORT", std::nullopt},
                           {"DDP_HOST_ID", std::nullopt}}));
  }
  for (int rank = 0; rank < size; ++rank) {
    const auto r = ranks[static_cast<std::size_t>(rank)].wait(150s);
    EXPECT_EQ(r.exit_code, 0) << "rank " << rank << (r.timed_out ? " timed out" : "") << ":\n"
                              << r.output;
    if (r.exit_code == 0) std::cout << r.output;
  }
}

}  // namespace
}  // namespace ddp::test
