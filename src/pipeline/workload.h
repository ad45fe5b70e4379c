// A training configuration's pipeline profile (pipeline/profile.h): its backbone's units, its
// step's prepare phase (the objective's draws and x_t with whatever frozen work it runs: a latent
// encoder, a teacher, control maps, an embedding network; then the network's precompute: a
// ControlNet's locked encoder) as the non-trainable task, and AdamW + EMA's time per parameter.
// Self-conditioning's first pass is not in the task: the planner models it per stage from the
// units' no-grad forward times.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "core/config.h"
#include "data/dataset.h"
#include "diffusion/objective.h"
#include "model/net.h"
#include "pipeline/profile.h"

namespace ddm {

// cfg as `ddm train` resolves it, net built from cfg.model (with its frozen parts attached) and
// objective set up (attach_latent, attach_embed); rows ascending, each <= the data's size.
PipeProfile profile_workload(const RunConfig& cfg, const Dataset& data, Net net, std::shared_ptr<Objective> objective,
                             const std::vector<int64_t>& rows, int repeats, const std::string& workload);

}  // namespace ddm
