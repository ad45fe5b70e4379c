// Any training run from its config: a plain model, an expert (data.partition + data.expert), a
// router (model.arch router-*) or a distilled student (train.teacher), prepared here and trained by
// the generic trainer. This is what `ddm train`, `ddm train-router` and `ddm distill` call.
#pragma once
#include "core/config.h"
#include "train/trainer.h"

namespace ddm {

// Validates, loads the data and prepares the job the config describes.
TrainJob prepare_train_job(RunConfig cfg);
TrainSummary train_run(RunConfig cfg, const TrainOptions& opt);

}  // namespace ddm
