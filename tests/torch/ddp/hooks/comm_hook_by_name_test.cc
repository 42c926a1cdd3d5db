// comm_hook_from_name: every name of comm_hook_names() gives its hook (and state), an unknown
// name and bad PowerSGD options are ConfigErrors that say what to use instead.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>

#include "ddp/error.h"
#include "ddp/torch/ddp/hooks/comm_hook_by_name.h"
#include "support/unity_namespace.h"

namespace ddp {
namespace {
namespace DDP_UNITY_ID {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(CommHookByName, EveryNameGivesItsHookAndState) {
  EXPECT_THAT(comm_hook_names(),
              ElementsAre("none", "fp16", "bf16", "powersgd", "batched-powersgd", "int8", "noop"));
  for (const auto& name : comm_hook_names()) {
    SCOPED_TRACE(name);
    const auto chosen = comm_hook_from_name(name, {.powersgd_rank = 3, .powersgd_start_iter = 7});
    EXPECT_EQ(chosen.hook.has_value(), name != "none");
    const bool powersgd = name == "powersgd" || name == "batched-powersgd";
    ASSERT_EQ(chosen.powersgd_state != nullptr, powersgd);
    EXPECT_EQ(chosen.int8_state != nullptr, name == "int8");
    if (powersgd) {
      EXPECT_EQ(chosen.powersgd_state->options().matrix_approximation_rank, 3);
      EXPECT_EQ(chosen.powersgd_state->options().start_powersgd_iter, 7);
    }
  }
}

TEST(CommHookByName, UnknownNameIsAConfigErrorListingTheNames) {
  try {
    comm_hook_from_name("powersgd4");
    FAIL() << "no error for an unknown hook name";
  } catch (const ConfigError& e) {
    EXPECT_THAT(e.what(), HasSubstr("'powersgd4' is unknown"));
    EXPECT_THAT(e.what(), HasSubstr("none, fp16, bf16, powersgd, batched-powersgd, int8, noop"));
  }
}

TEST(CommHookByName, BadPowerSgdRankIsAConfigError) {
  EXPECT_THROW(comm_hook_from_name("powersgd", {.powersgd_rank = 0}), ConfigError);
  // Only the PowerSGD hooks read the PowerSGD options.
  EXPECT_NO_THROW(comm_hook_from_name("int8", {.powersgd_rank = 0}));
}

}  // namespace DDP_UNITY_ID
}  // namespace
}  // namespace ddp
