// libFuzzer harness: the distributed checkpoint's metadata reader (src/archive/dcp_metadata.h) on
// any bytes. It must return metadata whose every chunk lies inside its tensor with a storage
// record in a plain file name, or throw archive::FormatError; nothing else, in bounded time and
// memory (seeds: PyTorch 2.15's metadata and its hostile variants, tests/data/dcp). What it
// accepts must also survive the writer: encode_dcp_metadata of it parses back to the same
// entries, and encoding that gives the same bytes (what ddp writes, ddp reads).
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
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
    std::string written;
    try {
      written = ddp::archive::encode_dcp_metadata(metadata);
    } catch (const ddp::archive::FormatError&) {
      fail("metadata the reader accepted could not be written");
    }
    ddp::archive::DcpMetadata again;
    try {
      again = ddp::archive::parse_dcp_metadata(written);
    } catch (const ddp::archive::FormatError&) {
      fail("metadata ddp wrote was refused by its reader");
    }
    if (again.order != metadata.order || again.tensors.size() != metadata.tensors.size() ||
        again.values.size() != metadata.values.size()) {
      fail("metadata written and read back lost entries");
    }
    if (ddp::archive::encode_dcp_metadata(again) != written) {
      fail("metadata written twice gave different bytes");
    }
  } catch (const ddp::archive::FormatError&) {
  }
  return 0;
}
