// Samplers over a Denoiser, integrating from t = 1 (noise) to t = 0 (data) on a time grid that is
// uniform in t for the flow path and, for VP paths, follows the EDM schedule (rho = 7) in the
// noise-to-signal ratio sigma/alpha down to 0.002, which puts steps where the VP paths change fastest:
//   euler  first-order probability-flow ODE          NFE = steps
//   heun   second-order ODE (Euler on the last step)  NFE = 2 * steps - 1
//   ddim   deterministic DDIM (eta = 0)               NFE = steps
//   ddpm   ancestral DDPM (DDIM with eta = 1)         NFE = steps
// All work with every prediction type and path, because they only use x0_hat / eps_hat / velocity.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <torch/types.h>

#include "diffusion/denoiser.h"

namespace ddm {

struct SampleOptions {
  std::string sampler = "euler";
  int64_t steps = 20;
  double cfg = 1.0;    // guidance scale
  uint64_t seed = 0;   // for ancestral noise
};

struct SampleResult {
  torch::Tensor x;  // [N, C, H, W] data-space samples (roughly [-1, 1])
  int64_t nfe = 0;  // network evaluations per sample
};

// Integrates from x1 [N,C,H,W] (pure noise at t = 1) with labels y [N]. Runs under NoGradGuard.
SampleResult sample(const Denoiser& den, const torch::Tensor& x1, const torch::Tensor& y, const SampleOptions& opt);

// The steps + 1 times from 1 down to 0 that the samplers visit.
std::vector<double> time_grid(const NoisePath& path, int64_t steps);

// Number of network evaluations a sampler uses for `steps` steps.
int64_t sampler_nfe(const std::string& sampler, int64_t steps);

}  // namespace ddm
