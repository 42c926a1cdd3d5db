// Object collectives (ddp/torch/api/distributed_objects.h) across real rank processes: every
// built-in codec round-trips through each call, and an encoder that throws on one rank is a named
// ObjectCodecError on every rank, with the group still usable afterwards.
#include <stdexcept>
#include <string>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "ddp/error.h"
#include "ddp/runtime/init.h"
#include "ddp/torch/api/distributed_objects.h"
#include "ddp/torch/api/json_codec.h"
#include "support/multiprocess.h"
#include "support/torch/ddp_test_util.h"
#include "support/unity_namespace.h"

// A user type whose encoder fails on demand.
struct Fragile {
  bool explode = false;
  int value = 0;
};

template <>
struct ddp::ObjectCodec<Fragile> {
  static std::string encode(const Fragile& f) {
    if (f.explode) throw std::runtime_error("Fragile refuses to be encoded");
    return std::to_string(f.value);
  }
  static Fragile decode(const std::string& bytes) { return {false, std::stoi(bytes)}; }
};

namespace ddp {
namespace {
namespace DDP_UNITY_ID {

using test::free_port;
using test::join_group;
using test::run_ranks;

void require(bool condition, const std::string& what) {
  if (!condition) throw std::runtime_error(what);
}

std::string word_of(int r) {
  return std::string(static_cast<std::size_t>(r) * 3, 'a' + r);
}

void run_round_trips(int rank, int size) {
  // broadcast_object_list: strings (one empty), from the last rank; the list is resized.
  std::vector<std::string> words;
  if (rank == size - 1) words = {"alpha", "", std::string(5000, 'z')};
  broadcast_object_list(words, size - 1);
  require(words == std::vector<std::string>{"alpha", "", std::string(5000, 'z')},
          "broadcast_object_list of strings");
  // all_gather_object: strings of different lengths (rank 0's empty), doubles, int64.
  std::vector<std::string> all_words;
  all_gather_object(all_words, word_of(rank));
  require(all_words.size() == static_cast<std::size_t>(size), "all_gather_object size");
  for (int r = 0; r < size; ++r)
    require(all_words[r] == word_of(r), "all_gather_object string");
  std::vector<double> losses;
  all_gather_object(losses, 0.25 * rank);
  for (int r = 0; r < size; ++r)
    require(losses[r] == 0.25 * r, "all_gather_object double");
  std::vector<std::int64_t> big;
  all_gather_object(big, std::int64_t{1} << (40 + rank));
  for (int r = 0; r < size; ++r)
    require(big[r] == std::int64_t{1} << (40 + r), "int64 object");
  // gather_object: JSON to rank 0.
  nlohmann::json mine = {{"rank", rank}, {"name", word_of(rank)}, {"ok", true}};
  std::vector<nlohmann::json> jsons;
  gather_object(mine, jsons, 0);
  if (rank == 0) {
    require(jsons.size() == static_cast<std::size_t>(size), "gather_object size");
    for (int r = 0; r < size; ++r)
      require(jsons[r]["rank"] == r && jsons[r]["name"] == word_of(r), "gather_object json");
  } else {
    require(jsons.empty(), "gather_object leaves the list alone off dst");
  }
  // scatter_object_list: tensors from rank 0.
  std::vector<torch::Tensor> parts;
  if (rank == 0)
    for (int r = 0; r < size; ++r)
      parts.push_back(torch::arange(r + 1, torch::kFloat64) * r);
  std::vector<torch::Tensor> got;
  scatter_object_list(got, parts, 0);
  require(got.size() == 1 && torch::equal(got[0], torch::arange(rank + 1, torch::kFloat64) * rank),
          "scatter_object_list of tensors");
  // IValues: a tuple of a string, an int and a tensor.
  std::vector<c10::IValue> values;
  if (rank == 0) {
    values.emplace_back(
        c10::ivalue::Tuple::create({c10::IValue(std::string("config")), c10::IValue(int64_t{42}),
                                    c10::IValue(torch::ones({2, 2}, torch::kInt32))}));
  }
  broadcast_object_list(values, 0);
  const auto tuple = values.at(0).toTuple();
  require(tuple->elements()[0].toStringRef() == "config" && tuple->elements()[1].toInt() == 42 &&
              torch::equal(tuple->elements()[2].toTensor(), torch::ones({2, 2}, torch::kInt32)),
          "broadcast_object_list of an IValue tuple");
}

class DistributedObjects : public ::testing::TestWithParam<int> {};

TEST_P(DistributedObjects, EveryBuiltInCodecRoundTripsThroughEveryCall) {
  const int size = GetParam();
  const int port = free_port();
  const auto results = run_ranks(size, [&](int rank) {
    join_group(rank, size, port);
    run_round_trips(rank, size);
  });
  EXPECT_ALL_RANKS_OK(results);
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, DistributedObjects, ::testing::Values(1, 3));

template <class F>
void require_codec_error(F&& call, const std::string& needle, const std::string& what) {
  try {
    call();
  } catch (const ObjectCodecError& e) {
    require(std::string(e.what()).find(needle) != std::string::npos,
            fmt::format("{}: '{}' does not mention '{}'", what, e.what(), needle));
    return;
  }
  throw std::runtime_error(what + ": no ObjectCodecError");
}

TEST(DistributedObjectsErrors, AnEncoderThatThrowsOnOneRankIsANamedErrorOnEveryRank) {
  const int size = 3;
  const int port = free_port();
  const auto results = run_ranks(size, [&](int rank) {
    join_group(rank, size, port, std::chrono::seconds(20));
    std::vector<Fragile> out;
    require_codec_error(
        [&] {
          all_gather_object(out, Fragile{rank == 1, rank});
        },
        "rank 1: Fragile refuses", "all_gather_object");
    require_codec_error(
        [&] {
          gather_object(Fragile{rank == 2, rank}, out, 0);
        },
        "rank 2: Fragile refuses", "gather_object");
    std::vector<Fragile> list;
    if (rank == 0) list = {Fragile{false, 1}, Fragile{true, 2}};
    require_codec_error([&] { broadcast_object_list(list, 0); }, "object 1: Fragile refuses",
                        "broadcast_object_list");
    std::vector<Fragile> short_list{Fragile{false, 1}};
    require_codec_error([&] { scatter_object_list(out, short_list, 0); }, "needs one per rank",
                        "scatter_object_list with too few objects");
    // Invalid UTF-8 makes nlohmann::json's dump throw: a real codec failure.
    std::vector<nlohmann::json> jsons;
    require_codec_error(
        [&] { all_gather_object(jsons, nlohmann::json(rank == 0 ? std::string("\xff") : "ok")); },
        "rank 0:", "json that cannot be dumped");
    // The group is still in step.
    std::vector<Fragile> fine;
    all_gather_object(fine, Fragile{false, 10 * rank});
    for (int r = 0; r < size; ++r)
      require(fine[r].value == 10 * r, "all_gather after the errors");
  });
  EXPECT_ALL_RANKS_OK(results);
}

}  // namespace DDP_UNITY_ID
}  // namespace
}  // namespace ddp
