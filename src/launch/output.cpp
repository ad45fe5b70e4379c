// LinePrefixer (see output.h): worker bytes in, whole "[rank N] " lines out, without the rank
// repeated at a line's start or after "error: ".
#include "launch/output.h"

#include <utility>

namespace ddm {

LinePrefixer::LinePrefixer(std::string prefix, std::chrono::milliseconds progress_interval, size_t max_line)
    : prefix_(std::move(prefix)), progress_interval_(progress_interval), max_line_(max_line < 1 ? 1 : max_line) {}

LinePrefixer LinePrefixer::for_rank(int64_t rank, std::chrono::milliseconds progress_interval, size_t max_line) {
  LinePrefixer p("[rank " + std::to_string(rank) + "] ", progress_interval, max_line);
  p.named_ = "rank " + std::to_string(rank) + ": ";
  return p;
}

std::string LinePrefixer::emit(const std::string& text) {
  if (!named_.empty() && !continued_) {
    if (text.compare(0, named_.size(), named_) == 0) return prefix_ + text.substr(named_.size()) + "\n";
    for (const char* error : {"error: ", "error (LibTorch): "}) {
      const std::string e = error;
      if (text.compare(0, e.size(), e) == 0 && text.compare(e.size(), named_.size(), named_) == 0)
        return prefix_ + e + text.substr(e.size() + named_.size()) + "\n";
    }
  }
  return prefix_ + text + "\n";
}

std::string LinePrefixer::feed(const char* data, size_t n, Clock::time_point now) {
  std::string out;
  for (size_t i = 0; i < n; ++i) {
    const char c = data[i];
    if (c == '\n') {
      // The line as a terminal would leave it: the text after the last "\r", or, for a line that
      // ended right after a redraw ("...\r\n"), the last redrawn text unless it was shown already.
      if (!current_.empty()) {
        out += emit(current_);
      } else if (!redrawn_.empty()) {
        if (!redrawn_shown_) out += emit(redrawn_);
      } else {
        out += emit("");  // a blank line stays a blank line
      }
      current_.clear();
      redrawn_.clear();
      redrawn_shown_ = false;
      continued_ = false;
    } else if (c == '\r') {
      if (current_.empty()) continue;  // "\r" at the start of a redraw, or "\r\r"
      redrawn_.swap(current_);
      current_.clear();
      redrawn_shown_ = false;
      if (now - last_progress_ >= progress_interval_) {
        out += emit(redrawn_);
        redrawn_shown_ = true;
        last_progress_ = now;
      }
    } else {
      current_.push_back(c);
      if (current_.size() >= max_line_) {  // a program that never ends its line: split it
        out += emit(current_);
        current_.clear();
        redrawn_.clear();
        redrawn_shown_ = false;
        continued_ = true;
      }
    }
  }
  return out;
}

std::string LinePrefixer::flush() {
  std::string out;
  if (!current_.empty()) {
    out = emit(current_);
  } else if (!redrawn_.empty() && !redrawn_shown_) {
    out = emit(redrawn_);
  }
  current_.clear();
  redrawn_.clear();
  redrawn_shown_ = false;
  continued_ = false;
  return out;
}

}  // namespace ddm
