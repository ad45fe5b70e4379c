// Tests for src/model: embeddings against naive loops, patchify round trip, zero outputs at init,
// shapes of every preset, null / absent class labels, config errors, float64 finite-difference
// gradient checks of the building blocks, parameter and FLOP counting.
#include <cmath>
#include <cstdlib>
#include <functional>
#include <tuple>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "core/device.h"
#include "core/error.h"
#include "core/presets.h"
#include "core/rng.h"
#include "diffusion/denoiser.h"
#include "diffusion/path.h"
#include "diffusion/sampler.h"
#include "float_tolerance.h"
#include "grad_check.h"
#include "model/dit.h"
#include "model/flops.h"
#include "model/fused_cpu.h"
#include "model/fused_gpu.h"
#include "model/graphed_net.h"
#include "model/recompute.h"
#include "model/layers.h"
#include "model/net.h"
#include "model/ops.h"
#include "model/router.h"
#include "model/unet.h"

namespace ddm {
namespace {

// A preset at 28x28x1, or (presets sized for other images, core/presets.h) at the smallest side its
// levels divide with their channels: RGB at 32 px, latents at 16.
ModelConfig preset_cfg(const std::string& name, int64_t num_classes = 10) {
  ModelConfig cfg;
  const PresetShape shape = preset_shape(name);
  const bool sized = shape.side != 28 && shape.side != 7;
  cfg.in_channels = sized ? shape.channels : 1;
  cfg.image_size = sized ? (shape.channels == 3 ? 32 : 16) : 28;
  cfg.num_classes = num_classes;
  cfg.num_experts = 3;  // used by the router presets only
  cfg.preset = name;
  apply_preset(name, cfg);
  return cfg;
}

// n images of the shape the preset's config takes, [n, C, S, S].
torch::Tensor images_for(const ModelConfig& cfg, int64_t n) {
  return torch::randn({n, cfg.in_channels, cfg.image_size, cfg.image_size});
}

// The output shape of a preset's net for a batch of images x: like x, or [B, K] logits for a router.
std::vector<int64_t> out_shape(const ModelConfig& cfg, const torch::Tensor& x) {
  if (is_router_arch(cfg.arch)) return {x.size(0), cfg.num_experts};
  return x.sizes().vec();
}

// Fills every parameter of m with N(0, std^2) values (undoing zero initializations).
void randomize(torch::nn::Module& m, double std = 0.3) {
  torch::NoGradGuard ng;
  for (auto& p : m.parameters()) p.normal_(0.0, std);
}

// Runs fn and returns the ddm::Error message (fails the test if nothing or something else is thrown).
std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected ddm::Error, got another exception: " << e.what();
    return "";
  }
  ADD_FAILURE() << "expected ddm::Error, nothing thrown";
  return "";
}

// f = sum(out * w) with a fixed random w, so every output element matters.
torch::Tensor weighted_sum(const torch::Tensor& out, const torch::Tensor& w) { return (out * w).sum(); }

TEST(Embedding, TimestepMatchesNaiveLoop) {
  auto t = torch::tensor({0.0, 0.1, 0.5, 0.731, 1.0}, torch::kFloat64);
  for (int64_t dim : {16, 7}) {
    auto e = timestep_embedding(t, dim);
    ASSERT_EQ(e.sizes(), (std::vector<int64_t>{5, dim}));
    const int64_t half = dim / 2;
    for (int64_t b = 0; b < 5; ++b) {
      const double s = 1000.0 * t[b].item<double>();
      for (int64_t i = 0; i < half; ++i) {
        const double f = std::pow(10000.0, -static_cast<double>(i) / half);
        EXPECT_NEAR(e[b][i].item<double>(), std::cos(s * f), 1e-9) << "dim " << dim << " b " << b << " i " << i;
        EXPECT_NEAR(e[b][half + i].item<double>(), std::sin(s * f), 1e-9);
      }
      if (dim % 2 == 1) {
        EXPECT_EQ(e[b][dim - 1].item<double>(), 0.0);
      }
    }
  }
}

TEST(Embedding, PosEmbed2dMatchesNaiveLoop) {
  const int64_t dim = 8, grid = 3, q = dim / 4;
  auto e = pos_embed_2d(dim, grid);
  ASSERT_EQ(e.sizes(), (std::vector<int64_t>{grid * grid, dim}));
  for (int64_t r = 0; r < grid; ++r)
    for (int64_t c = 0; c < grid; ++c)
      for (int64_t i = 0; i < q; ++i) {
        const double w = std::pow(10000.0, -static_cast<double>(i) / q);
        auto row = e[r * grid + c];
        EXPECT_NEAR(row[i].item<float>(), std::sin(r * w), 1e-6);
        EXPECT_NEAR(row[q + i].item<float>(), std::cos(r * w), 1e-6);
        EXPECT_NEAR(row[2 * q + i].item<float>(), std::sin(c * w), 1e-6);
        EXPECT_NEAR(row[3 * q + i].item<float>(), std::cos(c * w), 1e-6);
      }
}

TEST(Patchify, RoundTripIsIdentityAndMatchesStridedConv) {
  torch::manual_seed(0);
  auto x = torch::randn({2, 3, 8, 12});
  auto tokens = patchify(x, 4);
  ASSERT_EQ(tokens.sizes(), (std::vector<int64_t>{2, 6, 48}));
  EXPECT_TRUE(torch::equal(unpatchify(tokens, 4, 3, 8, 12), x));
  // Linear on patches == Conv2d(kernel p, stride p) with the same weights.
  torch::nn::Conv2d conv(torch::nn::Conv2dOptions(3, 5, 4).stride(4));
  auto via_conv = conv(x).flatten(2).transpose(1, 2);                                 // [2, 6, 5]
  auto via_linear = torch::nn::functional::linear(tokens, conv->weight.reshape({5, 48}), conv->bias);
  // oneDNN's convolution and OpenBLAS's product add the 48 terms and the bias in different orders:
  // each is within gamma_49 (|tokens| |W|^T + |b|) of the exact value (float_tolerance.h).
  auto tol = 2 * test::gamma32(49) *
             (torch::matmul(tokens.abs().to(torch::kFloat64), conv->weight.reshape({5, 48}).abs().t().to(torch::kFloat64)) +
              conv->bias.abs().to(torch::kFloat64));  // [2, 6, 5]
  EXPECT_LE(test::tolerance_ratio(via_conv, via_linear, tol), 1.0);
  // A patch order that does not match the convolution's (transposed pixels within each patch) fails.
  auto swapped = tokens.view({2, 6, 3, 4, 4}).transpose(3, 4).reshape({2, 6, 48});
  EXPECT_GT(test::tolerance_ratio(via_conv, torch::nn::functional::linear(swapped, conv->weight.reshape({5, 48}), conv->bias), tol), 1.0);
  EXPECT_THROW(patchify(x, 5), Error);
}

TEST(Nets, DiTOutputsExactlyZeroAtInit) {
  int n = 0;
  for (const auto& name : preset_names()) {
    auto cfg = preset_cfg(name);
    if (cfg.arch != "dit") continue;
    ++n;
    auto net = make_net(cfg);
    auto out = net->forward(images_for(cfg, 3), torch::rand({3}), torch::tensor({0, 5, 10}));
    EXPECT_TRUE(torch::equal(out, torch::zeros_like(out))) << name;
  }
  EXPECT_GE(n, 2);
}

TEST(Nets, UNetOutputsExactlyZeroAtInit) {
  for (const auto& name : preset_names()) {
    auto cfg = preset_cfg(name);
    if (cfg.arch != "unet") continue;
    auto net = make_net(cfg);
    auto out = net->forward(images_for(cfg, 2), torch::rand({2}), torch::tensor({1, 10}));
    ASSERT_EQ(out.sizes(), images_for(cfg, 2).sizes());
    EXPECT_TRUE(torch::equal(out, torch::zeros_like(out))) << name;
  }
}

TEST(Nets, AllPresetsGiveInputShapedFiniteOutputs) {
  torch::manual_seed(1);
  for (const auto& name : preset_names()) {
    auto cfg = preset_cfg(name);
    auto net = make_net(cfg);
    randomize(*net, 0.05);
    auto x = images_for(cfg, 3);
    auto out = net->forward(x, torch::rand({3}), torch::tensor({0, 9, 10}));
    EXPECT_EQ(out.sizes(), out_shape(cfg, x)) << name;
    EXPECT_TRUE(torch::isfinite(out).all().item<bool>()) << name;
  }
}

// A network wrapped as `--cuda-graphs` (model/graphed_net.h) and train.checkpoint_activations
// (model/recompute.h) wrap it: its parameters are the inner network's (where a network computes is
// read from them: a wrapper without them once sent a GPU model's samples to the CPU), eval() reaches
// the inner network, and on the CPU without gradients every call is the inner network's forward.
void expect_wrapper_is_inner(const std::shared_ptr<NetImpl>& wrapper, const Net& inner) {
  const auto mine = wrapper->parameters(), theirs = inner->parameters();
  ASSERT_EQ(mine.size(), theirs.size());
  for (size_t i = 0; i < mine.size(); ++i) EXPECT_TRUE(mine[i].is_same(theirs[i])) << i;
  wrapper->eval();
  EXPECT_FALSE(inner->is_training());
  torch::NoGradGuard no_grad;
  const auto x = torch::randn({3, 1, 28, 28}), t = torch::rand({3});
  const auto y = torch::tensor({0, 9, 10});
  EXPECT_TRUE(torch::equal(wrapper->forward(x, t, y), inner->forward(x, t, y)));
}

TEST(Nets, AGraphedOrCheckpointedNetworkIsItsInnerNetworkOnTheCpu) {
  torch::manual_seed(3);
  Net dit = make_net(preset_cfg("dit-tiny")), unet = make_net(preset_cfg("unet-tiny"));
  randomize(*dit, 0.05);
  randomize(*unet, 0.05);
  auto graphed = std::make_shared<GraphedNetImpl>(dit);
  expect_wrapper_is_inner(graphed, dit);
  EXPECT_EQ(graphed->graphs(), 0);
  EXPECT_EQ(graphed->replays(), 0);
  expect_wrapper_is_inner(std::make_shared<RecomputedNetImpl>(unet), unet);
}

// A `--cuda-graphs` network's graphs read its linear and convolution weights cast once
// (HeldWeightCasts, model/graphed_net.h): with those parameters swapped for their casts, every
// preset's forward under bf16 autocast (and fp16's) gives the bits it gives with its float32 weights
// (autocast casts them for those layers anyway), and the swap ends with the float32 weights in place. A weight
// changed afterwards is cast again by refresh(); without it the swapped forward would read the old cast.
TEST(Nets, HeldWeightCastsChangeNoBitOfAForward) {
  torch::manual_seed(4);
  torch::NoGradGuard no_grad;
  for (const auto& name : preset_names()) {
    const ModelConfig cfg = preset_cfg(name);
    Net net = make_net(cfg);
    randomize(*net, 0.05);
    const auto x = images_for(cfg, 3), t = torch::rand({3});
    const Cond y(torch::tensor({0, 9, 10}));
    {  // float16 (`ddm sample --precision fp16` from graphs): held half casts change no bit either
      const Autocast half(torch::kCPU, Precision::kFp16);
      const AutocastCacheOff no_cache;
      const auto plain = net->forward(x, t, y);
      HeldWeightCasts held(*net, torch::kHalf);
      const HeldWeightCasts::Swap swap(held);
      EXPECT_TRUE(torch::equal(net->forward(x, t, y), plain)) << name << " fp16";
    }
    const Autocast autocast(torch::kCPU, Precision::kBf16);
    const AutocastCacheOff no_cache;  // as in a graph's capture: a cached cast would not see weights change
    const auto plain = net->forward(x, t, y);
    HeldWeightCasts held(*net, torch::kBFloat16);
    EXPECT_GT(held.size(), 0) << name;
    std::printf("%s: %lld weights held cast\n", name.c_str(), static_cast<long long>(held.size()));
    {
      const HeldWeightCasts::Swap swap(held);
      EXPECT_TRUE(torch::equal(net->forward(x, t, y), plain)) << name;
    }
    for (const auto& p : net->parameters()) EXPECT_EQ(p.scalar_type(), torch::kFloat) << name;
    for (auto& p : net->parameters()) p.mul_(1.5);
    const auto changed = net->forward(x, t, y);
    {
      const HeldWeightCasts::Swap swap(held);
      EXPECT_FALSE(torch::equal(net->forward(x, t, y), changed)) << name << ": the old casts read the new weights";
    }
    EXPECT_EQ(held.refresh(), held.size()) << name;
    EXPECT_EQ(held.refresh(), 0) << name;
    {
      const HeldWeightCasts::Swap swap(held);
      EXPECT_TRUE(torch::equal(net->forward(x, t, y), changed)) << name;
    }
    // Weights given other memory (as Module::to or a load anew would) are refused, not read stale; a
    // weight that is part of a larger buffer (a flat one) is not held.
    for (auto& p : net->parameters()) p.set_data(p.detach().clone());
    EXPECT_NE(error_of([&] { held.refresh(); }).find("wrap the network for graphs after it is loaded"),
              std::string::npos) << name;
    for (auto& p : net->parameters()) {
      auto flat = torch::zeros({p.numel() + 1});
      p.set_data(flat.narrow(0, 1, p.numel()).view(p.sizes()));
    }
    EXPECT_EQ(HeldWeightCasts(*net, torch::kBFloat16).size(), 0) << name;
  }
}

TEST(Nets, NullClassIsItsOwnLabel) {
  torch::manual_seed(2);
  for (const auto& name : {"unet-tiny", "dit-tiny"}) {
    auto net = make_net(preset_cfg(name));
    randomize(*net, 0.05);
    auto x = torch::randn({1, 1, 28, 28}).repeat({2, 1, 1, 1});
    auto t = torch::full({2}, 0.3);
    auto out = net->forward(x, t, torch::tensor({10, 3}));  // null class, class 3
    EXPECT_FALSE(torch::allclose(out[0], out[1])) << name << ": null class equals class 3";
    EXPECT_ANY_THROW(net->forward(x, t, torch::tensor({11, 3}))) << name << ": label 11 accepted";
  }
}

TEST(Nets, UnconditionalNetsIgnoreLabels) {
  for (const auto& name : preset_names()) {
    auto cfg = preset_cfg(name, /*num_classes=*/0);
    auto net = make_net(cfg);
    for (const auto& p : net->named_parameters())
      EXPECT_EQ(p.key().find("label"), std::string::npos) << name << ": " << p.key();
    auto x = images_for(cfg, 2);
    auto out = net->forward(x, torch::rand({2}), torch::Tensor());
    EXPECT_EQ(out.sizes(), out_shape(cfg, x)) << name;
  }
}

TEST(Nets, InvalidConfigsNameTheKey) {
  struct Case {
    std::string preset, key;
    std::function<void(ModelConfig&)> edit;
  };
  const std::vector<Case> cases = {
      {"unet-tiny", "model.arch", [](ModelConfig& c) { c.arch = "resnet"; }},
      {"unet-tiny", "model.in_channels", [](ModelConfig& c) { c.in_channels = 0; }},
      {"unet-tiny", "model.image_size", [](ModelConfig& c) { c.image_size = -1; }},
      {"unet-tiny", "model.num_classes", [](ModelConfig& c) { c.num_classes = -1; }},
      {"unet-tiny", "model.image_size", [](ModelConfig& c) { c.image_size = 30; }},
      {"unet-tiny", "model.groups", [](ModelConfig& c) { c.groups = 7; }},
      {"unet-tiny", "model.channel_mult", [](ModelConfig& c) { c.channel_mult = {}; }},
      {"unet-tiny", "model.channel_mult", [](ModelConfig& c) { c.channel_mult = {1, 0}; }},
      {"unet-tiny", "model.attn_levels", [](ModelConfig& c) { c.attn_levels = {3}; }},
      {"unet-tiny", "model.res_blocks", [](ModelConfig& c) { c.res_blocks = 0; }},
      {"unet-small", "model.heads", [](ModelConfig& c) { c.heads = 3; }},
      {"dit-tiny", "model.patch", [](ModelConfig& c) { c.patch = 3; }},
      {"dit-tiny", "model.heads", [](ModelConfig& c) { c.width = 132; c.heads = 8; }},
      {"dit-tiny", "model.width", [](ModelConfig& c) { c.width = 126; c.heads = 3; }},
      {"dit-tiny", "model.depth", [](ModelConfig& c) { c.depth = 0; }},
      {"dit-tiny", "model.mlp_ratio", [](ModelConfig& c) { c.mlp_ratio = 0.0; }},
  };
  for (const auto& c : cases) {
    auto cfg = preset_cfg(c.preset);
    c.edit(cfg);
    const auto msg = error_of([&] { make_net(cfg); });
    EXPECT_NE(msg.find(c.key), std::string::npos) << "expected '" << c.key << "' in: " << msg;
    const auto msg2 = error_of([&] { forward_flops_per_image(cfg); });
    EXPECT_NE(msg2.find(c.key), std::string::npos) << "expected '" << c.key << "' in: " << msg2;
  }
  ModelConfig cfg;
  const auto msg = error_of([&] { apply_preset("unet-huge", cfg); });
  for (const auto& name : preset_names()) EXPECT_NE(msg.find(name), std::string::npos) << msg;
  EXPECT_NE(msg.find("unet-huge"), std::string::npos) << msg;
}

TEST(GradCheck, ResBlock) {
  torch::manual_seed(3);
  ResBlock block(4, 6, 5, 2);
  block->to(torch::kFloat64);
  randomize(*block);
  auto x = torch::randn({2, 4, 5, 5}, torch::kFloat64).requires_grad_();
  auto e = torch::randn({2, 5}, torch::kFloat64).requires_grad_();
  auto w = torch::randn({2, 6, 5, 5}, torch::kFloat64);
  std::vector<torch::Tensor> leaves = {x, e};
  for (auto& p : block->parameters()) leaves.push_back(p);
  expect_gradients_match([&] { return weighted_sum(block->forward(x, e), w); }, leaves, "ResBlock");
}

TEST(GradCheck, AttentionBlock) {
  torch::manual_seed(4);
  AttentionBlock block(4, 2, 2);
  block->to(torch::kFloat64);
  randomize(*block);
  auto x = torch::randn({2, 4, 3, 3}, torch::kFloat64).requires_grad_();
  auto w = torch::randn({2, 4, 3, 3}, torch::kFloat64);
  std::vector<torch::Tensor> leaves = {x};
  for (auto& p : block->parameters()) leaves.push_back(p);
  expect_gradients_match([&] { return weighted_sum(block->forward(x), w); }, leaves, "AttentionBlock");
}

TEST(GradCheck, DiTBlockWithNonZeroModulation) {
  torch::manual_seed(5);
  DiTBlock block(8, 2, 2.0);
  block->to(torch::kFloat64);
  randomize(*block);
  ASSERT_GT(block->modulation()->weight.abs().sum().item<double>(), 0.0);
  auto x = torch::randn({2, 5, 8}, torch::kFloat64).requires_grad_();
  auto c = torch::randn({2, 8}, torch::kFloat64).requires_grad_();
  auto w = torch::randn({2, 5, 8}, torch::kFloat64);
  std::vector<torch::Tensor> leaves = {x, c};
  for (auto& p : block->parameters()) leaves.push_back(p);
  expect_gradients_match([&] { return weighted_sum(block->forward(x, c), w); }, leaves, "DiTBlock");
}

TEST(GradCheck, DiTFinalLayerAndTimeEmbedder) {
  torch::manual_seed(6);
  DiTFinalLayer fin(8, 12);
  TimeEmbedder temb(6, 8);
  fin->to(torch::kFloat64);
  temb->to(torch::kFloat64);
  randomize(*fin);
  randomize(*temb);
  auto x = torch::randn({2, 5, 8}, torch::kFloat64).requires_grad_();
  auto t = torch::tensor({0.013, 0.0007}, torch::kFloat64).requires_grad_();
  auto w = torch::randn({2, 5, 12}, torch::kFloat64);
  std::vector<torch::Tensor> leaves = {x, t};
  for (auto& p : fin->parameters()) leaves.push_back(p);
  for (auto& p : temb->parameters()) leaves.push_back(p);
  expect_gradients_match([&] { return weighted_sum(fin->forward(x, torch::silu(temb->forward(t))), w); }, leaves,
                         "DiTFinalLayer+TimeEmbedder");
}

// ---------------------------------------------------------------------------------------------
// The fused CPU attention against the three-op form in float64, forward and backward, for the
// two memory layouts the models use and for sizes that exercise every tile edge.
struct AttnCase {
  int64_t B, H, N, d;
  double logit_scale;  // multiplies q and k: large values make the softmax nearly one-hot
  bool unet_layout;    // qkv as [B, 3, H, d, N] storage (U-Net) instead of [B, N, 3, H, d] (DiT)
};

// qkv [B, 3, H, N, d] as a view of `storage` in the chosen layout.
torch::Tensor qkv_view_of(const torch::Tensor& storage, bool unet_layout) {
  return unet_layout ? storage.transpose(-1, -2) : storage.permute({0, 2, 3, 1, 4});
}

void check_fused_attention(const AttnCase& c) {
  SCOPED_TRACE("B=" + std::to_string(c.B) + " H=" + std::to_string(c.H) + " N=" + std::to_string(c.N) +
               " d=" + std::to_string(c.d) + " scale=" + std::to_string(c.logit_scale) +
               (c.unet_layout ? " unet" : " dit"));
  torch::manual_seed(7);
  auto shape = c.unet_layout ? std::vector<int64_t>{c.B, 3, c.H, c.d, c.N} : std::vector<int64_t>{c.B, c.N, 3, c.H, c.d};
  auto base = torch::randn(shape, torch::kFloat64);
  {
    // scale q and k only, so v keeps unit size
    torch::NoGradGuard ng;
    auto v = qkv_view_of(base, c.unet_layout);
    v.narrow(1, 0, 2).mul_(c.logit_scale);
  }
  auto grad_out = torch::randn({c.B, c.H, c.N, c.d}, torch::kFloat64);

  auto s32 = base.to(torch::kFloat32).detach().requires_grad_(true);
  auto q32 = qkv_view_of(s32, c.unet_layout);
  ASSERT_TRUE(fused_attention_cpu_supported(q32));
  auto out32 = fused_attention_cpu(q32);
  ASSERT_EQ(out32.sizes(), (std::vector<int64_t>{c.B, c.H, c.N, c.d}));
  (out32 * grad_out.to(torch::kFloat32)).sum().backward();

  auto s64 = base.detach().requires_grad_(true);
  auto u = qkv_view_of(s64, c.unet_layout).unbind(1);
  auto out64 = attention_reference(u[0], u[1], u[2]);
  (out64 * grad_out).sum().backward();

  EXPECT_LT((out32.to(torch::kFloat64) - out64).abs().max().item<double>(), 2e-5);
  const double gscale = std::max(1.0, s64.grad().abs().max().item<double>());
  EXPECT_LT((s32.grad().to(torch::kFloat64) - s64.grad()).abs().max().item<double>() / gscale, 5e-5);
  EXPECT_TRUE(torch::isfinite(s32.grad()).all().item<bool>());
}

TEST(FusedAttention, MatchesThreeOpFormForwardAndBackward) {
  if (!fused_attention_cpu_supported(torch::zeros({1, 3, 1, 1, 1}))) GTEST_SKIP() << "no AVX2/FMA CPU kernel here";
  for (const AttnCase& c : {AttnCase{2, 2, 49, 32, 1.0, false}, AttnCase{1, 3, 196, 32, 1.0, false},
                            AttnCase{2, 1, 7, 20, 1.0, false}, AttnCase{3, 2, 17, 8, 1.0, true},
                            AttnCase{2, 4, 49, 32, 1.0, true}, AttnCase{1, 1, 1, 5, 1.0, false},
                            AttnCase{2, 2, 23, 16, 6.0, false}})
    check_fused_attention(c);
}

TEST(FusedAttention, ResultDoesNotDependOnThreadCount) {
  if (!fused_attention_cpu_supported(torch::zeros({1, 3, 1, 1, 1}))) GTEST_SKIP() << "no AVX2/FMA CPU kernel here";
  torch::manual_seed(3);
  auto base = torch::randn({4, 49, 3, 4, 32});
  const int threads = torch::get_num_threads();
  auto run = [&](int n) {
    torch::set_num_threads(n);
    auto s = base.clone().requires_grad_(true);
    auto out = fused_attention_cpu(qkv_view_of(s, false));
    out.pow(2).sum().backward();
    return std::make_pair(out.detach(), s.grad());
  };
  auto one = run(1), two = run(2);
  torch::set_num_threads(threads);
  EXPECT_TRUE(torch::equal(one.first, two.first));
  EXPECT_TRUE(torch::equal(one.second, two.second));
}

TEST(FusedAttention, DispatchFallsBackForOtherDtypes) {
  torch::manual_seed(5);
  auto base = torch::randn({2, 9, 3, 2, 4}, torch::kFloat64);
  auto qkv = qkv_view_of(base, false);
  EXPECT_FALSE(fused_attention_cpu_supported(qkv));
  auto u = qkv.unbind(1);
  EXPECT_TRUE(torch::allclose(attention_qkv(qkv), attention_reference(u[0], u[1], u[2]), 1e-12, 1e-12));
}

namespace {
// Max |got - want| relative to max(1, max |want|), got in any dtype, want in float64.
double rel_err(const torch::Tensor& got, const torch::Tensor& want) {
  return (got.to(torch::kFloat64) - want).abs().max().item<double>() / std::max(1.0, want.abs().max().item<double>());
}
}  // namespace

TEST(FusedAdaLN, MatchesLayerNormThenModulateWithGradients) {
  torch::manual_seed(12);
  // W = 20: two vectors and a tail of 4; W = 128 (dit-tiny); one token; rows with a large offset.
  for (auto [B, N, W] : {std::tuple<int64_t, int64_t, int64_t>{3, 7, 20}, {2, 49, 128}, {1, 1, 8}, {4, 5, 13}}) {
    auto x64 = torch::randn({B, N, W}, torch::kFloat64) * 3 + torch::randn({B, N, 1}, torch::kFloat64) * 10;
    auto sh64 = torch::randn({B, W}, torch::kFloat64), sc64 = torch::randn({B, W}, torch::kFloat64) * 0.5;
    auto g64 = torch::randn({B, N, W}, torch::kFloat64);
    auto x32 = x64.to(torch::kFloat32).requires_grad_(true), sh32 = sh64.to(torch::kFloat32).requires_grad_(true);
    auto sc32 = sc64.to(torch::kFloat32).requires_grad_(true);
    if (!adaln_modulate_cpu_supported(x32, sh32, sc32)) GTEST_SKIP() << "no AVX2/FMA CPU kernel here";
    auto y32 = adaln_modulate_cpu(x32, sh32, sc32, 1e-6);
    (y32 * g64.to(torch::kFloat32)).sum().backward();
    auto x = x64.clone().requires_grad_(true), sh = sh64.clone().requires_grad_(true);
    auto sc = sc64.clone().requires_grad_(true);
    auto y = torch::layer_norm(x, {W}, {}, {}, 1e-6) * (1 + sc.unsqueeze(1)) + sh.unsqueeze(1);
    (y * g64).sum().backward();
    const std::string where = "B " + std::to_string(B) + " N " + std::to_string(N) + " W " + std::to_string(W);
    EXPECT_LT(rel_err(y32, y), 2e-6) << where;
    EXPECT_LT(rel_err(x32.grad(), x.grad()), 2e-5) << where;
    EXPECT_LT(rel_err(sh32.grad(), sh.grad()), 2e-6) << where;
    EXPECT_LT(rel_err(sc32.grad(), sc.grad()), 5e-6) << where;
    // ops.h dispatches here for float32 and to ATen's layer_norm + addcmul otherwise.
    EXPECT_TRUE(torch::equal(adaln_modulate(x32.detach(), sh32.detach(), sc32.detach(), 1e-6), y32.detach()));
    EXPECT_LT(rel_err(adaln_modulate(x64, sh64, sc64, 1e-6), y.detach()), 1e-12);
  }
}

TEST(FusedGatedResidual, MatchesAddcmulWithBiasAndGradients) {
  torch::manual_seed(13);
  for (auto [B, N, W] : {std::tuple<int64_t, int64_t, int64_t>{3, 7, 20}, {2, 49, 128}, {1, 1, 5}}) {
    auto x64 = torch::randn({B, N, W}, torch::kFloat64), a64 = torch::randn({B, N, W}, torch::kFloat64);
    auto gate64 = torch::randn({B, W}, torch::kFloat64), b64 = torch::randn({W}, torch::kFloat64);
    auto g64 = torch::randn({B, N, W}, torch::kFloat64);
    auto x32 = x64.to(torch::kFloat32).requires_grad_(true), a32 = a64.to(torch::kFloat32).requires_grad_(true);
    auto gate32 = gate64.to(torch::kFloat32).requires_grad_(true), b32 = b64.to(torch::kFloat32).requires_grad_(true);
    if (!gated_residual_cpu_supported(x32, gate32, a32, b32)) GTEST_SKIP() << "no AVX2/FMA CPU kernel here";
    auto y32 = gated_residual_cpu(x32, gate32, a32, b32);
    (y32 * g64.to(torch::kFloat32)).sum().backward();
    auto x = x64.clone().requires_grad_(true), a = a64.clone().requires_grad_(true);
    auto gate = gate64.clone().requires_grad_(true), b = b64.clone().requires_grad_(true);
    auto y = x + gate.unsqueeze(1) * (a + b);
    (y * g64).sum().backward();
    EXPECT_LT(rel_err(y32, y), 2e-6);
    EXPECT_LT(rel_err(x32.grad(), x.grad()), 1e-7);
    EXPECT_LT(rel_err(a32.grad(), a.grad()), 2e-6);
    EXPECT_LT(rel_err(gate32.grad(), gate.grad()), 5e-6);
    EXPECT_LT(rel_err(b32.grad(), b.grad()), 5e-6);
    EXPECT_TRUE(torch::equal(gated_residual(x32.detach(), gate32.detach(), a32.detach(), b32.detach()),
                             y32.detach()));
    EXPECT_LT(rel_err(gated_residual(x64, gate64, a64, b64), y.detach()), 1e-12);
  }
}

TEST(FusedAdaLN, AdaLNAndGatedResidualDoNotDependOnThreadCount) {
  torch::manual_seed(3);
  auto x = torch::randn({16, 49, 128}), a = torch::randn({16, 49, 128});
  auto shift = torch::randn({16, 128}), scale = torch::randn({16, 128}), bias = torch::randn({128});
  if (!adaln_modulate_cpu_supported(x, shift, scale)) GTEST_SKIP() << "no AVX2/FMA CPU kernel here";
  const int threads = torch::get_num_threads();
  auto run = [&](int n) {
    torch::set_num_threads(n);
    auto xx = x.clone().requires_grad_(true), sc = scale.clone().requires_grad_(true);
    auto bb = bias.clone().requires_grad_(true);
    auto h = adaln_modulate_cpu(xx, shift, sc, 1e-6);
    gated_residual_cpu(xx, sc, h, bb).pow(2).sum().backward();
    return std::vector<torch::Tensor>{h.detach(), xx.grad(), sc.grad(), bb.grad()};
  };
  auto one = run(1), two = run(2);
  torch::set_num_threads(threads);
  for (size_t i = 0; i < one.size(); ++i) EXPECT_TRUE(torch::equal(one[i], two[i])) << i;
}

TEST(Counting, CountParamsIsSumOfNumel) {
  for (const auto& name : preset_names()) {
    auto net = make_net(preset_cfg(name));
    int64_t n = 0;
    for (const auto& p : net->named_parameters()) n += p.value().numel();
    EXPECT_EQ(count_params(*net), n) << name;
    EXPECT_GT(forward_flops_per_image(preset_cfg(name)), 0.0) << name;
  }
  const auto tiny = count_params(*make_net(preset_cfg("unet-tiny")));
  EXPECT_GT(tiny, 450000);
  EXPECT_LT(tiny, 650000);
  const auto small = count_params(*make_net(preset_cfg("unet-small")));
  EXPECT_GT(small, 2000000);
  EXPECT_LT(small, 4000000);
}

TEST(Counting, FlopsMatchHandCounts) {
  EXPECT_EQ(flops::conv2d(3, 8, 3, 10, 10), 2.0 * 3 * 8 * 9 * 100);
  EXPECT_EQ(flops::linear(16, 32, 5), 2.0 * 16 * 32 * 5);
  EXPECT_EQ(flops::attention(7, 12), 2.0 * (7 * 7 * 12) * 2);

  // One-token DiT: 4x4x1 image, patch 4, width 4, depth 1, 1 head, mlp_ratio 1, unconditional.
  ModelConfig dit;
  dit.arch = "dit";
  dit.in_channels = 1, dit.image_size = 4, dit.num_classes = 0;
  dit.patch = 4, dit.width = 4, dit.depth = 1, dit.heads = 1, dit.mlp_ratio = 1.0;
  const double dit_hand = 2.0 * 16 * 4                      // patch embedding
                          + 2.0 * 256 * 4 + 2.0 * 4 * 4     // time MLP (256 frequencies)
                          + 2.0 * 4 * 24                    // block adaLN
                          + 2.0 * 4 * 12 + 4.0 * 1 * 1 * 4 + 2.0 * 4 * 4  // qkv, attention, proj
                          + 2.0 * 4 * 4 + 2.0 * 4 * 4       // MLP
                          + 2.0 * 4 * 8 + 2.0 * 4 * 16;     // final adaLN and linear
  EXPECT_EQ(forward_flops_per_image(dit), dit_hand);

  // One-level U-Net on a 2x2x1 image, 2 channels, one ResBlock: time MLP (2 -> 8 -> 8),
  // in conv, ResBlock (two 3x3 convs + scale/shift linear 8 -> 4), out conv.
  ModelConfig unet;
  unet.arch = "unet";
  unet.in_channels = 1, unet.image_size = 2, unet.num_classes = 0;
  unet.channels = 2, unet.channel_mult = {1}, unet.res_blocks = 1, unet.groups = 1, unet.attn_levels = {};
  const double unet_hand = (2.0 * 2 * 8 + 2.0 * 8 * 8) + 2.0 * 1 * 2 * 9 * 4 +
                           (2.0 * 2 * 2 * 9 * 4 * 2 + 2.0 * 8 * 4) + 2.0 * 2 * 1 * 9 * 4;
  EXPECT_EQ(forward_flops_per_image(unet), unet_hand);
  EXPECT_EQ(make_net(unet)->forward(torch::randn({1, 1, 2, 2}), torch::rand({1}), {}).sizes(),
            (std::vector<int64_t>{1, 1, 2, 2}));

  // Two levels (4x4 -> 2x2), attention (1 head) at level 1: exercises down, up, skip and attention.
  unet.image_size = 4, unet.channel_mult = {1, 1}, unet.attn_levels = {1}, unet.heads = 1;
  const double two_level_hand = (2.0 * 2 * 8 + 2.0 * 8 * 8)            // time MLP
                                + 2.0 * 1 * 2 * 9 * 16                 // in conv, 4x4
                                + (2 * 2.0 * 2 * 2 * 9 * 16 + 2.0 * 8 * 4)  // enc ResBlock, 4x4
                                + 2.0 * 2 * 2 * 9 * 4                  // down conv -> 2x2
                                + (2 * 2.0 * 2 * 2 * 9 * 4 + 2.0 * 8 * 4)   // mid ResBlock, 2x2
                                + (2.0 * 2 * 6 * 4 + 4.0 * 4 * 4 * 2 + 2.0 * 2 * 2 * 4)  // attention
                                + 2.0 * 2 * 2 * 9 * 16                 // up conv, 4x4
                                + (2.0 * 4 * 2 * 9 * 16 + 2.0 * 2 * 2 * 9 * 16 + 2.0 * 8 * 4 +
                                   2.0 * 4 * 2 * 16)                   // dec ResBlock 4 -> 2 (+1x1 skip)
                                + 2.0 * 2 * 1 * 9 * 16;                // out conv
  EXPECT_EQ(forward_flops_per_image(unet), two_level_hand);
  EXPECT_EQ(make_net(unet)->forward(torch::randn({1, 1, 4, 4}), torch::rand({1}), {}).sizes(),
            (std::vector<int64_t>{1, 1, 4, 4}));
}

// A DiT block's attention from the qkv linear's token layout: the fused CPU kernel where it runs, and
// elsewhere (here float64) the same softmax attention as the reference, gradients included.
TEST(FusedAttention, TokenLayoutEqualsTheReference) {
  torch::manual_seed(6);
  for (const auto dtype : {torch::kFloat32, torch::kFloat64}) {
    auto qkv = torch::randn({2, 9, 3, 2, 4}, dtype).requires_grad_(true);  // [B, N, 3, h, d]
    auto u = qkv.permute({0, 2, 3, 1, 4}).unbind(1);                     // 3 x [B, h, N, d]
    const auto ref = attention_reference(u[0], u[1], u[2]);
    const auto out = attention_tokens_qkv(qkv);
    const double tol = dtype == torch::kFloat64 ? 1e-12 : 1e-5;
    EXPECT_TRUE(torch::allclose(out, ref, tol, tol)) << dtype;
    const auto w = torch::randn_like(ref);
    const auto g_ref = torch::autograd::grad({(ref * w).sum()}, {qkv}, {}, /*retain_graph=*/true)[0];
    const auto g_out = torch::autograd::grad({(out * w).sum()}, {qkv}, {}, /*retain_graph=*/true)[0];
    EXPECT_TRUE(torch::allclose(g_out, g_ref, tol, tol)) << dtype;
  }
  EXPECT_ANY_THROW(attention_tokens_qkv(torch::zeros({2, 9, 4, 2, 4})));
}

}  // namespace
}  // namespace ddm

// The hand-written CUDA kernels (model/fused_gpu.h) are on unless DDM_FUSED_CUDA=0 and never take
// CPU tensors; what they compute is checked on a GPU (tests/gpu/test_cuda.cpp).
TEST(FusedGpu, OnUnlessTurnedOffAndNeverForCpuTensors) {
  const auto x = torch::randn({2, 5, 8}), m = torch::randn({2, 8});
  const char* was = std::getenv("DDM_FUSED_CUDA");
  const std::string before = was ? was : "";
  unsetenv("DDM_FUSED_CUDA");
  EXPECT_TRUE(ddm::fused_cuda_enabled());
  setenv("DDM_FUSED_CUDA", "0", 1);
  EXPECT_FALSE(ddm::fused_cuda_enabled());
  EXPECT_FALSE(ddm::adaln_modulate_cuda_supported(x, m, m));
  setenv("DDM_FUSED_CUDA", "1", 1);
  EXPECT_TRUE(ddm::fused_cuda_enabled());
  EXPECT_FALSE(ddm::adaln_modulate_cuda_supported(x, m, m));
  EXPECT_FALSE(ddm::gated_residual_cuda_supported(x, m, x));
  EXPECT_THROW(ddm::adaln_modulate_cuda(x, m, m, 1e-6), ddm::Error);
  was ? setenv("DDM_FUSED_CUDA", before.c_str(), 1) : unsetenv("DDM_FUSED_CUDA");
}

namespace ddm {

// bf16 sampling casts each weight once per run (AutocastWeightCache in sample(), apply_linear in the
// DiT): the casts end with the run, so a run after the weights change samples the new weights, bit
// for bit as a network built with them does (a cast kept across runs would sample the old ones).
TEST(Sampling, Bf16WeightCastsLastOneRunAndFollowTheWeights) {
  torch::manual_seed(5);
  const ModelConfig cfg = preset_cfg("dit-tiny");
  Net net = make_net(cfg);
  randomize(*net, 0.05);
  const NoisePath path(PathKind::kFlow);
  Denoiser den(net, path, Prediction::kVelocity, cfg.num_classes);
  den.set_precision(Precision::kBf16);
  const auto x1 = images_for(cfg, 3);                                  // [3, C, S, S]
  const Cond y(torch::tensor({0, 1, 2}, torch::kLong));
  SampleOptions opt;
  opt.steps = 2;
  const auto before = sample(den, x1, y, opt).x;                       // [3, C, S, S]
  EXPECT_TRUE(torch::equal(before, sample(den, x1, y, opt).x));         // a run repeats itself
  {
    torch::NoGradGuard ng;
    for (auto& p : net->parameters()) p.mul_(1.5);
  }
  const auto after = sample(den, x1, y, opt).x;
  EXPECT_FALSE(torch::equal(before, after));
  Net fresh = make_net(cfg);
  {
    torch::NoGradGuard ng;
    const auto from = net->parameters(), to = fresh->parameters();
    for (size_t i = 0; i < from.size(); ++i) to[i].copy_(from[i]);
  }
  Denoiser den2(fresh, path, Prediction::kVelocity, cfg.num_classes);
  den2.set_precision(Precision::kBf16);
  EXPECT_TRUE(torch::equal(after, sample(den2, x1, y, opt).x));
}

// fp16 sampling (`ddm sample --precision fp16`, for GPUs without bfloat16 tensor cores) runs the
// networks under float16 autocast: not float32's bits, finite, a run repeats itself bit for bit, and,
// with 3 more mantissa bits than bfloat16, it lands closer to float32's samples than bf16 does. For a
// DiT, a U-Net with attention, and a DiT attending to text through a padding mask.
TEST(Sampling, Fp16FollowsFp32CloserThanBf16) {
  for (const std::string name : {"dit-tiny", "unet-small", "dit-tiny text"}) {
    SCOPED_TRACE(name);
    torch::manual_seed(7);
    ModelConfig cfg = preset_cfg(name.substr(0, name.find(' ')));
    Cond y(torch::tensor({0, 1, 2}, torch::kLong));
    if (name.find("text") != std::string::npos) {
      cfg.text_dim = 24, cfg.text_tokens = 6;
      y.context = torch::randn({3, 6, 24});                                                   // [3, T, D]
      y.context_mask = torch::tensor({1, 1, 1, 0, 0, 0}, torch::kLong).repeat({3, 1});       // [3, T]
    }
    Net net = make_net(cfg);
    randomize(*net, 0.05);
    const NoisePath path(PathKind::kFlow);
    Denoiser den(net, path, Prediction::kVelocity, cfg.num_classes);
    const auto x1 = images_for(cfg, 3);  // [3, C, S, S]
    SampleOptions opt;
    opt.steps = 3;
    auto run = [&](Precision p) {
      den.set_precision(p);
      return sample(den, x1, y, opt).x;  // [3, C, S, S]
    };
    const auto fp32 = run(Precision::kFp32), fp16 = run(Precision::kFp16), bf16 = run(Precision::kBf16);
    EXPECT_EQ(fp16.scalar_type(), torch::kFloat);  // the sampler integrates in float32
    EXPECT_TRUE(torch::isfinite(fp16).all().item<bool>());
    EXPECT_TRUE(torch::equal(fp16, run(Precision::kFp16)));
    EXPECT_FALSE(torch::equal(fp16, fp32));  // it did run in float16
    const double scale = fp32.abs().max().item<double>();
    const double e16 = (fp16 - fp32).abs().max().item<double>() / scale;
    const double eb16 = (bf16 - fp32).abs().max().item<double>() / scale;
    EXPECT_LT(e16, eb16) << "fp16 " << e16 << ", bf16 " << eb16;
    EXPECT_LT(e16, 2e-3);  // a few of float16's roundings (2^-11 = 4.9e-4 of a value each) through 3 steps
    std::printf("%s: max |fp16 - fp32| %.2e, max |bf16 - fp32| %.2e of the largest sample value\n", name.c_str(), e16, eb16);
  }
}

namespace {
// Sets an environment variable for a scope and restores it after.
struct ScopedEnv {
  std::string name;
  bool had;
  std::string value;
  ScopedEnv(const char* n, const char* v) : name(n), had(std::getenv(n) != nullptr), value(had ? std::getenv(n) : "") {
    v ? setenv(n, v, 1) : unsetenv(n);
  }
  ~ScopedEnv() { had ? setenv(name.c_str(), value.c_str(), 1) : unsetenv(name.c_str()); }
};
}  // namespace

// The GroupNorm kernel (model/fused_gpu.h) is opt-in (DDM_FUSED_GROUPNORM=1) until a GPU has checked
// it, off with DDM_FUSED_CUDA=0, and never takes CPU tensors; the switches take 1 or 0 and refuse
// anything else; group_norm_act's CPU path is the expressions it replaced, bit for bit: silu(norm(x)) and silu(norm(x) * (1 + scale) + shift) with
// [B, C, 1, 1] views of the modulation, contiguous or channels-last.
TEST(FusedGpu, GroupNormKernelIsOptInAndItsCpuPathIsTheOldExpression) {
  torch::manual_seed(9);
  auto norm = torch::nn::GroupNorm(4, 8);
  {
    torch::NoGradGuard ng;
    norm->weight.normal_(1.0, 0.3);
    norm->bias.normal_(0.0, 0.3);
  }
  const auto x = torch::randn({3, 8, 5, 6}), ss = torch::randn({3, 16});
  const auto scale = ss.narrow(1, 0, 8), shift = ss.narrow(1, 8, 8);  // [3, 8], row stride 16
  {
    ScopedEnv off("DDM_FUSED_GROUPNORM", nullptr);
    EXPECT_FALSE(fused_group_norm_enabled());
  }
  {
    ScopedEnv on("DDM_FUSED_GROUPNORM", "1");
    EXPECT_TRUE(fused_group_norm_enabled());
    {
      ScopedEnv cuda_off("DDM_FUSED_CUDA", "0");
      EXPECT_FALSE(fused_group_norm_enabled());
    }
    EXPECT_FALSE(group_norm_act_cuda_supported(x, norm, scale, shift));  // a CPU tensor
    EXPECT_THROW(group_norm_act_cuda(x, norm, true, scale, shift), Error);
    for (const auto& in : {x, x.contiguous(at::MemoryFormat::ChannelsLast)}) {
      EXPECT_TRUE(torch::equal(group_norm_silu(norm, in), torch::silu(norm(in))));
      EXPECT_TRUE(torch::equal(group_norm_act(norm, in, /*silu=*/false), norm(in)));
      const auto ss4 = ss.unsqueeze(-1).unsqueeze(-1);                   // [3, 16, 1, 1], as ResBlock had it
      const auto old = torch::silu(torch::addcmul(ss4.narrow(1, 8, 8), norm(in), ss4.narrow(1, 0, 8) + 1.0));
      EXPECT_TRUE(torch::equal(group_norm_act(norm, in, /*silu=*/true, scale, shift), old));
    }
  }
  EXPECT_THROW(group_norm_act(norm, x, true, scale, torch::Tensor()), Error);  // scale without shift
  // A switch takes 1 or 0 (or nothing): another value is refused, naming it, not read as off.
  for (const char* name : {"DDM_FUSED_GROUPNORM", "DDM_CHANNELS_LAST", "DDM_FUSED_CUDA"}) {
    ScopedEnv bad(name, "yes");
    const std::string e = error_of([] { (void)fused_group_norm_enabled(), (void)channels_last_requested(); });
    EXPECT_NE(e.find(std::string(name) + "=yes: expected 1 (on) or 0 (off)"), std::string::npos) << e;
  }
  {
    ScopedEnv empty("DDM_CHANNELS_LAST", "");
    EXPECT_FALSE(channels_last_requested());
  }
}

// DDM_CHANNELS_LAST=1 (model/ops.h): a U-Net with attention, and one with SD's transformer (text
// cross-attention), computes what it computes in NCHW order, forward and every gradient, within
// float32 rounding (oneDNN's convolutions sum in another order in channels-last), and its output is in
// NCHW order again. The attention block reads the qkv convolution's channels-last output as tokens; a
// channel order mixed up there (or anywhere) would be far outside the bound, as one attention block's
// value channels in reverse order are.
TEST(Nets, AUNetInChannelsLastComputesWhatItComputesInNchw) {
  ModelConfig text;  // a small text U-Net (model/text_layers.h's transformer at level 1)
  text.arch = "unet";
  text.in_channels = 3, text.image_size = 8, text.num_classes = 0;
  text.channels = 16, text.channel_mult = {1, 2}, text.res_blocks = 1, text.attn_levels = {1}, text.groups = 4;
  text.heads = 2, text.text_dim = 12, text.text_pooled_dim = 6, text.text_tokens = 5;
  for (const ModelConfig& cfg : {preset_cfg("unet-small"), text}) {
    torch::manual_seed(11);
    ASSERT_FALSE(cfg.attn_levels.empty());
    Net net = make_net(cfg);
    randomize(*net, 0.05);
    const auto x = images_for(cfg, 2), t = torch::rand({2});
    Cond c(torch::tensor({3, 10}));
    if (cfg.text_dim > 0) {
      c = Cond();
      c.context = torch::randn({2, 5, 12});
      c.context_mask = torch::ones({2, 5}, torch::kInt64);
      c.context_mask[0][4] = 0;
      c.pooled = torch::randn({2, 6});
    }
    const auto w = torch::randn_like(x);
    struct Out { torch::Tensor out; std::vector<torch::Tensor> grads; };
    auto run = [&](const char* channels_last) {
      ScopedEnv env("DDM_CHANNELS_LAST", channels_last);
      net->zero_grad();
      const auto out = net->forward(x, t, c);                            // [2, C, S, S]
      weighted_sum(out, w).backward();
      Out o{out.detach(), {}};
      for (const auto& p : net->parameters()) o.grads.push_back(p.grad().clone());
      return o;
    };
    const Out nchw = run(nullptr), nhwc = run("1");
    const std::string which = cfg.text_dim > 0 ? "text U-Net" : "unet-small";
    EXPECT_TRUE(nhwc.out.is_contiguous()) << which;
    {  // the order holds through the encoder (its attention included) to the middle
      ScopedEnv env("DDM_CHANNELS_LAST", "1");
      torch::NoGradGuard ng;
      const auto f = net->as<UNetImpl>()->encode(x, t, c);
      EXPECT_TRUE(f.h.is_contiguous(at::MemoryFormat::ChannelsLast) && !f.h.is_contiguous()) << which;
      for (const auto& skip : f.skips) EXPECT_TRUE(skip.is_contiguous(at::MemoryFormat::ChannelsLast)) << which;
      // Unit by unit with the carry in NCHW order between units, as a pipeline's wire delivers it:
      // every unit puts what it reads back in channels-last order, and the output is the same.
      NetCarry k{x, {}, {}};
      for (const NetUnit& u : net->units()) {
        u.run(k, t, c);
        if (k.h.dim() == 4 && u.name != "out") {
          EXPECT_TRUE(k.h.is_contiguous(at::MemoryFormat::ChannelsLast)) << which << ", after " << u.name;
        }
        k.h = k.h.contiguous();
        for (auto& skip : k.skips) skip = skip.contiguous();
      }
      EXPECT_LT((k.h - nchw.out).abs().max().item<double>() / nchw.out.abs().max().item<double>(), 1e-4) << which;
    }
    auto rel = [](const torch::Tensor& a, const torch::Tensor& b) {
      return (a - b).abs().max().item<double>() / (b.abs().max().item<double>() + 1e-30);
    };
    // Float32 rounding through about 20 layers of convolutions of up to 9 x 256 terms: a few times 1e-6.
    constexpr double kBound = 1e-4;
    EXPECT_LT(rel(nhwc.out, nchw.out), kBound) << which;
    double worst = 0.0;
    for (size_t i = 0; i < nchw.grads.size(); ++i) worst = std::max(worst, rel(nhwc.grads[i], nchw.grads[i]));
    EXPECT_LT(worst, kBound) << which;
    std::printf("%s, channels-last against NCHW: output %.1e, gradients at most %.1e\n", which.c_str(),
                rel(nhwc.out, nchw.out), worst);
    // What a real difference looks like: one attention block's value channels in reverse order, a
    // mix-up of the kind a wrong layout would make.
    bool reversed = false;
    for (const auto& item : net->named_parameters()) {
      if (item.key().find("qkv.weight") == std::string::npos) continue;
      torch::NoGradGuard ng;
      const int64_t ch = item.value().size(0) / 3;
      const auto v = item.value().narrow(0, 2 * ch, ch);                // [ch, ...]: the value projection
      v.copy_(v.flip({0}));
      reversed = true;
      break;
    }
    ASSERT_TRUE(reversed) << which;
    EXPECT_GT(rel(run(nullptr).out, nchw.out), 10 * kBound) << which;
  }
}

}  // namespace ddm
