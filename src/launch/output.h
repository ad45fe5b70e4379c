// Line prefixing of worker output: `ddm launch` reads each worker's stdout + stderr from one pipe
// and writes it line by line with a "[rank N] " prefix, so that the lines of N workers interleave
// whole. LinePrefixer is the pure part (bytes in, complete prefixed lines out), unit-tested without
// processes.
//
// Rules:
//   - "\n" ends a line; "\r\n" counts as one line end.
//   - "\r" alone is a progress redraw (a counter rewriting its own line on a terminal). The text
//     after the last "\r" replaces what came before, as a terminal would show it; a redrawn line
//     is emitted when its "\n" arrives, and at most once per `progress_interval` in between, so a
//     fast counter neither floods the output nor stays invisible for a long phase.
//   - A partial line is held until its end arrives, or emitted when it grows past `max_line`
//     bytes (a program that never writes "\n"), or when the worker's pipe closes (flush).
//   - A rank's prefixer (for_rank) drops the rank a line's error already names: ddm prints a
//     failure as "error: rank N: ..." in any distributed job (apps/ddm.cpp; many messages start
//     with "rank N: " themselves), which is what torchrun, srun and mpirun show; under `ddm launch`
//     the prefix names the rank, so rank N's "error: rank N: X" (and "error (LibTorch): rank N: X")
//     is shown as "[rank N] error: X". An error naming another rank is kept whole.
#pragma once
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace ddm {

class LinePrefixer {
 public:
  using Clock = std::chrono::steady_clock;

  explicit LinePrefixer(std::string prefix, std::chrono::milliseconds progress_interval = std::chrono::seconds(2),
                        size_t max_line = 64 * 1024);
  // `ddm launch`'s prefixer for the worker of rank `rank`: "[rank N] ", without a repeated "rank N: "
  // after "error: " (see the rules above).
  static LinePrefixer for_rank(int64_t rank, std::chrono::milliseconds progress_interval = std::chrono::seconds(2),
                               size_t max_line = 64 * 1024);

  // Feeds bytes read from the worker; returns the complete prefixed lines they finish, each
  // ending in "\n", concatenated (empty when nothing is complete yet). `now` is for the progress
  // throttle.
  std::string feed(const char* data, size_t n, Clock::time_point now = Clock::now());
  std::string feed(const std::string& s, Clock::time_point now = Clock::now()) {
    return feed(s.data(), s.size(), now);
  }
  // The pipe closed: returns the held partial line (prefixed, with "\n") or "".
  std::string flush();

 private:
  std::string emit(const std::string& text);

  std::string prefix_;
  std::string named_;  // "rank N: " for for_rank(N): dropped at a line's start or after "error: "; "" otherwise
  std::chrono::milliseconds progress_interval_;
  size_t max_line_;
  bool continued_ = false;  // the current line was split at max_line: its rest does not start a line
  std::string current_;   // text since the last "\r" or "\n"
  std::string redrawn_;   // the last non-empty text ended by "\r" in this line
  bool redrawn_shown_ = false;  // redrawn_ was already emitted
  Clock::time_point last_progress_{};
};

}  // namespace ddm
