// LinePrefixer (see output.h): worker bytes in, whole "[rank N] " lines out.
#include "launch/output.h"

#include <utility>

namespace ddm {

LinePrefixer::LinePrefixer(std::string prefix, std::chrono::milliseconds progress_interval, size_t max_line)
    : prefix_(std::move(prefix)), progress_interval_(progress_interval), max_line_(max_line < 1 ? 1 : max_line) {}

std::string LinePrefixer::emit(const std::string& text) { return prefix_ + text + "\n"; }

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
  return out;
}

}  // namespace ddm
