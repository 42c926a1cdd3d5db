// The elastic rounds' membership rules and their store encoding (round_membership.h).
#include "ddprun/round_membership.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "ddp/error.h"
#include "support/unity_namespace.h"

namespace ddp::ddprun {
namespace {
namespace DDP_UNITY_ID {

using ::testing::HasSubstr;
using Members = std::vector<RoundMember>;

TEST(RoundMembership, FirstRoundIsAgentZeroThenArrivalOrder) {
  const Members arrivals{{2, 1}, {0, 1}, {1, 1}};
  EXPECT_EQ(order_members({}, arrivals, 3), (Members{{0, 1}, {2, 1}, {1, 1}}));
}

TEST(RoundMembership, SurvivorsKeepTheirOrderAndNewcomersFollow) {
  const Members previous{{0, 1}, {3, 1}, {1, 1}};
  // Agent 1 came back first, agent 3 later, agent 5 is new; agent 4's arrival is beyond MAX.
  const Members arrivals{{1, 1}, {5, 2}, {0, 1}, {3, 1}, {4, 1}};
  EXPECT_EQ(order_members(previous, arrivals, 4), (Members{{0, 1}, {3, 1}, {1, 1}, {5, 2}}));
  // A member that did not come back is gone.
  EXPECT_EQ(order_members(previous, Members{{0, 1}, {1, 1}}, 4), (Members{{0, 1}, {1, 1}}));
}

TEST(RoundMembership, PlacementSumsTheMembersNproc) {
  const Members members{{0, 2}, {3, 1}, {1, 4}};
  EXPECT_EQ(place(members, 1),
            (RoundPlacement{.node_rank = 2, .nnodes = 3, .first_rank = 3, .world_size = 7}));
  EXPECT_EQ(place(members, 0).first_rank, 0);
  EXPECT_EQ(place(members, 9).node_rank, -1);
}

TEST(RoundMembership, VerdictsRoundTrip) {
  const Verdict ok{.members = {{0, 1}, {4, 2}}, .restarts_used = 2};
  const Verdict back = parse_verdict(encode_verdict(ok));
  EXPECT_EQ(back.members, ok.members);
  EXPECT_EQ(back.restarts_used, 2);
  EXPECT_FALSE(back.ends_job());
  const Verdict end = parse_verdict(
      encode_verdict({.end_message = "giving up after 3 restarts", .end_exit_code = 1}));
  EXPECT_TRUE(end.ends_job());
  EXPECT_EQ(end.end_message, "giving up after 3 restarts");
  EXPECT_EQ(end.end_exit_code, 1);
}

TEST(RoundMembership, MalformedValuesAreNamedStoreErrors) {
  for (const char* text :
       {"", "ok", "ok 1", "ok x 0:1", "ok 0 0-1", "ok 0 0:0", "end 1", "maybe"}) {
    try {
      parse_verdict(text);
      ADD_FAILURE() << "accepted '" << text << "'";
    } catch (const StoreError& e) {
      EXPECT_THAT(e.what(), HasSubstr("malformed")) << text;
    }
  }
  EXPECT_THROW(parse_member("3:"), StoreError);
  EXPECT_EQ(parse_member("3:2"), (RoundMember{3, 2}));
}

}  // namespace DDP_UNITY_ID
}  // namespace
}  // namespace ddp::ddprun
