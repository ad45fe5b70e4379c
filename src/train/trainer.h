// The training loop: data -> noisy inputs -> loss -> FlatAdamW -> EMA, with checkpoints, metrics,
// resume that reproduces an uninterrupted run bit for bit, and clean stops on non-finite loss or
// SIGINT/SIGTERM (a checkpoint is written first on a signal).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "core/config.h"
#include "data/dataset.h"
#include "diffusion/denoiser.h"
#include "model/net.h"

namespace ddm {

struct TrainOptions {
  std::string out_dir;
  bool resume = false;  // continue from the latest checkpoint in out_dir (fresh start if none)
  bool force = false;   // overwrite a different run in out_dir
  bool quiet = false;   // no progress output
};

struct TrainSummary {
  int64_t first_step = 0;  // step the run started from (0, or the resumed checkpoint's step)
  int64_t last_step = 0;
  double final_loss = 0;   // mean loss over the last logging interval
  std::string checkpoint;  // the final checkpoint directory
  bool interrupted = false;
  int signal = 0;          // the signal that interrupted it (SIGINT, SIGTERM); exit with 128 + signal
};

// Fills model.in_channels / image_size / num_classes from the data (error if set and different).
void resolve_data_shape(RunConfig& cfg, const Dataset& data);

TrainSummary train(RunConfig cfg, const TrainOptions& opt);

// A trained model loaded for sampling.
struct LoadedModel {
  RunConfig cfg;
  Net net;
  int64_t step = 0;
  std::vector<std::string> class_names;
  std::string checkpoint;
};
// path: a run directory (latest checkpoint) or a checkpoint directory. use_ema selects EMA weights.
LoadedModel load_model(const std::string& path, bool use_ema);
Denoiser make_denoiser(const LoadedModel& m);

// Sets LibTorch's intra-op threads (0 = all cores); returns the count used.
int set_threads(int64_t threads);

}  // namespace ddm
