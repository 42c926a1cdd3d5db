// ddp's distributed checkpoint (save_dcp, save_dcp_async, DcpReader) on a model sharded as FSDP
// shards it: every parameter and its two Adam moments split by rows over the ranks (as
// torch.chunk splits them: PyTorch's DTensor Shard(0)), plus a step value. One process per rank,
// under ddprun; bench/compare/compare_dcp.py runs it beside PyTorch's dcp
// (bench/compare/pytorch_dcp_bench.py) on the same shapes.
//
//   ddprun --nproc-per-node 4 dcp-bench --phase save --dir /tmp/ckpt --params 268435456
//   ddprun --nproc-per-node 3 dcp-bench --phase load --dir /tmp/ckpt --params 268435456
//   ddprun --nproc-per-node 4 dcp-bench --phase replicas --dir /tmp/ckpt2 --params 268435456
//
// --params is the model's parameter count (float32); the checkpoint holds three times it (Adam).
// save: --rounds synchronous saves into --dir, then (after one unmeasured, as a training loop's
// saves after its first) as many asynchronous ones (the time save_dcp_async keeps the caller:
// the stall; and to its wait()'s end), the copy bound (a host copy of the rank's tensors into
// buffers already touched: what an asynchronous save cannot avoid) and the disk bound (the
// rank's bytes written to a file of its own and synced, every rank at once).
// replicas: a model DDP replicates (every rank holds every tensor whole: --params / world
// parameters and their moments, the bytes a rank holds in the sharded save), saved --rounds times
// with the replicas compared across ranks (DcpSaveOptions::check_replicas, the default) and as
// many without, alternated: what the check costs.
// load: the rank's rows of every tensor at this world size (the save's layout, or another:
// resharding), read --rounds times; the peak memory a load adds beyond the tensors it returns
// (VmHWM, reset before each round) and the largest saved chunk, the bound.
// Times are the slowest rank's per round, medians over the rounds. Rank 0's last line:
//   dcp-bench phase=save world=4 bytes=B save_ms=S async_stall_ms=A async_total_ms=T copy_ms=C
//             raw_write_ms=W
//   dcp-bench phase=replicas world=4 bytes=B save_ms=S unchecked_save_ms=U
//   dcp-bench phase=load world=3 bytes=B load_ms=L peak_added_mb=P largest_chunk_mb=K
#include <malloc.h>
#include <unistd.h>

#include <cstdio>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include "bench_timing.h"
#include "ddp/runtime/init.h"
#include "ddp/torch.h"

namespace {

// The model's parameters: square-ish matrices of `width` columns, `rows` rows each, about
// `params` float32 elements in all (8 layers).
struct Shapes {
  std::vector<std::vector<std::int64_t>> layers;
};

Shapes shapes_for(std::int64_t params) {
  constexpr int kLayers = 8;
  const std::int64_t per_layer = std::max<std::int64_t>(params / kLayers, 1);
  const std::int64_t width = std::max<std::int64_t>(1, std::min<std::int64_t>(1024, per_layer));
  const std::int64_t rows = std::max<std::int64_t>(1, per_layer / width);
  Shapes s;
  for (int i = 0; i < kLayers; ++i)
    s.layers.push_back({rows, width});
  return s;
}

// torch.chunk's split of `rows` over `world`: ceil(rows / world) each, the last ones shorter or
// empty.
std::pair<std::int64_t, std::int64_t> rows_of(std::int64_t rows, int world, int rank) {
  const std::int64_t per = (rows + world - 1) / world;
  const std::int64_t start = std::min<std::int64_t>(rows, per * rank);
  return {start, std::min<std::int64_t>(rows, start + per) - start};
}

const char* const kKinds[] = {"weight", "exp_avg", "exp_avg_sq"};

std::string entry_name(int layer, int kind) {
  return kind == 0 ? fmt::format("model.layers.{}.weight", layer)
                   : fmt::format("optim.state.layers.{}.{}", layer, kKinds[kind]);
}

double status_mib(const std::string& field) {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);) {
    if (line.rfind(field + ":", 0) == 0) return std::stod(line.substr(field.size() + 1)) / 1024.0;
  }
  return 0.0;
}

// Resets VmHWM to the current resident size (Linux's clear_refs, value 5).
void reset_peak() {
  std::ofstream("/proc/self/clear_refs") << "5";
}

double over_ranks(double value, ddp::ReduceOp op) {
  auto t = torch::full({1}, value, torch::kFloat64);
  ddp::all_reduce(t, op);
  return t.item<double>();
}

double max_over_ranks(double value) {
  return over_ranks(value, ddp::ReduceOp::kMax);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"ddp's distributed checkpoint: save, asynchronous save and (resharding) load"};
  std::string phase, dir;
  std::int64_t params = 1 << 20;
  int rounds = 3;
  app.add_option("--phase", phase, "save, replicas or load")
      ->required()
      ->check(CLI::IsMember({"save", "replicas", "load"}));
  app.add_option("--dir", dir, "the checkpoint folder")->required();
  app.add_option("--params", params, "the model's float32 parameters")
      ->check(CLI::Range(8, 1 << 30));
  app.add_option("--rounds", rounds, "rounds of each measurement")->check(CLI::Range(1, 100));
  CLI11_PARSE(app, argc, argv);

  try {
    torch::set_num_threads(1);
    auto group = ddp::init_process_group();
    const int rank = group->rank();
    const int world = group->size();
    const Shapes shapes = shapes_for(params);
    std::uint64_t bytes = 0;

    if (phase == "replicas") {
      // DDP's layout: every rank holds every tensor whole, so every rank checks its copies
      // against the others' (check_replicas) and each tensor is written once.
      ddp::DcpStateDict state;
      const Shapes replicated = shapes_for(std::max<std::int64_t>(params / world, 8));
      for (std::size_t layer = 0; layer < replicated.layers.size(); ++layer) {
        for (int kind = 0; kind < 3; ++kind) {
          at::Tensor whole = at::full(replicated.layers[layer],
                                      static_cast<double>(layer * 3 + kind), torch::kFloat32);
          bytes += whole.nbytes();
          state.add_tensor(entry_name(static_cast<int>(layer), kind), whole);
        }
      }
      state.add_value("step", 1000);
      std::vector<double> checked, unchecked;
      // One unmeasured save first: the first save of a process pays for what later ones reuse
      // (a fresh folder, the first large collective), which would fall on the checked side.
      ddp::save_dcp(state, dir);
      for (int r = 0; r < rounds; ++r) {  // alternated: both see the same machine load
        ddp::barrier();
        checked.push_back(max_over_ranks(milliseconds([&] { ddp::save_dcp(state, dir); })));
        ddp::barrier();
        unchecked.push_back(max_over_ranks(
            milliseconds([&] { ddp::save_dcp(state, dir, {.check_replicas = false}); })));
      }
      if (rank == 0) {
        fmt::print(
            "dcp-bench phase=replicas world={} bytes={} save_ms={:.1f} unchecked_save_ms={:.1f}\n",
            world, bytes, median(checked), median(unchecked));
      }
    } else if (phase == "save") {
      ddp::DcpStateDict state;
      for (std::size_t layer = 0; layer < shapes.layers.size(); ++layer) {
        const auto& shape = shapes.layers[layer];
        const auto [start, count] = rows_of(shape[0], world, rank);
        for (int kind = 0; kind < 3; ++kind) {
          at::Tensor local =
              at::full({count, shape[1]}, static_cast<double>(layer * 3 + kind), torch::kFloat32);
          bytes += local.nbytes();
          state.add_shard(entry_name(static_cast<int>(layer), kind), local, {start, 0}, shape);
        }
      }
      state.add_value("step", 1000);
      std::vector<double> sync, stall, total, copy;
      for (int r = 0; r < rounds; ++r) {
        ddp::barrier();
        sync.push_back(max_over_ranks(milliseconds([&] { ddp::save_dcp(state, dir); })));
      }
      // One unmeasured asynchronous save first: a training loop's saves after its first reuse
      // the host copy's buffers (pytorch_dcp_bench.py does the same).
      ddp::save_dcp_async(state, dir).wait();
      for (int r = 0; r < rounds; ++r) {
        ddp::barrier();
        ddp::DcpAsyncSave pending{nullptr};
        double stalled = 0;
        const double whole = milliseconds([&] {
          stalled = milliseconds([&] { pending = ddp::save_dcp_async(state, dir); });
          pending.wait();
        });
        stall.push_back(max_over_ranks(stalled));
        total.push_back(max_over_ranks(whole));
      }
      // The copy bound: the rank's tensors copied into host buffers already touched (as an
      // asynchronous save's after its first).
      std::vector<at::Tensor> copies;
      for (const auto& e : state.entries()) {
        if (e.tensor.defined()) copies.push_back(e.tensor.clone());
      }
      for (int r = 0; r < rounds; ++r) {
        ddp::barrier();
        copy.push_back(max_over_ranks(milliseconds([&] {
          std::size_t i = 0;
          for (const auto& e : state.entries()) {
            if (e.tensor.defined()) copies[i++].copy_(e.tensor);
          }
        })));
      }
      copies.clear();
      // The disk bound: the rank's bytes written to one file of its own and synced, every rank
      // at once, with nothing else (what any save of these bytes costs here).
      std::vector<double> raw;
      const auto raw_file = std::filesystem::path(dir) / fmt::format("raw_write_{}.bin", rank);
      for (int r = 0; r < rounds; ++r) {
        ddp::barrier();
        raw.push_back(max_over_ranks(milliseconds([&] {
          std::FILE* out = std::fopen(raw_file.c_str(), "wb");
          if (out == nullptr) throw ddp::Error("dcp-bench: cannot write " + raw_file.string());
          for (const auto& e : state.entries()) {
            if (e.tensor.defined()) std::fwrite(e.tensor.data_ptr(), 1, e.tensor.nbytes(), out);
          }
          std::fflush(out);
          ::fsync(::fileno(out));
          std::fclose(out);
        })));
        std::filesystem::remove(raw_file);
      }
      const double all_bytes = over_ranks(static_cast<double>(bytes), ddp::ReduceOp::kSum);
      if (rank == 0) {
        fmt::print(
            "dcp-bench phase=save world={} bytes={:.0f} save_ms={:.1f} async_stall_ms={:.1f} "
            "async_total_ms={:.1f} copy_ms={:.1f} raw_write_ms={:.1f}\n",
            world, all_bytes, median(sync), median(stall), median(total), median(copy),
            median(raw));
      }
    } else {
      const ddp::DcpReader checkpoint(dir);
      double largest_chunk = 0;
      for (const auto& [name, tensor] : checkpoint.info().tensors) {
        for (const auto& chunk : tensor.chunks) {
          double n = 4;
          for (const auto s : chunk.sizes)
            n *= static_cast<double>(s);
          largest_chunk = std::max(largest_chunk, n);
        }
      }
      std::vector<double> load, peak_added;
      for (int r = 0; r < rounds; ++r) {
        ddp::barrier();
        malloc_trim(0);
        const double before = status_mib("VmRSS");
        reset_peak();
        std::vector<at::Tensor> loaded;
        double destination = 0;
        const double ms = milliseconds([&] {
          for (std::size_t layer = 0; layer < shapes.layers.size(); ++layer) {
            const auto& shape = shapes.layers[layer];
            const auto [start, count] = rows_of(shape[0], world, rank);
            for (int kind = 0; kind < 3; ++kind) {
              loaded.push_back(checkpoint.read(entry_name(static_cast<int>(layer), kind),
                                               {start, 0}, {count, shape[1]}));
              destination += static_cast<double>(loaded.back().nbytes());
            }
          }
        });
        peak_added.push_back(
            max_over_ranks(status_mib("VmHWM") - before - destination / (1 << 20)));
        load.push_back(max_over_ranks(ms));
        bytes = static_cast<std::uint64_t>(destination);
        // What was read is what was saved (each tensor holds layer * 3 + kind).
        for (std::size_t i = 0; i < loaded.size(); ++i) {
          if (loaded[i].numel() > 0 && (loaded[i].min().item<float>() != static_cast<float>(i) ||
                                        loaded[i].max().item<float>() != static_cast<float>(i))) {
            throw ddp::Error(fmt::format("dcp-bench: tensor {} read back wrong", i));
          }
        }
      }
      const double all_bytes = over_ranks(static_cast<double>(bytes), ddp::ReduceOp::kSum);
      if (rank == 0) {
        fmt::print(
            "dcp-bench phase=load world={} bytes={:.0f} load_ms={:.1f} peak_added_mb={:.1f} "
            "largest_chunk_mb={:.1f}\n",
            world, all_bytes, median(load), median(peak_added), largest_chunk / (1 << 20));
      }
    }
    ddp::destroy_process_group();
  } catch (const std::exception& e) {
    fmt::print(stderr, "dcp-bench: {}\n", e.what());
    return 1;
  }
  return 0;
}
