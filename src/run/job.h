// What a training job is, before it runs: the options of `ddm train` (where, resume, force, which
// process group), a prepared TrainJob (config, data, objective, the run's records) and the steps that
// make a plain one: validate, set the threads, load the data, resolve the model's shape from it.
// decentral/train_run.h prepares the other kinds (an expert, a router, a distilled student); run/
// trainer.h trains any of them.
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
  bool restarted = false;  // resume set by a launcher's restart (the run must be the one the job started)
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

// Sets LibTorch's intra-op threads (0 = the machine's cores divided among `local_processes`, the
// processes of one job on this machine); returns the count used.
int set_threads(int64_t threads, int local_processes = 1);

}  // namespace ddm
