// Noise paths (schedules). Convention for all of ddm: t = 0 is data, t = 1 is noise, and
//   x_t = alpha(t) * x0 + sigma(t) * eps,   eps ~ N(0, I).
// flow:       alpha = 1 - t, sigma = t (rectified flow / flow matching); velocity target eps - x0.
// vp-linear:  DDPM's linear beta schedule in continuous time, alpha^2 = exp(-(b0 t + (b1-b0) t^2 / 2)),
//             b0 = 0.1, b1 = 20, sigma^2 = 1 - alpha^2.
// vp-cosine:  improved-DDPM cosine schedule, alpha^2 = cos^2(phi(t)) / cos^2(phi(0)),
//             phi(t) = (t * tau + s) / (1 + s) * pi / 2, s = 0.008, tau chosen so alpha^2(1) equals
//             the linear schedule's endpoint (avoids the singular alpha(1) = 0).
// discrete:   DDPM's and Stable Diffusion's schedule of T betas (diffusers' alphas_cumprod[k] for
//             its timesteps k = 0..T-1), made continuous: timestep k sits at t = (k + 1) / T, with
//             alpha^2 = alphas_cumprod[k]; t = 0 is the data (alpha = 1). Between two of these
//             times the log of the noise-to-signal ratio sigma / alpha is linear in t (from t = 0 to
//             1 / T the ratio itself), as diffusers maps a sigma to its timestep. A diffusers network
//             reads t as its timestep t * T - 1, so its training times are the T points (k + 1) / T,
//             and its samplers' sigmas are the same times on this path.
#pragma once
#include <string>
#include <vector>

#include <torch/types.h>

#include "core/config.h"

namespace ddm {

enum class PathKind { kFlow, kVpLinear, kVpCosine, kDiscrete };

class NoisePath {
 public:
  explicit NoisePath(PathKind kind);  // flow, vp-linear or vp-cosine
  // The discrete path of alphas_cumprod (float [T], decreasing in (0, 1]).
  static NoisePath discrete(const torch::Tensor& alphas_cumprod);
  PathKind kind() const { return kind_; }
  std::string name() const;
  // The discrete path's T (0 for the continuous ones).
  int64_t timesteps() const { return static_cast<int64_t>(ratio_.size()) - 1; }

  // Scalar versions (double precision) and tensor versions (elementwise, same dtype as t).
  double alpha(double t) const;
  double sigma(double t) const;
  double dalpha(double t) const;  // d alpha / dt
  double dsigma(double t) const;  // d sigma / dt
  torch::Tensor alpha(const torch::Tensor& t) const;
  torch::Tensor sigma(const torch::Tensor& t) const;
  torch::Tensor dalpha(const torch::Tensor& t) const;
  torch::Tensor dsigma(const torch::Tensor& t) const;
  // The same path: the same kind, and for the discrete kind the same table of ratios.
  bool same_as(const NoisePath& other) const {
    return kind_ == other.kind_ && tau_ == other.tau_ && ratio_ == other.ratio_;
  }

 private:
  PathKind kind_;
  double tau_ = 1.0;          // cosine time scaling
  std::vector<double> ratio_;  // discrete: sigma / alpha at t = k / T, k = 0..T (ratio_[0] = 0)
  torch::Tensor ratio_table_;  // the same, double [T + 1]
  // discrete: the ratio r and dr/dt at t (tensor versions: elementwise, double).
  void discrete_ratio(double t, double& r, double& dr) const;
  void discrete_ratio(const torch::Tensor& t, torch::Tensor& r, torch::Tensor& dr) const;
};

// The cumulative products of (1 - beta) of a discrete schedule, float32 [T], computed as diffusers
// computes them (betas in float32 and their cumulative product in float32; squaredcos_cap_v2's betas
// in double, each capped at 0.999): beta_schedule linear | scaled_linear | squaredcos_cap_v2.
torch::Tensor discrete_alphas_cumprod(const std::string& beta_schedule, double beta_start, double beta_end,
                                      int64_t timesteps);

// A training time of the discrete path from u in [0, 1): the time (k + 1) / T of timestep
// k = floor(u * T), so a uniform u draws every timestep alike, as diffusers' training scripts do.
double discrete_time(double u, int64_t timesteps);

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

// objective flow -> flow path; eps / v -> VP path with diffusion.schedule (discrete: of
// diffusion.beta_schedule, beta_start, beta_end and timesteps).
NoisePath make_path(const DiffusionConfig& cfg);

// Training-time distribution of t: uniform on [t_min, 1] or logit-normal; t_min keeps VP
// eps-prediction away from the t = 0 singularity of its loss weighting.
torch::Tensor sample_time(const DiffusionConfig& cfg, int64_t n, at::Generator& gen);

}  // namespace ddm
