// The generic training loop: a prepared TrainJob (run/job.h) -> the steps of the parallel mode's
// engine (parallel/engine.h; set up by run/setup.h, stepped by run/loop.h) -> checkpoints, metrics,
// progress, with resume that reproduces an uninterrupted run bit for bit and clean stops on a
// non-finite loss or SIGINT/SIGTERM (a checkpoint is written first on a signal). What kind of run it
// is (plain, an expert, a router, a distilled student) is decided before: decentral/train_run.h
// prepares those jobs and calls train().
#pragma once
#include <cstdint>
#include <string>

#include "run/job.h"

namespace ddm {

struct TrainSummary {
  int64_t first_step = 0;  // step the run started from (0, or the resumed checkpoint's step)
  int64_t last_step = 0;
  double final_loss = 0;   // mean loss over the last logging interval
  std::string checkpoint;  // the final checkpoint directory
  bool interrupted = false;
  int signal = 0;          // the signal that interrupted it (SIGINT, SIGTERM); exit with 128 + signal
  int rank = 0;            // this process's rank: only rank 0 reports and writes
  int64_t bytes_sent = 0;  // the most any rank sent in collectives over the whole run (comm/comm.h)
  std::string device;      // where this process trained ("cpu", "cuda:0")
  double device_peak_bytes = 0;  // on a GPU, the most its tensors took (core/device.h); 0 on the CPU
};

TrainSummary train(TrainJob job, const TrainOptions& opt);

}  // namespace ddm
