// One diffusion training step (see step.h).
#include "train/step.h"

#include <cmath>

#include "core/rng.h"
#include "core/error.h"
#include "diffusion/path.h"
#include "model/router.h"

namespace ddm {

double lr_at(const TrainConfig& t, int64_t step) {
  double lr = t.lr;
  if (t.warmup > 0 && step < t.warmup) return lr * static_cast<double>(step + 1) / t.warmup;
  if (t.lr_schedule == "cosine") {
    const double p = static_cast<double>(step - t.warmup) / std::max<int64_t>(1, t.steps - t.warmup);
    lr *= 0.5 * (1.0 + std::cos(3.14159265358979323846 * std::min(1.0, p)));
  }
  return lr;
}

DiffusionStep::DiffusionStep(const RunConfig& cfg, Net net)
    : cfg_(cfg),
      net_(std::move(net)),
      optim_(*net_, {cfg.train.beta1, cfg.train.beta2, cfg.train.adam_eps, cfg.train.weight_decay}),
      path_(make_path(cfg.diffusion)),
      pred_(prediction_for(cfg.diffusion)),
      router_(is_router_arch(cfg.model.arch)) {}

StepResult DiffusionStep::run(const Batch& batch, int64_t step) {
  const TrainConfig& tc = cfg_.train;
  const uint64_t seed = static_cast<uint64_t>(tc.seed), s = static_cast<uint64_t>(step);
  const int64_t b = batch.x.size(0), num_classes = cfg_.model.num_classes;
  auto gen_noise = make_generator(derive_seed({seed, static_cast<uint64_t>(RngPurpose::kNoise), s}));
  auto gen_time = make_generator(derive_seed({seed, static_cast<uint64_t>(RngPurpose::kTime), s}));
  auto gen_drop = make_generator(derive_seed({seed, static_cast<uint64_t>(RngPurpose::kLabelDrop), s}));
  auto eps = torch::randn(batch.x.sizes(), gen_noise);  // [B,C,H,W]
  auto t = sample_time(cfg_.diffusion, b, gen_time);    // [B]
  auto y = batch.y;                                     // [B]
  if (num_classes == 0) {
    y = torch::zeros({b}, torch::kLong);
  } else if (tc.label_dropout > 0) {
    auto drop = torch::rand({b}, gen_drop) < tc.label_dropout;  // [B] bool
    y = torch::where(drop, torch::full_like(y, num_classes), y);
  }
  auto xt = path_.alpha(t).view({-1, 1, 1, 1}) * batch.x + path_.sigma(t).view({-1, 1, 1, 1}) * eps;  // [B,C,H,W]

  StepResult r;
  r.lr = lr_at(tc, step);
  optim_.zero_grad();
  auto out = net_->forward(xt, t, y);  // [B,C,H,W], or a router's logits [B,K]
  torch::Tensor loss;                  // []
  if (router_) {
    DDM_CHECK(batch.k.defined(), "router training needs the batch's clusters (Dataset::clusters)");
    loss = torch::nn::functional::cross_entropy(out, batch.k);
  } else if (teacher_) {
    DDM_CHECK(batch.k.defined(), "distillation needs the batch's clusters (Dataset::clusters)");
    Denoiser::Estimate est;
    {
      torch::NoGradGuard no_grad;
      est = teacher_(xt, t, y, batch.k);
    }
    loss = torch::mse_loss(out, training_target(path_, pred_, est.x0, est.eps, t));
  } else {
    loss = torch::mse_loss(out, training_target(path_, pred_, batch.x, eps, t));
  }
  r.loss = loss.item<double>();
  if (!std::isfinite(r.loss)) {
    r.finite = false;
    return r;
  }
  loss.backward();
  r.grad_norm = optim_.clip_grad_norm(tc.grad_clip);
  if (!std::isfinite(r.grad_norm)) {
    r.finite = false;
    return r;
  }
  // EMA with the usual warm-up so short runs are not dominated by the initial weights.
  const double n = static_cast<double>(optim_.step_count() + 1);
  optim_.step(r.lr, std::min(tc.ema_decay, (1.0 + n) / (10.0 + n)));
  return r;
}

}  // namespace ddm
