// libFuzzer harness: ddp-trace's reader of flight recorder dumps and its analysis
// (tools/ddp-trace/flight_dump.h, analyze.h).
//
// The first input byte picks the rank the dump claims (0..3, so that two inputs' halves can form
// a group); the rest is the dump's text. The reader must return or throw TraceError, nothing
// else; a dump it returns goes through analyze(), alone and as two ranks of one group, which must
// finish (no hang: libFuzzer's -timeout) without crashing.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "ddp-trace/analyze.h"
#include "ddp-trace/flight_dump.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 1) return 0;
  const std::string text(reinterpret_cast<const char*>(data) + 1, size - 1);
  ddp::trace::FlightDump dump;
  try {
    dump = ddp::trace::parse_flight_dump(text, "fuzz.json");
  } catch (const ddp::trace::TraceError&) {
    return 0;
  }
  if (dump.rank < 0 || dump.rank >= dump.size) std::abort();  // the reader checks this
  std::vector<ddp::trace::FlightDump> dumps{dump};
  (void)ddp::trace::analyze(dumps);
  // The same dump as another rank of the group, when the group has one.
  if (dump.size > 1) {
    ddp::trace::FlightDump other = dump;
    other.rank = (dump.rank + 1 + data[0] % 3) % dump.size;
    if (!other.entries.empty()) other.entries.pop_back();
    dumps.push_back(other);
    (void)ddp::trace::analyze(dumps);
  }
  return 0;
}
