#include "ddprun/round_membership.h"

#include <algorithm>
#include <sstream>

#include <fmt/format.h>

#include "ddp/error.h"

namespace ddp::ddprun {
namespace {

bool contains(const std::vector<RoundMember>& list, int agent) {
  return std::any_of(list.begin(), list.end(),
                     [agent](const RoundMember& m) { return m.agent == agent; });
}

[[noreturn]] void bad_value(const std::string& what, const std::string& text) {
  throw StoreError(
      fmt::format("the elastic rendezvous holds a malformed {} '{}' (another ddprun version, or "
                  "another job with the same --rdzv-id on this --agent-port?)",
                  what, text));
}

}  // namespace

std::vector<RoundMember> order_members(const std::vector<RoundMember>& previous,
                                       const std::vector<RoundMember>& arrivals, int max_nodes) {
  std::vector<RoundMember> members;
  const auto add = [&](const RoundMember& m) {
    if (static_cast<int>(members.size()) < max_nodes && !contains(members, m.agent)) {
      members.push_back(m);
    }
  };
  for (const RoundMember& m : arrivals) {
    if (m.agent == 0) add(m);
  }
  for (const RoundMember& old : previous) {
    for (const RoundMember& m : arrivals) {
      if (m.agent == old.agent) add(m);  // the arrival's nproc: it may have changed
    }
  }
  for (const RoundMember& m : arrivals)
    add(m);
  return members;
}

RoundPlacement place(const std::vector<RoundMember>& members, int agent) {
  RoundPlacement placement{.node_rank = -1,
                           .nnodes = static_cast<int>(members.size()),
                           .first_rank = 0,
                           .world_size = 0};
  for (std::size_t i = 0; i < members.size(); ++i) {
    if (members[i].agent == agent) {
      placement.node_rank = static_cast<int>(i);
      placement.first_rank = placement.world_size;
    }
    placement.world_size += members[i].nproc;
  }
  return placement;
}

std::string encode_member(const RoundMember& member) {
  return fmt::format("{}:{}", member.agent, member.nproc);
}

RoundMember parse_member(const std::string& text) {
  RoundMember member;
  char colon = 0;
  std::istringstream in(text);
  if (!(in >> member.agent >> colon >> member.nproc) || colon != ':' || member.agent < 0 ||
      member.nproc < 1 || !in.eof()) {
    bad_value("member", text);
  }
  return member;
}

std::string encode_verdict(const Verdict& verdict) {
  if (verdict.ends_job()) {
    return fmt::format("end {} {}", verdict.end_exit_code, verdict.end_message);
  }
  std::string text = fmt::format("ok {}", verdict.restarts_used);
  for (const RoundMember& m : verdict.members)
    text += " " + encode_member(m);
  return text;
}

Verdict parse_verdict(const std::string& text) {
  Verdict verdict;
  std::istringstream in(text);
  std::string kind;
  in >> kind;
  if (kind == "end") {
    if (!(in >> verdict.end_exit_code)) bad_value("round verdict", text);
    std::getline(in >> std::ws, verdict.end_message);
    if (verdict.end_message.empty()) bad_value("round verdict", text);
    return verdict;
  }
  if (kind != "ok" || !(in >> verdict.restarts_used)) bad_value("round verdict", text);
  for (std::string member; in >> member;)
    verdict.members.push_back(parse_member(member));
  if (verdict.members.empty()) bad_value("round verdict", text);
  return verdict;
}

}  // namespace ddp::ddprun
