#include "ddp-trace/timeline_merge.h"

#include <algorithm>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <sstream>

#include <fmt/format.h>

namespace ddp::trace {
namespace {

const nlohmann::json& member(const nlohmann::json& object, const char* key,
                             const std::string& file) {
  if (!object.is_object() || !object.contains(key)) {
    throw TraceError(
        fmt::format("{}: no '{}' member: not a ddp timeline (trace_rank<R>.json "
                    "written under DDP_TRACE)",
                    file, key));
  }
  return object.at(key);
}

std::int64_t integer(const nlohmann::json& object, const char* key, const std::string& file) {
  const auto& value = member(object, key, file);
  if (!value.is_number_integer()) {
    throw TraceError(fmt::format("{}: '{}' is {}, not an integer", file, key, value.dump()));
  }
  return value.get<std::int64_t>();
}

std::string micros_text(std::int64_t ns) {
  return fmt::format("{:.3f} ms", ns / 1e6);
}

}  // namespace

std::vector<RankTimeline> read_timelines(const std::filesystem::path& dir) {
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec)) {
    throw TraceError(
        fmt::format("'{}' is not a folder; give the folder DDP_TRACE named", dir.string()));
  }
  static const std::regex kName(R"(trace_rank(\d+)\.json)");
  std::vector<RankTimeline> ranks;
  std::set<int> seen;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    std::smatch match;
    if (!entry.is_regular_file() || !std::regex_match(name, match, kName)) continue;
    RankTimeline timeline;
    timeline.file = entry.path().string();
    std::ifstream in(entry.path());
    try {
      timeline.trace = nlohmann::json::parse(in);
    } catch (const nlohmann::json::exception& e) {
      throw TraceError(
          fmt::format("{}: not valid JSON ({}); was it cut short? ddp writes traces "
                      "whole (temporary file and rename)",
                      timeline.file, e.what()));
    }
    const auto& events = member(timeline.trace, "traceEvents", timeline.file);
    if (!events.is_array()) throw TraceError(timeline.file + ": 'traceEvents' is not a list");
    const auto& other = member(timeline.trace, "otherData", timeline.file);
    timeline.rank = static_cast<int>(integer(other, "rank", timeline.file));
    timeline.world_size = static_cast<int>(integer(other, "world_size", timeline.file));
    const auto& clock = member(other, "clock", timeline.file);
    integer(clock, "steady_origin_ns", timeline.file);
    integer(clock, "system_origin_ns", timeline.file);
    if (!seen.insert(timeline.rank).second) {
      throw TraceError(fmt::format("two trace files of rank {} in '{}' ({} among them)",
                                   timeline.rank, dir.string(), timeline.file));
    }
    ranks.push_back(std::move(timeline));
  }
  if (ranks.empty()) {
    throw TraceError(fmt::format(
        "no trace_rank<R>.json in '{}'; run the job with DDP_TRACE={} (or ddp::start_trace)",
        dir.string(), dir.string()));
  }
  std::sort(ranks.begin(), ranks.end(),
            [](const RankTimeline& a, const RankTimeline& b) { return a.rank < b.rank; });
  return ranks;
}

MergedTimeline merge_timelines(const std::vector<RankTimeline>& ranks) {
  if (ranks.empty()) throw TraceError("nothing to merge: no rank's timeline");
  MergedTimeline merged;
  const RankTimeline& reference = ranks.front();
  const auto& reference_clock = reference.trace["otherData"]["clock"];
  const std::int64_t reference_steady = reference_clock["steady_origin_ns"].get<std::int64_t>();
  const std::int64_t reference_system = reference_clock["system_origin_ns"].get<std::int64_t>();
  const bool have_rank0 = reference.rank == 0;

  nlohmann::json events = nlohmann::json::array();
  nlohmann::json alignment_json = nlohmann::json::array();
  for (const auto& timeline : ranks) {
    const auto& other = timeline.trace["otherData"];
    const auto& clock = other["clock"];
    RankAlignment a;
    a.rank = timeline.rank;
    a.events = other.value("events", std::int64_t{0});
    a.dropped_events = other.value("dropped_events", std::int64_t{0});
    const std::int64_t steady = clock["steady_origin_ns"].get<std::int64_t>();
    const std::int64_t system = clock["system_origin_ns"].get<std::int64_t>();
    if (&timeline == &reference) {
      a.method = "reference";
      a.shift_ns = 0;
      a.error_bound_ns = 0;
    } else if (have_rank0 && clock.value("offset_measured", false)) {
      a.method = "ping-pong";
      a.shift_ns = steady + clock.value("offset_to_rank0_ns", std::int64_t{0}) - reference_steady;
      a.error_bound_ns = clock.value("offset_error_ns", std::int64_t{-1});
    } else {
      a.method = "system clock";
      a.shift_ns = system - reference_system;
      a.error_bound_ns = -1;
    }
    const double shift_us = static_cast<double>(a.shift_ns) / 1000.0;
    for (auto event : timeline.trace["traceEvents"]) {
      if (event.contains("ts") && event["ts"].is_number()) {
        event["ts"] = event["ts"].get<double>() + shift_us;
      }
      events.push_back(std::move(event));
    }
    alignment_json.push_back({{"rank", a.rank},
                              {"file", timeline.file},
                              {"method", a.method},
                              {"shift_ns", a.shift_ns},
                              {"error_bound_ns", a.error_bound_ns},
                              {"events", a.events},
                              {"dropped_events", a.dropped_events}});
    merged.lines.push_back(fmt::format(
        "rank {}: {} events, {}{}", a.rank, a.events,
        a.method == "reference"
            ? std::string("the reference clock")
            : fmt::format("shifted by {} ({}{})", micros_text(a.shift_ns), a.method,
                          a.error_bound_ns >= 0
                              ? fmt::format(", within ±{}", micros_text(a.error_bound_ns))
                              : std::string(", error unknown: as good as the hosts' clock sync")),
        a.dropped_events > 0 ? fmt::format("; {} events were dropped (the trace hit its cap; "
                                           "raise DDP_TRACE_MAX_EVENTS)",
                                           a.dropped_events)
                             : std::string()));
    merged.alignment.push_back(a);
  }
  const int world_size = reference.world_size;
  std::vector<int> missing;
  for (int r = 0; r < world_size; ++r) {
    if (std::none_of(ranks.begin(), ranks.end(),
                     [r](const RankTimeline& t) { return t.rank == r; })) {
      missing.push_back(r);
    }
  }
  if (!missing.empty()) {
    std::string list;
    for (const int r : missing)
      list += (list.empty() ? "" : ", ") + std::to_string(r);
    merged.lines.push_back(
        fmt::format("warning: no trace of rank(s) {} of world size {}", list, world_size));
  }
  merged.trace = {{"traceEvents", std::move(events)},
                  {"displayTimeUnit", "ms"},
                  {"otherData",
                   {{"format", "ddp-trace merged 1"},
                    {"reference_rank", reference.rank},
                    {"world_size", world_size},
                    {"ranks", std::move(alignment_json)}}}};
  return merged;
}

}  // namespace ddp::trace
