// Progress display and JSONL metrics (see progress.h).
#include "core/progress.h"

#include <cmath>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <sstream>
#include <unistd.h>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/error.h"

namespace ddm {

std::string format_bytes(int64_t bytes) {
  char buf[32];
  const double b = static_cast<double>(bytes);
  if (bytes < 1024) std::snprintf(buf, sizeof buf, "%lld B", static_cast<long long>(bytes));
  else if (b < 1024.0 * 1024) std::snprintf(buf, sizeof buf, "%.1f KiB", b / 1024);
  else if (b < 1024.0 * 1024 * 1024) std::snprintf(buf, sizeof buf, "%.1f MiB", b / (1024.0 * 1024));
  else std::snprintf(buf, sizeof buf, "%.2f GiB", b / (1024.0 * 1024 * 1024));
  return buf;
}

std::string format_duration(double s) {
  if (!(s >= 0) || s > 1e7) return "?";
  char buf[32];
  const long t = static_cast<long>(s + 0.5);
  if (t >= 3600)
    std::snprintf(buf, sizeof buf, "%ldh%02ldm", t / 3600, (t % 3600) / 60);
  else if (t >= 60)
    std::snprintf(buf, sizeof buf, "%ldm%02lds", t / 60, t % 60);
  else
    std::snprintf(buf, sizeof buf, "%lds", t);
  return buf;
}

std::string format_finish_time(double seconds) {
  if (!(seconds >= 60) || seconds > 1e7) return "";  // under a minute the clock says nothing more
  const std::time_t now = std::time(nullptr), end = now + static_cast<std::time_t>(seconds + 0.5);
  std::tm a{}, b{};
  localtime_r(&now, &a);
  localtime_r(&end, &b);
  char buf[32];
  std::strftime(buf, sizeof buf, a.tm_yday == b.tm_yday && a.tm_year == b.tm_year ? "%H:%M" : "%a %H:%M", &b);
  return buf;
}

Progress::Progress(int64_t first_step, int64_t total_steps, bool quiet)
    : first_step_(first_step), total_(total_steps), quiet_(quiet), tty_(isatty(fileno(stdout)) != 0) {
  start_ = interval_start_ = last_draw_ = Clock::now();
}

double Progress::interval_img_per_s() const {
  const double dt = std::chrono::duration<double>(Clock::now() - interval_start_).count();
  return dt > 0 ? interval_images_ / dt : 0.0;
}

double Progress::eta_seconds(int64_t step) const {
  const double elapsed = std::chrono::duration<double>(Clock::now() - start_).count();
  const int64_t done = step - first_step_;
  return done > 0 ? elapsed / done * static_cast<double>(total_ - step) : -1.0;
}

void Progress::reset_interval() {
  interval_sum_ = 0;
  interval_n_ = 0;
  interval_images_ = 0;
  interval_start_ = Clock::now();
}

void Progress::step(int64_t step, double loss, double lr, double grad_norm, int64_t batch_size,
                    const std::string& extra) {
  if (std::isfinite(loss)) {  // an fp16 step skipped for a non-finite loss is left out of the mean
    interval_sum_ += loss;
    ++interval_n_;
  }
  interval_images_ += batch_size;
  images_ += batch_size;
  last_loss_ = loss;
  if (quiet_) return;
  const auto now = Clock::now();
  const double elapsed = std::chrono::duration<double>(now - start_).count();
  const double eta = eta_seconds(step);
  const double img_s = elapsed > 0 ? images_ / elapsed : 0.0;
  if (tty_) {
    if (std::chrono::duration<double>(now - last_draw_).count() < 0.2 && step != total_) return;
    last_draw_ = now;
    const std::string at = format_finish_time(eta);
    std::printf("\r  step %lld/%lld %3d%%  loss %.4f  lr %.2e  |g| %.3f%s  %.0f img/s  ETA %s%s   ",
                static_cast<long long>(step), static_cast<long long>(total_),
                static_cast<int>(100.0 * step / total_), loss, lr, grad_norm, extra.c_str(), img_s,
                format_duration(eta).c_str(),
                at.empty() || step == total_ ? "" : (" (" + at + ")").c_str());
    std::fflush(stdout);
  }
  (void)0;
}

void Progress::finish() {
  if (tty_ && !quiet_) std::printf("\n");
  std::fflush(stdout);
}

MetricsLog::MetricsLog(const std::string& path, int64_t resume_step) {
  std::vector<std::string> keep;
  if (resume_step > 0 && std::filesystem::exists(path)) {
    std::ifstream in(path);
    std::string line;
    while (std::getline(in, line)) {
      try {
        auto j = nlohmann::json::parse(line);
        if (j.value("step", int64_t{0}) <= resume_step) keep.push_back(line);
      } catch (const nlohmann::json::exception&) {
        break;  // a torn last line from a crash
      }
    }
  }
  out_.open(path, std::ios::trunc);
  DDM_CHECK(out_, "cannot write metrics file '" << path << "'");
  for (const auto& l : keep) out_ << l << "\n";
  out_.flush();
}

void MetricsLog::write(const std::string& json_line) {
  out_ << json_line << "\n";
  out_.flush();
}

}  // namespace ddm
