// libFuzzer harness: the restricted pickle reader (src/archive/pickle_reader.h) on any bytes.
// It must return a tree whose shape check passes and whose every node a converter may visit, or
// throw archive::FormatError; nothing else, in time and memory linear in the input (libFuzzer's
// -timeout and -rss_limit_mb, run_fuzzer.sh, catch a regression to the quadratic or exponential
// cases of the seeds).
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string_view>

#include "archive/pickle_reader.h"
#include "pytorch_archive_walk.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view pickle(reinterpret_cast<const char*>(data), size);
  try {
    const auto tree = ddp::archive::read_pickle(pickle, {.allow_global = ddp::fuzz::torch_global});
    tree.check_shape({});
    ddp::fuzz::walk_pickle(tree, [](const std::string&, std::uint64_t) {});
  } catch (const ddp::archive::FormatError& e) {
    if (e.kind() == ddp::archive::FormatError::Kind::kUnsafe && e.global_name().empty() &&
        std::string_view(e.what()).find("opcode") == std::string_view::npos) {
      std::fprintf(stderr, "fuzz_pickle_reader: an unsafe refusal that names nothing\n");
      std::abort();
    }
  }
  return 0;
}
