// Loading libnccl and libcudart (see nccl_library.h).
#include "comm/nccl/nccl_library.h"

#include <dlfcn.h>

#include <memory>
#include <mutex>
#include <sstream>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "ddp/error.h"

#ifndef DDP_NCCL_FALLBACK_DIRS
#define DDP_NCCL_FALLBACK_DIRS ""
#endif

namespace ddp::comm::nccl {
namespace {

struct Opened {
  void* handle = nullptr;
  std::string path;
};

std::vector<std::string> fallback_dirs() {
  std::vector<std::string> dirs;
  std::stringstream in(DDP_NCCL_FALLBACK_DIRS);
  for (std::string dir; std::getline(in, dir, ':');) {
    if (!dir.empty()) dirs.push_back(dir);
  }
  return dirs;
}

// The file a handle came from (for messages): the path of one of its symbols.
std::string path_of(void* handle, const char* symbol, const std::string& fallback) {
  Dl_info info{};
  void* address = ::dlsym(handle, symbol);
  if (address != nullptr && ::dladdr(address, &info) != 0 && info.dli_fname != nullptr) {
    return info.dli_fname;
  }
  return fallback;
}

// Tries each soname by the loader's rules, then in each fallback folder. `tried` collects the
// loader's reasons for the message.
Opened open_first(const std::vector<std::string>& names, const char* probe_symbol,
                  std::vector<std::string>& tried) {
  std::vector<std::string> candidates = names;
  for (const auto& dir : fallback_dirs()) {
    for (const auto& name : names)
      candidates.push_back(dir + "/" + name);
  }
  for (const auto& candidate : candidates) {
    ::dlerror();
    // RTLD_LOCAL: ddp calls through the table only; RTLD_NOW: a broken library shows here.
    void* handle = ::dlopen(candidate.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (handle != nullptr) return {handle, path_of(handle, probe_symbol, candidate)};
    const char* why = ::dlerror();
    tried.push_back(fmt::format("{} ({})", candidate, why != nullptr ? why : "not found"));
  }
  return {};
}

template <class F>
void bind(void* handle, const std::string& path, const char* symbol, F& slot, const char* what) {
  ::dlerror();
  void* address = ::dlsym(handle, symbol);
  if (address == nullptr) {
    throw ConfigError(fmt::format(
        "the {} loaded from {} has no function {}: it is too old or not a {} library; point "
        "DDP_NCCL_LIBRARY (NCCL) or the loader path (LD_LIBRARY_PATH) at NCCL 2.14 or later and "
        "CUDA runtime 12 or later",
        what, path, symbol, what));
  }
  slot = reinterpret_cast<F>(address);
}

std::unique_ptr<NcclLibrary> load_now(const std::string& library) {
  auto lib = std::make_unique<NcclLibrary>();
  std::vector<std::string> tried;
  const std::vector<std::string> nccl_names =
      library.empty() ? std::vector<std::string>{"libnccl.so.2"} : std::vector{library};
  // An explicit path is taken as it is: no fallback folders behind it (a test names a missing
  // one to see this error, and a user who named one wants that one).
  Opened nccl;
  if (library.empty()) {
    nccl = open_first(nccl_names, "ncclGetVersion", tried);
  } else {
    ::dlerror();
    nccl.handle = ::dlopen(library.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (nccl.handle == nullptr) {
      const char* why = ::dlerror();
      tried.push_back(fmt::format("{} ({})", library, why != nullptr ? why : "not found"));
    } else {
      nccl.path = path_of(nccl.handle, "ncclGetVersion", library);
    }
  }
  if (nccl.handle == nullptr) {
    throw ConfigError(fmt::format(
        "the nccl backend cannot load libnccl: tried {}. Install NCCL (PyTorch's CUDA wheel ships "
        "it in site-packages/nvidia/nccl/lib), add its folder to LD_LIBRARY_PATH or set "
        "DDP_NCCL_LIBRARY to the library's path; or use the ring backend",
        fmt::join(tried, "; ")));
  }
  lib->nccl_path = nccl.path;
  tried.clear();
  Opened cudart = open_first({"libcudart.so.13", "libcudart.so.12", "libcudart.so"},
                             "cudaGetDeviceCount", tried);
  if (cudart.handle == nullptr) {
    throw ConfigError(fmt::format(
        "the nccl backend cannot load the CUDA runtime: tried {}. Install the CUDA runtime "
        "(PyTorch's CUDA wheel ships it in site-packages/nvidia/cu13/lib) and add its folder to "
        "LD_LIBRARY_PATH; or use the ring backend",
        fmt::join(tried, "; ")));
  }
  lib->cudart_path = cudart.path;

  const auto n = [&](const char* symbol, auto& slot) {
    bind(nccl.handle, lib->nccl_path, symbol, slot, "libnccl");
  };
  n("ncclGetVersion", lib->GetVersion);
  n("ncclGetUniqueId", lib->GetUniqueId);
  n("ncclCommInitRankConfig", lib->CommInitRankConfig);
  n("ncclCommSplit", lib->CommSplit);
  n("ncclCommAbort", lib->CommAbort);
  n("ncclCommFinalize", lib->CommFinalize);
  n("ncclCommDestroy", lib->CommDestroy);
  n("ncclCommGetAsyncError", lib->CommGetAsyncError);
  n("ncclGetErrorString", lib->GetErrorString);
  n("ncclGetLastError", lib->GetLastError);
  n("ncclGroupStart", lib->GroupStart);
  n("ncclGroupEnd", lib->GroupEnd);
  n("ncclAllReduce", lib->AllReduce);
  n("ncclBroadcast", lib->Broadcast);
  n("ncclReduce", lib->Reduce);
  n("ncclAllGather", lib->AllGather);
  n("ncclReduceScatter", lib->ReduceScatter);
  n("ncclSend", lib->Send);
  n("ncclRecv", lib->Recv);

  const auto c = [&](const char* symbol, auto& slot) {
    bind(cudart.handle, lib->cudart_path, symbol, slot, "CUDA runtime");
  };
  c("cudaGetDeviceCount", lib->GetDeviceCount);
  c("cudaGetDevice", lib->GetDevice);
  c("cudaSetDevice", lib->SetDevice);
  c("cudaGetErrorName", lib->GetErrorName);
  c("cudaGetErrorString", lib->GetErrorStringCuda);
  c("cudaStreamCreateWithFlags", lib->StreamCreateWithFlags);
  c("cudaStreamDestroy", lib->StreamDestroy);
  c("cudaStreamWaitEvent", lib->StreamWaitEvent);
  c("cudaEventCreateWithFlags", lib->EventCreateWithFlags);
  c("cudaEventDestroy", lib->EventDestroy);
  c("cudaEventRecord", lib->EventRecord);
  c("cudaEventQuery", lib->EventQuery);
  c("cudaMalloc", lib->Malloc);
  c("cudaFree", lib->Free);
  c("cudaMallocHost", lib->MallocHost);
  c("cudaFreeHost", lib->FreeHost);
  c("cudaMemcpyAsync", lib->MemcpyAsync);
  c("cudaMemcpy", lib->Memcpy);
  c("cudaMemsetAsync", lib->MemsetAsync);
  c("cudaStreamSynchronize", lib->StreamSynchronize);
  c("cudaDeviceSynchronize", lib->DeviceSynchronize);
  c("cudaPointerGetAttributes", lib->PointerGetAttributes);
  c("cudaGetLastError", lib->GetLastErrorCuda);

  int version = 0;
  if (lib->GetVersion(&version) == ncclSuccess) lib->nccl_version = version;
  // ncclConfig_t (non-blocking communicators) and ncclCommSplit came with NCCL 2.14; ncclAvg and
  // bfloat16 with 2.10.
  if (version != 0 && version < 21400) {
    throw ConfigError(fmt::format(
        "the libnccl loaded from {} is NCCL {}.{}.{}; the nccl backend needs 2.14 or later "
        "(non-blocking communicators). Point DDP_NCCL_LIBRARY at a newer libnccl.so.2",
        lib->nccl_path, version / 10000, version / 100 % 100, version % 100));
  }
  return lib;
}

}  // namespace

const NcclLibrary& NcclLibrary::load(std::string_view library) {
  static std::mutex mutex;
  static std::unique_ptr<NcclLibrary> loaded;  // never freed: the libraries stay loaded
  std::lock_guard lock(mutex);
  if (!loaded) loaded = load_now(std::string(library));
  return *loaded;
}

std::string cuda_error_text(const NcclLibrary& lib, cudaError_t error) {
  return fmt::format("{}: {}", lib.GetErrorName(error), lib.GetErrorStringCuda(error));
}

int NcclLibrary::select_device(int device) const {
  int count = 0;
  const cudaError_t rc = GetDeviceCount(&count);
  if (rc != cudaSuccess || count == 0) {
    throw ConfigError(fmt::format(
        "the nccl backend found no CUDA device in this process ({}; CUDA runtime {}). Run on a "
        "machine with an NVIDIA GPU and its driver, check CUDA_VISIBLE_DEVICES, or use the ring "
        "backend (DDP_BACKEND=ring) for CPU training",
        rc != cudaSuccess ? cuda_error_text(*this, rc) : "cudaGetDeviceCount gave 0 devices",
        cudart_path));
  }
  if (device < 0) {
    const cudaError_t got = GetDevice(&device);
    if (got != cudaSuccess) {
      throw ConfigError(fmt::format("the nccl backend cannot read the current CUDA device ({})",
                                    cuda_error_text(*this, got)));
    }
  }
  if (device >= count) {
    throw ConfigError(fmt::format(
        "the nccl backend was asked for CUDA device {} but this process sees {} device{} (0..{}): "
        "every rank needs a GPU of its own, so launch with --nproc-per-node {} or fewer per host "
        "(or check CUDA_VISIBLE_DEVICES)",
        device, count, count == 1 ? "" : "s", count - 1, count));
  }
  const cudaError_t set = SetDevice(device);
  if (set != cudaSuccess) {
    throw ConfigError(fmt::format("the nccl backend cannot use CUDA device {} ({})", device,
                                  cuda_error_text(*this, set)));
  }
  return device;
}

}  // namespace ddp::comm::nccl
