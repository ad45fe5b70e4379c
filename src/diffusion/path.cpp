// Noise paths: alpha(t), sigma(t) and their time derivatives for flow and VP schedules.
#include "diffusion/path.h"

#include <cmath>

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

std::string NoisePath::name() const {
  switch (kind_) {
    case PathKind::kFlow: return "flow";
    case PathKind::kVpLinear: return "vp-linear";
    case PathKind::kVpCosine: return "vp-cosine";
  }
  return "?";
}

double NoisePath::alpha(double t) const {
  switch (kind_) {
    case PathKind::kFlow: return 1.0 - t;
    case PathKind::kVpLinear: return std::exp(-0.5 * (kB0 * t + 0.5 * (kB1 - kB0) * t * t));
    case PathKind::kVpCosine: return std::cos(cos_phi(t, tau_)) / std::cos(cos_phi(0.0, tau_));
  }
  return 0;
}

double NoisePath::sigma(double t) const {
  if (kind_ == PathKind::kFlow) return t;
  const double a = alpha(t);
  return std::sqrt(std::max(0.0, 1.0 - a * a));
}

double NoisePath::dalpha(double t) const {
  switch (kind_) {
    case PathKind::kFlow: return -1.0;
    case PathKind::kVpLinear: return -0.5 * (kB0 + (kB1 - kB0) * t) * alpha(t);
    case PathKind::kVpCosine:
      return -std::sin(cos_phi(t, tau_)) * tau_ / (1.0 + kCosS) * kPi / 2.0 / std::cos(cos_phi(0.0, tau_));
  }
  return 0;
}

double NoisePath::dsigma(double t) const {
  if (kind_ == PathKind::kFlow) return 1.0;
  // sigma^2 = 1 - alpha^2  =>  dsigma = -alpha * dalpha / sigma.
  return -alpha(t) * dalpha(t) / sigma(t);
}

torch::Tensor NoisePath::alpha(const torch::Tensor& t) const {
  switch (kind_) {
    case PathKind::kFlow: return 1.0 - t;
    case PathKind::kVpLinear: return torch::exp(-0.5 * (kB0 * t + 0.5 * (kB1 - kB0) * t * t));
    case PathKind::kVpCosine:
      return torch::cos((t * tau_ + kCosS) / (1.0 + kCosS) * (kPi / 2.0)) / std::cos(cos_phi(0.0, tau_));
  }
  return {};
}

torch::Tensor NoisePath::sigma(const torch::Tensor& t) const {
  if (kind_ == PathKind::kFlow) return t.clone();
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
  }
  return {};
}

torch::Tensor NoisePath::dsigma(const torch::Tensor& t) const {
  if (kind_ == PathKind::kFlow) return torch::ones_like(t);
  return -alpha(t) * dalpha(t) / sigma(t);
}

PathMatch match_path(const NoisePath& from, const torch::Tensor& t, const NoisePath& to) {
  if (from.kind() == to.kind()) return {t, torch::ones_like(t)};
  const auto tc = t.to(torch::kDouble).contiguous();
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
  return {t_to.to(t.scalar_type()), scale.to(t.scalar_type())};
}

NoisePath make_path(const DiffusionConfig& cfg) {
  if (cfg.objective == "flow") return NoisePath(PathKind::kFlow);
  if (cfg.schedule == "linear") return NoisePath(PathKind::kVpLinear);
  if (cfg.schedule == "cosine") return NoisePath(PathKind::kVpCosine);
  DDM_FAIL("diffusion.schedule = \"" << cfg.schedule << "\" is not one of: linear, cosine");
}

torch::Tensor sample_time(const DiffusionConfig& cfg, int64_t n, at::Generator& gen) {
  const double t_min = cfg.objective == "flow" ? 0.0 : 1e-3;
  torch::Tensor t;
  if (cfg.time_dist == "logit-normal")
    t = torch::sigmoid(torch::randn({n}, gen) * cfg.logit_std + cfg.logit_mean);  // [n]
  else
    t = torch::rand({n}, gen);  // [n]
  return t_min + (1.0 - t_min) * t;
}

}  // namespace ddm
