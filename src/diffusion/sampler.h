// Samplers over a Denoiser, integrating from t = 1 (noise) to t = 0 (data) on a time grid that is
// uniform in t for the flow path and, for VP paths, follows the EDM schedule (rho = 7) in the
// noise-to-signal ratio sigma/alpha down to 0.002 (a discrete path: down to its timestep 0's, then
// the data), which puts steps where the VP paths change fastest:
//   euler  first-order probability-flow ODE          NFE = steps
//   heun   second-order ODE (Euler on the last step)  NFE = 2 * steps - 1
//   ddim   deterministic DDIM (eta = 0)               NFE = steps
//   ddpm   ancestral DDPM (DDIM with eta = 1)         NFE = steps
// All work with every prediction type and path, because they only use x0_hat / eps_hat / velocity.
//
// Randomness is keyed per sample, never per batch: row j of x1 is sample number first_index + j, and
// every draw for it (ddpm's ancestral noise at step i; the key handed to the denoiser at each network
// evaluation, from which a routed ensemble draws that sample's expert) comes from (seed, first_index
// + j, step or evaluation). So a sample does not depend on the batch it is generated in or on the
// other samples in it, beyond the float32 rounding of the network (docs/determinism.md).
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
  uint64_t seed = 0;         // for the random draws (ddpm's ancestral noise, a routed ensemble's experts)
  int64_t first_index = 0;   // the sample number of x1's first row: row j is sample first_index + j
};

struct SampleResult {
  torch::Tensor x;  // [N, C, H, W] data-space samples (roughly [-1, 1])
  int64_t nfe = 0;  // network evaluations per sample
};

// Integrates from x1 [N,C,H,W] (pure noise at t = 1) with conditioning y (labels [N], and a control map
// [N, Cc, H, W] for a ControlNet; a self-conditioned network gets each evaluation's x0 estimate at the
// next one). Runs under NoGradGuard.
SampleResult sample(const Denoiser& den, const torch::Tensor& x1, const Cond& y, const SampleOptions& opt);

// The steps + 1 times from 1 down to 0 that the samplers visit.
std::vector<double> time_grid(const NoisePath& path, int64_t steps);

// The key of sample `index` at the sampler's network evaluation number `eval` (0, 1, ...) under
// `seed`: what sample() passes to Denoiser::estimate for that sample.
uint64_t sample_key(uint64_t seed, int64_t index, int64_t eval);

// Number of network evaluations a sampler uses for `steps` steps.
int64_t sampler_nfe(const std::string& sampler, int64_t steps);

}  // namespace ddm
