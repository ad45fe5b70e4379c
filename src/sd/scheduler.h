// The noise schedule of a diffusers scheduler folder (scheduler/scheduler_config.json): the
// discrete training schedule Stable Diffusion's UNet was trained with (num_train_timesteps betas,
// "linear", "scaled_linear" or "squaredcos_cap_v2") and what the UNet predicts ("epsilon",
// "v_prediction" or "sample"). Every diffusers scheduler class that SD pipelines ship (DDPM, DDIM,
// PNDM, LMS, Euler, Euler ancestral, DPM-Solver++, UniPC, ...) shares these keys; their other keys
// describe diffusers' own sampler (its steps, offsets, clipping, solver order), which ddm's samplers
// replace: those are read and listed, not used. A key that changes the schedule ddm does not build
// (trained_betas, rescale_betas_zero_snr, other beta schedules) is refused by name.
#pragma once
#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>
#include <torch/types.h>

namespace ddm::sd {

struct SchedulerConfig {
  std::string class_name;  // e.g. "PNDMScheduler"
  int64_t num_train_timesteps = 1000;
  double beta_start = 0.0001, beta_end = 0.02;
  std::string beta_schedule = "linear";     // linear | scaled_linear | squaredcos_cap_v2
  std::string prediction_type = "epsilon";  // epsilon | v_prediction | sample
  std::vector<std::string> sampler_keys;    // the keys read and not used (diffusers' sampler's)
};

// diffusers' schedulers of a beta schedule (its KarrasDiffusionSchedulers but DPMSolverSDEScheduler,
// which needs torchsde beside diffusers; DDPM's and DDIM's parallel forms, LCM and TCD): the classes
// whose schedule ddm reads, and which an export writes back. Each is checked to be a class of the
// pinned diffusers (tests/unit/sd/test_scheduler.cpp).
const std::set<std::string>& beta_scheduler_classes();

// Reads a scheduler_config.json object (`file` names it in errors).
SchedulerConfig parse_scheduler_config(const nlohmann::json& config, const std::string& file);
// DIR/scheduler_config.json.
SchedulerConfig load_scheduler_config(const std::string& dir);

// The training schedule's cumulative products of (1 - beta), float32 [num_train_timesteps], computed
// as diffusers computes them (betas in float32, their cumulative product in float32): equal to its
// scheduler's alphas_cumprod.
torch::Tensor alphas_cumprod(const SchedulerConfig& c);

}  // namespace ddm::sd
