#include "ddp-trace/flight_dump.h"

#include <algorithm>
#include <fstream>
#include <sstream>
#include <system_error>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

namespace ddp::trace {
namespace {

using nlohmann::json;

// The field `key` of `object`, checked to have `type`; TraceError naming the file otherwise.
const json& field(const json& object, const char* key, json::value_t type,
                  const std::filesystem::path& path, const std::string& where) {
  const auto it = object.find(key);
  if (it == object.end()) {
    throw TraceError(fmt::format("{}: {} has no field '{}'; is this a ddp flight recorder dump?",
                                 path.string(), where, key));
  }
  const bool ok = it->type() == type || (type == json::value_t::number_integer &&
                                         it->type() == json::value_t::number_unsigned);
  if (!ok) {
    throw TraceError(fmt::format("{}: {}'s field '{}' is {}, not the {} the format has",
                                 path.string(), where, key, it->type_name(),
                                 json(type).type_name()));
  }
  return *it;
}

std::string string_or_empty(const json& object, const char* key) {
  const auto it = object.find(key);
  return it != object.end() && it->is_string() ? it->get<std::string>() : std::string();
}

long long int_or(const json& object, const char* key, long long fallback) {
  const auto it = object.find(key);
  return it != object.end() && it->is_number_integer() ? it->get<long long>() : fallback;
}

std::optional<std::int64_t> time_of(const json& object, const char* key) {
  const auto it = object.find(key);
  if (it == object.end() || !it->is_number_integer()) return std::nullopt;
  return it->get<std::int64_t>();
}

}  // namespace

std::string DumpEntry::describe() const {
  if (op.empty()) return fmt::format("operation #{}", sequence);
  std::string args = fmt::format("{} x {}", dtype, count);
  if (!reduce_op.empty()) args += ", " + reduce_op;
  if (root >= 0 && (op == "broadcast" || op == "reduce" || op == "gather" || op == "scatter")) {
    args += fmt::format(", root {}", root);
  }
  if (op == "barrier") args.clear();
  std::string text = fmt::format("{}({}) #{}", op, args, sequence);
  if (channel != "collective" && peer >= 0) {
    text += fmt::format(" {} rank {}", channel == "send" ? "to" : "from", peer);
  }
  return text;
}

std::string DumpEntry::fingerprint() const {
  return fmt::format("{}|{}|{}|{}|{}", op, dtype, count, reduce_op, root);
}

FlightDump parse_flight_dump(const std::string& text, const std::filesystem::path& path) {
  json doc;
  try {
    doc = json::parse(text);
  } catch (const json::exception& e) {  // parse_error, or out_of_range for a huge number
    throw TraceError(
        fmt::format("{}: not valid JSON ({}); a truncated dump? ranks write them atomically, so a "
                    "partial file was not written by ddp",
                    path.string(), e.what()));
  }
  if (!doc.is_object() || string_or_empty(doc, "format") != "ddp-flight-recorder") {
    throw TraceError(
        fmt::format("{}: not a ddp flight recorder dump (no \"format\": \"ddp-flight-recorder\")",
                    path.string()));
  }
  const long long version = int_or(doc, "version", -1);
  if (version != 1) {
    throw TraceError(
        fmt::format("{}: flight recorder format version {} is not one this ddp-trace reads (1)",
                    path.string(), version));
  }
  FlightDump dump;
  dump.path = path;
  dump.group = field(doc, "group", json::value_t::string, path, "the dump").get<std::string>();
  dump.backend = string_or_empty(doc, "backend");
  dump.rank = field(doc, "rank", json::value_t::number_integer, path, "the dump").get<int>();
  dump.size = field(doc, "size", json::value_t::number_integer, path, "the dump").get<int>();
  constexpr int kMaxSize = 1 << 22;  // far above any job; bounds what the analysis allocates
  if (dump.size < 1 || dump.size > kMaxSize || dump.rank < 0 || dump.rank >= dump.size) {
    throw TraceError(fmt::format("{}: rank {} of size {} is not a rank of a group", path.string(),
                                 dump.rank, dump.size));
  }
  dump.host = string_or_empty(doc, "host");
  dump.pid = int_or(doc, "pid", 0);
  dump.reason = string_or_empty(doc, "reason");
  dump.error = string_or_empty(doc, "error");
  dump.dump_time_us = int_or(doc, "dump_time_unix_us", 0);
  dump.capacity = static_cast<std::uint64_t>(int_or(doc, "capacity", 0));
  dump.recorded = static_cast<std::uint64_t>(int_or(doc, "recorded", 0));
  const json& entries = field(doc, "entries", json::value_t::array, path, "the dump");
  for (std::size_t i = 0; i < entries.size(); ++i) {
    const json& e = entries[i];
    const std::string where = fmt::format("entry {}", i);
    if (!e.is_object()) {
      throw TraceError(fmt::format("{}: {} is not an object", path.string(), where));
    }
    DumpEntry entry;
    entry.id = field(e, "id", json::value_t::number_integer, path, where).get<std::uint64_t>();
    entry.sequence =
        field(e, "sequence", json::value_t::number_integer, path, where).get<std::uint64_t>();
    entry.channel = field(e, "channel", json::value_t::string, path, where).get<std::string>();
    entry.state = field(e, "state", json::value_t::string, path, where).get<std::string>();
    entry.peer = static_cast<int>(int_or(e, "peer", -1));
    entry.op = string_or_empty(e, "op");
    entry.dtype = string_or_empty(e, "dtype");
    entry.count = static_cast<std::uint64_t>(int_or(e, "count", 0));
    entry.reduce_op = string_or_empty(e, "reduce_op");
    entry.root = static_cast<int>(int_or(e, "root", -1));
    entry.algorithm = string_or_empty(e, "algorithm");
    entry.enqueued_us = time_of(e, "enqueued_us");
    entry.started_us = time_of(e, "started_us");
    entry.ended_us = time_of(e, "ended_us");
    dump.entries.push_back(std::move(entry));
  }
  return dump;
}

std::vector<FlightDump> read_flight_dumps(const std::filesystem::path& dir) {
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec)) {
    throw TraceError(
        fmt::format("{} is not a folder{}; give the folder the ranks dumped into "
                    "(DDP_DUMP_DIR, or their working directory)",
                    dir.string(), ec ? " (" + ec.message() + ")" : std::string()));
  }
  std::vector<std::filesystem::path> files;
  std::filesystem::directory_iterator it(dir, ec);
  if (ec)
    throw TraceError(fmt::format("cannot read the folder {}: {}", dir.string(), ec.message()));
  for (; it != std::filesystem::directory_iterator(); it.increment(ec)) {
    if (ec) {
      throw TraceError(fmt::format("cannot read the folder {}: {}", dir.string(), ec.message()));
    }
    const std::string name = it->path().filename().string();
    if (name.rfind("ddp_flight_", 0) == 0 && name.size() > 5 &&
        name.compare(name.size() - 5, 5, ".json") == 0) {
      files.push_back(it->path());
    }
  }
  if (files.empty()) {
    throw TraceError(fmt::format(
        "no flight recorder dumps (ddp_flight_*.json) in {}; ranks write them on a timeout, a "
        "failure, a mismatch or SIGUSR1 into DDP_DUMP_DIR (default: their working directory)",
        dir.string()));
  }
  std::vector<FlightDump> dumps;
  for (const auto& file : files) {
    std::ifstream in(file, std::ios::binary);
    std::ostringstream text;
    text << in.rdbuf();
    if (!in) {
      throw TraceError(
          fmt::format("cannot read {}: {}", file.string(), std::generic_category().message(errno)));
    }
    dumps.push_back(parse_flight_dump(text.str(), file));
  }
  std::sort(dumps.begin(), dumps.end(), [](const FlightDump& a, const FlightDump& b) {
    return a.group != b.group ? a.group < b.group : a.rank < b.rank;
  });
  return dumps;
}

}  // namespace ddp::trace
