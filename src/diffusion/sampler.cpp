// Euler, Heun, DDIM and ancestral DDPM samplers over the Denoiser interface.
#include "diffusion/sampler.h"

#include <algorithm>
#include <cmath>

#include "core/device.h"
#include "core/error.h"
#include "core/keyed_random.h"
#include "core/rng.h"

namespace ddm {

namespace {
constexpr uint64_t kAncestralNoise = 0xa9ce57ULL, kEvaluationKey = 0xe7a1ULL;

uint64_t u64(int64_t v) { return static_cast<uint64_t>(v); }

// Standard normal noise shaped like x [N, ...]: row j from its own counter-based stream keyed by
// (seed, sample first + j, step), so it is the same whatever batch the sample is in.
torch::Tensor per_sample_noise(const torch::Tensor& x, uint64_t seed, int64_t first, int64_t step) {
  std::vector<uint64_t> keys(static_cast<size_t>(x.size(0)));
  for (size_t j = 0; j < keys.size(); ++j)
    keys[j] = derive_seed({seed, static_cast<uint64_t>(RngPurpose::kSample), kAncestralNoise,
                           u64(first + static_cast<int64_t>(j)), u64(step)});
  return normal_rows(keys, x.sizes().slice(1), x.options());  // [N, ...]
}
}  // namespace

uint64_t sample_key(uint64_t seed, int64_t index, int64_t eval) {
  return derive_seed({seed, static_cast<uint64_t>(RngPurpose::kSample), kEvaluationKey, u64(index), u64(eval)});
}

std::vector<double> time_grid(const NoisePath& path, int64_t steps) {
  std::vector<double> grid(static_cast<size_t>(steps) + 1);
  if (path.kind() == PathKind::kFlow) {
    for (int64_t i = 0; i <= steps; ++i) grid[i] = 1.0 - static_cast<double>(i) / steps;
    return grid;
  }
  // EDM (Karras et al. 2022) rho-schedule in r = sigma / alpha, mapped back to t by bisection
  // (r is increasing in t); the last point is t = 0.
  // A discrete path's least noise is its timestep 0's (t = 1 / T): the grid ends there, then at the data.
  const double rho = 7.0, r_max = path.sigma(1.0) / path.alpha(1.0);
  const double t_least = path.kind() == PathKind::kDiscrete ? 1.0 / static_cast<double>(path.timesteps()) : 0.0;
  const double r_min = std::max(0.002, path.sigma(t_least) / path.alpha(t_least));
  auto t_of = [&](double r) {
    double lo = 0.0, hi = 1.0;
    for (int k = 0; k < 60; ++k) {
      const double mid = 0.5 * (lo + hi);
      (path.sigma(mid) / path.alpha(mid) < r ? lo : hi) = mid;
    }
    return 0.5 * (lo + hi);
  };
  grid[0] = 1.0;
  for (int64_t i = 1; i < steps; ++i) {
    const double f = static_cast<double>(i) / (steps - 1);
    const double r = std::pow(std::pow(r_max, 1 / rho) + f * (std::pow(r_min, 1 / rho) - std::pow(r_max, 1 / rho)), rho);
    grid[i] = t_of(r);
  }
  grid[steps] = 0.0;
  if (steps == 1) grid[1] = 0.0;
  return grid;
}

int64_t sampler_nfe(const std::string& sampler, int64_t steps) {
  return sampler == "heun" ? 2 * steps - 1 : steps;
}

SampleResult sample(const Denoiser& den, const torch::Tensor& x1, const Cond& y, const SampleOptions& opt) {
  DDM_CHECK(opt.steps > 0, "sampling steps must be > 0, got " << opt.steps);
  DDM_CHECK(opt.cfg >= 0 && std::isfinite(opt.cfg), "cfg must be a finite number >= 0, got " << opt.cfg);
  const std::string& kind = opt.sampler;
  DDM_CHECK(kind == "euler" || kind == "heun" || kind == "ddim" || kind == "ddpm",
            "sampler \"" << kind << "\" is not one of: euler, heun, ddim, ddpm");
  torch::NoGradGuard no_grad;
  const AutocastWeightCache weight_casts;  // bf16: each weight cast once for all the steps
  const NoisePath& path = den.path();
  const int64_t n = x1.size(0);
  const int64_t nfe0 = den.nfe();
  auto x = x1.clone();  // [N,C,H,W]
  auto tvec = [&](double t) { return torch::full({n}, t, x.options()); };
  int64_t evals = 0;
  auto keys = [&] {  // int64 [N]: each sample's key for the next network evaluation
    auto k = torch::empty({n}, torch::kLong);
    int64_t* p = k.data_ptr<int64_t>();
    for (int64_t j = 0; j < n; ++j) p[j] = static_cast<int64_t>(sample_key(opt.seed, opt.first_index + j, evals));
    ++evals;
    return k;
  };

  // Self-conditioned networks get each evaluation's x0 estimate at the next one (none at the first).
  Cond c = y;
  auto estimate = [&](const torch::Tensor& xx, double t) {
    Denoiser::Estimate e = den.estimate(xx, tvec(t), c, opt.cfg, keys());
    if (den.self_conditioned()) c.self_cond = e.x0;
    return e;
  };

  const std::vector<double> grid = time_grid(path, opt.steps);
  for (int64_t i = 0; i < opt.steps; ++i) {
    const double t = grid[i], t_next = grid[i + 1];
    const double h = t_next - t;  // negative
    if (kind == "euler" || kind == "heun") {
      auto v = den.velocity(estimate(x, t), tvec(t));  // [N,C,H,W]
      if (kind == "heun" && t_next > 0) {
        auto x_pred = x + h * v;
        auto v2 = den.velocity(estimate(x_pred, t_next), tvec(t_next));
        x = x + (0.5 * h) * (v + v2);
      } else {
        x = x + h * v;
      }
    } else {
      auto e = estimate(x, t);
      const double a_next = path.alpha(t_next), s_next = path.sigma(t_next);
      if (kind == "ddim" || t_next <= 0) {
        x = a_next * e.x0 + s_next * e.eps;
      } else {
        // Ancestral step: the Gaussian posterior q(x_{t'} | x_t, x0) with x0 = x0_hat.
        const double a = path.alpha(t), s = path.sigma(t);
        const double r = (a * s_next) / (a_next * s);
        const double var = s_next * s_next * std::max(0.0, 1.0 - r * r);
        const double noise_scale = std::sqrt(var);
        const double eps_scale = std::sqrt(std::max(0.0, s_next * s_next - var));
        auto z = per_sample_noise(x, opt.seed, opt.first_index, i);  // [N,C,H,W]
        x = a_next * e.x0 + eps_scale * e.eps + noise_scale * z;
      }
    }
  }
  return {x, den.nfe() - nfe0};
}

}  // namespace ddm
