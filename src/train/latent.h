// Latent diffusion (Rombach et al. 2022): a model with model.latent set learns and samples the latents
// of a frozen autoencoder instead of pixels: ddm's own (`ddm train-autoencoder`), or diffusers'
// AutoencoderKL read from the directory diffusers keeps it in (Stable Diffusion's VAE, sd-vae-ft-mse,
// SDXL's, 16-channel ones: sd/autoencoder_kl.h; model.latent = its folder, or a pipeline's whose
// vae/ holds it). Each training step encodes its
// batch with the frozen encoder under no-grad, sampling the posterior with keyed noise, and normalizes
// z' = (z - shift) * scale (measured once on the data by train-autoencoder); sampling decodes.
//
// The frozen part is pinned, not copied: a latent model's resolved config names the autoencoder's
// checkpoint directory (a diffusers VAE's folder) and the sha256 of its weights file (weights_sha256
// of a diffusers VAE's files); scale and shift are the measured ones, or a diffusers VAE's
// scaling_factor and shift_factor, so its checkpoints never hold the
// autoencoder again, and a changed or missing autoencoder is an error naming it on every load.
#pragma once
#include <cstdint>
#include <memory>
#include <string>

#include <torch/types.h>

#include "core/config.h"
#include "data/dataset.h"
#include "diffusion/objective.h"
#include "model/autoencoder.h"
#include "sd/autoencoder_kl.h"

namespace ddm {

class LatentSpace {
 public:
  // Loads the autoencoder of a resolved model config (model.latent a checkpoint directory,
  // model.latent_sha256 its weights' hash, latent_scale > 0) onto `device`. Errors name the file and
  // the key. Every method below takes its inputs from any device and returns its result on the
  // input's device, the autoencoder computing on its own.
  static std::shared_ptr<const LatentSpace> load(const ModelConfig& cfg, torch::Device device = torch::kCPU);
  // An autoencoder already in memory (tests): its parameters are frozen here.
  LatentSpace(std::shared_ptr<AutoencoderImpl> ae, double scale, double shift);
  LatentSpace() = default;

  // Images float [B, C, H, W] in [-1, 1] and posterior noise eps [B, z, h, w] -> normalized latents
  // (mean + std * eps - shift) * scale [B, z, h, w]. No gradients.
  torch::Tensor encode(const torch::Tensor& x, const torch::Tensor& eps) const;
  // The posterior means, normalized [N, z, h, w] (deterministic: features, not training inputs), of
  // images [N, C, H, W]: uint8 (a Dataset's, scaled here) or float in [-1, 1]. Encodes 1000 at a
  // time, so any N fits in memory.
  torch::Tensor encode_mean(const torch::Tensor& images) const;
  // train.cache_latents: the posteriors of every image of a dataset (uint8 [N, C, H, W]), computed once
  // 1000 at a time; then encode_cached(index [B], eps) = what encode gives those images, up to float32
  // rounding of the encoder over another batch.
  Posterior posteriors(const torch::Tensor& images) const;
  torch::Tensor encode_cached(const Posterior& cache, const torch::Tensor& index, const torch::Tensor& eps) const;
  // Latent shards (data.source = "latents"): a batch of posteriors x = [mean; logvar] float
  // [B, 2z, h, w] and noise eps [B, z, h, w] -> normalized latents [B, z, h, w] on x's device, what
  // encode gives the images they were encoded from (up to float32 rounding of the encoder).
  torch::Tensor sample_posterior(const torch::Tensor& x, const torch::Tensor& eps) const;
  // Normalized latents [B, z, h, w] -> images [B, C, H, W] clamped to [-1, 1]. No gradients.
  torch::Tensor decode(const torch::Tensor& z) const;
  // The frozen encoder's posterior of images float [B, C, H, W] in [-1, 1] on its device: mean and
  // log-variance [B, z, h, w], neither sampled nor normalized. No gradients.
  Posterior posterior(const torch::Tensor& x) const;

  // The autoencoder's design (a diffusers VAE's too: the same design; its image_size is that of the
  // model's latents times the downsampling factor).
  const AutoencoderShape& shape() const { return shape_; }
  bool is_diffusers() const { return static_cast<bool>(kl_); }
  const std::string& checkpoint() const { return checkpoint_; }
  const std::string& sha256() const { return sha256_; }
  double scale() const { return scale_; }
  double shift() const { return shift_; }
  // Where the autoencoder computes.
  torch::Device device() const;

 private:
  std::shared_ptr<AutoencoderImpl> ae_;  // ddm's own, or
  std::shared_ptr<sd::AutoencoderKLImpl> kl_;  // diffusers' (then ae_ is null)
  AutoencoderShape shape_;
  std::string checkpoint_, sha256_;
  double scale_ = 1, shift_ = 0;
};

// Resolves model.latent of a config before training, against the data it trains on: `latent` given
// as a `ddm train-autoencoder` run directory (or the checkpoint its autoencoder.json measured)
// becomes that checkpoint directory (a diffusers AutoencoderKL folder, or a diffusers pipeline's
// directory, its vae/ folder; its latent_scale / latent_shift its scaling_factor / shift_factor, and
// the data's images any size its downsampling divides), latent_sha256 the hash of its weights (a value already set must
// match it: the autoencoder must not have changed), latent_scale / latent_shift the measured ones
// (unless set), and in_channels / image_size the latents' (the data must have the shape the
// autoencoder was trained on; latent shards must have been encoded by this autoencoder, by sha256).
// Throws ddm::Error naming the run, the file or the key.
void resolve_latent(ModelConfig& m, const Dataset& data);

// How many times smaller than the images the model's input is, for a resolved config: the
// autoencoder's downsampling factor (a diffusers VAE's or ddm's own), 1 for a pixel model.
int64_t latent_downsampling(const ModelConfig& m);

// For a resolved latent model config, loads its autoencoder and makes `objective` encode every batch
// with it (Objective::set_encoder); returns it. Returns null and changes nothing for a pixel model.
// With `cache` (train.cache_latents: the dataset the batches come from), the posteriors of all its
// images are computed here once, and each batch looks its own up by Batch::index. With
// `posteriors` (latent shards), each batch holds its posteriors already, and is only sampled.
std::shared_ptr<const LatentSpace> attach_latent(Objective& objective, const ModelConfig& m, torch::Device device,
                                                 const Dataset* cache = nullptr, bool posteriors = false);

}  // namespace ddm
