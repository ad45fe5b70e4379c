// Generating many samples from a Denoiser in batches: the initial noise of sample i and every later
// draw for it (see sampler.h) depend only on (seed, i), so a sample does not depend on the batch size
// (beyond the network's float32 rounding, docs/determinism.md); labels cycle through the classes (or
// are all one class), so a grid shows one class per row.
#pragma once
#include <cstdint>
#include <functional>

#include <torch/types.h>

#include "diffusion/sampler.h"

namespace ddm {

struct GenerateOptions {
  int64_t n = 100;
  SampleOptions sample;
  int64_t class_id = -1;     // -1: sample i gets class (i / per_class) so rows are classes
  int64_t per_class = 10;    // samples of each class in a row when class_id == -1
  int64_t batch_size = 250;
  uint64_t seed = 0;
  std::function<void(int64_t done, int64_t total)> on_progress;
  // Latent models: latents [b, z, h, w] -> images [b, C, H, W] in [-1, 1] (the frozen decoder), run on
  // each batch as it is sampled. Unset: the samples are the images.
  std::function<torch::Tensor(const torch::Tensor&)> decode;
  // ControlNets: the control map of each sample, float [n, Cc, H, W] (data/control.h); undefined: none.
  torch::Tensor control;
  // model.embed: each sample's reference embedding, float [n, D]; undefined: the null embedding.
  torch::Tensor embed;
  // Text models: each sample's prompt encoding (context [n, T, D], context_mask [n, T], pooled [n, P]:
  // the other fields unset); undefined context: none. Guidance's unconditional branch takes the
  // denoiser's null text (Denoiser::set_null_text).
  Cond text;
  // Each sample's noise at t = 1, float [n, C, H, W] (`ddm sample --init-noise`: the latents another
  // library starts from); undefined: drawn from (seed, sample number).
  torch::Tensor init_noise;
  // Each sample's label, int64 [n] (e.g. of the test images the control maps come from); undefined:
  // from class_id and per_class.
  torch::Tensor labels;
};

struct Generated {
  torch::Tensor images;  // float [N, C, H, W] in [-1, 1] (clamped; decoded with GenerateOptions::decode)
  torch::Tensor labels;  // int64 [N] (num_classes = unconditional)
  torch::Tensor latents;  // latent models: what was sampled, before decoding, float [N, z, h, w]; else undefined
  int64_t nfe = 0;       // network evaluations per sample
  double seconds = 0;
};

// Labels for n samples as described in GenerateOptions.
torch::Tensor sample_labels(int64_t n, int64_t num_classes, int64_t class_id, int64_t per_class);

Generated generate(const Denoiser& den, int64_t channels, int64_t size, const GenerateOptions& opt);

}  // namespace ddm
