// What a training run says while it runs (see run_log.h).
#include "run/run_log.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <string>

#include <nlohmann/json.hpp>

#include "core/device.h"

namespace ddm {

RunLog::RunLog(const RunLogSpec& spec, std::function<int64_t()> sent, const DataPosition& data,
               const BatchSource& source)
    : spec_(spec),
      sent_(std::move(sent)),
      data_(data),
      source_(source),
      progress_(spec.first_step, spec.steps, spec.quiet),
      interval_start_(Clock::now()),
      interval_sent_(sent_()),
      interval_first_(spec.first_step),
      noticed_skips_(data.skipped_mine()),
      reported_skips_(data.skipped_recorded()) {
  if (!spec.metrics_path.empty()) metrics_.emplace(spec.metrics_path, spec.first_step);
  if (!spec.tensorboard_dir.empty()) events_.emplace(spec.tensorboard_dir, spec.first_step);
  // The grids of steps a crash made the run repeat belong to a history that is undone, as the records
  // after first_step do (RUN/grids/step-XXXXXXXX.png).
  std::error_code ec;
  if (!spec.grids_dir.empty() && std::filesystem::is_directory(spec.grids_dir, ec))
    for (const auto& e : std::filesystem::directory_iterator(spec.grids_dir)) {
      const std::string name = e.path().filename().string();
      if (name.rfind("step-", 0) == 0 && std::atoll(name.c_str() + 5) > spec.first_step) std::filesystem::remove(e.path(), ec);
    }
}

void RunLog::step(int64_t step, const StepResult& r, const std::string& news) {
  if (!news.empty() && !spec_.quiet) {
    progress_.finish();
    std::cout << news << std::endl;
  }
  overflows_ += r.overflow ? 1 : 0;
  // fp16: the loss scale, and the steps since the last line that float16 overflowed and were skipped.
  std::string scale;
  if (r.loss_scale > 0) {
    char buf[80];
    std::snprintf(buf, sizeof buf, "  scale %g%s", r.loss_scale,
                  overflows_ > 0 ? (" (" + std::to_string(overflows_) + " skipped)").c_str() : "");
    scale = buf;
  }
  // (A skipped fp16 step's NaN printed as "nan", not the "-nan" its sign bit gives.)
  const double grad_norm = std::isnan(r.grad_norm) ? std::nan("") : r.grad_norm;
  progress_.step(step, std::isnan(r.loss) ? std::nan("") : r.loss, r.lr, grad_norm, spec_.batch_size, scale);  // (a non-finite loss is not averaged)
  // Every replica names its own skipped samples (data.skip_bad) in its own output, as they come.
  if (spec_.name_skips && data_.skipped_mine() > noticed_skips_) {
    progress_.finish();
    noticed_skips_ = data_.skipped_mine();
    std::cout << (spec_.world > 1 ? "replica " + std::to_string(spec_.replica) + ": " : std::string()) << "skipped "
              << noticed_skips_ << " bad sample" << (noticed_skips_ > 1 ? "s" : "") << " so far; the last: "
              << data_.last_skip() << std::endl;
  }
  if (step % spec_.log_every != 0 && step != spec_.steps) return;
  const int64_t sent = sent_();
  const double seconds = std::chrono::duration<double>(Clock::now() - interval_start_).count();
  if (metrics_) {
    nlohmann::json rec = {{"step", step},          {"loss", progress_.interval_loss()}, {"lr", r.lr},
                          {"grad_norm", r.grad_norm}, {"img_per_s", progress_.interval_img_per_s()},
                          {"epoch", source_.cursor().epoch}};
    // The time this rank waited for its batches, as a share of the interval's wall time: how far the
    // loader is from being the bottleneck.
    rec["data_wait"] = waited_ / std::max(1e-9, seconds);
    // fp16: the loss scale of this step, and the interval's steps skipped because float16 overflowed.
    if (r.loss_scale > 0) rec["loss_scale"] = r.loss_scale, rec["skipped_steps"] = overflows_;
    // The most memory this process has held so far (core/device.h: a GPU's tensors, or the host's
    // resident set), for sizing a run's batch and train.checkpoint_activations.
    rec["peak_memory_bytes"] = static_cast<int64_t>(peak_memory_bytes_on(spec_.device));
    // All replicas' (this one's now, the others' at the last checkpoint; each checkpoint holds the
    // exact total and each replica's).
    if (spec_.skip_bad && source_.per_replica()) rec["skipped_samples"] = data_.skipped_known();
    if (spec_.world > 1) {
      rec["sent_bytes"] = sent;
      rec["sent_bytes_per_step"] = (sent - interval_sent_) / std::max<int64_t>(1, step - interval_first_);
    }
    metrics_->write(rec.dump());
    // TensorBoard: the record's numbers as scalars, grouped under train/.
    if (events_)
      for (const auto& [name, v] : rec.items())
        if (name != "step" && v.is_number()) events_->scalar("train/" + name, step, v.get<double>());
  }
  interval_sent_ = sent;
  interval_first_ = step;
  waited_ = 0;
  interval_start_ = Clock::now();
  overflows_ = 0;
  if (!progress_.tty() && !spec_.quiet) {
    const double eta = progress_.eta_seconds(step);
    const std::string at = step < spec_.steps ? format_finish_time(eta) : "";
    std::printf("step %lld/%lld  loss %.4f  lr %.2e  |g| %.3f%s  %.0f img/s  ETA %s%s\n", static_cast<long long>(step),
                static_cast<long long>(spec_.steps), progress_.interval_loss(), r.lr, grad_norm, scale.c_str(),
                progress_.interval_img_per_s(), format_duration(eta).c_str(), at.empty() ? "" : (" (" + at + ")").c_str());
    std::fflush(stdout);
  }
  final_loss_ = progress_.interval_loss();
  progress_.reset_interval();
}

void RunLog::skipped_at_checkpoint(int64_t total, int replicas) {
  if (total > reported_skips_ && !spec_.quiet) {
    progress_.finish();
    std::cout << "data: " << total << " skip" << (total > 1 ? "s" : "") << " of bad samples so far"
              << (replicas > 1 ? ", all replicas together" : "")
              << " (data.skip_bad: a bad sample is skipped again in each epoch; each rank's log names its own)"
              << std::endl;
  }
  reported_skips_ = std::max(reported_skips_, total);
}

void RunLog::grid(int64_t step, const std::string& path, const std::string& png, double seconds) {
  // The interval's img/s and data-wait share are training's: the grid's time is left out of them.
  progress_.exclude_from_interval(seconds);
  interval_start_ += std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
  if (events_) events_->image("samples", step, png);
  if (spec_.quiet) return;
  progress_.finish();
  std::cout << "step " << step << ": wrote " << path << std::endl;
}

void RunLog::stopped(int signal, int64_t step, const std::string& checkpoint) {
  progress_.finish();
  if (spec_.lead)
    std::cout << "stopped by signal " << signal << " at step " << step << "; checkpoint " << checkpoint
              << " written; continue with --resume" << std::endl;
}

void RunLog::finish(int64_t steps_run, int64_t sent_before, int64_t most) {
  if (!spec_.quiet && spec_.world > 1) {
    const int64_t here = sent_() - sent_before, per = here / std::max<int64_t>(1, steps_run);
    std::printf("communication: rank 0 sent %s in this run (%s per step over %lld steps); the most any rank sent "
                "over the whole run: %s\n",
                format_bytes(here).c_str(), format_bytes(per).c_str(), static_cast<long long>(steps_run),
                format_bytes(most).c_str());
    std::fflush(stdout);
  }
  progress_.finish();
}

}  // namespace ddm
