// A diffusers scheduler's noise schedule (see scheduler.h).
#include "sd/scheduler.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <set>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "core/error.h"
#include "core/json.h"
#include "diffusion/path.h"
#include "sd/diffusers_weights.h"

namespace fs = std::filesystem;

namespace ddm::sd {

const std::set<std::string>& beta_scheduler_classes() {
  static const std::set<std::string> classes = {
      "DDIMScheduler", "DDPMScheduler", "PNDMScheduler", "LMSDiscreteScheduler", "EulerDiscreteScheduler",
      "HeunDiscreteScheduler", "EulerAncestralDiscreteScheduler", "DPMSolverMultistepScheduler",
      "DPMSolverSinglestepScheduler", "KDPM2DiscreteScheduler", "KDPM2AncestralDiscreteScheduler",
      "DEISMultistepScheduler", "UniPCMultistepScheduler", "DDPMParallelScheduler",
      "DDIMParallelScheduler", "LCMScheduler", "TCDScheduler"};
  return classes;
}

SchedulerConfig parse_scheduler_config(const nlohmann::json& j, const std::string& file) {
  DDM_CHECK(j.is_object(), file << ": not a JSON object");
  // Keys of diffusers' samplers, which ddm's own replace.
  static const std::set<std::string> sampler = {
      "clip_sample", "clip_sample_range", "set_alpha_to_one", "skip_prk_steps", "steps_offset", "timestep_spacing",
      "thresholding", "dynamic_thresholding_ratio", "sample_max_value", "variance_type", "interpolation_type",
      "use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas", "sigma_min", "sigma_max", "final_sigmas_type",
      "timestep_type", "algorithm_type", "solver_order", "solver_type", "lower_order_final", "euler_at_final",
      "lambda_min_clipped", "variance_tiny", "use_lu_lambdas", "disable_corrector", "solver_p", "predict_x0",
      "use_flow_sigmas", "flow_shift", "eta", "s_noise", "sigma_data"};
  static const std::set<std::string> meta = {"_class_name", "_diffusers_version", "_name_or_path", "_use_default_values"};
  SchedulerConfig c;
  const ConfigReader r{j, file};
  r.string("_class_name", c.class_name);
  DDM_CHECK(beta_scheduler_classes().count(c.class_name), file << ": _class_name \"" << c.class_name
                                              << "\" is not one of diffusers' schedulers of a beta schedule that ddm "
                                                 "reads (DDIMScheduler, DDPMScheduler, EulerDiscreteScheduler, "
                                                 "DPMSolverMultistepScheduler, PNDMScheduler, ...)");
  for (const auto& [key, value] : j.items()) {
    if (meta.count(key) || sampler.count(key)) {
      if (sampler.count(key)) c.sampler_keys.push_back(key);
      continue;
    }
    if (key == "trained_betas") {
      DDM_CHECK(value.is_null(), file << ": trained_betas is set: a schedule given beta by beta is not supported yet");
    } else if (key == "rescale_betas_zero_snr") {
      DDM_CHECK(value == false, file << ": rescale_betas_zero_snr = " << value.dump() << ": the zero-terminal-SNR "
                                     << "rescaling is not supported yet");
    } else if (key == "num_train_timesteps") {
      c.num_train_timesteps = json_int(value, file + ": num_train_timesteps", 2, 1 << 20);
    } else if (key == "beta_start" || key == "beta_end") {
      DDM_CHECK(value.is_number() && value.get<double>() > 0 && value.get<double>() < 1,
                file << ": " << key << " must be a number in (0, 1), got " << value.dump());
      (key == "beta_start" ? c.beta_start : c.beta_end) = value.get<double>();
    } else if (key == "beta_schedule" || key == "prediction_type") {
      DDM_CHECK(value.is_string(), file << ": " << key << " must be a string, got " << value.dump());
      (key == "beta_schedule" ? c.beta_schedule : c.prediction_type) = value.get<std::string>();
    } else {
      DDM_FAIL(file << ": \"" << key << "\" is not a key of a diffusers scheduler that ddm reads; ddm does not "
                    << "ignore what it does not know");
    }
  }
  DDM_CHECK(c.beta_schedule == "linear" || c.beta_schedule == "scaled_linear" || c.beta_schedule == "squaredcos_cap_v2",
            file << ": beta_schedule \"" << c.beta_schedule << "\": ddm builds linear, scaled_linear and "
                 << "squaredcos_cap_v2");
  DDM_CHECK(c.prediction_type == "epsilon" || c.prediction_type == "v_prediction" || c.prediction_type == "sample",
            file << ": prediction_type \"" << c.prediction_type << "\": ddm reads epsilon, v_prediction and sample");
  DDM_CHECK(c.beta_schedule == "squaredcos_cap_v2" || c.beta_start < c.beta_end,
            file << ": beta_start " << c.beta_start << " is not below beta_end " << c.beta_end);
  return c;
}

SchedulerConfig load_scheduler_config(const std::string& dir) {
  const std::string file = (fs::path(dir) / "scheduler_config.json").string();
  DDM_CHECK(fs::is_regular_file(file), dir << ": no scheduler_config.json (a diffusers scheduler folder)");
  return parse_scheduler_config(read_json_file(file), file);
}

torch::Tensor alphas_cumprod(const SchedulerConfig& c) {
  return discrete_alphas_cumprod(c.beta_schedule, c.beta_start, c.beta_end, c.num_train_timesteps);
}

}  // namespace ddm::sd
