// settings: the DDP_* variables read below the top layer, through an injected lookup.
#include "settings/settings.h"

#include <gtest/gtest.h>

#include <map>

#include "ddp/error.h"

namespace ddp::test {
namespace {

using namespace std::chrono_literals;

settings::Lookup from(std::map<std::string, std::string> values) {
  return [values = std::move(values)](const std::string& name) -> std::optional<std::string> {
    const auto it = values.find(name);
    if (it == values.end()) return std::nullopt;
    return it->second;
  };
}

TEST(Settings, TimeoutIsTheDefaultUnlessDdpTimeoutIsSet) {
  EXPECT_EQ(settings::timeout(from({})), kDefaultTimeout);
  EXPECT_EQ(settings::timeout(from({{"DDP_TIMEOUT", "60"}})), 60s);
  EXPECT_EQ(settings::timeout(from({{"DDP_TIMEOUT", "0.25"}})), 250ms);
}

TEST(Settings, AMalformedTimeoutIsAConfigErrorNamingTheVariable) {
  // Non-finite, overflowing, trailing garbage, hex (ddprun once took 'inf' and '1e300' into a
  // negative deadline, and '60abc' and '0x10' as numbers; it uses this parser since issue 24).
  for (const char* bad : {"", "abc", "-1", "0", "5s", "inf", "-inf", "nan", "1e300", "1e10",
                          "60abc", "0x10", "0X10", " 60", "60 ", "+60", "1,5", "-0"}) {
    try {
      const auto accepted = settings::timeout(from({{"DDP_TIMEOUT", bad}}));
      ADD_FAILURE() << "DDP_TIMEOUT='" << bad << "' was accepted as " << accepted.count() << " ms";
    } catch (const ConfigError& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find(std::string("DDP_TIMEOUT='") + bad + "'"), std::string::npos) << what;
      EXPECT_NE(what.find("e.g. DDP_TIMEOUT=60"), std::string::npos) << what;
    }
  }
  // The largest value accepted still fits the clock's arithmetic.
  EXPECT_EQ(settings::timeout(from({{"DDP_TIMEOUT", "1e9"}})), Milliseconds(1'000'000'000'000));
  EXPECT_EQ(settings::timeout(from({{"DDP_TIMEOUT", "1e2"}})), 100s);
}

TEST(Settings, WaitWarningIsThirtySecondsUnlessSetAndZeroTurnsItOff) {
  EXPECT_EQ(settings::wait_warning(from({})), 30s);
  EXPECT_EQ(settings::wait_warning(from({{"DDP_WAIT_WARN_SECONDS", "0.5"}})), 500ms);
  EXPECT_EQ(settings::wait_warning(from({{"DDP_WAIT_WARN_SECONDS", "0"}})), 0ms);
  for (const char* bad : {"", "soon", "-1", "30s", "nan"}) {
    try {
      settings::wait_warning(from({{"DDP_WAIT_WARN_SECONDS", bad}}));
      ADD_FAILURE() << "DDP_WAIT_WARN_SECONDS='" << bad << "' was accepted";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("DDP_WAIT_WARN_SECONDS"), std::string::npos) << e.what();
    }
  }
}

TEST(Settings, RingVariablesAreEmptyWhenUnset) {
  EXPECT_EQ(settings::transport(from({})), "");
  EXPECT_EQ(settings::host_id(from({})), "");
  EXPECT_EQ(settings::advertise_address(from({})), "");
  const auto set =
      from({{"DDP_TRANSPORT", "tcp"}, {"DDP_HOST_ID", "h1"}, {"DDP_ADVERTISE_ADDR", "10.0.0.7"}});
  EXPECT_EQ(settings::transport(set), "tcp");
  EXPECT_EQ(settings::host_id(set), "h1");
  EXPECT_EQ(settings::advertise_address(set), "10.0.0.7");
}

}  // namespace
}  // namespace ddp::test
