// shared_page_refault: what it costs to free a buffer between uses and fill it again, for the
// two kinds of memory a flat FSDP buffer could live in.
//
//   shared_page_refault [--sizes 16M,64M] [--iters 5]
//
// FSDP frees each unit's flat gradient (and, FULL_SHARD, its gathered parameters) between uses
// and maps them afresh, so peak memory holds one unit at a time. Its buffers are private
// anonymous memory, 2 MiB-aligned with MADV_HUGEPAGE (src/torch/fsdp/fsdp_flat_memory.cc); the
// ring backend's zero-copy reduce-scatter and allgather need them in a shared buffer instead (a
// memfd every rank maps), which would be released between uses by punching a hole (MADV_REMOVE)
// and refaulted on the next fill. This program times, per size, the median of --iters rounds of
// each cycle, and the fill of memory that stays resident (the floor):
//
//   anon_thp      mmap (2 MiB-aligned, MADV_HUGEPAGE), fill, munmap
//   memfd         fill a shared memfd mapping, MADV_REMOVE (huge only where
//                 /sys/kernel/mm/transparent_hugepage/shmem_enabled allows it: the mapping is
//                 2 MiB-aligned with MADV_HUGEPAGE, so "advise" is enough)
//   resident      fill memory already faulted in
//
// One JSON object per size and kind: {"kind", "bytes", "cycle_ms", "release_ms",
// "shmem_enabled"}. Every fill is checked (a byte of each page read back).
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include "byte_sizes.h"

namespace {

constexpr std::size_t kHugePage = std::size_t{2} << 20;
constexpr std::size_t kPage = 4096;

using Clock = std::chrono::steady_clock;

double ms_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[(v.size() - 1) / 2];
}

// The bracketed choice of /sys/kernel/mm/transparent_hugepage/shmem_enabled ("unknown" without).
std::string shmem_enabled() {
  std::ifstream in("/sys/kernel/mm/transparent_hugepage/shmem_enabled");
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const auto open = text.find('['), close = text.find(']');
  if (open == std::string::npos || close == std::string::npos || close < open) return "unknown";
  return text.substr(open + 1, close - open - 1);
}

void fill_and_check(std::byte* p, std::size_t bytes, int value) {
  std::memset(p, value, bytes);
  for (std::size_t at = 0; at < bytes; at += kPage) {
    if (p[at] != std::byte(value)) throw std::runtime_error("a filled page reads back wrong");
  }
}

// The first 2 MiB boundary in a reservation one huge page larger than the range it must hold.
std::byte* aligned_inside(void* reserved) {
  const auto at = reinterpret_cast<std::uintptr_t>(reserved);
  return reinterpret_cast<std::byte*>((at + kHugePage - 1) & ~(kHugePage - 1));
}

struct Cycle {
  double cycle_ms, release_ms;
};

Cycle anon_thp(std::size_t bytes, int value) {
  const auto start = Clock::now();
  const std::size_t reserved_bytes = bytes + kHugePage;
  void* reserved =
      mmap(nullptr, reserved_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (reserved == MAP_FAILED) throw std::runtime_error("mmap of anonymous memory failed");
  std::byte* p = aligned_inside(reserved);
  (void)madvise(p, bytes, MADV_HUGEPAGE);  // advice: ignored where THP is off
  fill_and_check(p, bytes, value);
  const auto filled = Clock::now();
  munmap(reserved, reserved_bytes);
  const auto end = Clock::now();
  return {ms_between(start, end), ms_between(filled, end)};
}

class SharedMemory {
 public:
  explicit SharedMemory(std::size_t bytes) : bytes_(bytes) {
    fd_ = memfd_create("shared_page_refault", MFD_CLOEXEC);
    if (fd_ < 0 || ftruncate(fd_, static_cast<off_t>(bytes)) != 0) {
      throw std::runtime_error("memfd_create/ftruncate failed");
    }
    reserved_bytes_ = bytes + kHugePage;
    reserved_ = mmap(nullptr, reserved_bytes_, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (reserved_ == MAP_FAILED) throw std::runtime_error("mmap of the reservation failed");
    data_ = aligned_inside(reserved_);
    if (mmap(data_, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd_, 0) == MAP_FAILED) {
      throw std::runtime_error("mmap of the memfd failed");
    }
    (void)madvise(data_, bytes, MADV_HUGEPAGE);
  }
  ~SharedMemory() {
    munmap(reserved_, reserved_bytes_);
    close(fd_);
  }
  SharedMemory(const SharedMemory&) = delete;
  SharedMemory& operator=(const SharedMemory&) = delete;

  Cycle cycle(int value) {
    const auto start = Clock::now();
    fill_and_check(data_, bytes_, value);
    const auto filled = Clock::now();
    if (madvise(data_, bytes_, MADV_REMOVE) != 0) throw std::runtime_error("MADV_REMOVE failed");
    const auto end = Clock::now();
    return {ms_between(start, end), ms_between(filled, end)};
  }
  double fill_resident(int value) {
    fill_and_check(data_, bytes_, value);  // fault in, untimed
    const auto start = Clock::now();
    fill_and_check(data_, bytes_, value + 1);
    return ms_between(start, Clock::now());
  }

 private:
  std::size_t bytes_;
  int fd_ = -1;
  void* reserved_ = nullptr;
  std::size_t reserved_bytes_ = 0;
  std::byte* data_ = nullptr;
};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "shared_page_refault: the cost of freeing a buffer between uses and filling it "
      "again, private THP memory against a shared memfd"};
  std::string sizes_text = "16M,64M";
  int iters = 5;
  app.add_option("--sizes", sizes_text, "comma-separated sizes, K/M/G suffixes (default 16M,64M)");
  app.add_option("--iters", iters, "rounds per size and kind; the median counts (default 5)")
      ->check(CLI::Range(1, 1000));
  CLI11_PARSE(app, argc, argv);
  try {
    const auto sizes = parse_byte_sizes(sizes_text);
    const std::string shmem = shmem_enabled();
    for (const std::size_t bytes : sizes) {
      std::vector<double> anon_cycle, anon_release, shared_cycle, shared_release, resident;
      SharedMemory shared(bytes);
      anon_thp(bytes, 1);  // the first round faults in the kernel's own structures: untimed
      shared.cycle(1);
      for (int i = 0; i < iters; ++i) {
        const auto a = anon_thp(bytes, 2 + i % 100);
        anon_cycle.push_back(a.cycle_ms);
        anon_release.push_back(a.release_ms);
        const auto s = shared.cycle(2 + i % 100);
        shared_cycle.push_back(s.cycle_ms);
        shared_release.push_back(s.release_ms);
      }
      for (int i = 0; i < iters; ++i)
        resident.push_back(shared.fill_resident(2 + i % 100));
      auto row = [&](const char* kind, double cycle_ms, double release_ms) {
        fmt::print(
            "{{\"kind\": \"{}\", \"bytes\": {}, \"cycle_ms\": {:.2f}, \"release_ms\": {:.2f}, "
            "\"shmem_enabled\": \"{}\"}}\n",
            kind, bytes, cycle_ms, release_ms, shmem);
      };
      row("anon_thp", median(anon_cycle), median(anon_release));
      row("memfd", median(shared_cycle), median(shared_release));
      row("resident", median(resident), 0.0);
      std::fflush(stdout);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "shared_page_refault: %s\n", e.what());
    return 1;
  }
  return 0;
}
