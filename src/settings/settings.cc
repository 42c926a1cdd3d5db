#include "settings/settings.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <utility>

#include <fmt/format.h>

#include "ddp/error.h"

namespace ddp::settings {
namespace {

std::string value_or_empty(const Lookup& lookup, const char* name) {
  return lookup(name).value_or(std::string());
}

}  // namespace

std::optional<std::string> environment(const std::string& name) {
  const char* value = std::getenv(name.c_str());
  if (value == nullptr) return std::nullopt;
  return std::string(value);
}

Milliseconds timeout(const Lookup& lookup) {
  const auto text = lookup("DDP_TIMEOUT");
  if (!text) return kDefaultTimeout;
  double seconds = 0;
  const auto [ptr, ec] = std::from_chars(text->data(), text->data() + text->size(), seconds);
  if (text->empty() || ec != std::errc() || ptr != text->data() + text->size() ||
      !std::isfinite(seconds) || seconds <= 0 || seconds > 1e9) {
    throw ConfigError(fmt::format(
        "DDP_TIMEOUT='{}' is not a positive number of seconds written in decimal, at most 1e9 "
        "(e.g. DDP_TIMEOUT=60 or DDP_TIMEOUT=0.5)",
        *text));
  }
  return Milliseconds(std::max<long long>(1, std::llround(seconds * 1000.0)));
}

Milliseconds wait_warning(const Lookup& lookup) {
  const auto text = lookup("DDP_WAIT_WARN_SECONDS");
  if (!text) return kDefaultWaitWarning;
  double seconds = 0;
  const auto [ptr, ec] = std::from_chars(text->data(), text->data() + text->size(), seconds);
  if (text->empty() || ec != std::errc() || ptr != text->data() + text->size() ||
      !std::isfinite(seconds) || seconds < 0 || seconds > 1e9) {
    throw ConfigError(fmt::format(
        "DDP_WAIT_WARN_SECONDS='{}' is not a number of seconds (e.g. DDP_WAIT_WARN_SECONDS=30; 0 "
        "turns the warnings off)",
        *text));
  }
  if (seconds == 0) return Milliseconds(0);
  return Milliseconds(std::max<long long>(1, std::llround(seconds * 1000.0)));
}

std::string transport(const Lookup& lookup) {
  return value_or_empty(lookup, "DDP_TRANSPORT");
}

bool shm_shared_buffers(const Lookup& lookup) {
  const std::string value = value_or_empty(lookup, "DDP_SHM_SHARED_BUFFERS");
  if (value.empty() || value == "1") return true;
  if (value == "0") return false;
  throw ConfigError(fmt::format(
      "DDP_SHM_SHARED_BUFFERS='{}' is not 0 or 1; use DDP_SHM_SHARED_BUFFERS=0 to make every "
      "allreduce copy through the shared segment, 1 (the default) to let shared buffers skip it",
      value));
}

std::string host_id(const Lookup& lookup) {
  return value_or_empty(lookup, "DDP_HOST_ID");
}

std::string advertise_address(const Lookup& lookup) {
  return value_or_empty(lookup, "DDP_ADVERTISE_ADDR");
}

std::string nccl_library(const Lookup& lookup) {
  return value_or_empty(lookup, "DDP_NCCL_LIBRARY");
}

std::size_t flight_recorder_entries(const Lookup& lookup) {
  constexpr std::size_t kMax = 10'000'000;
  const auto text = lookup("DDP_FLIGHT_RECORDER_ENTRIES");
  if (!text) return kDefaultFlightRecorderEntries;
  std::size_t entries = 0;
  const auto [ptr, ec] = std::from_chars(text->data(), text->data() + text->size(), entries);
  if (text->empty() || ec != std::errc() || ptr != text->data() + text->size() || entries > kMax) {
    throw ConfigError(fmt::format(
        "DDP_FLIGHT_RECORDER_ENTRIES='{}' is not a number of operations from 0 (off) to {} "
        "(e.g. DDP_FLIGHT_RECORDER_ENTRIES=2000)",
        *text, kMax));
  }
  return entries;
}

std::string trace_dir(const Lookup& lookup) {
  return value_or_empty(lookup, "DDP_TRACE");
}

std::size_t trace_max_events(const Lookup& lookup) {
  constexpr std::size_t kMax = 100'000'000;
  const auto text = lookup("DDP_TRACE_MAX_EVENTS");
  if (!text) return kDefaultTraceMaxEvents;
  std::size_t events = 0;
  const auto [ptr, ec] = std::from_chars(text->data(), text->data() + text->size(), events);
  if (text->empty() || ec != std::errc() || ptr != text->data() + text->size() || events < 1 ||
      events > kMax) {
    throw ConfigError(
        fmt::format("DDP_TRACE_MAX_EVENTS='{}' is not a number of events from 1 to {} (e.g. "
                    "DDP_TRACE_MAX_EVENTS=200000)",
                    *text, kMax));
  }
  return events;
}

std::string dump_dir(const Lookup& lookup) {
  return value_or_empty(lookup, "DDP_DUMP_DIR");
}

JobPlace job_place(const Lookup& lookup) {
  const auto number = [&](const char* name) {
    const auto text = lookup(name);
    if (!text || text->empty()) return -1;
    int value = -1;
    const auto [ptr, ec] = std::from_chars(text->data(), text->data() + text->size(), value);
    return ec == std::errc() && ptr == text->data() + text->size() && value >= 0 ? value : -1;
  };
  for (const auto& [rank, size] :
       {std::pair{"RANK", "WORLD_SIZE"}, std::pair{"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"},
        std::pair{"SLURM_PROCID", "SLURM_NTASKS"}}) {
    if (const int r = number(rank); r >= 0) return {r, number(size)};
  }
  return {};
}

}  // namespace ddp::settings
