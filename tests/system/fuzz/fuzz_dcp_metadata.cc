// libFuzzer harness: the distributed checkpoint's metadata reader (src/archive/dcp_metadata.h) on
// any bytes. It must return metadata whose every chunk lies inside its tensor with a storage
// record in a plain file name, or throw archive::FormatError; nothing else, in bounded time and
// memory (seeds: PyTorch 2.15's metadata and its hostile variants, tests/data/dcp).
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string_view>

#include "archive/dcp_metadata.h"

namespace {

[[noreturn]] void fail(const char* what) {
  std::fprintf(stderr, "fuzz_dcp_metadata: %s\n", what);
  std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  try {
    const auto metadata = ddp::archive::parse_dcp_metadata(bytes);
    for (const auto& [name, tensor] : metadata.tensors) {
      for (const auto& chunk : tensor.chunks) {
        if (chunk.offsets.size() != tensor.shape.size()) fail("a chunk of another rank");
        for (std::size_t d = 0; d < tensor.shape.size(); ++d) {
          if (chunk.offsets[d] < 0 || chunk.sizes[d] < 0 ||
              chunk.offsets[d] + chunk.sizes[d] > tensor.shape[d]) {
            fail("a chunk outside its tensor");
          }
        }
        if (chunk.storage.file.empty() || chunk.storage.file.find('/') != std::string::npos ||
            chunk.storage.file.front() == '.') {
          fail("a data file name outside the folder");
        }
      }
    }
  } catch (const ddp::archive::FormatError&) {
  }
  return 0;
}
