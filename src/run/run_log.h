// What a training run says while it runs, in one place: the live progress line (or plain lines when
// not on a terminal), metrics.jsonl's records (one per logging interval: loss, lr, gradient norm,
// img/s, the share of time spent waiting for data, bytes sent, samples skipped), the engine's news,
// each replica's notes on the bad samples it skipped, the stop on a signal, and the communication
// totals at the end. The same records, and the grids of train.sample_every, go into TensorBoard
// event files (core/tensorboard.h). Only rank 0 prints the run's lines and writes metrics; every replica names the
// samples it skipped itself.
#pragma once
#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>

#include "core/progress.h"
#include "core/tensorboard.h"
#include "run/data_position.h"
#include "train/step.h"

namespace ddm {

struct RunLogSpec {
  int64_t first_step = 0;     // where this run (re)starts
  int64_t steps = 0;          // train.steps
  int64_t log_every = 1;      // train.log_every
  int64_t batch_size = 0;     // the global batch
  bool quiet = false;         // no run lines (every rank but 0, or --quiet)
  bool lead = false;          // rank 0: says where a signal stopped the run, even when quiet
  bool name_skips = false;    // this process names the bad samples it skips (unless --quiet)
  bool skip_bad = false;      // data.skip_bad: skipped samples are counted in the metrics
  int world = 1;
  int replica = 0;            // this process's data-parallel replica, in its notes
  std::string metrics_path;   // metrics.jsonl (rank 0); empty: none
  std::string tensorboard_dir;  // event files (rank 0); empty: none
  std::string grids_dir;        // train.sample_every's grids (rank 0): those after first_step go; empty: none
  torch::Device device = torch::kCPU;  // where this process trains: the records give its peak memory
};

class RunLog {
 public:
  // `sent` gives the bytes this rank has sent over the whole run so far (comm/comm.h); `data` the
  // run's data positions, for the epoch and the skipped samples.
  RunLog(const RunLogSpec& spec, std::function<int64_t()> sent, const DataPosition& data, const BatchSource& source);

  // The logging interval a resumed checkpoint was written in, so that the first record after a
  // resume averages the same steps as an uninterrupted run.
  void restore_interval(double loss_sum, int64_t steps, int64_t skipped) {
    progress_.restore_interval(loss_sum, steps);
    overflows_ = skipped;
  }
  double interval_loss_sum() const { return progress_.interval_loss_sum(); }
  int64_t interval_steps() const { return progress_.interval_steps(); }
  int64_t interval_skipped() const { return overflows_; }  // fp16: the interval's skipped steps so far

  void waited(double seconds) { waited_ += seconds; }  // for data (this interval)
  // After `step` (1-based count of steps done): its line, notes and, at a logging step, the record.
  void step(int64_t step, const StepResult& r, const std::string& news);
  // At a checkpoint: the bad samples all replicas skipped so far, when more than last said.
  void skipped_at_checkpoint(int64_t total, int replicas);
  // A grid of samples after `step` (train.sample_every) that took `seconds`: its PNG into the event
  // files, its path said.
  void grid(int64_t step, const std::string& path, const std::string& png, double seconds);
  void stopped(int signal, int64_t step, const std::string& checkpoint);
  // The communication totals (this run's, rank 0's; `most` the most any rank sent), then the end.
  void finish(int64_t steps_run, int64_t sent_before, int64_t most);
  double final_loss() const { return final_loss_; }

 private:
  using Clock = std::chrono::steady_clock;
  RunLogSpec spec_;
  std::function<int64_t()> sent_;
  const DataPosition& data_;
  const BatchSource& source_;
  Progress progress_;
  std::optional<MetricsLog> metrics_;
  std::optional<EventWriter> events_;
  double waited_ = 0;
  int64_t overflows_ = 0;  // fp16: steps of this interval skipped for an overflow (train/loss_scale.h)
  Clock::time_point interval_start_;
  int64_t interval_sent_ = 0, interval_first_ = 0;
  int64_t noticed_skips_ = 0;   // this replica's, last named
  int64_t reported_skips_ = 0;  // all replicas', last reported at a checkpoint
  double final_loss_ = 0;
};

}  // namespace ddm
