// Saving and loading a model's state dict in Python's format (ddp::save_state_dict /
// ddp::load_state_dict, state_dict.h) against libtorch's own torch::save / torch::load of the
// same tensors: the median of each over --repeats rounds, and their ratio (issue 27 asks for
// at most 1.5x).
//
//   state_dict_bench --params 50000000 --repeats 5 --dir /tmp [--overwrite]
//
// The model is a stack of square Linear layers holding about --params parameters. Files go to
// --dir (the page cache, unless the folder is on another file system), and are removed at the end.
//
// The bound measured in the same rounds: writing the file's bytes to PATH.tmp with plain fwrite
// and renaming it over PATH (raw_replace_ms), which is what any atomic save costs on this file
// system. ddp's save replaces its file that way so a crash never leaves half a checkpoint;
// torch::save truncates and rewrites in place. On ext4 mounted with `discard` (this machine's
// root) replacing a file by rename is several times dearer than truncating it; on tmpfs it is not.
//
// The cost of the CRC-32 check, in the same rounds: ddp's reader of the file (every record's
// CRC-32 verified, as always) against the same reader told to skip the check (an internal option
// that exists only for this measurement), both reading the file from the page cache into fresh
// tensors; crc_share_of_load is their difference over load_state_dict's whole time. And the zip
// layers alone, every record read into fresh memory: ddp's reader (CRC-32 verified) against
// libtorch's PyTorchStreamReader (miniz, no CRC check), which ddp read state dicts with before.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <stdexcept>
#include <vector>

#include <unistd.h>

#include <c10/core/CPUAllocator.h>
#include <caffe2/serialize/inline_container.h>
#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include "archive/zip_reader.h"
#include "bench_timing.h"
#include "ddp/torch/formats/state_dict.h"
#include "torch/formats/pytorch_archive.h"

int main(int argc, char** argv) {
  CLI::App app{"ddp::save_state_dict/load_state_dict against torch::save/torch::load"};
  std::int64_t params = 50'000'000;
  int repeats = 5;
  std::string dir = std::filesystem::temp_directory_path().string();
  app.add_option("--params", params, "parameters in the model (about)")->check(CLI::PositiveNumber);
  app.add_option("--repeats", repeats, "rounds; the median is reported")
      ->check(CLI::PositiveNumber);
  bool overwrite = false;
  app.add_option("--dir", dir, "folder for the files");
  app.add_flag("--overwrite", overwrite, "save over the previous round's files");
  CLI11_PARSE(app, argc, argv);

  torch::set_num_threads(1);
  constexpr int kLayers = 5;
  const auto width = std::max<std::int64_t>(
      1, static_cast<std::int64_t>(std::sqrt(static_cast<double>(params) / kLayers)));
  torch::nn::Sequential model;
  for (int i = 0; i < kLayers; ++i)
    model->push_back(torch::nn::Linear(width, width));
  std::vector<torch::Tensor> tensors;
  std::int64_t count = 0;
  for (const auto& item : ddp::state_dict(*model)) {
    tensors.push_back(item.value());
    count += item.value().numel();
  }

  const auto ours = std::filesystem::path(dir) / fmt::format("state_dict_bench_{}.pt", getpid());
  const auto theirs =
      std::filesystem::path(dir) / fmt::format("state_dict_bench_{}_torch.pt", getpid());
  const auto raw =
      std::filesystem::path(dir) / fmt::format("state_dict_bench_{}_raw.bin", getpid());
  std::vector<double> save_ours, load_ours, save_torch, load_torch, raw_replace, read_verified,
      read_unverified, records_ours, records_miniz;
  std::vector<char> bytes;
  for (int r = 0; r < repeats; ++r) {
    // Each save starts with no dirty pages, so neither pays for writing back the other's file,
    // and (unless --overwrite) with its file gone: ddp's save writes PATH.tmp and renames it over
    // PATH, torch::save truncates PATH, which costs differently where PATH exists.
    if (!overwrite) std::filesystem::remove(theirs);
    ::sync();
    save_torch.push_back(milliseconds([&] { torch::save(tensors, theirs.string()); }));
    load_torch.push_back(milliseconds([&] {
      std::vector<torch::Tensor> loaded;
      torch::load(loaded, theirs.string());
    }));
    if (!overwrite) std::filesystem::remove(ours);
    ::sync();
    save_ours.push_back(milliseconds([&] { ddp::save_state_dict(*model, ours); }));
    load_ours.push_back(milliseconds([&] { ddp::load_state_dict(*model, ours); }));
    read_verified.push_back(milliseconds([&] { ddp::detail::read_pytorch_archive(ours); }));
    read_unverified.push_back(
        milliseconds([&] { ddp::detail::read_pytorch_archive(ours, {.verify_crc = false}); }));
    records_ours.push_back(milliseconds([&] {
      const auto zip = ddp::archive::ZipReader::open(ours);
      for (const auto& entry : zip.entries()) {
        at::DataPtr bytes = c10::GetCPUAllocator()->allocate(entry.size);
        zip.read(entry, bytes.get());
      }
    }));
    records_miniz.push_back(milliseconds([&] {
      caffe2::serialize::PyTorchStreamReader reader(ours.string());
      for (const auto& name : reader.getAllRecords())
        reader.getRecord(name);
    }));
    // The bound: the same number of bytes written to a temporary file and renamed over `raw`.
    if (bytes.empty()) bytes.assign(std::filesystem::file_size(ours), 1);
    if (!overwrite) std::filesystem::remove(raw);
    ::sync();
    raw_replace.push_back(milliseconds([&] {
      auto temporary = raw;
      temporary += ".tmp";
      FILE* file = std::fopen(temporary.c_str(), "wb");
      if (file == nullptr || std::fwrite(bytes.data(), 1, bytes.size(), file) != bytes.size()) {
        throw std::runtime_error("cannot write " + temporary.string());
      }
      std::fclose(file);
      std::filesystem::rename(temporary, raw);
    }));
  }
  const auto file_mb = static_cast<double>(std::filesystem::file_size(ours)) / 1e6;
  std::filesystem::remove(ours);
  std::filesystem::remove(theirs);
  std::filesystem::remove(raw);

  fmt::print("params={} file_mb={:.1f} repeats={} overwrite={}\n", count, file_mb, repeats,
             overwrite);
  fmt::print("save_state_dict_ms={:.1f} torch_save_ms={:.1f} save_ratio={:.2f}\n",
             median(save_ours), median(save_torch), median(save_ours) / median(save_torch));
  fmt::print("raw_replace_ms={:.1f} save_over_raw_replace={:.2f}\n", median(raw_replace),
             median(save_ours) / median(raw_replace));
  fmt::print("load_state_dict_ms={:.1f} torch_load_ms={:.1f} load_ratio={:.2f}\n",
             median(load_ours), median(load_torch), median(load_ours) / median(load_torch));
  fmt::print("read_verified_ms={:.1f} read_unverified_ms={:.1f} crc_share_of_load={:.3f}\n",
             median(read_verified), median(read_unverified),
             (median(read_verified) - median(read_unverified)) / median(load_ours));
  fmt::print("zip_records_ms={:.1f} miniz_records_ms={:.1f} zip_over_miniz={:.2f}\n",
             median(records_ours), median(records_miniz),
             median(records_ours) / median(records_miniz));
  return 0;
}
