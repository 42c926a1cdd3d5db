#include "ddp-trace/analyze.h"

#include <algorithm>
#include <chrono>
#include <ctime>
#include <map>
#include <optional>
#include <set>

#include <fmt/format.h>

namespace ddp::trace {
namespace {

// Findings per kind beyond which the rest are counted, not listed.
constexpr std::size_t kMaxListed = 5;

// "rank 3", "ranks 0, 2", "ranks 0, 1, ... and 990 more".
std::string ranks_text(const std::vector<int>& ranks) {
  constexpr std::size_t kMaxNamed = 16;
  std::string list;
  for (std::size_t i = 0; i < ranks.size() && i < kMaxNamed; ++i)
    list += fmt::format("{}{}", list.empty() ? "" : ", ", ranks[i]);
  if (ranks.size() > kMaxNamed) list += fmt::format(" and {} more", ranks.size() - kMaxNamed);
  return fmt::format("{} {}", ranks.size() == 1 ? "rank" : "ranks", list);
}

std::string time_text(std::int64_t unix_us) {
  const std::time_t seconds = static_cast<std::time_t>(unix_us / 1'000'000);
  std::tm utc{};
  ::gmtime_r(&seconds, &utc);
  return fmt::format("{:02}:{:02}:{:02}.{:06} UTC", utc.tm_hour, utc.tm_min, utc.tm_sec,
                     unix_us % 1'000'000);
}

// What one rank's dump says about the group's collectives.
struct RankView {
  const FlightDump* dump = nullptr;
  // Collectives issued before the group's first failure, by sequence number.
  std::map<std::uint64_t, const DumpEntry*> issued;
  // Every recorded collective (also those issued after the failure), for the fingerprints.
  std::map<std::uint64_t, const DumpEntry*> all;
  std::optional<std::uint64_t> reached;         // the last issued
  std::optional<std::uint64_t> last_completed;  // the last completed
  std::uint64_t window_start = 0;               // older sequences fell out of the recorder
};

struct FirstFailure {
  int rank = -1;
  const DumpEntry* entry = nullptr;
  std::int64_t at_us = 0;
};

std::string state_of(const DumpEntry& e) {
  return e.state == "started" ? "started, never completed" : e.state;
}

class GroupAnalysis {
 public:
  GroupAnalysis(std::string group, std::vector<const FlightDump*> dumps, Report& report)
      : group_(std::move(group)), dumps_(std::move(dumps)), report_(report) {}

  void run() {
    if (!index_ranks()) return;
    find_first_failure();
    build_views();
    report_behind();
    report_unmatched();
    report_mismatches();
    if (!found_) {
      const auto reached = views_.begin()->second.reached;
      say(reached
              ? fmt::format("  no problem found: every rank reached #{} and completed it", *reached)
              : std::string("  no problem found: no collective was recorded"));
    }
  }

 private:
  void say(std::string line) { report_.lines.push_back(std::move(line)); }
  void problem(std::string line) {
    found_ = true;
    report_.problem = true;
    say(std::move(line));
  }

  bool index_ranks() {
    size_ = dumps_.front()->size;
    std::string reasons;
    for (const FlightDump* d : dumps_) {
      if (d->size != size_) {
        problem(
            fmt::format("group '{}': {} says the group has {} ranks, {} says {}: dumps of two "
                        "different jobs in one folder?",
                        group_, dumps_.front()->path.filename().string(), size_,
                        d->path.filename().string(), d->size));
        return false;
      }
      auto& slot = views_[d->rank].dump;
      if (slot == nullptr || d->dump_time_us > slot->dump_time_us) slot = d;
    }
    std::vector<int> present, missing;
    for (int r = 0; r < size_; ++r) {
      if (views_.count(r) != 0) {
        present.push_back(r);
        const FlightDump& d = *views_[r].dump;
        reasons += fmt::format("{}rank {}: {}{}", reasons.empty() ? "" : ", ", r,
                               d.reason.empty() ? "?" : d.reason,
                               d.host.empty() ? "" : fmt::format(" on {} pid {}", d.host, d.pid));
      } else {
        missing.push_back(r);
      }
    }
    say(fmt::format("group '{}' ({}{} ranks): dumps from {} ({})", group_,
                    dumps_.front()->backend.empty() ? "" : dumps_.front()->backend + ", ", size_,
                    ranks_text(present), reasons));
    if (!missing.empty()) {
      problem(fmt::format(
          "  no dump from {}: {} did not fail and got no SIGUSR1, could not write into the "
          "folder, or died first (send SIGUSR1 to a live rank for its dump)",
          ranks_text(missing), missing.size() == 1 ? "it" : "they"));
    }
    return true;
  }

  // The earliest operation that ran and failed: where the group broke. Calls issued after it
  // fail at once on a poisoned group and say nothing about who was behind.
  void find_first_failure() {
    for (const auto& [rank, view] : views_) {
      for (const DumpEntry& e : view.dump->entries) {
        if (e.state != "failed" || !e.started_us || !e.ended_us) continue;
        if (!first_ || *e.ended_us < first_->at_us) first_ = FirstFailure{rank, &e, *e.ended_us};
      }
    }
    if (first_) {
      const FlightDump& d = *views_[first_->rank].dump;
      problem(fmt::format("  first failure: rank {} in {} at {}{}", first_->rank,
                          first_->entry->describe(), time_text(first_->at_us),
                          d.error.empty() ? "" : ": " + d.error));
      return;
    }
    for (const auto& [rank, view] : views_) {
      if (!view.dump->error.empty()) {
        problem(fmt::format("  rank {} reports the group failed: {}", rank, view.dump->error));
        return;
      }
    }
  }

  void build_views() {
    for (auto& [rank, view] : views_) {
      bool first = true;
      for (const DumpEntry& e : view.dump->entries) {
        if (e.channel != "collective") continue;
        if (first || e.sequence < view.window_start) view.window_start = e.sequence;
        first = false;
        view.all[e.sequence] = &e;
        const bool before_failure =
            !first_ || (e.enqueued_us && *e.enqueued_us <= first_->at_us) || rank == first_->rank;
        if (!before_failure) continue;
        view.issued[e.sequence] = &e;
        if (!view.reached || e.sequence > *view.reached) view.reached = e.sequence;
        if (e.state == "completed" && (!view.last_completed || e.sequence > *view.last_completed)) {
          view.last_completed = e.sequence;
        }
      }
    }
  }

  std::optional<std::uint64_t> max_reached(int* who) const {
    std::optional<std::uint64_t> best;
    for (const auto& [rank, view] : views_) {
      if (view.reached && (!best || *view.reached > *best)) {
        best = view.reached;
        *who = rank;
      }
    }
    return best;
  }

  void report_behind() {
    int leader = -1;
    const auto top = max_reached(&leader);
    if (!top) return;
    const DumpEntry& lead = *views_.at(leader).issued.at(*top);
    for (const auto& [rank, view] : views_) {
      if (view.reached && *view.reached >= *top) continue;
      std::string where;
      if (view.last_completed) {
        where = fmt::format("last completed {}", view.issued.at(*view.last_completed)->describe());
      } else {
        where = "completed no collective";
      }
      if (view.reached && (!view.last_completed || *view.reached > *view.last_completed)) {
        const DumpEntry& last = *view.issued.at(*view.reached);
        where += fmt::format(" and last issued {} ({})", last.describe(), state_of(last));
      } else if (first_) {
        where += " and issued nothing more before the failure";
      }
      problem(fmt::format("  rank {} is behind: it {}, while rank {} reached {} ({})", rank, where,
                          leader, lead.describe(), state_of(lead)));
    }
  }

  void report_unmatched() {
    int leader = -1;
    const auto top = max_reached(&leader);
    if (!top) return;
    // From the first sequence that some rank did not complete, up to the furthest issued.
    std::optional<std::uint64_t> from;
    for (const auto& [rank, view] : views_) {
      const std::uint64_t next = view.last_completed ? *view.last_completed + 1 : view.window_start;
      if (!from || next < *from) from = next;
    }
    // Only the sequence numbers some rank issued: a dump's numbers may be far apart.
    std::set<std::uint64_t> sequences;
    for (const auto& [rank, view] : views_) {
      for (auto it = view.issued.lower_bound(*from); it != view.issued.end() && it->first <= *top;
           ++it)
        sequences.insert(it->first);
    }
    std::size_t listed = 0, more = 0;
    for (const std::uint64_t s : sequences) {
      std::vector<int> missing, completed, failed, running;
      const DumpEntry* example = nullptr;
      std::vector<int> issued_on;
      for (const auto& [rank, view] : views_) {
        const auto it = view.issued.find(s);
        if (it == view.issued.end()) {
          if (s >= view.window_start) missing.push_back(rank);
          continue;
        }
        issued_on.push_back(rank);
        example = it->second;
        const std::string& st = it->second->state;
        (st == "completed" ? completed : st == "failed" ? failed : running).push_back(rank);
      }
      if (example == nullptr) continue;
      std::string line;
      if (!missing.empty()) {
        line = fmt::format("  collective {} never matched: issued on {}, never issued on {}",
                           example->describe(), ranks_text(issued_on), ranks_text(missing));
      } else if (completed.size() != issued_on.size()) {
        line = fmt::format("  collective {} was issued on every rank but completed on {}",
                           example->describe(),
                           completed.empty() ? std::string("none") : ranks_text(completed));
      } else {
        continue;
      }
      if (!failed.empty()) line += fmt::format("; failed on {}", ranks_text(failed));
      if (!running.empty())
        line += fmt::format("; still queued or running on {}", ranks_text(running));
      if (listed < kMaxListed) {
        problem(std::move(line));
        ++listed;
      } else {
        ++more;
      }
    }
    if (more > 0) say(fmt::format("  ... and {} later collectives like these", more));
  }

  void report_mismatches() {
    std::set<std::uint64_t> sequences;
    for (const auto& [rank, view] : views_) {
      for (const auto& [s, e] : view.all)
        sequences.insert(s);
    }
    std::size_t listed = 0, more = 0;
    for (const std::uint64_t s : sequences) {
      std::map<std::string, std::vector<int>> by_fingerprint;
      std::map<std::string, const DumpEntry*> example;
      for (const auto& [rank, view] : views_) {
        const auto it = view.all.find(s);
        if (it == view.all.end() || it->second->op.empty()) continue;
        by_fingerprint[it->second->fingerprint()].push_back(rank);
        example[it->second->fingerprint()] = it->second;
      }
      if (by_fingerprint.size() < 2) continue;
      if (listed >= kMaxListed) {
        ++more;
        continue;
      }
      // In rank order: the group holding rank 0 (or the lowest rank) first.
      std::vector<std::pair<std::vector<int>, const DumpEntry*>> calls_by_ranks;
      for (const auto& [fp, ranks] : by_fingerprint)
        calls_by_ranks.emplace_back(ranks, example[fp]);
      std::sort(calls_by_ranks.begin(), calls_by_ranks.end(),
                [](const auto& a, const auto& b) { return a.first.front() < b.first.front(); });
      std::string calls;
      for (const auto& [ranks, call] : calls_by_ranks) {
        calls += fmt::format("{}{} called {}", calls.empty() ? "" : "; ", ranks_text(ranks),
                             call->describe());
      }
      problem(fmt::format("  mismatch at #{}: {}", s, calls));
      ++listed;
    }
    if (more > 0) say(fmt::format("  ... and {} more mismatched sequence numbers", more));
  }

  const std::string group_;
  const std::vector<const FlightDump*> dumps_;
  Report& report_;
  int size_ = 1;
  std::map<int, RankView> views_;
  std::optional<FirstFailure> first_;
  bool found_ = false;
};

}  // namespace

Report analyze(const std::vector<FlightDump>& dumps) {
  Report report;
  std::map<std::string, std::vector<const FlightDump*>> groups;
  for (const FlightDump& d : dumps)
    groups[d.group].push_back(&d);
  for (auto& [name, members] : groups)
    GroupAnalysis(name, std::move(members), report).run();
  return report;
}

}  // namespace ddp::trace
