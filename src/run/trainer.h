// The generic training loop: a prepared TrainJob (config, data, objective, the run's records) ->
// the steps of the parallel mode's engine (parallel/engine.h; set up by run/setup.h) -> checkpoints,
// metrics, progress, with resume that reproduces an uninterrupted run bit for bit and clean stops on
// a non-finite loss or SIGINT/SIGTERM (a checkpoint is written first on a signal). What kind of run
// it is (plain, an expert, a router, a distilled student) is decided before: decentral/train_run.h
// prepares those jobs and calls train().
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "comm/comm.h"
#include "core/config.h"
#include "core/run_dir.h"
#include "data/dataset.h"
#include "diffusion/objective.h"

namespace ddm {

struct TrainOptions {
  std::string out_dir;
  bool resume = false;  // continue from the latest checkpoint in out_dir (fresh start if none)
  bool force = false;   // overwrite a different run in out_dir
  bool quiet = false;   // no progress output
  // The process group to train in; null: from the environment (a launcher's variables, else one
  // process). Only rank 0 touches the run directory and prints; see docs/distributed.md.
  std::shared_ptr<Comm> comm;
};

struct TrainSummary {
  int64_t first_step = 0;  // step the run started from (0, or the resumed checkpoint's step)
  int64_t last_step = 0;
  double final_loss = 0;   // mean loss over the last logging interval
  std::string checkpoint;  // the final checkpoint directory
  bool interrupted = false;
  int signal = 0;          // the signal that interrupted it (SIGINT, SIGTERM); exit with 128 + signal
  int rank = 0;            // this process's rank: only rank 0 reports and writes
  int64_t bytes_sent = 0;  // the most any rank sent in collectives over the whole run (comm/comm.h)
};

// A run ready to train.
struct TrainJob {
  RunConfig cfg;       // what the run trains with (model resolved against the data)
  RunConfig recorded;  // what config.toml and the checkpoints record (an expert's keeps the global budget)
  Dataset data;
  std::shared_ptr<Objective> objective;  // null: make_objective(cfg)
  std::string header;  // extra lines for the run header (which cluster, which teacher, ...)
  // Called once the run directory is locked, before the first step: writes the run's records
  // (expert.json, ...) or, on resume, checks them against what the run started with.
  std::function<void(const RunDir& dir, bool resume)> records;
};

// Fills model.in_channels / image_size / num_classes from the data (error if set and different).
void resolve_data_shape(RunConfig& cfg, const Dataset& data);

// Validates the config, sets the threads, loads the data and resolves the model's shape: a plain run.
TrainJob plain_job(RunConfig cfg);

TrainSummary train(TrainJob job, const TrainOptions& opt);

// Sets LibTorch's intra-op threads (0 = the machine's cores divided among `local_processes`, the
// processes of one job on this machine); returns the count used.
int set_threads(int64_t threads, int local_processes = 1);

}  // namespace ddm
