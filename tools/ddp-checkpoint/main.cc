// ddp-checkpoint: what a distributed checkpoint (PyTorch's DCP folder) holds, whether every byte
// of it reads back, and conversions to and from one torch.save file (docs/checkpoints.md).
//
//   ddp-checkpoint inspect DIR   the format version, then a line per entry: a tensor's name,
//                                dtype, shape, chunks and bytes; a value's name and bytes
//   ddp-checkpoint verify DIR    reads every chunk and value (CRC-32s, dtypes, shapes); last
//                                line "verified: T tensors in C chunks, V values, B bytes"
//   ddp-checkpoint dcp-to-torch DIR FILE
//                                the one torch.save file PyTorch's dcp_to_torch_save writes for
//                                DIR (the nested state dict, tensors whole); last line
//                                "wrote FILE: E entries, B bytes"
//   ddp-checkpoint torch-to-dcp FILE DIR
//                                the folder PyTorch's torch_save_to_dcp writes for the torch.save
//                                file FILE (its dict flattened, one process); last line
//                                "wrote DIR: E entries, B bytes"
//
// Exit status: 0; 1 for a checkpoint or file that cannot be read or written (the message names
// the file, the entry and what is wrong); 2 for a usage error.
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <set>
#include <string>
#include <utility>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <CLI/CLI.hpp>

#include "ddp/torch/checkpoint/distributed_checkpoint.h"
#include "ddp/torch/checkpoint/distributed_checkpoint_save.h"

namespace {

// The bytes of every chunk and value of a checkpoint, and the data files they lie in.
std::pair<std::uint64_t, std::set<std::string>> stored_bytes(const ddp::DcpCheckpointInfo& info) {
  std::uint64_t bytes = 0;
  std::set<std::string> files;
  for (const auto& [name, tensor] : info.tensors) {
    for (const auto& chunk : tensor.chunks) {
      bytes += chunk.storage.length;
      files.insert(chunk.storage.file);
    }
  }
  for (const auto& [name, value] : info.values) {
    bytes += value.length;
    files.insert(value.file);
  }
  return {bytes, files};
}

void inspect(const ddp::DcpReader& checkpoint) {
  const ddp::DcpCheckpointInfo& info = checkpoint.info();
  const auto [bytes, files] = stored_bytes(info);
  fmt::print("{}: DCP format {}, {} tensors, {} values, {} data files, {} bytes\n",
             checkpoint.folder().string(), info.version.empty() ? "(unrecorded)" : info.version,
             info.tensors.size(), info.values.size(), files.size(), bytes);
  for (const std::string& name : info.order) {  // as the file lists them
    if (const auto tensor = info.tensors.find(name); tensor != info.tensors.end()) {
      std::uint64_t tensor_bytes = 0;
      for (const auto& chunk : tensor->second.chunks)
        tensor_bytes += chunk.storage.length;
      fmt::print("tensor {} {} [{}] chunks={} bytes={}\n", name,
                 c10::toString(tensor->second.dtype), fmt::join(tensor->second.shape, ", "),
                 tensor->second.chunks.size(), tensor_bytes);
    } else {
      fmt::print("value {} bytes={}\n", name, info.values.at(name).length);
    }
  }
}

void verify(const ddp::DcpReader& checkpoint) {
  const ddp::DcpCheckpointInfo& info = checkpoint.info();
  std::size_t chunks = 0;
  for (const auto& [name, tensor] : info.tensors)
    chunks += tensor.chunks.size();
  const std::uint64_t bytes = checkpoint.verify();
  fmt::print("verified: {} tensors in {} chunks, {} values, {} bytes\n", info.tensors.size(),
             chunks, info.values.size(), bytes);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "Reads and writes PyTorch's distributed checkpoint folders (torch.distributed.checkpoint)"};
  app.require_subcommand(1);
  std::string folder;
  CLI::App* inspect_command = app.add_subcommand("inspect", "what the checkpoint holds");
  inspect_command->add_option("DIR", folder, "the checkpoint's folder")->required();
  CLI::App* verify_command = app.add_subcommand("verify", "read back every chunk and value");
  verify_command->add_option("DIR", folder, "the checkpoint's folder")->required();
  std::string file;
  CLI::App* to_torch_command =
      app.add_subcommand("dcp-to-torch", "write the checkpoint as one torch.save file");
  to_torch_command->add_option("DIR", folder, "the checkpoint's folder")->required();
  to_torch_command->add_option("FILE", file, "the file to write")->required();
  CLI::App* to_dcp_command = app.add_subcommand(
      "torch-to-dcp", "write a torch.save file's state dict as a distributed checkpoint");
  to_dcp_command->add_option("FILE", file, "the torch.save file to read")->required();
  to_dcp_command->add_option("DIR", folder, "the checkpoint folder to write")->required();
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }
  try {
    if (*to_torch_command) {
      ddp::dcp_to_torch_save(folder, file);
      const ddp::DcpReader checkpoint(folder);
      fmt::print("wrote {}: {} entries, {} bytes\n", file, checkpoint.info().order.size(),
                 std::filesystem::file_size(file));
      return 0;
    }
    if (*to_dcp_command) {
      const ddp::DcpCheckpointInfo info = ddp::torch_save_to_dcp(file, folder);
      fmt::print("wrote {}: {} entries, {} bytes\n", folder, info.order.size(),
                 stored_bytes(info).first);
      return 0;
    }
    const ddp::DcpReader checkpoint(folder);
    if (*inspect_command) inspect(checkpoint);
    if (*verify_command) verify(checkpoint);
  } catch (const std::exception& e) {
    std::fflush(stdout);
    fmt::print(stderr, "ddp-checkpoint: {}\n", e.what());
    return 1;
  }
  return 0;
}
