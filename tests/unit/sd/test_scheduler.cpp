// A diffusers scheduler folder's noise schedule (src/sd/scheduler.*) against diffusers itself: the
// schedulers Stable Diffusion's pipelines ship, written by save_config with every key their class
// writes, and their own alphas_cumprod (tests/reference/diffusers_schedulers.py). And the keys that
// would change the schedule, refused by name.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/safetensors.h"
#include "sd/scheduler.h"
#include "test_util.h"

TEST(SdScheduler, TheTrainingScheduleIsDiffusersOwn) {
  const auto made = ddm::test::reference_outputs("tests/reference/diffusers_schedulers.py", "{dir}");
  ASSERT_EQ(made.run.exit_code, 0) << made.run.output;
  struct Case {
    const char *name, *schedule, *prediction;
  };
  for (const Case c : {Case{"sd15", "scaled_linear", "epsilon"}, Case{"sd21", "scaled_linear", "v_prediction"},
                       Case{"ddpm", "linear", "epsilon"}, Case{"cosine", "squaredcos_cap_v2", "epsilon"},
                       Case{"euler", "scaled_linear", "epsilon"}}) {
    SCOPED_TRACE(c.name);
    const std::string dir = made.dir + "/" + c.name;
    const auto s = ddm::sd::load_scheduler_config(dir);
    EXPECT_EQ(s.beta_schedule, c.schedule);
    EXPECT_EQ(s.prediction_type, c.prediction);
    EXPECT_FALSE(s.sampler_keys.empty());  // diffusers' sampler's keys: read, listed, not used
    const torch::Tensor want = ddm::load_safetensors(dir + "/alphas_cumprod.safetensors").tensors.at("alphas_cumprod");
    const torch::Tensor got = ddm::sd::alphas_cumprod(s);
    ASSERT_EQ(got.sizes(), want.sizes());
    // The same float32 operations as diffusers' (linspace, square, cumprod; the cosine schedule's
    // betas in double on both sides, then float32): within 1e-7 of the largest value.
    EXPECT_LE((got - want).abs().max().item<double>(), 1e-7 * want.abs().max().item<double>());
  }
}

TEST(SdScheduler, KeysThatChangeTheScheduleAreRefusedByName) {
  const nlohmann::json good = {{"_class_name", "DDPMScheduler"}, {"beta_schedule", "scaled_linear"},
                               {"beta_start", 0.00085}, {"beta_end", 0.012}};
  ddm::sd::parse_scheduler_config(good, "scheduler_config.json");
  auto refused = [&](const std::string& key, const nlohmann::json& value, const std::string& needle) {
    auto j = good;
    j[key] = value;
    try {
      ddm::sd::parse_scheduler_config(j, "scheduler/scheduler_config.json");
      ADD_FAILURE() << key << " = " << value.dump() << " accepted";
    } catch (const ddm::Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  refused("trained_betas", {0.1, 0.2}, "scheduler/scheduler_config.json: trained_betas is set");
  refused("rescale_betas_zero_snr", true, "rescale_betas_zero_snr = true");
  refused("beta_schedule", "sigmoid", "beta_schedule \"sigmoid\"");
  refused("prediction_type", "flow", "prediction_type \"flow\"");
  refused("shift_terminal", 0.5, "\"shift_terminal\" is not a key of a diffusers scheduler that ddm reads");
  refused("_class_name", "UNet2DConditionModel", "is not one of diffusers' schedulers of a beta schedule");
  // A class diffusers does not have (an export would write a pipeline from_pretrained cannot open),
  // and one of another kind of schedule.
  refused("_class_name", "FooScheduler", "\"FooScheduler\" is not one of diffusers' schedulers");
  refused("_class_name", "FlowMatchEulerDiscreteScheduler", "is not one of diffusers' schedulers");
  refused("beta_end", 0.0001, "beta_start 0.00085 is not below beta_end 0.0001");
}

// Every scheduler class ddm accepts (and an export writes back) is a class of the pinned diffusers
// whose config takes a beta schedule: diffusers itself says so.
TEST(SdScheduler, EveryAcceptedClassIsADiffusersSchedulerOfBetas) {
  std::string names;
  for (const std::string& n : ddm::sd::beta_scheduler_classes()) names += " " + n;
  const auto made = ddm::test::reference_outputs("tests/reference/diffusers_scheduler_classes.py", "{dir}" + names);
  ASSERT_EQ(made.run.exit_code, 0) << made.run.output;
  const auto got = nlohmann::json::parse(ddm::test::read_text(made.dir + "/classes.json"));
  ASSERT_EQ(got.size(), ddm::sd::beta_scheduler_classes().size()) << got.dump();
  for (const auto& [name, verdict] : got.items()) EXPECT_EQ(verdict, true) << name << ": " << verdict.dump();
}
