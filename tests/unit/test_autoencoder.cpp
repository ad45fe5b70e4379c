// Tests for src/model/autoencoder: shapes at Fashion-MNIST's scale, the posterior's sample and KL
// against hand computations, float64 finite-difference gradients of the whole encoder and decoder,
// shape errors that name the field, and FLOP counts against a hand count.
#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "core/error.h"
#include "grad_check.h"
#include "model/autoencoder.h"

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
  EXPECT_NE(msg.find("autoencoder.groups = 3"), std::string::npos) << msg;
  s = AutoencoderShape{};
  s.latent_channels = 0;
  EXPECT_NE(error_of([&] { Autoencoder a(s); }).find("autoencoder.latent_channels"), std::string::npos);
  s = AutoencoderShape{};
  s.channel_mult = {};
  EXPECT_NE(error_of([&] { Autoencoder a(s); }).find("autoencoder.channel_mult"), std::string::npos);
  Autoencoder ok(AutoencoderShape{});
  msg = error_of([&] { ok->encode(torch::zeros({1, 3, 28, 28})); });
  EXPECT_NE(msg.find("expected images [B, 1, 28, 28]"), std::string::npos) << msg;
  msg = error_of([&] { ok->decode(torch::zeros({1, 4, 14, 14})); });
  EXPECT_NE(msg.find("expected latents [B, 4, 7, 7]"), std::string::npos) << msg;
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

}  // namespace
}  // namespace ddm
