// OutputRouting: where each worker's stdout and stderr go, the console or the --log-dir files or
// both, from torchrun's options --redirects, --tee and --local-ranks-filter.
//
//   OutputRouting routing = parse_output_routing({.redirects = "1", .tee = "0:2"}, /*nproc=*/2);
//   routing.to_console(0, kStdout);   // false: local rank 0's stdout goes to its file only
//
// A stream value is torchrun's: 0 none, 1 stdout, 2 stderr, 3 both; either one value for every
// local rank ("3") or LOCAL_RANK:VALUE pairs ("0:1,1:3"; ranks not named get 0). Unlike torchrun,
// the files (when there is a --log-dir) always get every stream: --redirects takes a stream off
// the console, --tee puts it back (and is therefore accepted for compatibility), and
// --local-ranks-filter keeps all but the named ranks off the console. Pure values: any thread.
//
// Errors: UsageError naming the option, what was wrong and what is valid.
#pragma once

#include <string>
#include <vector>

namespace ddp::ddprun {

// Bits of a stream value, as torchrun's Std.
inline constexpr int kStdout = 1;
inline constexpr int kStderr = 2;

struct OutputRoutingText {
  std::string redirects;           // "" = not given
  std::string tee;                 // "" = not given
  std::string local_ranks_filter;  // "" = not given: every rank reaches the console
};

struct OutputRouting {
  std::vector<int> redirects;  // per local rank: streams sent to the files only
  std::vector<int> tee;        // per local rank: streams sent to the files and the console
  std::vector<bool> shown;     // per local rank: whether its output may reach the console

  // Whether `stream` (kStdout or kStderr) of `local_rank` is printed on ddprun's console.
  bool to_console(int local_rank, int stream) const;
  // Whether --redirects or --tee asked for any file at all (they need a --log-dir).
  bool wants_files() const;
};

// Parses the three options for a node of `nproc` local workers. Throws UsageError.
OutputRouting parse_output_routing(const OutputRoutingText& text, int nproc);

}  // namespace ddp::ddprun
