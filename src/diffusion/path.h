// Noise paths (schedules). Convention for all of ddm: t = 0 is data, t = 1 is noise, and
//   x_t = alpha(t) * x0 + sigma(t) * eps,   eps ~ N(0, I).
// flow:       alpha = 1 - t, sigma = t (rectified flow / flow matching); velocity target eps - x0.
// vp-linear:  DDPM's linear beta schedule in continuous time, alpha^2 = exp(-(b0 t + (b1-b0) t^2 / 2)),
//             b0 = 0.1, b1 = 20, sigma^2 = 1 - alpha^2.
// vp-cosine:  improved-DDPM cosine schedule, alpha^2 = cos^2(phi(t)) / cos^2(phi(0)),
//             phi(t) = (t * tau + s) / (1 + s) * pi / 2, s = 0.008, tau chosen so alpha^2(1) equals
//             the linear schedule's endpoint (avoids the singular alpha(1) = 0).
#pragma once
#include <string>

#include <torch/types.h>

#include "core/config.h"

namespace ddm {

enum class PathKind { kFlow, kVpLinear, kVpCosine };

class NoisePath {
 public:
  explicit NoisePath(PathKind kind);
  PathKind kind() const { return kind_; }
  std::string name() const;

  // Scalar versions (double precision) and tensor versions (elementwise, same dtype as t).
  double alpha(double t) const;
  double sigma(double t) const;
  double dalpha(double t) const;  // d alpha / dt
  double dsigma(double t) const;  // d sigma / dt
  torch::Tensor alpha(const torch::Tensor& t) const;
  torch::Tensor sigma(const torch::Tensor& t) const;
  torch::Tensor dalpha(const torch::Tensor& t) const;
  torch::Tensor dsigma(const torch::Tensor& t) const;

 private:
  PathKind kind_;
  double tau_ = 1.0;  // cosine time scaling
};

// The same noisy sample on another path. Two paths meet wherever their signal-to-noise ratios
// alpha / sigma agree, so x_t on `from` equals scale * x_t on `to` at the time t_to of equal ratio,
// with scale = alpha_to(t_to) / alpha_from(t) (computed as the ratio of sqrt(alpha^2 + sigma^2),
// which is the same where the ratios agree and defined at t = 1 of the flow path). A VP path has no
// time of zero signal: beyond its noisiest point t_to is clamped to 1 (an approximation whose
// error is that path's own alpha(1), about 0.007). t [B] -> t_to [B], scale [B].
struct PathMatch {
  torch::Tensor t, scale;
};
PathMatch match_path(const NoisePath& from, const torch::Tensor& t, const NoisePath& to);

// objective flow -> flow path; eps / v -> VP path with diffusion.schedule.
NoisePath make_path(const DiffusionConfig& cfg);

// Training-time distribution of t: uniform on [t_min, 1] or logit-normal; t_min keeps VP
// eps-prediction away from the t = 0 singularity of its loss weighting.
torch::Tensor sample_time(const DiffusionConfig& cfg, int64_t n, at::Generator& gen);

}  // namespace ddm
