// Training objectives (see objective.h).
#include "diffusion/objective.h"

#include <cmath>
#include <sstream>
#include <vector>

#include <torch/nn/functional/loss.h>

#include "core/device.h"
#include "core/error.h"
#include "core/keyed_random.h"
#include "core/rng.h"
#include "data/control.h"
#include "model/autoencoder.h"
#include "model/router.h"

namespace ddm {

namespace {
// A number as written in a config: 0.00085, not 0.000850000.
std::string format_number(double v) {
  std::ostringstream o;
  o << v;
  return o.str();
}

uint64_t u64(int64_t v) { return static_cast<uint64_t>(v); }

// One key per sample: (seed, purpose, step, position in the global batch).
std::vector<uint64_t> sample_keys(uint64_t seed, RngPurpose purpose, int64_t step, int64_t first, int64_t n) {
  std::vector<uint64_t> keys(static_cast<size_t>(n));
  for (int64_t j = 0; j < n; ++j)
    keys[static_cast<size_t>(j)] = derive_seed({seed, static_cast<uint64_t>(purpose), u64(step), u64(first + j)});
  return keys;
}
}  // namespace

Objective::Objective(const RunConfig& cfg)
    : diffusion_(cfg.diffusion),
      path_(make_path(cfg.diffusion)),
      pred_(prediction_for(cfg.diffusion)),
      seed_(static_cast<uint64_t>(cfg.train.seed)),
      num_classes_(cfg.model.num_classes),
      label_dropout_(cfg.train.label_dropout),
      caption_dropout_(cfg.train.caption_dropout),
      self_cond_(cfg.train.self_cond),
      sample_shape_{cfg.model.in_channels, cfg.model.image_size, cfg.model.image_size},
      control_(cfg.model.controlnet.empty() ? "" : cfg.model.control) {}

torch::Tensor Objective::draw_time(int64_t step, int64_t first, int64_t n) const {
  // Uniform on [t_min, 1] or logit-normal; t_min keeps VP eps-prediction away from the t = 0
  // singularity of its loss weighting (as sample_time in path.h).
  const double t_min = diffusion_.objective == "flow" ? 0.0 : 1e-3;
  const auto keys = sample_keys(seed_, RngPurpose::kTime, step, first, n);
  auto t = torch::empty({n}, torch::kFloat);  // [B]
  float* p = t.data_ptr<float>();
  for (int64_t j = 0; j < n; ++j) {
    const uint64_t key = keys[static_cast<size_t>(j)];
    double u;
    if (diffusion_.time_dist == "logit-normal")
      u = 1.0 / (1.0 + std::exp(-(normal_from_key(key) * diffusion_.logit_std + diffusion_.logit_mean)));
    else
      u = uniform_from_key(key);
    // The discrete path trains at its timesteps' times (k + 1) / T only, as diffusers' scripts do.
    p[j] = static_cast<float>(path_.kind() == PathKind::kDiscrete ? discrete_time(u, path_.timesteps())
                                                                  : t_min + (1.0 - t_min) * u);
  }
  return t;
}

torch::Tensor Objective::draw_noise(int64_t step, int64_t first, const torch::Tensor& like) const {
  return normal_rows(sample_keys(seed_, RngPurpose::kNoise, step, first, like.size(0)), like.sizes().slice(1),
                     like.options());  // [B, C, H, W]
}

Prepared Objective::prepare(const Batch& pixels, int64_t step) const {
  Batch batch = pixels;
  if (encode_)  // latent diffusion: the frozen encoder's posterior sample is the data the model learns
    batch.x = encode_(pixels, normal_rows(sample_keys(seed_, RngPurpose::kPosterior, step, pixels.first,
                                                        pixels.x.size(0)),
                                            sample_shape_, pixels.x.options()));  // [B, z, h, w]
  const int64_t b = batch.x.size(0);
  // The draws are made on the CPU, identical whatever the device, and follow the data to its device.
  const torch::Device dev = batch.x.device();
  Prepared p;
  p.t = to_device_async(draw_time(step, batch.first, b), dev);  // [B]
  const torch::Tensor eps = draw_noise(step, batch.first, batch.x);  // [B, C, H, W]
  // Label dropout: one keyed draw per sample drops its label and its embedding together.
  auto dropped = torch::zeros({b}, torch::kBool);  // [B]
  if (label_dropout_ > 0 && (num_classes_ > 0 || embed_)) {
    const auto keys = sample_keys(seed_, RngPurpose::kLabelDrop, step, batch.first, b);
    bool* d = dropped.data_ptr<bool>();
    for (int64_t j = 0; j < b; ++j) d[j] = uniform_from_key(keys[static_cast<size_t>(j)]) < label_dropout_;
  }
  dropped = to_device_async(dropped, dev);
  if (num_classes_ == 0) {
    p.cond.y = torch::zeros({b}, torch::TensorOptions().dtype(torch::kLong).device(dev));  // [B]: the null class of an unconditional model
  } else {
    p.cond.y = batch.y.masked_fill(dropped, num_classes_);  // [B]
  }
  if (embed_) {  // the frozen network's embedding of each clean image: the image-variation condition
    p.cond.embed = embed_(pixels.x);  // [B, D]
    p.cond.embed_null = dropped;      // [B]
  }
  if (text_) {  // the frozen text encoder's encoding of each caption (dropped ones: the empty prompt)
    const Cond text = text_(captions_after_dropout(pixels, step), dev);
    p.cond.context = text.context;            // [B, T, D]
    p.cond.context_mask = text.context_mask;  // [B, T]
    p.cond.pooled = text.pooled;              // [B, P]
  } else if (cached_null_.context.defined()) {  // the encodings the batch holds (dropped ones: the empty prompt's)
    DDM_CHECK(pixels.context.defined() && pixels.context.size(0) == b,
              "a text-conditioned model trained on cached text encodings needs them in every batch (latent "
              "shards `ddm encode --text` wrote)");
    const torch::Tensor keep = to_device_async(caption_drops(batch.first, b, step).logical_not(), dev).view({-1, 1});  // [B, 1]
    const Cond& null = cached_null_;
    p.cond.context = torch::where(keep.unsqueeze(2), pixels.context, to_device_async(null.context, dev));  // [B, T, D]
    p.cond.context_mask = torch::where(keep, pixels.context_mask, to_device_async(null.context_mask, dev));  // [B, T]
    p.cond.pooled = torch::where(keep, pixels.pooled, to_device_async(null.pooled, dev));  // [B, P]
  }
  if (!control_.empty()) p.cond.control = control_map(control_, pixels.x);  // [B, Cc, H, W]
  p.xt = path_.alpha(p.t).view({-1, 1, 1, 1}) * batch.x + path_.sigma(p.t).view({-1, 1, 1, 1}) * eps;  // [B,C,H,W]
  p.target = target(batch, p, eps);
  return p;
}

std::vector<std::string> Objective::captions_after_dropout(const Batch& b, int64_t step) const {
  const int64_t n = b.x.size(0);
  DDM_CHECK(static_cast<int64_t>(b.captions.size()) == n,
            "a text-conditioned model (model.text_encoder) needs a caption for every sample, and this batch of " << n
                << " has " << b.captions.size() << " (docs/data.md, Captions)");
  std::vector<std::string> out = b.captions;
  const torch::Tensor drops = caption_drops(b.first, n, step);  // [n]
  const bool* d = drops.data_ptr<bool>();
  for (int64_t j = 0; j < n; ++j)
    if (d[j]) out[static_cast<size_t>(j)].clear();
  return out;
}

torch::Tensor Objective::caption_drops(int64_t first, int64_t n, int64_t step) const {
  auto drops = torch::zeros({n}, torch::kBool);  // [n]
  if (caption_dropout_ <= 0) return drops;
  const auto keys = sample_keys(seed_, RngPurpose::kCaptionDrop, step, first, n);
  bool* d = drops.data_ptr<bool>();
  for (int64_t j = 0; j < n; ++j) d[j] = uniform_from_key(keys[static_cast<size_t>(j)]) < caption_dropout_;
  return drops;
}

torch::Tensor Objective::self_cond_rows(int64_t first, int64_t n, int64_t step) const {
  const auto keys = sample_keys(seed_, RngPurpose::kSelfCond, step, first, n);
  std::vector<int64_t> chosen;
  for (int64_t j = 0; j < n; ++j)
    if (uniform_from_key(keys[static_cast<size_t>(j)]) < self_cond_) chosen.push_back(j);
  return torch::tensor(chosen, torch::kLong);  // [b'], on the CPU
}

torch::Tensor Objective::self_cond_estimate(const torch::Tensor& x, const torch::Tensor& t, const torch::Tensor& f) const {
  const Scalings sc = scalings(path_, pred_, t);
  return sc.c_skip * x + sc.c_out * f;  // x0 estimates [b', C, H, W]
}

void Objective::self_condition(NetImpl& net, Prepared& p, int64_t first, int64_t step) const {
  if (self_cond_ <= 0) return;
  torch::NoGradGuard no_grad;
  const auto idx = to_device_async(self_cond_rows(first, p.xt.size(0), step), p.xt.device());  // [b']
  p.cond.self_cond = torch::zeros_like(p.xt);                   // [B, C, H, W]
  if (idx.numel() == 0) return;
  Cond c = p.cond.select(idx);
  c.self_cond = torch::zeros_like(p.xt.index_select(0, idx));  // the first pass has no estimate
  const auto x = p.xt.index_select(0, idx), t = p.t.index_select(0, idx);
  const auto f = net.forward(x, t, c);  // [b', C, H, W]
  p.cond.self_cond.index_copy_(0, idx, self_cond_estimate(x, t, f));
}

torch::Tensor Objective::target(const Batch& b, const Prepared& p, const torch::Tensor& eps) const {
  return training_target(path_, pred_, b.x, eps, p.t);  // [B, C, H, W]
}

torch::Tensor Objective::forward_loss(NetImpl& net, const Prepared& p) const {
  return loss(net.forward(p.xt, p.t, p.cond), p);  // out [B,C,H,W], or a router's logits [B,K]
}

torch::Tensor Objective::loss(const torch::Tensor& out, const Prepared& p) const {
  return torch::mse_loss(out, p.target);  // []
}

std::string Objective::describe() const {
  if (path_.kind() == PathKind::kDiscrete)
    return diffusion_.objective + " on the discrete schedule (" + diffusion_.beta_schedule + " betas " +
           format_number(diffusion_.beta_start) + ".." + format_number(diffusion_.beta_end) + " over " +
           std::to_string(diffusion_.timesteps) + " timesteps), each timestep drawn " +
           (diffusion_.time_dist == "uniform" ? "alike" : "by " + diffusion_.time_dist);
  return diffusion_.objective + " on path " + path_.name() + ", t " + diffusion_.time_dist;
}

torch::Tensor RouterObjective::target(const Batch& b, const Prepared&, const torch::Tensor&) const {
  DDM_CHECK(b.k.defined(), "router training needs the batch's clusters (Dataset::clusters)");
  return b.k;  // int64 [B]
}

torch::Tensor RouterObjective::loss(const torch::Tensor& logits, const Prepared& p) const {
  return torch::nn::functional::cross_entropy(logits, p.target);  // []
}

std::string RouterObjective::describe() const {
  return "router cross-entropy on the clusters, at x_t of " + Objective::describe();
}

DistillObjective::DistillObjective(const RunConfig& cfg, TeacherFn teacher)
    : Objective(cfg), teacher_(std::move(teacher)) {}

torch::Tensor DistillObjective::target(const Batch& b, const Prepared& p, const torch::Tensor&) const {
  DDM_CHECK(b.k.defined(), "distillation needs the batch's clusters (Dataset::clusters)");
  const Denoiser::Estimate est = teacher_(p.xt, p.t, p.cond, b.k);
  return training_target(path_, pred_, est.x0, est.eps, p.t);  // [B, C, H, W]
}

std::string DistillObjective::describe() const {
  return "distillation (" + Objective::describe() + "): the target is the teacher's estimate at x_t";
}

AutoencoderObjective::AutoencoderObjective(const RunConfig& cfg)
    : Objective(cfg), kl_weight_(cfg.train.kl_weight) {
  const AutoencoderShape s = autoencoder_shape(cfg.model);
  latent_ = {s.latent_channels, s.latent_size(), s.latent_size()};
}

Prepared AutoencoderObjective::prepare(const Batch& batch, int64_t step) const {
  const int64_t b = batch.x.size(0);
  Prepared p;
  p.xt = batch.x;      // [B, C, H, W]
  p.target = batch.x;  // [B, C, H, W]
  p.posterior_eps = normal_rows(sample_keys(seed_, RngPurpose::kPosterior, step, batch.first, b), latent_,
                                batch.x.options());  // [B, z, h, w]
  return p;
}

AutoencoderObjective::Terms AutoencoderObjective::terms(NetImpl& net, const Prepared& p) const {
  auto* ae = dynamic_cast<AutoencoderImpl*>(&net);
  DDM_CHECK(ae, "the autoencoder objective needs model.arch = autoencoder");
  const Posterior q = ae->encode(p.xt);                        // mean, logvar [B, z, h, w]
  const torch::Tensor rec = ae->decode(q.sample(p.posterior_eps));  // [B, C, H, W]
  const double pixels = static_cast<double>(p.xt[0].numel());
  return {(rec - p.target).abs().mean(), q.kl().mean() / pixels};  // [], []
}

torch::Tensor AutoencoderObjective::forward_loss(NetImpl& net, const Prepared& p) const {
  const Terms t = terms(net, p);
  return kl_weight_ > 0 ? t.rec + kl_weight_ * t.kl : t.rec;  // []
}

std::string AutoencoderObjective::describe() const {
  std::ostringstream os;
  os << "autoencoder: L1 reconstruction through a posterior sample + " << kl_weight_
     << " x KL per pixel; latents " << latent_[0] << "x" << latent_[1] << "x" << latent_[2];
  return os.str();
}

std::shared_ptr<Objective> make_objective(const RunConfig& cfg) {
  if (is_router_arch(cfg.model.arch)) return std::make_shared<RouterObjective>(cfg);
  if (cfg.model.arch == "autoencoder") return std::make_shared<AutoencoderObjective>(cfg);
  return std::make_shared<Objective>(cfg);
}

}  // namespace ddm
