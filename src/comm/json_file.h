// Helpers for the JSON files the comm layer writes (flight-recorder dumps, timeline traces):
// string literals and an atomic file write (internal).
//
// write_file_atomically writes through a temporary file in the same folder and a rename, so a
// reader sees the old file or the whole new one, never half of it; on any failure (cannot
// create, disk full, file-size limit, rename) the temporary file is removed and the old file, if
// any, is left as it was. Thread-safe (no shared state).
#pragma once

#include <filesystem>
#include <string>
#include <string_view>

namespace ddp::comm {

// The text of errno value `err` (thread-safe, unlike strerror).
std::string error_text(int err);

// JSON string literal of `text` (UTF-8 passes through; control characters are escaped).
std::string json_string(std::string_view text);

// Returns "" on success, else what went wrong (naming the file and the system's reason).
std::string write_file_atomically(const std::filesystem::path& path, std::string_view text);

}  // namespace ddp::comm
