// The bytes of an RPC value (src/torch/rpc/rpc_values.h): what is encoded decodes equal, and
// every damaged or hostile message is a named error, never a crash or a wrong value.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <span>

#include <torch/torch.h>

#include "ddp/error.h"
#include "support/unity_namespace.h"
#include "torch/rpc/rpc_values.h"

namespace ddp {
namespace {
namespace DDP_UNITY_ID {

using rpc::detail::decode_value;
using rpc::detail::encode_value;

std::string refusal(std::span<const std::uint8_t> bytes) {
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

TEST(RpcValues, LargeStoragesTravelAsAttachmentsAndStayInTheReceivedMessage) {
  // Small, large, small, large: from the first large storage on, the message's parts are
  // attachments (each storage at a multiple of 64, zeros between), and the bytes on the wire are
  // exactly encode_value's.
  const auto small = torch::arange(5, torch::kFloat64);
  const auto large = torch::randn({300, 100}, torch::kFloat32);  // 120,000 bytes
  const auto later = torch::arange(3, torch::kInt64);
  const auto big = torch::randn({40000}, torch::kFloat64);  // 320,000 bytes
  const auto value = c10::ivalue::Tuple::create({small, large, later, big.narrow(0, 10, 7), 4});
  auto attached = rpc::detail::encode_value_attached(value, "test");
  EXPECT_GE(attached.attachments.size(), 3u);
  EXPECT_LT(attached.bytes.size(), 2048u) << "a large storage was copied into the message";
  for (const auto& a : attached.attachments) {
    EXPECT_TRUE(a.data != nullptr && a.size > 0);
  }
  const auto whole = encode_value(value, "test");
  auto flat = std::move(attached).flatten();
  ASSERT_EQ(flat.size(), whole.size());
  EXPECT_EQ(std::memcmp(flat.data(), whole.data(), whole.size()), 0);

  const auto* first = flat.data();
  const auto* end = flat.data() + flat.size();
  c10::IValue decoded = decode_value(std::move(flat), "test");
  const auto& back = decoded.toTupleRef().elements();
  const auto in_message = [&](const at::Tensor& t) {
    const auto* p = static_cast<const std::uint8_t*>(t.data_ptr());
    return p >= first && p < end;
  };
  EXPECT_FALSE(in_message(back[0].toTensor())) << "a small storage was left in the message";
  EXPECT_TRUE(in_message(back[1].toTensor())) << "a large storage was copied";
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(back[1].toTensor().data_ptr()) % 16, 0u);
  EXPECT_TRUE(in_message(back[3].toTensor()));
  EXPECT_TRUE(torch::equal(back[0].toTensor(), small));
  EXPECT_TRUE(torch::equal(back[1].toTensor(), large));
  EXPECT_TRUE(torch::equal(back[2].toTensor(), later));
  EXPECT_TRUE(torch::equal(back[3].toTensor(), big.narrow(0, 10, 7)));
  // The message lives as long as a tensor in it: the others gone, the last still reads.
  auto last = back[3].toTensor();
  decoded = c10::IValue();
  EXPECT_TRUE(torch::equal(last, big.narrow(0, 10, 7)));
  last.add_(1);  // writable
  EXPECT_TRUE(torch::equal(last, big.narrow(0, 10, 7) + 1));
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
