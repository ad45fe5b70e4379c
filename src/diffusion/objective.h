// Training objectives: what a training step does around the model's forward. An Objective draws
// the step's randomness (time t, noise eps, label dropout), builds the model's inputs (x_t, t, y) and
// the target, and computes the loss from the model's output. The draw of each sample is keyed by
// (seed, step, the sample's position in the global batch) (core/keyed_random.h), so it does not
// depend on how the global batch is split over ranks or micro-batches.
//   Diffusion:  regress training_target(x0, eps, t) (velocity, eps or v; diffusion/denoiser.h).
//   Router:     the same x_t, t and label dropout; cross-entropy of the logits against the clusters.
//   Distill:    regress the teacher's estimate at the same x_t (run without gradients).
//   ControlNet:  diffusion regression, with the control map of each clean image (data/control.h) in
//               the conditioning; the network's precompute (its locked encoder) also runs in prepare.
//   Self-conditioning (train.self_cond): a first no-grad pass's x0 estimate as extra input, for some samples.
//   Autoencoder: L1 reconstruction of x through a sample of the encoder's posterior, plus
//               kl_weight x the posterior's KL to N(0, I) per pixel (Rombach et al. 2022, at kl_weight 1e-6).
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <torch/types.h>

#include "core/config.h"
#include "data/dataset.h"
#include "diffusion/denoiser.h"
#include "diffusion/path.h"
#include "model/net.h"

namespace ddm {

// The model's inputs and the target of one (micro-)batch: all no-grad work of the step.
struct Prepared {
  torch::Tensor xt;      // float [B, C, H, W]
  torch::Tensor t;       // float [B]
  Cond cond;             // y int64 [B] (num_classes = the null class: dropped label or unconditional);
                         // a ControlNet's control map and its locked encoder's features (NetImpl::precompute)
  torch::Tensor target;  // float [B, C, H, W], or int64 [B] (a router's clusters)
  torch::Tensor posterior_eps;  // autoencoders: the posterior's noise [B, z, h, w] (else undefined)
};

class NetImpl;

// The teacher of distillation: (x0_hat, eps_hat) at x_t [B,C,H,W] on the student's path, times t [B],
// the student's condition y (labels y.y [B], null = num_classes; a text student's caption encodings,
// the dropped ones the empty prompt's) and the examples' clusters k [B].
using TeacherFn = std::function<Denoiser::Estimate(const torch::Tensor& xt, const torch::Tensor& t, const Cond& y,
                                                   const torch::Tensor& k)>;

class Objective {
 public:
  // cfg.model must be resolved (num_classes).
  explicit Objective(const RunConfig& cfg);
  virtual ~Objective() = default;
  // Draws t, eps and label dropout for the batch and builds x_t and the target. Call without
  // gradients: this is the step's prepare phase.
  virtual Prepared prepare(const Batch& batch, int64_t step) const;
  // Self-conditioning (train.self_cond = q > 0), after prepare, without gradients: each sample is
  // chosen with probability q (keyed like every draw); the chosen ones' x0 estimates from a first pass
  // of `net` (the current weights) become p.cond.self_cond, the others' zeros. No-op when q = 0.
  void self_condition(NetImpl& net, Prepared& p, int64_t first, int64_t step) const;
  // Its two halves, for a first pass that runs elsewhere (a pipeline's stages): the rows of a batch
  // of n at global positions first.. chosen for a first pass (int64 [b'], possibly empty), and the
  // x0 estimate from that pass's output f at x_t and t of those rows.
  torch::Tensor self_cond_rows(int64_t first, int64_t n, int64_t step) const;
  torch::Tensor self_cond_estimate(const torch::Tensor& x, const torch::Tensor& t, const torch::Tensor& f) const;
  // The trainable phase: the model on the prepared inputs and the loss of its output, [] (the mean
  // over the samples). By default loss(net(x_t, t, y), p).
  virtual torch::Tensor forward_loss(NetImpl& net, const Prepared& p) const;
  // The loss of the model's output on a prepared batch: the mean over its samples, [].
  virtual torch::Tensor loss(const torch::Tensor& out, const Prepared& p) const;
  virtual std::string describe() const;

  // Latent diffusion (train/latent.h): a batch of images (float [B, C, H, W], and their indices for a
  // cache) and posterior noise [B, z, h, w] -> the latents the model learns, [B, z, h, w]. Set,
  // prepare encodes each batch with it (the frozen encoder's work, no gradients) and draws the noise
  // keyed per sample like every other draw.
  using EncodeFn = std::function<torch::Tensor(const Batch& pixels, const torch::Tensor& eps)>;
  void set_encoder(EncodeFn encode) { encode_ = std::move(encode); }
  // Image-embedding conditioning (train/embed.h): images float [B, C, H, W] -> embeddings [B, D]. Set,
  // prepare embeds each clean batch (the frozen network's work, no gradients); label dropout drops
  // the embedding with the label (one draw per sample), even for a model without classes.
  using EmbedFn = std::function<torch::Tensor(const torch::Tensor& x)>;
  void set_embedder(EmbedFn embed) { embed_ = std::move(embed); }
  // Text conditioning (train/text.h): captions -> a Cond holding the frozen encoder's token states,
  // their mask and the pooled embedding, on `device` (no gradients). Set, prepare encodes each
  // batch's captions, each first replaced by the empty prompt with probability
  // train.caption_dropout (one keyed draw per sample): the null condition guidance needs.
  using TextFn = std::function<Cond(const std::vector<std::string>& captions, torch::Device device)>;
  void set_text_encoder(TextFn text) { text_ = std::move(text); }
  // Or the batches hold their captions' encodings (Batch::context: latent shards `ddm encode --text`
  // wrote) and `null` [1, T, D] / [1, T] / [1, P] is the empty prompt's: prepare takes the batch's,
  // the dropped rows (the same draws) replaced by `null`. No encoder runs.
  void set_cached_text(Cond null) { cached_null_ = std::move(null); }
  // The captions a batch's rows are encoded from at `step`: those of the batch, with the dropped ones empty.
  std::vector<std::string> captions_after_dropout(const Batch& b, int64_t step) const;
  // Which of the rows caption dropout drops at `step`: bool [n], on the CPU.
  torch::Tensor caption_drops(int64_t first, int64_t n, int64_t step) const;

  // The per-sample draws alone (for tests): t [B] and eps [B, C, H, W] of positions first..first+B-1.
  torch::Tensor draw_time(int64_t step, int64_t first, int64_t n) const;
  torch::Tensor draw_noise(int64_t step, int64_t first, const torch::Tensor& like) const;

 protected:
  virtual torch::Tensor target(const Batch& b, const Prepared& p, const torch::Tensor& eps) const;
  DiffusionConfig diffusion_;
  NoisePath path_;
  Prediction pred_;
  uint64_t seed_;
  int64_t num_classes_;
  double label_dropout_;
  double caption_dropout_;
  double self_cond_;
  std::vector<int64_t> sample_shape_;  // the model's input [C, H, W] (the latents' with an encoder)
  std::string control_;                // a ControlNet's model.control (else empty)
  EncodeFn encode_;
  EmbedFn embed_;
  TextFn text_;
  Cond cached_null_;  // set_cached_text's (context undefined: not set)
};

class RouterObjective : public Objective {
 public:
  using Objective::Objective;
  torch::Tensor loss(const torch::Tensor& logits, const Prepared& p) const override;
  std::string describe() const override;

 protected:
  torch::Tensor target(const Batch& b, const Prepared& p, const torch::Tensor& eps) const override;
};

class DistillObjective : public Objective {
 public:
  DistillObjective(const RunConfig& cfg, TeacherFn teacher);
  std::string describe() const override;

 protected:
  torch::Tensor target(const Batch& b, const Prepared& p, const torch::Tensor& eps) const override;

 private:
  TeacherFn teacher_;
};

// Trains an autoencoder (model/autoencoder.h): x_t is the clean batch and the target too; t and y
// are undefined. Reconstruction |decode(z) - x| averaged over pixels, z = mean + std * eps from the
// posterior with keyed noise eps, plus kl_weight * KL(q(z|x) || N(0, I)) / (pixels per image).
class AutoencoderObjective : public Objective {
 public:
  explicit AutoencoderObjective(const RunConfig& cfg);
  Prepared prepare(const Batch& batch, int64_t step) const override;
  torch::Tensor forward_loss(NetImpl& net, const Prepared& p) const override;
  std::string describe() const override;

  // The two terms of the loss on a prepared batch, each [] (forward_loss = rec + kl_weight * kl).
  struct Terms {
    torch::Tensor rec, kl;
  };
  Terms terms(NetImpl& net, const Prepared& p) const;

 private:
  double kl_weight_;
  std::vector<int64_t> latent_;  // [z, h, w]
};

// The objective of a config: a router's cross-entropy for router archs, an autoencoder's for
// arch = autoencoder, else diffusion regression.
// (Distillation needs a teacher: construct DistillObjective directly.)
std::shared_ptr<Objective> make_objective(const RunConfig& cfg);

}  // namespace ddm
