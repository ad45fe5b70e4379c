// Text conditioning in training (docs/text.md): a model with model.text_encoder attends to a frozen
// text encoder's encoding of each sample's caption. The encoder runs in every step's no-grad prepare
// phase (Objective::set_text_encoder), after caption dropout has replaced some captions by the empty
// prompt, whose encoding is the null condition guidance uses. The encoder is pinned, not copied: the
// resolved config names its directory and the sha256 of its weights, checked on every load.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include <torch/types.h>

#include "core/config.h"
#include "data/dataset.h"
#include "diffusion/objective.h"
#include "text/encoder.h"

namespace ddm {

// Resolves model.text_encoder before training: the absolute directory, text_sha256 (a value already
// set must match: the encoder must not have changed), text_dim, text_pooled_dim and text_tokens from
// the encoder (values already set must agree). The data must have captions. Latent shards holding
// cached encodings (`ddm encode --text`) must hold this encoder's, with the same text_skip and
// text_tokens. Throws ddm::Error naming the key and the directory.
void resolve_text(ModelConfig& m, const Dataset& data);

// The encoder of a resolved config on `device`, its weights checked against model.text_sha256. Models
// of one process that pin the same encoder share it (loaded and checked once while one holds it).
std::shared_ptr<const text::TextEncoder> load_pinned_text_encoder(const ModelConfig& m, torch::Device device);

// The Cond fields (context, context_mask, pooled) of `texts` through `e`, on `device`; `what` names them in errors.
Cond encode_texts(const text::TextEncoder& e, const std::vector<std::string>& texts, torch::Device device,
                  const std::vector<std::string>& what = {});

// For a resolved config with model.text_encoder: loads the encoder and makes `objective` encode every
// batch's captions with it; returns it. When `data` holds the encodings (latent shards `ddm encode
// --text` wrote), the encoder encodes only the empty prompt, once (the null condition), the
// objective takes each batch's cached encodings, and null is returned: no encoder stays loaded.
// Returns null and changes nothing for a model without text.
std::shared_ptr<const text::TextEncoder> attach_text(Objective& objective, const ModelConfig& m, const Dataset& data,
                                                     torch::Device device);

// True when `data` holds text encodings that a model with text `m` trains from (resolve_text checked them).
bool cached_text(const ModelConfig& m, const Dataset& data);

}  // namespace ddm
