// ControlNet training and loading (model/controlnet.h): the locked base model is pinned, not copied.
// A ControlNet's resolved config holds the base's model keys, model.controlnet = the base's
// checkpoint directory and model.controlnet_sha256 = the sha256 of its EMA weights; its checkpoints
// hold only the trainable part (the encoder copy, the hint block, the zero convolutions), and every
// load checks the base against the pin, so a changed or missing base is an error naming it.
#pragma once
#include <string>

#include "core/config.h"
#include "data/dataset.h"
#include "model/net.h"

namespace ddm {

// Resolves model.controlnet before training: a base run directory (its latest checkpoint) or
// checkpoint directory becomes that checkpoint's absolute directory and the sha256 of its EMA weights
// (a value already set must match: the base must not have changed); the model keys become the base's
// (a U-Net trained on pixels of the data's shape); cfg.diffusion must equal the base's (the
// ControlNet predicts what the base predicts). Throws ddm::Error naming the run, the file or the key.
void resolve_controlnet(RunConfig& cfg, const Dataset& data);

// The config to train a ControlNet of `base` with when no --config is given: the base run's own
// config, with model.controlnet set.
RunConfig controlnet_default_config(const std::string& base, const std::vector<std::string>& overrides);

// For a net built from a resolved ControlNet config: loads the locked base from the pin (its EMA
// weights) and initializes the trainable encoder copy from the base's encoder (a checkpoint loaded
// afterwards overwrites the copy). Does nothing for other nets.
void attach_controlnet(NetImpl& net, const ModelConfig& m);

}  // namespace ddm
