// Euler, Heun, DDIM and ancestral DDPM samplers over the Denoiser interface.
#include "diffusion/sampler.h"

#include <cmath>

#include "core/error.h"
#include "core/rng.h"

namespace ddm {

int64_t sampler_nfe(const std::string& sampler, int64_t steps) {
  return sampler == "heun" ? 2 * steps - 1 : steps;
}

SampleResult sample(const Denoiser& den, const torch::Tensor& x1, const torch::Tensor& y, const SampleOptions& opt) {
  DDM_CHECK(opt.steps > 0, "sampling steps must be > 0, got " << opt.steps);
  DDM_CHECK(opt.cfg >= 0, "cfg must be >= 0, got " << opt.cfg);
  const std::string& kind = opt.sampler;
  DDM_CHECK(kind == "euler" || kind == "heun" || kind == "ddim" || kind == "ddpm",
            "sampler \"" << kind << "\" is not one of: euler, heun, ddim, ddpm");
  torch::NoGradGuard no_grad;
  const NoisePath& path = den.path();
  const int64_t n = x1.size(0);
  const int64_t nfe0 = den.nfe();
  auto x = x1.clone();  // [N,C,H,W]
  auto tvec = [&](double t) { return torch::full({n}, t, x.options()); };

  for (int64_t i = 0; i < opt.steps; ++i) {
    const double t = 1.0 - static_cast<double>(i) / opt.steps;
    const double t_next = 1.0 - static_cast<double>(i + 1) / opt.steps;
    const double h = t_next - t;  // negative
    if (kind == "euler" || kind == "heun") {
      auto v = den.velocity(x, tvec(t), y, opt.cfg);  // [N,C,H,W]
      if (kind == "heun" && t_next > 0) {
        auto x_pred = x + h * v;
        auto v2 = den.velocity(x_pred, tvec(t_next), y, opt.cfg);
        x = x + (0.5 * h) * (v + v2);
      } else {
        x = x + h * v;
      }
    } else {
      auto e = den.estimate(x, tvec(t), y, opt.cfg);
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
        auto gen = make_generator(derive_seed({opt.seed, static_cast<uint64_t>(RngPurpose::kSample),
                                               static_cast<uint64_t>(i)}));
        auto z = torch::randn(x.sizes(), gen, x.options());
        x = a_next * e.x0 + eps_scale * e.eps + noise_scale * z;
      }
    }
  }
  return {x, den.nfe() - nfe0};
}

}  // namespace ddm
