// Stable Diffusion's UNet as a ddm network (src/sd/unet_net.*) and the discrete noise path it trains
// on (diffusion/path.h), against diffusers itself: diffusers saves a small SD 2.1-kind pipeline and
// computes one training step of its train_text_to_image.py (add_noise, get_velocity, the UNet, the
// MSE and its gradients; tests/reference/diffusers_pipeline.py). ddm, from the same folders and the
// same latents, noise, timesteps and context, must compute the same noisy latents, target, output,
// loss and gradients. Also the path's own properties, its training times and the samplers' grid on it,
// and the UNet's FLOP count against torch's flop counter running diffusers' UNet.
#include <gtest/gtest.h>

#include <cmath>
#include <set>

#include <torch/torch.h>

#include "core/config.h"
#include "core/device.h"
#include "core/error.h"
#include "core/safetensors.h"
#include "diffusion/denoiser.h"
#include "diffusion/path.h"
#include "diffusion/sampler.h"
#include "model/graphed_net.h"
#include "sd/scheduler.h"
#include "sd/unet_net.h"
#include "test_util.h"

using namespace ddm;

namespace {

double relative(const torch::Tensor& got, const torch::Tensor& want) {
  return (got - want).abs().max().item<double>() / want.abs().max().item<double>();
}

const test::ReferenceOutputs& pipeline() {
  static const test::ReferenceOutputs made =
      test::reference_outputs("tests/reference/diffusers_pipeline.py", "{dir}");
  return made;
}

}  // namespace

TEST(SdUNetNet, OneTrainingStepIsDiffusersTrainingStep) {
  ASSERT_EQ(pipeline().run.exit_code, 0) << pipeline().run.output;
  const std::string sd = pipeline().dir + "/sd";
  const auto ref = load_safetensors(pipeline().dir + "/step.safetensors").tensors;
  const sd::SchedulerConfig sc = sd::load_scheduler_config(sd + "/scheduler");
  ASSERT_EQ(sc.prediction_type, "v_prediction");
  const NoisePath path = NoisePath::discrete(sd::alphas_cumprod(sc));
  ASSERT_EQ(path.timesteps(), 1000);
  // diffusers' timestep k is ddm's t = (k + 1) / T.
  const torch::Tensor t = (ref.at("timesteps").to(torch::kFloat) + 1) / 1000.0;  // [2]
  const torch::Tensor x0 = ref.at("latents"), eps = ref.at("noise");
  const torch::Tensor xt = path.alpha(t).view({-1, 1, 1, 1}) * x0 + path.sigma(t).view({-1, 1, 1, 1}) * eps;
  EXPECT_LT(relative(xt, ref.at("noisy")), 1e-6);
  const torch::Tensor target = training_target(path, Prediction::kV, x0, eps, t);
  EXPECT_LT(relative(target, ref.at("target")), 1e-6);

  auto net = std::make_shared<sd::SdUNetNetImpl>(sd::load_unet_2d_condition(sd::unet_folder(sd)), 1000);
  EXPECT_TRUE(torch::equal(net->timestep(t), ref.at("timesteps").to(torch::kFloat)));
  Cond c;
  c.context = ref.at("context");
  const torch::Tensor pred = net->forward(ref.at("noisy"), t, c);
  EXPECT_LT(relative(pred, ref.at("pred")), 1e-5);
  const torch::Tensor loss = torch::mse_loss(pred, target);
  EXPECT_NEAR(loss.item<double>(), ref.at("loss").item<double>(), 1e-5 * ref.at("loss").item<double>());
  loss.backward();
  int checked = 0;
  for (const auto& p : net->named_parameters()) {
    const auto it = ref.find("grad." + p.key().substr(5));  // "unet." + diffusers' name
    if (it == ref.end()) continue;
    SCOPED_TRACE(p.key());
    EXPECT_LT(relative(p.value().grad(), it->second), 1e-4);
    ++checked;
  }
  EXPECT_EQ(checked, 5);
  // Its units (pipeline stages, `ddm plan`) compute forward bit for bit, and hold every parameter once.
  {
    torch::NoGradGuard no_grad;
    NetCarry k{ref.at("noisy"), {}, {}};
    std::set<const void*> seen;
    int64_t held = 0, listed = 0;
    for (const NetUnit& u : net->units()) {
      u.run(k, t, c);
      for (const torch::Tensor& p : u.params) held += seen.insert(p.data_ptr()).second ? 1 : 0;
      listed += static_cast<int64_t>(u.params.size());
    }
    EXPECT_EQ(listed, held);
    EXPECT_TRUE(torch::equal(k.h, net->forward(ref.at("noisy"), t, c)));
    EXPECT_TRUE(k.skips.empty());
    EXPECT_EQ(held, static_cast<int64_t>(net->parameters().size()));
  }
  // `ddm sample --cuda-graphs` of this UNet in bf16 captures it with its linear and convolution weights
  // swapped for casts held beside the graphs (model/graphed_net.h): the bits of autocast's own casts.
  {
    torch::NoGradGuard no_grad;
    const Autocast autocast(torch::kCPU, Precision::kBf16);
    const AutocastCacheOff no_cache;
    const torch::Tensor plain = net->forward(ref.at("noisy"), t, c);
    HeldWeightCasts held(*net, torch::kBFloat16);
    EXPECT_GT(held.size(), 0);
    const HeldWeightCasts::Swap swap(held);
    EXPECT_TRUE(torch::equal(net->forward(ref.at("noisy"), t, c), plain));
  }
  // The same UNet's FLOPs, as torch's flop counter counts diffusers' forward of one sample.
  const sd::UNet2DConditionConfig& uc = net->unet()->config();
  EXPECT_DOUBLE_EQ(sd::unet_2d_condition_flops(uc, 8, 8, 77), ref.at("flops").item<double>());
}

TEST(SdUNetNet, TheDiscretePathHoldsDiffusersScheduleAtItsTimesAndIsContinuousBetween) {
  DiffusionConfig d;
  d.objective = "v";
  d.schedule = "discrete";  // SD's: scaled_linear 0.00085..0.012 over 1000
  const NoisePath path = make_path(d);
  const torch::Tensor acp = discrete_alphas_cumprod("scaled_linear", 0.00085, 0.012, 1000).to(torch::kDouble);
  const torch::Tensor t = (torch::arange(1000, torch::kDouble) + 1) / 1000.0;
  EXPECT_LT((path.alpha(t).pow(2) - acp).abs().max().item<double>(), 1e-12);
  EXPECT_LT((path.alpha(t).pow(2) + path.sigma(t).pow(2) - 1).abs().max().item<double>(), 1e-12);
  EXPECT_EQ(path.alpha(0.0), 1.0);
  EXPECT_EQ(path.sigma(0.0), 0.0);
  // Scalar and tensor versions agree; derivatives are the slopes inside each step (between its knots).
  for (double x : {0.0003, 0.0157, 0.5004, 0.73421, 0.9995}) {
    const torch::Tensor tx = torch::tensor({x}, torch::kDouble);
    EXPECT_NEAR(path.alpha(tx).item<double>(), path.alpha(x), 1e-15);
    EXPECT_NEAR(path.dsigma(tx).item<double>(), path.dsigma(x), 1e-12);
    const double h = 1e-7;
    EXPECT_NEAR((path.alpha(x + h) - path.alpha(x - h)) / (2 * h), path.dalpha(x), 1e-5 * (1 + std::abs(path.dalpha(x))));
    EXPECT_NEAR((path.sigma(x + h) - path.sigma(x - h)) / (2 * h), path.dsigma(x), 1e-5 * (1 + std::abs(path.dsigma(x))));
  }
  // Training times are the T points (k + 1) / T, each k alike.
  EXPECT_EQ(discrete_time(0.0, 1000), 0.001);
  EXPECT_EQ(discrete_time(0.9999999, 1000), 1.0);
  EXPECT_EQ(discrete_time(0.5004, 1000), 0.501);
  auto gen = at::detail::createCPUGenerator(3);
  const torch::Tensor drawn = sample_time(d, 20000, gen) * 1000;
  EXPECT_LT((drawn - drawn.round()).abs().max().item<double>(), 1e-3);
  EXPECT_GE(drawn.min().item<double>(), 1 - 1e-3);
  EXPECT_LE(drawn.max().item<double>(), 1000 + 1e-3);
  // The samplers' grid: from pure noise down to timestep 0's time, then the data.
  const auto grid = time_grid(path, 10);
  EXPECT_EQ(grid.front(), 1.0);
  EXPECT_NEAR(grid[9], 0.001, 1e-9);
  EXPECT_EQ(grid[10], 0.0);
  for (size_t i = 1; i < grid.size(); ++i) EXPECT_LT(grid[i], grid[i - 1]);
}

TEST(SdUNetNet, TheDiscreteScheduleIsRefusedWithFlowAndOutOfRange) {
  auto bad = [](const std::string& set) {
    try {
      parse_config("", "test", {set});
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  EXPECT_NE(bad("diffusion.schedule=\"discrete\"").find("for diffusion.objective = eps or v"), std::string::npos);
  EXPECT_NE(bad("diffusion.beta_schedule=\"cosine\"").find("diffusion.beta_schedule"), std::string::npos);
  EXPECT_NE(bad("diffusion.beta_start=0.5").find("below diffusion.beta_end"), std::string::npos);
  EXPECT_NE(bad("diffusion.timesteps=1").find("diffusion.timesteps must be in [2, 100000]"), std::string::npos);
  EXPECT_NE(bad("model.arch=\"sd-unet\"").find("set model.unet"), std::string::npos);
  EXPECT_NE(bad("model.unet=\"x\"").find("model.arch = sd-unet"), std::string::npos);
}
