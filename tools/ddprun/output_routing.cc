#include "ddprun/output_routing.h"

#include <fmt/format.h>
#include <charconv>
#include <optional>
#include <string_view>

#include "ddprun/launch_options.h"

namespace ddp::ddprun {
namespace {

// A whole number with nothing around it, or nullopt.
std::optional<long> whole_number(std::string_view text) {
  long value = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (text.empty() || ec != std::errc() || end != text.data() + text.size()) return std::nullopt;
  return value;
}

std::vector<std::string_view> split(std::string_view text, char separator) {
  std::vector<std::string_view> parts;
  for (;;) {
    const std::size_t at = text.find(separator);
    parts.push_back(text.substr(0, at));
    if (at == std::string_view::npos) return parts;
    text.remove_prefix(at + 1);
  }
}

int local_rank_of(std::string_view text, std::string_view option, std::string_view whole,
                  int nproc) {
  const auto rank = whole_number(text);
  if (!rank) {
    throw UsageError(
        fmt::format("{}: '{}' in '{}' is not a local rank (a whole number)", option, text, whole));
  }
  if (*rank < 0 || *rank >= nproc) {
    throw UsageError(fmt::format(
        "{}: local rank {} does not exist: --nproc-per-node is {}, so local ranks are 0 to {}",
        option, *rank, nproc, nproc - 1));
  }
  return static_cast<int>(*rank);
}

std::vector<int> parse_streams(const std::string& text, std::string_view option, int nproc) {
  std::vector<int> values(static_cast<std::size_t>(nproc), 0);
  if (text.empty()) return values;
  const auto stream_value = [&](std::string_view value_text) {
    const auto value = whole_number(value_text);
    if (!value || *value < 0 || *value > 3) {
      throw UsageError(fmt::format(
          "{}: expected 0 (none), 1 (stdout), 2 (stderr) or 3 (both), or LOCAL_RANK:VALUE pairs "
          "such as 0:3,1:2; got '{}'",
          option, text));
    }
    return static_cast<int>(*value);
  };
  if (text.find(':') == std::string::npos) {
    values.assign(values.size(), stream_value(text));
    return values;
  }
  std::vector<bool> named(values.size(), false);
  for (const std::string_view pair : split(text, ',')) {
    const std::size_t colon = pair.find(':');
    if (colon == std::string_view::npos) {
      throw UsageError(fmt::format(
          "{}: '{}' in '{}' is not LOCAL_RANK:VALUE; give one value for every rank (e.g. 3) or "
          "pairs for each (e.g. 0:3,1:2)",
          option, pair, text));
    }
    const int rank = local_rank_of(pair.substr(0, colon), option, text, nproc);
    if (named[static_cast<std::size_t>(rank)]) {
      throw UsageError(fmt::format("{}: local rank {} is named twice in '{}'", option, rank, text));
    }
    named[static_cast<std::size_t>(rank)] = true;
    values[static_cast<std::size_t>(rank)] = stream_value(pair.substr(colon + 1));
  }
  return values;
}

}  // namespace

bool OutputRouting::to_console(int local_rank, int stream) const {
  const auto i = static_cast<std::size_t>(local_rank);
  if (i < shown.size() && !shown[i]) return false;
  const int redirected = i < redirects.size() ? redirects[i] : 0;
  const int teed = i < tee.size() ? tee[i] : 0;
  return (redirected & stream) == 0 || (teed & stream) != 0;
}

bool OutputRouting::wants_files() const {
  for (const std::vector<int>* values : {&redirects, &tee}) {
    for (const int value : *values) {
      if (value != 0) return true;
    }
  }
  return false;
}

OutputRouting parse_output_routing(const OutputRoutingText& text, int nproc) {
  OutputRouting routing;
  routing.redirects = parse_streams(text.redirects, "--redirects", nproc);
  routing.tee = parse_streams(text.tee, "--tee", nproc);
  routing.shown.assign(static_cast<std::size_t>(nproc), text.local_ranks_filter.empty());
  if (!text.local_ranks_filter.empty()) {
    for (const std::string_view rank_text : split(text.local_ranks_filter, ',')) {
      const int rank =
          local_rank_of(rank_text, "--local-ranks-filter", text.local_ranks_filter, nproc);
      routing.shown[static_cast<std::size_t>(rank)] = true;
    }
  }
  return routing;
}

}  // namespace ddp::ddprun
