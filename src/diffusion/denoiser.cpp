// Denoiser: converts any prediction type to x0 / eps / velocity estimates, with CFG.
#include "diffusion/denoiser.h"

#include "core/device.h"
#include "core/error.h"

namespace ddm {
namespace {
torch::Tensor col(const torch::Tensor& v) { return v.view({-1, 1, 1, 1}); }
}  // namespace

Prediction prediction_for(const DiffusionConfig& cfg) {
  if (cfg.objective == "flow") return Prediction::kVelocity;
  if (cfg.objective == "eps") return Prediction::kEps;
  if (cfg.objective == "v") return Prediction::kV;
  DDM_FAIL("diffusion.objective = \"" << cfg.objective << "\" is not one of: flow, eps, v");
}

std::string prediction_name(Prediction p) {
  switch (p) {
    case Prediction::kVelocity: return "velocity";
    case Prediction::kEps: return "eps";
    case Prediction::kV: return "v";
  }
  return "?";
}

Scalings scalings(const NoisePath& path, Prediction pred, const torch::Tensor& t) {
  auto a = col(path.alpha(t)), s = col(path.sigma(t));
  switch (pred) {
    case Prediction::kVelocity: {
      // Solve x = a x0 + s eps, F = da x0 + ds eps for (x0, eps); det = a ds - s da.
      auto da = col(path.dalpha(t)), ds = col(path.dsigma(t));
      auto det = a * ds - s * da;
      return {ds / det, -s / det, -da / det, a / det};
    }
    case Prediction::kEps:
      // x0 = (x - s F) / a, eps = F.
      return {1.0 / a, -s / a, torch::zeros_like(a), torch::ones_like(a)};
    case Prediction::kV:
      // VP (a^2 + s^2 = 1), v = a eps - s x0: x0 = a x - s F, eps = s x + a F.
      return {a, -s, s, a};
  }
  DDM_FAIL("unknown prediction type");
}

torch::Tensor training_target(const NoisePath& path, Prediction pred, const torch::Tensor& x0,
                              const torch::Tensor& eps, const torch::Tensor& t) {
  switch (pred) {
    case Prediction::kVelocity: return col(path.dalpha(t)) * x0 + col(path.dsigma(t)) * eps;
    case Prediction::kEps: return eps;
    case Prediction::kV: return col(path.alpha(t)) * eps - col(path.sigma(t)) * x0;
  }
  DDM_FAIL("unknown prediction type");
}

Denoiser::Denoiser(Net net, NoisePath path, Prediction pred, int64_t num_classes)
    : net_(std::move(net)), path_(path), pred_(pred), num_classes_(num_classes) {}

Denoiser::Denoiser(EstimateFn fn, NoisePath path, int64_t num_classes, torch::Device device)
    : fn_(std::move(fn)), path_(path), pred_(Prediction::kVelocity), num_classes_(num_classes), fn_device_(device) {}

torch::Device Denoiser::device() const {
  if (!net_) return fn_device_;
  const auto params = net_->parameters();
  return params.empty() ? torch::Device(torch::kCPU) : params.front().device();
}

torch::Tensor Denoiser::raw(const torch::Tensor& x, const torch::Tensor& t, const Cond& y, double w) const {
  ++nfe_;
  const int64_t b = x.size(0);
  const auto on_x = torch::TensorOptions().device(x.device());
  Autocast autocast(x.device(), precision_);  // bf16: the forward passes; the output takes x's type below
  // The unconditional branch: the null class, the null embedding and the null text (the empty or the
  // negative prompt), the same control map.
  Cond null = y;
  null.y = torch::full({b}, num_classes_, on_x.dtype(torch::kLong));
  if (y.embed.defined()) null.embed_null = torch::ones({b}, on_x.dtype(torch::kBool));
  Cond c = y;
  if (num_classes_ == 0) c.y = null.y;  // an unconditional model's only class
  const bool conditional = num_classes_ > 0 || y.embed.defined() || y.context.defined();
  if (!conditional || w == 1.0) return net_->forward(x, t, c).to(x.scalar_type());  // [B,C,H,W]
  if (y.context.defined()) {
    DDM_CHECK(null_text_.context.defined(), "guidance of a text-conditioned model needs the empty prompt's encoding "
                                            "(Denoiser::set_null_text)");
    const Cond nt = null_text_.to(x.device());
    null.context = nt.context.expand({b, -1, -1});                                     // [B, T, D]
    null.context_mask = nt.context_mask.defined() ? nt.context_mask.expand({b, -1}) : nt.context_mask;  // [B, T]
    null.pooled = nt.pooled.defined() ? nt.pooled.expand({b, -1}) : nt.pooled;       // [B, P]
    DDM_CHECK(null.context_mask.defined() == y.context_mask.defined() && null.pooled.defined() == y.pooled.defined(),
              "the null text condition and the samples' carry different fields");
  }
  if (w == 0.0) return net_->forward(x, t, null).to(x.scalar_type());               // [B,C,H,W]
  // Conditional and unconditional branches in one batch of 2B.
  if (y.embed.defined() && !c.embed_null.defined()) c.embed_null = torch::zeros({b}, on_x.dtype(torch::kBool));
  auto out = net_->forward(torch::cat({x, x}), torch::cat({t, t}), Cond::cat(c, null)).to(x.scalar_type());  // [2B,C,H,W]
  auto cond = out.narrow(0, 0, b), uncond = out.narrow(0, b, b);                            // [B,C,H,W]
  return uncond + w * (cond - uncond);                                                       // [B,C,H,W]
}

Denoiser::Estimate Denoiser::estimate(const torch::Tensor& x, const torch::Tensor& t, const Cond& y,
                                      double w, const torch::Tensor& keys) const {
  if (fn_) {
    ++nfe_;
    return fn_(x, t, y, w, keys);
  }
  auto f = raw(x, t, y, w);               // [B,C,H,W]
  auto sc = scalings(path_, pred_, t);    // each [B,1,1,1]
  return {sc.c_skip * x + sc.c_out * f,   // x0_hat [B,C,H,W]
          sc.e_skip * x + sc.e_out * f};  // eps_hat [B,C,H,W]
}

torch::Tensor Denoiser::velocity(const torch::Tensor& x, const torch::Tensor& t, const Cond& y,
                                 double w, const torch::Tensor& keys) const {
  return velocity(estimate(x, t, y, w, keys), t);  // [B,C,H,W]
}

torch::Tensor Denoiser::velocity(const Estimate& e, const torch::Tensor& t) const {
  return col(path_.dalpha(t)) * e.x0 + col(path_.dsigma(t)) * e.eps;  // [B,C,H,W]
}

}  // namespace ddm
