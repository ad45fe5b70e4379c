// Training progress: a live status line on a terminal (step, loss, img/s, ETA), plain periodic
// lines otherwise, and metrics as JSON lines (one record per logging interval).
#pragma once
#include <chrono>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <string>

namespace ddm {

std::string format_duration(double seconds);  // "1h02m", "3m05s", "12s"
std::string format_bytes(int64_t bytes);       // "512 B", "3.2 KiB", "41.0 MiB", "1.20 GiB"
// When a run `seconds` from now ends, on the local clock: "14:05", or "Tue 14:05" past today; "" if
// unknown (seconds < 0) or under a minute away.
std::string format_finish_time(double seconds);
// Seconds from t0 until now, on the steady clock.
inline double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

class Progress {
 public:
  Progress(int64_t first_step, int64_t total_steps, bool quiet);
  // Called after every step with its loss; prints as appropriate. img_per_s over the interval.
  // `extra`: appended to the live line (fp16's loss scale).
  void step(int64_t step, double loss, double lr, double grad_norm, int64_t batch_size,
            const std::string& extra = "");
  // Finishes the live line (if any).
  void finish();
  bool tty() const { return tty_; }
  // Mean loss and img/s over the current logging interval, for the metrics record (the mean of the
  // finite losses; NaN when the interval's steps had none: fp16 steps skipped for a non-finite loss).
  double interval_loss() const {
    return interval_n_ ? interval_sum_ / interval_n_ : interval_images_ > 0 ? std::nan("") : 0.0;
  }
  double interval_img_per_s() const;
  // Estimated seconds to reach the last step, from the average step time so far.
  double eta_seconds(int64_t step) const;
  void reset_interval();
  // Work between steps that is not training (a grid of samples): left out of the interval's img/s,
  // kept in the ETA (it recurs).
  void exclude_from_interval(double seconds) {
    interval_start_ += std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
  }
  // The loss sum and step count of the logging interval so far: saved in a checkpoint and restored on
  // resume, so that the first record after a resume averages the same steps as an uninterrupted run.
  double interval_loss_sum() const { return interval_sum_; }
  int64_t interval_steps() const { return interval_n_; }
  void restore_interval(double loss_sum, int64_t steps) {
    interval_sum_ = loss_sum;
    interval_n_ = steps;
  }

 private:
  using Clock = std::chrono::steady_clock;
  int64_t first_step_, total_;
  bool quiet_, tty_;
  Clock::time_point start_, interval_start_, last_draw_;
  double interval_sum_ = 0.0;
  int64_t interval_n_ = 0, interval_images_ = 0, images_ = 0;
  double last_loss_ = 0.0;
};

// Appends JSON lines; on resume, first drops records with step > resume_step.
class MetricsLog {
 public:
  MetricsLog(const std::string& path, int64_t resume_step);
  void write(const std::string& json_line);

 private:
  std::ofstream out_;
};

}  // namespace ddm
