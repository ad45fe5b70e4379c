// Noise paths: alpha(t), sigma(t) and their time derivatives for flow and VP schedules.
#include "diffusion/path.h"

#include <algorithm>
#include <cmath>

#include <torch/torch.h>

#include "core/device.h"
#include "core/error.h"

namespace ddm {
namespace {
constexpr double kB0 = 0.1, kB1 = 20.0;  // VP linear beta range
constexpr double kCosS = 0.008;
constexpr double kPi = 3.14159265358979323846;

double cos_phi(double t, double tau) { return (t * tau + kCosS) / (1.0 + kCosS) * kPi / 2.0; }
}  // namespace

NoisePath::NoisePath(PathKind kind) : kind_(kind) {
  if (kind_ == PathKind::kVpCosine) {
    // Solve alpha_cos^2(1) = alpha_lin^2(1) for tau by bisection (monotone in tau).
    const double target = std::exp(-(kB0 + 0.5 * (kB1 - kB0)));
    double lo = 0.5, hi = 1.0;
    for (int i = 0; i < 100; ++i) {
      tau_ = 0.5 * (lo + hi);
      const double c = std::cos(cos_phi(1.0, tau_)) / std::cos(cos_phi(0.0, tau_));
      (c * c > target ? lo : hi) = tau_;
    }
  }
}

NoisePath NoisePath::discrete(const torch::Tensor& alphas_cumprod) {
  DDM_CHECK(alphas_cumprod.dim() == 1 && alphas_cumprod.numel() >= 2,
            "a discrete schedule needs at least 2 alphas_cumprod, got " << alphas_cumprod.sizes());
  NoisePath p(PathKind::kFlow);
  p.kind_ = PathKind::kDiscrete;
  const torch::Tensor a = alphas_cumprod.to(torch::kDouble).contiguous();
  const double* v = a.data_ptr<double>();
  p.ratio_.assign(static_cast<size_t>(a.numel()) + 1, 0.0);
  for (int64_t k = 0; k < a.numel(); ++k) {
    DDM_CHECK(v[k] > 0 && v[k] <= 1 && (k == 0 || v[k] < v[k - 1]),
              "a discrete schedule's alphas_cumprod must fall in (0, 1]; entry " << k << " is " << v[k]);
    p.ratio_[static_cast<size_t>(k) + 1] = std::sqrt((1 - v[k]) / v[k]);
  }
  p.ratio_table_ = torch::tensor(p.ratio_, torch::kDouble);
  return p;
}

// Between two timesteps the log of the ratio is linear in t (the first step, from the data's 0, is
// linear in the ratio itself), so that the time of a ratio is the timestep diffusers' samplers give
// the UNet for that sigma (their _sigma_to_t interpolates log sigma).
void NoisePath::discrete_ratio(double t, double& r, double& dr) const {
  const int64_t T = timesteps();
  const double s = std::clamp(t, 0.0, 1.0) * static_cast<double>(T);
  const int64_t k = std::min<int64_t>(static_cast<int64_t>(std::floor(s)), T - 1);
  const double lo = ratio_[static_cast<size_t>(k)], hi = ratio_[static_cast<size_t>(k) + 1], f = s - static_cast<double>(k);
  if (k == 0) {
    r = f * hi;
    dr = static_cast<double>(T) * hi;
    return;
  }
  const double step = std::log(hi) - std::log(lo);
  r = lo * std::exp(f * step);
  dr = static_cast<double>(T) * step * r;
}

void NoisePath::discrete_ratio(const torch::Tensor& t, torch::Tensor& r, torch::Tensor& dr) const {
  const int64_t T = timesteps();
  const torch::Tensor table = to_device_async(ratio_table_, t.device());                       // [T + 1]
  const torch::Tensor s = t.to(torch::kDouble).clamp(0.0, 1.0) * static_cast<double>(T);   // [B]
  const torch::Tensor k = s.floor().clamp_max(static_cast<double>(T - 1)).to(torch::kLong);  // [B]
  const torch::Tensor lo = table.index_select(0, k.flatten()).view_as(s);
  const torch::Tensor hi = table.index_select(0, (k + 1).flatten()).view_as(s);
  const torch::Tensor f = s - k.to(torch::kDouble);
  const torch::Tensor first = k.eq(0);
  const torch::Tensor step = torch::where(first, torch::zeros_like(hi), hi.log() - lo.clamp_min(1e-300).log());
  r = torch::where(first, f * hi, lo * (f * step).exp());
  dr = static_cast<double>(T) * torch::where(first, hi, step * r);
}

torch::Tensor discrete_alphas_cumprod(const std::string& beta_schedule, double beta_start, double beta_end,
                                      int64_t T) {
  DDM_CHECK(T >= 2, "a discrete schedule needs at least 2 timesteps, got " << T);
  torch::Tensor betas;
  if (beta_schedule == "linear") {
    betas = torch::linspace(beta_start, beta_end, T, torch::kFloat32);
  } else if (beta_schedule == "scaled_linear") {
    betas = torch::linspace(std::sqrt(beta_start), std::sqrt(beta_end), T, torch::kFloat32).pow(2);
  } else if (beta_schedule == "squaredcos_cap_v2") {  // GLIDE's cosine, in double, then float32
    auto alpha_bar = [](double t) { return std::pow(std::cos((t + 0.008) / 1.008 * kPi / 2), 2); };
    std::vector<float> b(static_cast<size_t>(T));
    for (int64_t i = 0; i < T; ++i)
      b[static_cast<size_t>(i)] = static_cast<float>(std::min(
          1 - alpha_bar(static_cast<double>(i + 1) / T) / alpha_bar(static_cast<double>(i) / T), 0.999));
    betas = torch::tensor(b, torch::kFloat32);
  } else {
    DDM_FAIL("beta schedule \"" << beta_schedule << "\" is not one of: linear, scaled_linear, squaredcos_cap_v2");
  }
  return torch::cumprod(1.0 - betas, 0);  // float32 [T]
}

double discrete_time(double u, int64_t T) {
  const int64_t k = std::clamp<int64_t>(static_cast<int64_t>(std::floor(u * static_cast<double>(T))), 0, T - 1);
  return static_cast<double>(k + 1) / static_cast<double>(T);
}

std::string NoisePath::name() const {
  switch (kind_) {
    case PathKind::kFlow: return "flow";
    case PathKind::kVpLinear: return "vp-linear";
    case PathKind::kVpCosine: return "vp-cosine";
    case PathKind::kDiscrete: return "discrete";
  }
  return "?";
}

double NoisePath::alpha(double t) const {
  switch (kind_) {
    case PathKind::kFlow: return 1.0 - t;
    case PathKind::kVpLinear: return std::exp(-0.5 * (kB0 * t + 0.5 * (kB1 - kB0) * t * t));
    case PathKind::kVpCosine: return std::cos(cos_phi(t, tau_)) / std::cos(cos_phi(0.0, tau_));
    case PathKind::kDiscrete: {
      double r, dr;
      discrete_ratio(t, r, dr);
      return 1.0 / std::sqrt(1.0 + r * r);
    }
  }
  return 0;
}

double NoisePath::sigma(double t) const {
  if (kind_ == PathKind::kFlow) return t;
  if (kind_ == PathKind::kDiscrete) {
    double r, dr;
    discrete_ratio(t, r, dr);
    return r / std::sqrt(1.0 + r * r);
  }
  const double a = alpha(t);
  return std::sqrt(std::max(0.0, 1.0 - a * a));
}

double NoisePath::dalpha(double t) const {
  switch (kind_) {
    case PathKind::kFlow: return -1.0;
    case PathKind::kVpLinear: return -0.5 * (kB0 + (kB1 - kB0) * t) * alpha(t);
    case PathKind::kVpCosine:
      return -std::sin(cos_phi(t, tau_)) * tau_ / (1.0 + kCosS) * kPi / 2.0 / std::cos(cos_phi(0.0, tau_));
    case PathKind::kDiscrete: {  // alpha = (1 + r^2)^(-1/2)
      double r, dr;
      discrete_ratio(t, r, dr);
      return -r * dr / std::pow(1.0 + r * r, 1.5);
    }
  }
  return 0;
}

double NoisePath::dsigma(double t) const {
  if (kind_ == PathKind::kFlow) return 1.0;
  if (kind_ == PathKind::kDiscrete) {  // sigma = r (1 + r^2)^(-1/2)
    double r, dr;
    discrete_ratio(t, r, dr);
    return dr / std::pow(1.0 + r * r, 1.5);
  }
  // sigma^2 = 1 - alpha^2  =>  dsigma = -alpha * dalpha / sigma.
  return -alpha(t) * dalpha(t) / sigma(t);
}

torch::Tensor NoisePath::alpha(const torch::Tensor& t) const {
  switch (kind_) {
    case PathKind::kFlow: return 1.0 - t;
    case PathKind::kVpLinear: return torch::exp(-0.5 * (kB0 * t + 0.5 * (kB1 - kB0) * t * t));
    case PathKind::kVpCosine:
      return torch::cos((t * tau_ + kCosS) / (1.0 + kCosS) * (kPi / 2.0)) / std::cos(cos_phi(0.0, tau_));
    case PathKind::kDiscrete: {
      torch::Tensor r, dr;
      discrete_ratio(t, r, dr);
      return (1.0 + r * r).rsqrt().to(t.scalar_type());
    }
  }
  return {};
}

torch::Tensor NoisePath::sigma(const torch::Tensor& t) const {
  if (kind_ == PathKind::kFlow) return t.clone();
  if (kind_ == PathKind::kDiscrete) {
    torch::Tensor r, dr;
    discrete_ratio(t, r, dr);
    return (r * (1.0 + r * r).rsqrt()).to(t.scalar_type());
  }
  auto a = alpha(t);
  return (1.0 - a * a).clamp_min(0.0).sqrt();
}

torch::Tensor NoisePath::dalpha(const torch::Tensor& t) const {
  switch (kind_) {
    case PathKind::kFlow: return torch::full_like(t, -1.0);
    case PathKind::kVpLinear: return -0.5 * (kB0 + (kB1 - kB0) * t) * alpha(t);
    case PathKind::kVpCosine:
      return -torch::sin((t * tau_ + kCosS) / (1.0 + kCosS) * (kPi / 2.0)) *
             (tau_ / (1.0 + kCosS) * kPi / 2.0 / std::cos(cos_phi(0.0, tau_)));
    case PathKind::kDiscrete: {
      torch::Tensor r, dr;
      discrete_ratio(t, r, dr);
      return (-r * dr * (1.0 + r * r).pow(-1.5)).to(t.scalar_type());
    }
  }
  return {};
}

torch::Tensor NoisePath::dsigma(const torch::Tensor& t) const {
  if (kind_ == PathKind::kFlow) return torch::ones_like(t);
  if (kind_ == PathKind::kDiscrete) {
    torch::Tensor r, dr;
    discrete_ratio(t, r, dr);
    return (dr * (1.0 + r * r).pow(-1.5)).to(t.scalar_type());
  }
  return -alpha(t) * dalpha(t) / sigma(t);
}

PathMatch match_path(const NoisePath& from, const torch::Tensor& t, const NoisePath& to) {
  if (from.same_as(to)) return {t, torch::ones_like(t)};
  // A loop over the times on the host: a copy of them there, the results sent back to t's device.
  const auto tc = t.to(torch::kCPU, torch::kDouble).contiguous();
  auto t_to = torch::empty_like(tc), scale = torch::empty_like(tc);
  const double* ti = tc.data_ptr<double>();
  double* out_t = t_to.data_ptr<double>();
  double* out_s = scale.data_ptr<double>();
  for (int64_t i = 0; i < tc.numel(); ++i) {
    const double a = from.alpha(ti[i]), s = from.sigma(ti[i]);
    // Bisection on the log signal-to-noise ratio, which falls with t on every path.
    double lo = 0.0, hi = 1.0;
    if (a <= 0) {
      lo = 1.0;
    } else if (s <= 0) {
      hi = 0.0;
    } else {
      const double target = std::log(a / s);
      for (int k = 0; k < 60; ++k) {
        const double mid = 0.5 * (lo + hi);
        (std::log(to.alpha(mid) / to.sigma(mid)) > target ? lo : hi) = mid;
      }
    }
    out_t[i] = 0.5 * (lo + hi);
    const double at = to.alpha(out_t[i]), st = to.sigma(out_t[i]);
    out_s[i] = std::sqrt(at * at + st * st) / std::sqrt(a * a + s * s);
  }
  return {to_device_async(t_to.to(t.scalar_type()), t.device()), to_device_async(scale.to(t.scalar_type()), t.device())};
}

NoisePath make_path(const DiffusionConfig& cfg) {
  if (cfg.objective == "flow") return NoisePath(PathKind::kFlow);
  if (cfg.schedule == "linear") return NoisePath(PathKind::kVpLinear);
  if (cfg.schedule == "cosine") return NoisePath(PathKind::kVpCosine);
  if (cfg.schedule == "discrete")
    return NoisePath::discrete(discrete_alphas_cumprod(cfg.beta_schedule, cfg.beta_start, cfg.beta_end, cfg.timesteps));
  DDM_FAIL("diffusion.schedule = \"" << cfg.schedule << "\" is not one of: linear, cosine, discrete");
}

torch::Tensor sample_time(const DiffusionConfig& cfg, int64_t n, at::Generator& gen) {
  if (cfg.objective != "flow" && cfg.schedule == "discrete") {
    const torch::Tensor u = cfg.time_dist == "logit-normal"
                                ? torch::sigmoid(torch::randn({n}, gen) * cfg.logit_std + cfg.logit_mean)
                                : torch::rand({n}, gen);  // [n]
    return ((u * static_cast<double>(cfg.timesteps)).floor().clamp(0, cfg.timesteps - 1) + 1) /
           static_cast<double>(cfg.timesteps);
  }
  const double t_min = cfg.objective == "flow" ? 0.0 : 1e-3;
  torch::Tensor t;
  if (cfg.time_dist == "logit-normal")
    t = torch::sigmoid(torch::randn({n}, gen) * cfg.logit_std + cfg.logit_mean);  // [n]
  else
    t = torch::rand({n}, gen);  // [n]
  return t_min + (1.0 - t_min) * t;
}

}  // namespace ddm
