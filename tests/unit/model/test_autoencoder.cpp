// Tests for src/model/autoencoder: shapes at Fashion-MNIST's scale, the posterior's sample and KL
// against hand computations, float64 finite-difference gradients of the whole encoder and decoder,
// shape errors that name the field, FLOP counts against a hand count; its training objective (keyed
// posterior noise that does not depend on the batch split, the loss against its formula), the latent
// statistics latent diffusion normalizes by, and PSNR against hand values.
#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "core/config.h"
#include "core/error.h"
#include "diffusion/objective.h"
#include "grad_check.h"
#include "model/autoencoder.h"
#include "model/net.h"
#include "train/autoencoder_report.h"
#include "test_util.h"
#include "train/latent.h"

namespace ddm {
namespace {

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected ddm::Error";
  return "";
}

TEST(Autoencoder, MapsImagesToLatentsOfAQuarterTheSizeAndBack) {
  torch::manual_seed(0);
  AutoencoderShape s;  // 28x28x1 -> 7x7x4
  Autoencoder ae(s);
  EXPECT_EQ(s.factor(), 4);
  EXPECT_EQ(s.latent_size(), 7);
  auto x = torch::rand({3, 1, 28, 28}) * 2 - 1;
  Posterior q = ae->encode(x);
  EXPECT_EQ(q.mean.sizes(), (std::vector<int64_t>{3, 4, 7, 7}));
  EXPECT_EQ(q.logvar.sizes(), (std::vector<int64_t>{3, 4, 7, 7}));
  auto y = ae->decode(q.sample(torch::randn_like(q.mean)));
  EXPECT_EQ(y.sizes(), x.sizes());
  EXPECT_TRUE(torch::isfinite(y).all().item<bool>());
  // Three levels: 28 -> 14 -> 7, and other sizes the factor divides.
  s.image_size = 32;
  Autoencoder ae32(s);
  EXPECT_EQ(ae32->encode(torch::zeros({1, 1, 32, 32})).mean.size(2), 8);
}

TEST(Autoencoder, PosteriorSampleAndKlMatchHandComputation) {
  Posterior q{torch::tensor({0.5f, -1.0f}).reshape({1, 2, 1, 1}), torch::tensor({0.0f, std::log(4.0f)}).reshape({1, 2, 1, 1})};
  auto eps = torch::tensor({1.0f, -0.5f}).reshape({1, 2, 1, 1});
  auto z = q.sample(eps).flatten();
  EXPECT_FLOAT_EQ(z[0].item<float>(), 0.5f + 1.0f * 1.0f);
  EXPECT_FLOAT_EQ(z[1].item<float>(), -1.0f + 2.0f * -0.5f);
  // KL = 1/2 sum(mu^2 + var - 1 - log var) = 1/2 [(0.25 + 1 - 1 - 0) + (1 + 4 - 1 - log 4)]
  EXPECT_NEAR(q.kl().item<double>(), 0.5 * (0.25 + 4.0 - std::log(4.0)), 1e-6);
  Posterior standard{torch::zeros({2, 3, 2, 2}), torch::zeros({2, 3, 2, 2})};
  EXPECT_EQ(standard.kl().sizes(), (std::vector<int64_t>{2}));
  EXPECT_EQ(standard.kl().abs().max().item<float>(), 0.0f);
  EXPECT_NE(error_of([&] { standard.sample(torch::zeros({2, 3, 2})); }).find("noise"), std::string::npos);
}

TEST(Autoencoder, GradientsOfEncoderKlAndDecoderMatchFiniteDifferences) {
  torch::manual_seed(5);
  AutoencoderShape s;
  s.image_size = 4;
  s.channels = 2;
  s.channel_mult = {1, 2};
  s.latent_channels = 1;
  s.groups = 1;
  Autoencoder ae(s);
  ae->to(torch::kFloat64);
  {
    torch::NoGradGuard ng;
    for (auto& p : ae->parameters()) p.normal_(0.0, 0.4);  // undo the attention's zero projection
  }
  auto x = torch::randn({2, 1, 4, 4}, torch::kFloat64).requires_grad_();
  auto eps = torch::randn({2, 1, 2, 2}, torch::kFloat64);
  auto w = torch::randn({2, 1, 4, 4}, torch::kFloat64);
  std::vector<torch::Tensor> leaves = {x};
  for (auto& p : ae->parameters()) leaves.push_back(p);
  expect_gradients_match(
      [&] {
        Posterior q = ae->encode(x);
        return (ae->decode(q.sample(eps)) * w).sum() + 0.1 * q.kl().sum();
      },
      leaves, "Autoencoder");
}

TEST(Autoencoder, InvalidShapesNameTheField) {
  AutoencoderShape s;
  s.image_size = 30;  // not divisible by 4
  auto msg = error_of([&] { Autoencoder a(s); });
  EXPECT_NE(msg.find("not divisible by the downsampling factor 4"), std::string::npos) << msg;
  s = AutoencoderShape{};
  s.groups = 3;
  msg = error_of([&] { Autoencoder a(s); });
  EXPECT_NE(msg.find("model.groups = 3"), std::string::npos) << msg;
  s = AutoencoderShape{};
  s.latent_channels = 0;
  EXPECT_NE(error_of([&] { Autoencoder a(s); }).find("model.latent_channels"), std::string::npos);
  s = AutoencoderShape{};
  s.channel_mult = {};
  EXPECT_NE(error_of([&] { Autoencoder a(s); }).find("model.channel_mult"), std::string::npos);
  Autoencoder ok(AutoencoderShape{});
  msg = error_of([&] { ok->encode(torch::zeros({1, 3, 28, 28})); });
  EXPECT_NE(msg.find("expected images [B, 1, 28, 28]"), std::string::npos) << msg;
  msg = error_of([&] { ok->decode(torch::zeros({1, 4, 14, 14})); });
  EXPECT_NE(msg.find("expected latents [B, 4, 7, 7]"), std::string::npos) << msg;
}

// model.latent naming a diffusers folder of another class (AutoencoderTiny) is refused by that class,
// not taken for a ddm run missing its files.
TEST(Autoencoder, ALatentOfAnotherDiffusersClassIsRefusedByItsName) {
  ddm::test::TempDir dir;
  ddm::test::write_text(dir / "config.json", R"({"_class_name": "AutoencoderTiny", "latent_channels": 4})");
  ModelConfig m;
  m.latent = dir.path;
  const std::string e = error_of([&] { latent_downsampling(m); });
  EXPECT_NE(e.find("_class_name \"AutoencoderTiny\": model.latent takes diffusers' AutoencoderKL"), std::string::npos) << e;
}

TEST(Autoencoder, FlopsMatchAHandCount) {
  AutoencoderShape s;
  s.image_size = 4;
  s.channels = 2;
  s.channel_mult = {1};
  s.latent_channels = 1;
  s.groups = 1;
  s.mid_attention = false;
  // Encoder at 4x4: conv_in 1->2 (576), a ResnetBlock 2->2 (2 x 1152), the middle's two (4608),
  // conv_out 2->2 (1152), the 1x1 quant conv 2->2 (128). One MAC = 2 FLOPs.
  EXPECT_DOUBLE_EQ(encoder_flops_per_image(s), 576 + 2304 + 4608 + 1152 + 128);
  // Decoder: post_quant 1x1 1->1 (32), conv_in 1->2 (576), middle (4608), two ResnetBlocks (4608),
  // conv_out 2->1 (576).
  EXPECT_DOUBLE_EQ(decoder_flops_per_image(s), 32 + 576 + 4608 + 4608 + 576);
  s.mid_attention = true;  // + qkv and proj (4 x 128) and the attention matmuls (2 x 2 x 16 x 16 x 2) per middle
  EXPECT_DOUBLE_EQ(encoder_flops_per_image(s), 576 + 2304 + 4608 + 1152 + 128 + 512 + 2048);
}

// A small autoencoder config as `ddm train-autoencoder` resolves it: 1x8x8 -> 2x2x2.
RunConfig small_ae_config() {
  RunConfig cfg;
  cfg.model.arch = "autoencoder";
  cfg.model.in_channels = 1;
  cfg.model.image_size = 8;
  cfg.model.num_classes = 3;
  cfg.model.channels = 4;
  cfg.model.channel_mult = {1, 2, 2};
  cfg.model.latent_channels = 2;
  cfg.model.groups = 2;
  cfg.train.kl_weight = 0.01;
  cfg.train.seed = 5;
  return cfg;
}

TEST(Autoencoder, IsANetThatReconstructsThroughThePosteriorMean) {
  torch::manual_seed(0);
  const RunConfig cfg = small_ae_config();
  Net net = make_net(cfg.model);
  auto* ae = dynamic_cast<AutoencoderImpl*>(net.get());
  ASSERT_NE(ae, nullptr);
  EXPECT_EQ(ae->shape().latent_size(), 2);
  const auto x = torch::rand({3, 1, 8, 8}) * 2 - 1;
  torch::NoGradGuard no_grad;
  EXPECT_TRUE(torch::equal(net->forward(x, {}, {}), ae->decode(ae->encode(x).mean)));
  EXPECT_DOUBLE_EQ(forward_flops_per_image(cfg.model),
                   encoder_flops_per_image(ae->shape()) + decoder_flops_per_image(ae->shape()));
}

TEST(AutoencoderObjective, PosteriorNoiseIsKeyedBySampleAndTheLossIsItsFormula) {
  torch::manual_seed(1);
  const RunConfig cfg = small_ae_config();
  auto obj = make_objective(cfg);
  ASSERT_NE(dynamic_cast<AutoencoderObjective*>(obj.get()), nullptr);
  Batch whole;
  whole.x = torch::rand({6, 1, 8, 8}) * 2 - 1;
  whole.y = torch::zeros({6}, torch::kLong);
  Batch a = whole, b = whole;
  a.x = whole.x.slice(0, 0, 4);
  b.x = whole.x.slice(0, 4, 6);
  b.first = 4;
  const Prepared all = obj->prepare(whole, 9), pa = obj->prepare(a, 9), pb = obj->prepare(b, 9);
  EXPECT_EQ(all.posterior_eps.sizes(), (std::vector<int64_t>{6, 2, 2, 2}));
  // Two ranks (or micro-batches) draw exactly what one process draws for the same samples.
  EXPECT_TRUE(torch::equal(torch::cat({pa.posterior_eps, pb.posterior_eps}), all.posterior_eps));
  EXPECT_FALSE(torch::equal(obj->prepare(whole, 10).posterior_eps, all.posterior_eps));
  EXPECT_TRUE(torch::equal(all.xt, whole.x));

  Net net = make_net(cfg.model);
  auto& ae = dynamic_cast<AutoencoderImpl&>(*net);
  torch::NoGradGuard no_grad;
  const Posterior q = ae.encode(whole.x);
  const auto rec = ae.decode(q.mean + torch::exp(0.5 * q.logvar) * all.posterior_eps);
  const double l1 = (rec - whole.x).abs().mean().item<double>();
  const double kl = (0.5 * (q.mean.square() + q.logvar.exp() - 1 - q.logvar)).sum({1, 2, 3}).mean().item<double>();
  EXPECT_NEAR(obj->forward_loss(*net, all).item<double>(), l1 + 0.01 * kl / 64, 1e-6);
  const auto terms = dynamic_cast<AutoencoderObjective&>(*obj).terms(*net, all);
  EXPECT_NEAR(terms.rec.item<double>(), l1, 1e-6);
  EXPECT_NEAR(terms.kl.item<double>(), kl / 64, 1e-6);
}

TEST(AutoencoderReport, LatentStatsAreTheMeanAndInverseStdOfPosteriorSamples) {
  torch::manual_seed(2);
  const RunConfig cfg = small_ae_config();
  Net net = make_net(cfg.model);
  auto& ae = dynamic_cast<AutoencoderImpl&>(*net);
  const auto x = torch::rand({10, 1, 8, 8}) * 2 - 1;
  const LatentStats one = measure_latent_stats(ae, x, 3, /*batch=*/10);
  const LatentStats split = measure_latent_stats(ae, x, 3, /*batch=*/3);
  EXPECT_EQ(one.n, 10);
  // The same noise whatever the batch; the encoder's float32 convolutions may round differently at
  // another batch size (~1e-7 relative per latent), far below what 1e-5 allows.
  EXPECT_NEAR(split.shift, one.shift, 1e-5);
  EXPECT_NEAR(split.scale, one.scale, 1e-5 * one.scale);
  EXPECT_NE(measure_latent_stats(ae, x, 4, 10).shift, one.shift);  // the seed keys the noise

  // A posterior known in closed form: with the 1x1 quant conv's weight zeroed, every latent is
  // N(c, exp(v)) whatever the image, so shift -> c and scale -> exp(-v / 2) up to sampling error
  // (here 10000 images x 8 latents: the standard error of the mean is 0.5 / sqrt(80000)).
  {
    torch::NoGradGuard no_grad;
    auto params = ae.named_parameters();
    params["quant.weight"].zero_();
    params["quant.bias"].copy_(torch::tensor({0.3f, 0.3f, std::log(0.25f), std::log(0.25f)}));
  }
  const LatentStats known = measure_latent_stats(ae, torch::zeros({10000, 1, 8, 8}), 7, 1000);
  EXPECT_NEAR(known.shift, 0.3, 4 * 0.5 / std::sqrt(80000.0));
  EXPECT_NEAR(known.scale, 2.0, 0.02);
}

TEST(AutoencoderReport, PsnrMatchesHandValues) {
  torch::manual_seed(11);  // the same draws in every run: LibTorch seeds its default generator anew per process
  const auto x = torch::rand({4, 1, 8, 8}) * 1.6 - 0.8;
  // A difference of 0.2 on [-1, 1] is 0.1 on [0, 1]: mse 0.01, 20 dB.
  EXPECT_NEAR(mean_psnr(x + 0.2, x), 20.0, 1e-4);
  EXPECT_NEAR(mean_psnr(x, x), 100.0, 1e-12);  // exact reconstructions count as 100 dB
  auto y = x.clone();
  y[0] += 0.02;  // one image at 40 dB, three exact: the mean over images
  EXPECT_NEAR(mean_psnr(y, x), (40.0 + 300.0) / 4, 1e-3);
}

TEST(LatentCache, CachedPosteriorsGiveTheFreshEncodesWithinFloatRounding) {
  torch::manual_seed(3);
  AutoencoderShape s;
  s.channels = 8;
  s.groups = 4;
  auto ae = std::make_shared<AutoencoderImpl>(s);
  const LatentSpace ls(ae, 0.5, 0.1);
  const auto images = torch::randint(0, 256, {30, 1, 28, 28}, torch::kLong).to(torch::kUInt8);
  const Posterior cache = ls.posteriors(images);  // [30, 4, 7, 7] each
  ASSERT_EQ(cache.mean.sizes(), (std::vector<int64_t>{30, 4, 7, 7}));
  const auto idx = torch::tensor({17, 3, 29, 3}, torch::kLong);
  const auto eps = torch::randn({4, 4, 7, 7});
  const auto cached = ls.encode_cached(cache, idx, eps);
  const auto fresh = ls.encode(to_unit_range(images.index_select(0, idx)), eps);  // [4, 4, 7, 7]
  // The encoder over 30 images or over these 4: the same arithmetic up to float32 rounding.
  EXPECT_TRUE(torch::allclose(cached, fresh, 1e-4, 1e-5)) << (cached - fresh).abs().max().item<float>();
  EXPECT_FALSE(cached.requires_grad());
  // The objective looks each batch up by its indices, through the same keyed posterior noise.
  RunConfig cfg;
  cfg.model.in_channels = 4;
  cfg.model.image_size = 7;
  cfg.model.num_classes = 0;
  Objective with_cache(cfg), without(cfg);
  with_cache.set_encoder([&](const Batch& b, const torch::Tensor& e) { return ls.encode_cached(cache, b.index, e); });
  without.set_encoder([&](const Batch& b, const torch::Tensor& e) { return ls.encode(b.x, e); });
  Batch b{to_unit_range(images.index_select(0, idx)), torch::zeros({4}, torch::kLong), {}, 0, idx};
  torch::NoGradGuard ng;
  EXPECT_TRUE(torch::allclose(with_cache.prepare(b, 2).xt, without.prepare(b, 2).xt, 1e-4, 1e-5));
  b.index = torch::Tensor();
  EXPECT_THROW(with_cache.prepare(b, 2), Error);  // a batch that does not say which images it holds
}

}  // namespace
}  // namespace ddm
