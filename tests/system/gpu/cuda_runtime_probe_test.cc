// The CUDA runtime probe (label gpu): loads the CUDA runtime library at run time (dlopen of
// libcudart.so.13, then .12, or DDP_CUDART_LIBRARY), reads the device count, and on each device
// copies a pattern host -> device -> device -> host and checks every byte came back. Torch-free,
// built without CUDA. Skips with "no CUDA device" where no runtime library loads or the runtime
// reports no device (no driver, or a driver without a GPU); every other runtime error fails.
#include <dlfcn.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include <gtest/gtest.h>

namespace {

// The few runtime entry points the probe needs, with the C ABI of cuda_runtime_api.h
// (cudaError_t is an int-sized enum; cudaMemcpyKind likewise).
using CudaError = int;
constexpr CudaError kCudaSuccess = 0;
constexpr CudaError kCudaErrorStubLibrary = 34;         // the toolkit's stub libcuda, no driver
constexpr CudaError kCudaErrorInsufficientDriver = 35;  // no driver (or one older than the runtime)
constexpr CudaError kCudaErrorNoDevice = 100;
constexpr int kHostToDevice = 1;
constexpr int kDeviceToHost = 2;
constexpr int kDeviceToDevice = 3;

struct CudaRuntime {
  void* handle = nullptr;
  std::string name;
  std::string load_errors;
  CudaError (*get_device_count)(int*) = nullptr;
  CudaError (*set_device)(int) = nullptr;
  CudaError (*malloc_)(void**, std::size_t) = nullptr;
  CudaError (*free_)(void*) = nullptr;
  CudaError (*memcpy_)(void*, const void*, std::size_t, int) = nullptr;
  CudaError (*runtime_version)(int*) = nullptr;
  CudaError (*driver_version)(int*) = nullptr;
  const char* (*error_string)(CudaError) = nullptr;

  std::string describe(CudaError e) const {
    return "error " + std::to_string(e) + " (" + (error_string ? error_string(e) : "?") + ")";
  }
};

template <typename F>
bool bind(CudaRuntime& rt, F& fn, const char* symbol) {
  fn = reinterpret_cast<F>(dlsym(rt.handle, symbol));
  // Appended piece by piece: GCC 12 warns (-Warray-bounds, a false positive) on the chain of
  // std::string operator+ this was, once <string> comes from the tests' precompiled header.
  if (fn == nullptr) {
    rt.load_errors.append(" ").append(symbol).append(" missing in ").append(rt.name).append(";");
  }
  return fn != nullptr;
}

// The first runtime library that loads and has every entry point, or one with handle == nullptr
// and load_errors saying what was tried.
CudaRuntime load_cuda_runtime() {
  CudaRuntime rt;
  std::vector<std::string> candidates;
  if (const char* path = std::getenv("DDP_CUDART_LIBRARY"); path != nullptr && *path != '\0') {
    candidates.emplace_back(path);
  }
  candidates.insert(candidates.end(), {"libcudart.so.13", "libcudart.so.12"});
  for (const auto& name : candidates) {
    rt.handle = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (rt.handle == nullptr) {
      const char* why = dlerror();
      rt.load_errors += " " + name + ": " + (why != nullptr ? why : "not found") + ";";
      continue;
    }
    rt.name = name;
    bool ok = bind(rt, rt.get_device_count, "cudaGetDeviceCount");
    ok = bind(rt, rt.set_device, "cudaSetDevice") && ok;
    ok = bind(rt, rt.malloc_, "cudaMalloc") && ok;
    ok = bind(rt, rt.free_, "cudaFree") && ok;
    ok = bind(rt, rt.memcpy_, "cudaMemcpy") && ok;
    ok = bind(rt, rt.runtime_version, "cudaRuntimeGetVersion") && ok;
    ok = bind(rt, rt.driver_version, "cudaDriverGetVersion") && ok;
    ok = bind(rt, rt.error_string, "cudaGetErrorString") && ok;
    if (ok) return rt;
    dlclose(rt.handle);  // incomplete: try the next (one that is complete stays loaded)
    rt.handle = nullptr;
  }
  return rt;
}

// The process's runtime (loaded once; never unloaded) and its device count, or the reason to skip.
struct Probe {
  CudaRuntime rt;
  int devices = 0;
  std::string skip;   // non-empty: no CUDA device, and why
  std::string error;  // non-empty: the runtime failed in a way that is not "no device"
};

const Probe& probe() {
  static const Probe result = [] {
    Probe p;
    p.rt = load_cuda_runtime();
    if (p.rt.handle == nullptr) {
      p.skip = "no CUDA device (no CUDA runtime library loaded:" + p.rt.load_errors +
               " set DDP_CUDART_LIBRARY to its path)";
      return p;
    }
    const CudaError e = p.rt.get_device_count(&p.devices);
    if (e == kCudaErrorNoDevice || e == kCudaErrorInsufficientDriver ||
        e == kCudaErrorStubLibrary) {
      p.skip = "no CUDA device (" + p.rt.name + ": cudaGetDeviceCount " + p.rt.describe(e) + ")";
    } else if (e != kCudaSuccess) {
      p.error = p.rt.name + ": cudaGetDeviceCount " + p.rt.describe(e);
    } else if (p.devices == 0) {
      p.skip = "no CUDA device (" + p.rt.name + ": cudaGetDeviceCount gave 0)";
    }
    return p;
  }();
  return result;
}

#define DDP_SKIP_WITHOUT_CUDA_DEVICE()                       \
  do {                                                       \
    ASSERT_TRUE(probe().error.empty()) << probe().error;     \
    if (!probe().skip.empty()) GTEST_SKIP() << probe().skip; \
  } while (false)

TEST(CudaRuntimeProbe, DeviceCountAndVersionsAreReadable) {
  DDP_SKIP_WITHOUT_CUDA_DEVICE();
  const auto& rt = probe().rt;
  EXPECT_GT(probe().devices, 0);
  int runtime = 0;
  int driver = 0;
  ASSERT_EQ(rt.runtime_version(&runtime), kCudaSuccess);
  ASSERT_EQ(rt.driver_version(&driver), kCudaSuccess);
  EXPECT_GT(runtime, 0);
  EXPECT_GT(driver, 0);
  // A runtime newer in its major version than the driver cannot run kernels; within a major
  // version CUDA's minor-version compatibility applies.
  EXPECT_LE(runtime / 1000, driver / 1000)
      << rt.name << " is CUDA " << runtime << " but the driver supports CUDA " << driver;
  std::printf("cuda_runtime_probe: %s, runtime %d, driver %d, %d device(s)\n", rt.name.c_str(),
              runtime, driver, probe().devices);
}

TEST(CudaRuntimeProbe, DeviceRoundTripKeepsEveryByte) {
  DDP_SKIP_WITHOUT_CUDA_DEVICE();
  const auto& rt = probe().rt;
  constexpr std::size_t kBytes = (std::size_t{64} << 20) + 13;  // 64 MiB and an odd tail
  std::vector<std::uint8_t> pattern(kBytes);
  std::uint32_t x = 0x9E3779B9u;
  for (auto& b : pattern) {  // xorshift: no runs a skipped copy could hide in
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    b = static_cast<std::uint8_t>(x);
  }
  for (int device = 0; device < probe().devices; ++device) {
    SCOPED_TRACE("cuda:" + std::to_string(device));
    CudaError e = rt.set_device(device);
    ASSERT_EQ(e, kCudaSuccess) << "cudaSetDevice " << rt.describe(e);
    void* a = nullptr;
    void* b = nullptr;
    e = rt.malloc_(&a, kBytes);
    ASSERT_EQ(e, kCudaSuccess) << "cudaMalloc " << rt.describe(e);
    e = rt.malloc_(&b, kBytes);
    if (e != kCudaSuccess) rt.free_(a);
    ASSERT_EQ(e, kCudaSuccess) << "cudaMalloc " << rt.describe(e);
    std::vector<std::uint8_t> back(kBytes, 0xA5);  // poisoned: an unwritten byte shows
    const CudaError up = rt.memcpy_(a, pattern.data(), kBytes, kHostToDevice);
    const CudaError across = up == kCudaSuccess ? rt.memcpy_(b, a, kBytes, kDeviceToDevice) : up;
    const CudaError down =
        across == kCudaSuccess ? rt.memcpy_(back.data(), b, kBytes, kDeviceToHost) : across;
    EXPECT_EQ(rt.free_(a), kCudaSuccess);
    EXPECT_EQ(rt.free_(b), kCudaSuccess);
    ASSERT_EQ(up, kCudaSuccess) << "cudaMemcpy host to device " << rt.describe(up);
    ASSERT_EQ(across, kCudaSuccess) << "cudaMemcpy device to device " << rt.describe(across);
    ASSERT_EQ(down, kCudaSuccess) << "cudaMemcpy device to host " << rt.describe(down);
    std::size_t wrong = 0;
    std::size_t first_wrong = kBytes;
    for (std::size_t i = 0; i < kBytes; ++i) {
      if (back[i] != pattern[i]) {
        if (wrong++ == 0) first_wrong = i;
      }
    }
    EXPECT_EQ(wrong, 0u) << "bytes differ after the round trip; the first at offset "
                         << first_wrong;
  }
}

}  // namespace
