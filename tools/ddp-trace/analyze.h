// ddp-trace analyze: reads every rank's flight recorder dump of a group and says what went wrong
// (docs/observability.md, "Analyzing dumps").
//
//   auto report = ddp::trace::analyze(ddp::trace::read_flight_dumps(dir));
//   for (const auto& line : report.lines) std::cout << line << '\n';
//   return report.problem ? 1 : 0;
//
// Per group: which ranks sent no dump; the first error and the rank that had it; which rank is
// behind ("rank N last completed #S while rank M reached #T"): counting only what each rank issued
// before the group's first failure, since calls issued after it fail at once and prove nothing;
// which collective never matched (issued on some ranks, missing on others, or started everywhere
// and completed nowhere); and fingerprint mismatches (different op, dtype, count, reduce op or
// root at one sequence number).
#pragma once

#include <string>
#include <vector>

#include "ddp-trace/flight_dump.h"

namespace ddp::trace {

struct Report {
  std::vector<std::string> lines;  // what to print, in order
  bool problem = false;            // something was found (ddp-trace exits 1)
};

// `dumps` as read_flight_dumps returns them (any order; several groups allowed).
Report analyze(const std::vector<FlightDump>& dumps);

}  // namespace ddp::trace
