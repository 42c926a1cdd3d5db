// Checksums inside torch archives, so that a damaged checkpoint fails to load instead of loading
// damaged weights: libtorch's zip reader does not check the zip's own CRCs, so 64 flipped bytes
// inside a weight load silently without this.
//
//   add_checksums(archive);                      // just before the archive is written
//   ...
//   auto archive = torch::serialize::InputArchive(); archive.load_from(path);
//   verify_checksums(archive, path);             // throws on damage; false when it has none
//
// The checksum entry ("ddp_checksums") lists, for every tensor and every other value of the
// archive (nested archives included, by their dotted path such as "model.fc1.weight"), a CRC-32 of
// its dtype, shape and bytes (tensors) or of its printed form (other values). CRC-32 detects
// accidental damage (disk, transfer, truncated copies), not deliberate tampering: whoever can
// rewrite the file can rewrite the checksums too.
//
// Internal to ddp_torch. Functions are thread-compatible (no shared state).
#pragma once

#include <filesystem>

#include <torch/torch.h>

namespace ddp::detail {

inline constexpr const char* kChecksumsEntry = "ddp_checksums";

// Adds (or replaces) the checksum entry of `archive`, computed from the archive as it will be
// read back (it is serialised once in memory for that). Throws ddp::Error if that fails.
void add_checksums(torch::serialize::OutputArchive& archive);

// True when `archive` has a checksum entry and every entry matches it; false when it has none
// (written before ddp stored checksums, or by torch::save). Throws ddp::Error naming `path` and
// the first entry that differs, is missing or is not listed.
bool verify_checksums(torch::serialize::InputArchive& archive, const std::filesystem::path& path);

}  // namespace ddp::detail
