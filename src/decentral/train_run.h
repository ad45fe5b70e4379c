// Any training run from its config: a plain model, an expert (data.partition + data.expert), a
// router (model.arch router-*) or a distilled student (train.teacher), prepared here and trained by
// the generic trainer. This is what `ddm train`, `ddm train-router` and `ddm distill` call.
#pragma once
#include "core/config.h"
#include "run/trainer.h"

namespace ddm {

// Validates, loads the data and prepares the job the config describes. Nothing has run yet, so its
// errors are ddm::InputErrors (core/error.h: the CLI exits 2, supervisors do not restart it).
TrainJob prepare_train_job(RunConfig cfg);
TrainSummary train_run(RunConfig cfg, const TrainOptions& opt);

// The router's run config (what `ddm train-router` trains): the experts' config at `config` (same
// data, forward process, time distribution, label dropout and seed) with the model replaced by the
// router `preset`, trained on every cluster of `partition` with `holdout` images withheld, then
// `overrides` ("section.key=value") applied. Its errors are ddm::InputErrors.
RunConfig router_run_config(const std::string& config, const std::string& partition, const std::string& preset,
                            int64_t holdout, const std::vector<std::string>& overrides);

}  // namespace ddm
