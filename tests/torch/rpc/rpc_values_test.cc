// The bytes of an RPC value (src/torch/rpc/rpc_values.h): what is encoded decodes equal, and
// every damaged or hostile message is a named error, never a crash or a wrong value.
#include <gtest/gtest.h>

#include <cstring>
#include <random>

#include <torch/torch.h>

#include "ddp/error.h"
#include "support/unity_namespace.h"
#include "torch/rpc/rpc_values.h"

namespace ddp {
namespace {
namespace DDP_UNITY_ID {

using rpc::detail::decode_value;
using rpc::detail::encode_value;

std::string refusal(const std::vector<std::uint8_t>& bytes) {
  try {
    decode_value(bytes, "msg");
  } catch (const Error& e) {
    return e.what();
  }
  return "decoded";
}

TEST(RpcValues, RoundTripsTensorsAndValues) {
  auto base = torch::randn({3, 5}, torch::kFloat64);
  auto value = c10::ivalue::Tuple::create(
      {base, base.narrow(0, 1, 2), torch::arange(4, torch::kInt32), 3, std::string("s")});
  const auto bytes = encode_value(value, "test");
  const auto back = decode_value(bytes, "test").toTupleRef().elements();
  EXPECT_TRUE(torch::equal(back[0].toTensor(), base));
  EXPECT_TRUE(torch::equal(back[1].toTensor(), base.narrow(0, 1, 2)));
  EXPECT_TRUE(torch::equal(back[2].toTensor(), torch::arange(4, torch::kInt32)));
  EXPECT_EQ(back[3].toInt(), 3);
  EXPECT_EQ(back[4].toStringRef(), "s");
}

TEST(RpcValues, DamagedMessagesAreNamed) {
  const auto good = encode_value(c10::ivalue::Tuple::create({torch::ones({4})}), "test");
  EXPECT_EQ(refusal(good), "decoded");
  auto bytes = good;
  bytes[0] ^= 1;
  EXPECT_NE(refusal(bytes).find("wrong magic"), std::string::npos) << refusal(bytes);
  bytes = good;
  bytes[4] = 9;
  EXPECT_NE(refusal(bytes).find("version 9"), std::string::npos) << refusal(bytes);
  bytes = good;
  bytes[8] = 2;
  EXPECT_NE(refusal(bytes).find("unknown flags 0x2"), std::string::npos) << refusal(bytes);
  bytes = good;
  bytes[8] = 1;  // RRefs, which a reader without RRefs cannot take
  EXPECT_NE(refusal(bytes).find("carries RRefs"), std::string::npos) << refusal(bytes);
  bytes = good;
  bytes.push_back(0);
  EXPECT_NE(refusal(bytes).find("1 bytes follow"), std::string::npos) << refusal(bytes);
  bytes = good;
  bytes.pop_back();
  EXPECT_NE(refusal(bytes).find("runs past its end"), std::string::npos) << refusal(bytes);
  bytes = good;
  std::uint64_t length = 8;  // the storage's length: 8 bytes are not four floats
  std::memcpy(bytes.data() + 24, &length, sizeof length);
  bytes.resize(bytes.size() - 8);
  EXPECT_NE(refusal(bytes).find("not the 4 elements"), std::string::npos) << refusal(bytes);
  for (std::size_t n = 0; n < good.size(); ++n) {
    bytes.assign(good.begin(), good.begin() + static_cast<std::ptrdiff_t>(n));
    EXPECT_NE(refusal(bytes), "decoded") << "a message cut to " << n << " bytes decoded";
  }
}

TEST(RpcValues, RandomBytesNeverCrashOrDecodeToAValueByChance) {
  std::mt19937 random(7);
  const auto good = encode_value(c10::ivalue::Tuple::create({torch::ones({4}), 5}), "test");
  for (int trial = 0; trial < 2000; ++trial) {
    auto bytes = good;
    const int flips = 1 + trial % 4;
    for (int f = 0; f < flips; ++f) {
      bytes[random() % bytes.size()] ^= static_cast<std::uint8_t>(1 + random() % 255);
    }
    try {
      decode_value(bytes, "fuzz");
    } catch (const Error&) {
    }
  }
}

}  // namespace DDP_UNITY_ID
}  // namespace
}  // namespace ddp
