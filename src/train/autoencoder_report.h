// What `ddm train-autoencoder` reports once an autoencoder is trained, and what latent diffusion
// later reads back from RUN/autoencoder.json:
//   reconstruction quality on the test split: PSNR, and FD-fmnist of the reconstructions against the
//     test split (with KID, precision/recall, class accuracy); no latent model built on this
//     autoencoder can have a better FD than its reconstructions, so it bounds them all;
//   the latent statistics latent diffusion normalizes by, z' = (z - shift) * scale, measured on
//     posterior samples of the training images (Rombach et al.: scale = 1 / std, so that the
//     diffusion model sees unit-variance latents; the shift centres them);
//   reconstructions.png: originals beside their reconstructions, one pair of rows per class.
// (What latent models read back of it, the record, is train/autoencoder_record.h's.)
#pragma once
#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>
#include <torch/types.h>

#include "eval/evaluate.h"
#include "model/autoencoder.h"
#include "train/autoencoder_record.h"

namespace ddm {

// Posterior samples z of images float [N, C, H, W] in [-1, 1], image i's noise keyed by (seed, i), so
// the result does not depend on `batch`: shift = mean(z), scale = 1 / std(z) over all elements
// (accumulated in float64).
LatentStats measure_latent_stats(AutoencoderImpl& ae, const torch::Tensor& images, uint64_t seed,
                                 int64_t batch = 500);

// PSNR in dB of reconstructions against originals, both float [N, C, H, W] in [-1, 1]: the mean over
// images of 10 log10(1 / mse), mse on the [0, 1] scale. An exact reconstruction counts as 100 dB.
double mean_psnr(const torch::Tensor& recon, const torch::Tensor& original);

struct AutoencoderReportOptions {
  int64_t n = 10000;        // test images reconstructed (at most the split's size)
  int64_t stats_n = 10000;  // training images the latent statistics are measured on
  std::string png;          // "" = no picture
  EvalConfig eval;          // feature network, cache, quiet
};

struct AutoencoderReport {
  std::string checkpoint;      // the checkpoint directory measured
  std::string weights;         // ema.safetensors in it (the EMA weights are what latent models use)
  std::string weights_sha256;  // what a latent model pins
  int64_t step = 0;
  int64_t latent_channels = 0, latent_size = 0, factor = 0;
  std::string reconstructed;   // what was reconstructed, e.g. "fashion-mnist test: 10000 images"
  double psnr = 0;
  bool has_fd = false;         // FD-fmnist only for Fashion-MNIST models
  EvalReport eval;
  LatentStats latent;
  double seconds = 0;
  nlohmann::json json() const;
  std::string table() const;
};

// Measures the autoencoder of a run directory (latest checkpoint) or checkpoint directory.
AutoencoderReport report_autoencoder(const std::string& path, const AutoencoderReportOptions& opt);

}  // namespace ddm
