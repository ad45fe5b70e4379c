// A trained model loaded from a run or checkpoint directory for sampling, evaluation, ensembles
// and distillation teachers.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/config.h"
#include "diffusion/denoiser.h"
#include "model/net.h"
#include "train/embed.h"
#include "train/latent.h"
#include "text/encoder.h"

namespace ddm {

struct LoadedModel {
  RunConfig cfg;
  Net net;
  int64_t step = 0;
  std::vector<std::string> class_names;
  std::string checkpoint;
  std::shared_ptr<const LatentSpace> latent;  // latent models: the frozen autoencoder (else null)
  std::shared_ptr<const ImageEmbedder> embedder;  // model.embed: the frozen embedding network (else null)
  std::shared_ptr<const text::TextEncoder> text;  // model.text_encoder: the frozen text encoder (else null)
};
// Where the frozen text encoder that checkpoints name is now (`ddm sample --text-encoder DIR`: a
// moved project, a rebuilt environment): every later load takes it from `dir` instead, verified
// against the sha256 the checkpoint records, so only the same weights are accepted. "" restores
// the recorded paths.
void use_text_encoder_at(const std::string& dir);

// path: a run directory (latest checkpoint) or a checkpoint directory. use_ema selects EMA weights
// (frozen parameters, which have no EMA, keep their model weights).
LoadedModel load_model(const std::string& path, bool use_ema, torch::Device device = torch::kCPU);
// A text model's denoiser guides against the empty prompt (Denoiser::set_null_text).
Denoiser make_denoiser(const LoadedModel& m);
// What turns the model's samples into images: the frozen decoder of a latent model (for
// GenerateOptions::decode), or an empty function for a pixel model.
std::function<torch::Tensor(const torch::Tensor&)> image_decoder(const LoadedModel& m);

}  // namespace ddm
