// One rank of the network-namespace test (tests/system/netns/netns_test.cc):
//   netns_rank RANK SIZE STORE_HOST STORE_PORT
// with DDP_ADVERTISE_ADDR set to its namespace's address. Checks that the group runs
// hierarchically, then allreduces several sizes, dtypes and ops against the reference on every
// rank. Exits 0 when everything matched, 1 with the reason on stderr otherwise.
#include <cstdio>
#include <exception>
#include <string>

#include <fmt/format.h>

#include "comm/comm_test_util.h"
#include "ddp/comm/ring_process_group.h"
#include "ddp/store/tcp_store.h"

int main(int argc, char** argv) {
  using namespace ddp;
  using namespace ddp::test;
  using namespace std::chrono_literals;
  if (argc != 5) {
    std::fprintf(stderr, "usage: netns_rank RANK SIZE STORE_HOST STORE_PORT\n");
    return 2;
  }
  const int rank = std::stoi(argv[1]);
  const int size = std::stoi(argv[2]);
  try {
    auto store =
        std::make_shared<TcpStore>(argv[3], static_cast<std::uint16_t>(std::stoi(argv[4])),
                                   TcpStoreOptions{.is_server = rank == 0,
                                                   .timeout = 60s,
                                                   .connect_timeout = 60s,
                                                   .listen_host = rank == 0 ? argv[3] : ""});
    auto pg =
        make_ring_process_group(store, rank, size, {.timeout = 60s, .transport = Transport::kAuto});
    const std::string transport = ring_transport_of(*pg);
    if (transport.rfind("hierarchical(2 hosts", 0) != 0) {
      throw std::runtime_error("expected a hierarchical group over 2 hosts, got " + transport);
    }
    int salt = 0;
    int checked = 0;
    // Small (leaders' path), just above the small-message size, and several shared-memory chunks
    // (slices, with a tail of count % 2 elements).
    for (std::size_t count :
         {std::size_t{1}, std::size_t{1009}, std::size_t{40001}, std::size_t{700001}}) {
      for (DType dtype : {DType::kFloat32, DType::kFloat64, DType::kBFloat16, DType::kInt32}) {
        for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax, ReduceOp::kProduct}) {
          ++salt;
          auto buf = make_input(dtype, count, rank, salt);
          pg->allreduce(buf.data(), count, dtype, op)->wait();
          expect_bytes(buf, expected_reduction(dtype, op, count, size, salt), dtype,
                       fmt::format("{} {} x {}", to_string(dtype), to_string(op), count));
          ++checked;
        }
      }
    }
    pg->barrier()->wait();  // rank 0 hosts the store: keep it up until everyone is done
    std::printf("rank %d: %d allreduces matched the reference over %s\n", rank, checked,
                transport.c_str());
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %d failed: %s\n", rank, e.what());
    return 1;
  }
}
