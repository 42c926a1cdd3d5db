// Damaged and hostile files handed to ddp's readers of PyTorch's formats (state dicts, optimizer
// state, checkpoints), as a user or an attacker would hand them: each ends in a named error
// within 2 s and a few MiB of memory, and leaves the model and the optimizer as they were; none
// crashes, runs away, or loads damaged values. The files are made here (support/
// hostile_archives.h); each case failed on the reader before these checks (a crash, gigabytes, a
// damaged weight loaded with exit 0, or `loss -nan` from a NaN learning rate).
#include <chrono>
#include <cmath>
#include <fstream>

#include <gtest/gtest.h>

#include "ddp/torch/checkpoint/checkpoint.h"
#include "ddp/torch/formats/optimizer_state_dict.h"
#include "ddp/torch/formats/state_dict.h"
#include "support/hostile_archives.h"
#include "support/resident_memory.h"
#include "support/temp_dir.h"
#include "support/unity_namespace.h"

namespace ddp {
namespace {
namespace DDP_UNITY_ID {

namespace fs = std::filesystem;
namespace p = test::pickle;
using namespace std::string_literals;

void write_file(const fs::path& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}
std::string read_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

// What `call` threw (its type's name is checked by the caller through catch), how long it took
// and what resident memory it added at its peak.
struct Outcome {
  std::string error;  // what(), empty when nothing was thrown
  bool format_error = false, mismatch = false;
  double seconds = 0, added_mib = 0;
};
template <class Call>
Outcome outcome_of(Call&& call) {
  Outcome o;
  const auto start = std::chrono::steady_clock::now();
  o.added_mib = test::peak_added_mib([&] {
    try {
      call();
    } catch (const StateDictFormatError& e) {
      o.error = e.what();
      o.format_error = true;
    } catch (const StateDictMismatchError& e) {
      o.error = e.what();
      o.mismatch = true;
    } catch (const Error& e) {
      o.error = e.what();
    }
  });
  o.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return o;
}
bool has(const Outcome& o, const std::string& text) {
  return o.error.find(text) != std::string::npos;
}

torch::Tensor floats(std::int64_t n) {
  return torch::arange(n, torch::kFloat32);
}
std::string bytes_of(const torch::Tensor& t) {
  return std::string(static_cast<const char*>(t.data_ptr()), t.nbytes());
}

// 1. An optimizer state whose tensors do not fit (another head, another dtype): the documented
// StateDictMismatchError, not signal 11 (the message was formatted after the report moved).
TEST(HostileFiles, OptimizerStateOfAnotherShapeOrDtypeIsAMismatch) {
  test::TempDir dir("ddp-hostile-optim");
  torch::nn::Linear eleven(128, 11), ten(128, 10);
  torch::optim::SGD sgd_eleven(eleven->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  eleven->forward(torch::ones({1, 128})).sum().backward();
  sgd_eleven.step();
  save_optimizer_state_dict(sgd_eleven, dir.path() / "sgd.pt");
  torch::optim::SGD sgd_ten(ten->parameters(), torch::optim::SGDOptions(0.5).momentum(0.5));
  const auto o = outcome_of([&] { load_optimizer_state_dict(sgd_ten, dir.path() / "sgd.pt"); });
  EXPECT_TRUE(o.mismatch) << o.error;
  EXPECT_TRUE(has(o, "state[0]['momentum_buffer']: [11, 128] Float in the file")) << o.error;
  EXPECT_EQ(static_cast<torch::optim::SGDOptions&>(sgd_ten.param_groups()[0].options()).lr(), 0.5);

  torch::nn::Linear small(4, 2);
  torch::optim::Adam adam(small->parameters(), torch::optim::AdamOptions(0.1));
  small->forward(torch::ones({1, 4})).sum().backward();
  adam.step();
  for (auto& [key, state] : adam.state()) {
    auto& s = static_cast<torch::optim::AdamParamState&>(*state);
    s.exp_avg(s.exp_avg().to(torch::kFloat64));
  }
  save_optimizer_state_dict(adam, dir.path() / "adam.pt");
  torch::optim::Adam fresh(small->parameters(), torch::optim::AdamOptions(0.1));
  const auto d = outcome_of([&] { load_optimizer_state_dict(fresh, dir.path() / "adam.pt"); });
  EXPECT_TRUE(d.mismatch) << d.error;
  EXPECT_TRUE(has(d, "['exp_avg']: [2, 4] Double in the file")) << d.error;
  EXPECT_TRUE(fresh.state().empty());
}

// 2, 4, 5, 6, 7: hostile pickles inside well-formed archives.
TEST(HostileFiles, HostilePicklesEndInANamedErrorFast) {
  test::TempDir dir("ddp-hostile-pickles");
  const std::string tail = "ccollections\nOrderedDict\n)R.";
  std::string dup = "\x80\x02N";
  for (int i = 0; i < 26; ++i)
    dup += "2\x86";
  std::string binget = "\x80\x02("s + std::string(1000, 'N') + "tq\x01(";
  for (int i = 0; i < 200000; ++i)
    binget += "h\x01";
  const std::vector<std::tuple<const char*, std::string, const char*>> cases{
      {"nested",
       "\x80\x02" + std::string(150000, '(') + "N" + std::string(150000, 'l') + "0" + tail,
       "nests values deeper than 256 levels"},
      {"dup", dup + "0" + tail, "unfold to more than"},
      {"binget", binget + "t0" + tail, "unfold to more than"},
      {"tuple1", "\x80\x02N" + std::string(100000, '\x85') + "0" + tail,
       "nests values deeper than 256 levels"},
  };
  torch::nn::Linear model(2, 2);
  const auto weight = model->weight.clone();
  for (const auto& [name, pickle, text] : cases) {
    const auto path = dir.path() / (std::string(name) + ".pt");
    write_file(path, test::make_torch_archive(pickle, {}));
    const auto o = outcome_of([&] { load_state_dict(*model, path); });
    EXPECT_TRUE(o.format_error) << name << ": " << o.error;
    EXPECT_TRUE(has(o, text)) << name << ": " << o.error;
    EXPECT_TRUE(has(o, path.string())) << name << ": " << o.error;
    EXPECT_LT(o.seconds, 2.0) << name;
    EXPECT_LT(o.added_mib, 64.0) << name;
  }
  // 5: a memo index of 2^25 costs nothing: the file is an empty dict, which does not fit.
  const auto memo = dir.path() / "memo.pt";
  write_file(memo, test::make_torch_archive("\x80\x02Nr\x00\x00\x00\x02\x30"s + tail, {}));
  const auto o = outcome_of([&] { load_state_dict(*model, memo); });
  EXPECT_TRUE(o.mismatch) << o.error;
  EXPECT_TRUE(has(o, "missing key(s)")) << o.error;
  EXPECT_LT(o.added_mib, 64.0);
  EXPECT_TRUE(torch::equal(model->weight, weight));
}

// A tensor of 10 floats whose record is `record`.
std::string ten_floats(const std::vector<test::ZipRecord>& storage) {
  std::vector<test::ZipRecord> records{
      {.name = "archive/data.pkl",
       .data = p::state_dict({{"w", p::tensor("FloatStorage", "0", 10, 0, {10}, {1})}})}};
  records.insert(records.end(), storage.begin(), storage.end());
  return test::make_zip(records);
}

// 8. Zip bombs: the record's declared size is checked against what its tensor needs before a
// byte is inflated; a record that inflates past what it declares stops there.
TEST(HostileFiles, ZipBombsCostNeitherMemoryNorTime) {
  test::TempDir dir("ddp-hostile-bomb");
  const auto honest = dir.path() / "honest.pt";  // declares its 4 GiB
  write_file(honest, ten_floats({{.name = "archive/data/0", .zeros = 4ull << 30}}));
  EXPECT_LT(fs::file_size(honest), 8u << 20);
  auto o = outcome_of([&] { read_state_dict(honest); });
  EXPECT_TRUE(o.format_error) << o.error;
  EXPECT_TRUE(has(o, "storage '0' holds 4294967296 bytes; its 10 elements of Float need 40"))
      << o.error;
  EXPECT_LT(o.seconds, 2.0);
  EXPECT_LT(o.added_mib, 64.0);

  const auto lying = dir.path() / "lying.pt";  // declares 40 bytes, inflates to 4 GiB
  write_file(lying, ten_floats({{.name = "archive/data/0", .declared = 40, .zeros = 4ull << 30}}));
  o = outcome_of([&] { read_state_dict(lying); });
  EXPECT_TRUE(o.format_error) << o.error;
  EXPECT_TRUE(has(o, "inflates to more than its declared 40 bytes")) << o.error;
  EXPECT_LT(o.seconds, 2.0);
  EXPECT_LT(o.added_mib, 64.0);

  // A deflated record that is what it says loads (PyTorch's reader accepts them too).
  const auto deflated = dir.path() / "deflated.pt";
  write_file(
      deflated,
      ten_floats({{.name = "archive/data/0", .data = bytes_of(floats(10)), .deflate = true}}));
  EXPECT_TRUE(torch::equal(read_state_dict(deflated)["w"], floats(10)));
}

// 9. One flipped byte in a weight, or 64 zeroed bytes anywhere, is refused by the record's
// CRC-32 (libtorch's reader and PyTorch's torch.load load them), and nothing is loaded.
TEST(HostileFiles, DamagedBytesAreCaughtByTheirCrc) {
  test::TempDir dir("ddp-hostile-crc");
  torch::nn::Linear saved(64, 64), model(64, 64);
  save_state_dict(*saved, dir.path() / "good.pt");
  const std::string good = read_file(dir.path() / "good.pt");
  const auto weight = model->weight.clone();
  const std::string first_weights = bytes_of(saved->weight.detach().slice(0, 0, 1));
  const auto at = good.find(first_weights);
  ASSERT_NE(at, std::string::npos);

  std::string flipped = good;
  flipped[at + 100] ^= 0x01;
  write_file(dir.path() / "flipped.pt", flipped);
  auto o = outcome_of([&] { load_state_dict(*model, dir.path() / "flipped.pt"); });
  EXPECT_TRUE(o.format_error) << o.error;
  EXPECT_TRUE(has(o, "fails its CRC-32 check")) << o.error;

  // 64 zeroed bytes at every 997th position: each is refused by name, whatever it hits.
  for (std::size_t start = 0; start + 64 < good.size(); start += 997) {
    std::string zeroed = good;
    std::fill(zeroed.begin() + static_cast<std::ptrdiff_t>(start),
              zeroed.begin() + static_cast<std::ptrdiff_t>(start + 64), '\0');
    if (zeroed == good) continue;
    write_file(dir.path() / "zeroed.pt", zeroed);
    o = outcome_of([&] { load_state_dict(*model, dir.path() / "zeroed.pt"); });
    EXPECT_TRUE(o.format_error) << start << ": " << o.error;
  }
  EXPECT_TRUE(torch::equal(model->weight, weight));
  load_state_dict(*model, dir.path() / "good.pt");
  EXPECT_TRUE(torch::equal(model->weight, saved->weight));
}

// 10. Sizes whose arithmetic overflows int64 are refused by name (they were accepted, or left
// to libtorch's misleading "damaged archive: Storage size calculation overflowed").
TEST(HostileFiles, OverflowingSizesAreRefusedByName) {
  test::TempDir dir("ddp-hostile-overflow");
  const std::string data = bytes_of(floats(4));
  const std::vector<std::pair<std::string, std::string>> cases{
      {p::tensor("FloatStorage", "0", (std::int64_t{1} << 62) + 10, 0, {2}, {1}),
       "impossible size of 4611686018427387914 elements"},
      {p::tensor("FloatStorage", "0", 4, 0, {2, std::int64_t{1} << 62}, {std::int64_t{1} << 62, 4}),
       "overflows 64-bit indexing"},
      // Strides that wrap around to a small sum passed the old bounds check.
      {p::tensor("FloatStorage", "0", 4, 0, {3, 2}, {std::int64_t{1} << 62, 1}),
       "overflows 64-bit indexing"},
      {p::tensor("FloatStorage", "0", 4, 2, {3}, {1}), "reaches past its storage of 4 elements"},
  };
  for (const auto& [tensor, text] : cases) {
    const auto path = dir.path() / "overflow.pt";
    write_file(path, test::make_torch_archive(p::state_dict({{"w", tensor}}), {{"0", data}}));
    const auto o = outcome_of([&] { read_state_dict(path); });
    EXPECT_TRUE(o.format_error) << o.error;
    EXPECT_TRUE(has(o, text)) << o.error;
  }
}

// An optimizer.state_dict() in Python's layout with one value replaced.
std::string adam_state(const std::string& lr, const std::string& step) {
  const std::string tensor = p::tensor("FloatStorage", "0", 2, 0, {2}, {1});
  const std::string tensor_sq = p::tensor("FloatStorage", "1", 2, 0, {2}, {1});
  return "\x80\x02" +
         p::dict({{p::binunicode("state"),
                   p::dict({{p::integer(0), p::dict({{p::binunicode("step"), step},
                                                     {p::binunicode("exp_avg"), tensor},
                                                     {p::binunicode("exp_avg_sq"), tensor_sq}})}})},
                  {p::binunicode("param_groups"),
                   p::list({p::dict(
                       {{p::binunicode("lr"), lr},
                        {p::binunicode("betas"), p::tuple({p::floating(0.9), p::floating(0.999)})},
                        {p::binunicode("eps"), p::floating(1e-8)},
                        {p::binunicode("weight_decay"), p::floating(0)},
                        {p::binunicode("amsgrad"), p::boolean(false)},
                        {p::binunicode("maximize"), p::boolean(false)},
                        {p::binunicode("params"), p::list({p::integer(0)})}})})}}) +
         ".";
}

// 11. Values the training loop cannot use: named by key, and the optimizer keeps its own.
TEST(HostileFiles, OptimizerValuesTheLoopCannotUseAreRefusedByKey) {
  test::TempDir dir("ddp-hostile-values");
  const std::string zeros = bytes_of(torch::zeros({2}));
  auto param = torch::zeros({2}, torch::requires_grad());
  torch::optim::Adam adam({param}, torch::optim::AdamOptions(0.25));
  const auto nan = std::nan("");
  const auto inf = std::numeric_limits<double>::infinity();
  const std::vector<std::tuple<std::string, std::string, std::string>> cases{
      {p::floating(nan), p::floating(1), "param_groups[0]['lr'] is nan"},
      {p::floating(inf), p::floating(1), "param_groups[0]['lr'] is inf"},
      {p::floating(-1e9), p::floating(1), "param_groups[0]['lr'] is -1000000000"},
      {p::floating(0.1), p::floating(nan), "state[0]['step'] is nan"},
      {p::floating(0.1), p::floating(inf), "state[0]['step'] is inf"},
      {p::floating(0.1), p::floating(1e300), "state[0]['step'] is 1e+300"},
      {p::floating(0.1), p::floating(-5), "state[0]['step'] is -5"},
      {p::floating(0.1), p::floating(2.5), "state[0]['step'] is 2.5"},
  };
  for (const auto& [lr, step, text] : cases) {
    const auto path = dir.path() / "adam.pt";
    write_file(path, test::make_torch_archive(adam_state(lr, step), {{"0", zeros}, {"1", zeros}}));
    const auto o = outcome_of([&] { load_optimizer_state_dict(adam, path); });
    EXPECT_TRUE(o.format_error) << text << ": " << o.error;
    EXPECT_TRUE(has(o, text)) << o.error;
    EXPECT_EQ(static_cast<torch::optim::AdamOptions&>(adam.param_groups()[0].options()).lr(), 0.25);
    EXPECT_TRUE(adam.state().empty());
  }
  // The same file with usable values loads.
  const auto path = dir.path() / "adam.pt";
  write_file(path, test::make_torch_archive(adam_state(p::floating(0.1), p::floating(3)),
                                            {{"0", zeros}, {"1", zeros}}));
  load_optimizer_state_dict(adam, path);
  EXPECT_EQ(static_cast<torch::optim::AdamOptions&>(adam.param_groups()[0].options()).lr(), 0.1);
}

// ddp's own checkpoints go through libtorch's reader, which loads an optimizer's state (not its
// options: libtorch keeps the optimizer's own): a negative step count in one is refused and the
// optimizer put back; a damaged record of an archive without ddp's checksums (torch::save's) is
// caught by the zip CRC before libtorch reads it.
TEST(HostileFiles, CheckpointsWithUnusableValuesOrDamagedRecordsAreRefused) {
  test::TempDir dir("ddp-hostile-checkpoint");
  torch::nn::Linear model(4, 4);
  torch::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(0.1));
  model->forward(torch::ones({1, 4})).sum().backward();
  adam.step();
  for (auto& [key, state] : adam.state())
    static_cast<torch::optim::AdamParamState&>(*state).step(-5);
  save_checkpoint(dir.path() / "negative.pt", *model, adam, {});
  torch::optim::Adam fresh(model->parameters(), torch::optim::AdamOptions(0.2));
  const auto o = outcome_of([&] { load_checkpoint(dir.path() / "negative.pt", *model, fresh); });
  EXPECT_TRUE(has(o, "step is -5; a step count must be >= 0")) << o.error;
  EXPECT_TRUE(has(o, "negative.pt")) << o.error;
  EXPECT_TRUE(fresh.state().empty());
  EXPECT_EQ(static_cast<torch::optim::AdamOptions&>(fresh.param_groups()[0].options()).lr(), 0.2);

  const auto tensor = torch::arange(4096, torch::kFloat32);
  torch::save(tensor, (dir.path() / "plain.pt").string());
  std::string bytes = read_file(dir.path() / "plain.pt");
  const auto at = bytes.find(bytes_of(tensor.slice(0, 0, 16)));
  ASSERT_NE(at, std::string::npos);
  bytes[at + 1000] ^= 0x20;
  write_file(dir.path() / "damaged.pt", bytes);
  const auto d = outcome_of([&] { load_archive(dir.path() / "damaged.pt"); });
  EXPECT_TRUE(has(d, "fails its CRC-32 check")) << d.error;
  EXPECT_TRUE(has(d, "damaged.pt")) << d.error;
  load_archive(dir.path() / "plain.pt");
}

}  // namespace DDP_UNITY_ID
}  // namespace
}  // namespace ddp
