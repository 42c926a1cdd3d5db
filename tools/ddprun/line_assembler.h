// LineAssembler: turns one worker's output stream (arbitrary chunks from a pipe) into whole,
// prefixed lines, so that two workers' output never mixes inside a line.
//
//   LineAssembler lines("[3] ");
//   lines.feed("hel", out);      // out unchanged: no complete line yet
//   lines.feed("lo\nwor", out);  // out += "[3] hello\n"
//   lines.finish(out);           // out += "[3] wor\n" (the unterminated tail, at EOF)
//
// A line longer than `max_line` bytes is cut there and emitted as several lines, so a worker that
// never writes a newline cannot make ddprun's memory grow without bound.
// Ending::kVerbatim (ddprun --no-prefix) adds nothing: a cut piece and an unterminated tail are
// emitted without a newline of their own, so the bytes out are exactly the bytes in.
// Not thread-safe; ddprun uses one per pipe from its single event loop. Throws only bad_alloc.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace ddp::ddprun {

class LineAssembler {
 public:
  static constexpr std::size_t kDefaultMaxLine = 1 << 20;

  // What ends a piece that is not a whole line (a cut or the tail at EOF).
  enum class Ending { kAddNewline, kVerbatim };

  explicit LineAssembler(std::string prefix, std::size_t max_line = kDefaultMaxLine,
                         Ending ending = Ending::kAddNewline)
      : prefix_(std::move(prefix)), max_line_(max_line == 0 ? 1 : max_line), ending_(ending) {}

  // Appends every line completed by `data` to `out`, each as prefix + line + '\n'.
  void feed(std::string_view data, std::string& out);
  // Appends the pending partial line (if any) with a newline added, and clears it.
  void finish(std::string& out);

  bool has_partial_line() const { return !partial_.empty(); }

 private:
  void emit(std::string_view line, bool whole, std::string& out) const;

  std::string prefix_;
  std::size_t max_line_;
  Ending ending_;
  std::string partial_;
};

}  // namespace ddp::ddprun
