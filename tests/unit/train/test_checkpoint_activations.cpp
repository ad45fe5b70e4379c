// Activation checkpointing (train.checkpoint_activations, model/recompute.h): every splittable
// network (ddm's U-Net and DiT, diffusers' UNet and a ControlNet on a locked one) computes forward's
// output bit for bit and its gradients within float32 rounding unit by unit; it holds less memory
// between forward and backward; a training step with it trains what one without does; data
// parallelism's gradient hooks see one ordinary backward; and the networks and layouts it cannot
// serve are refused by name.
#include <gtest/gtest.h>

#include <numeric>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "comm/grad_sync.h"
#include "core/config.h"
#include "core/device.h"
#include "core/error.h"
#include "core/runtime.h"
#include "data/dataset.h"
#include "diffusion/objective.h"
#include "model/net.h"
#include "model/recompute.h"
#include "parallel/layout.h"
#include "sd/controlnet_model.h"
#include "sd/controlnet_net.h"
#include "sd/unet_net.h"
#include "test_util.h"
#include "unit/test_dist_util.h"
#include "train/optimizer.h"
#include "train/step.h"

using namespace ddm;

namespace {

ModelConfig small_model(const std::string& arch) {
  ModelConfig m;
  m.arch = arch;
  m.channels = 16;
  m.channel_mult = {1, 2};
  m.groups = 4;
  m.attn_levels = {1};
  m.width = 48;
  m.depth = 3;
  m.heads = 2;
  m.patch = 2;
  m.in_channels = 3;
  m.image_size = 16;
  m.num_classes = 4;
  return m;
}

// A small Stable Diffusion UNet (cross-attention on the first level) from a diffusers config.
sd::UNet2DConditionModel small_sd_unet() {
  const nlohmann::json j = {{"_class_name", "UNet2DConditionModel"},
                            {"block_out_channels", {16, 32}},
                            {"down_block_types", {"CrossAttnDownBlock2D", "DownBlock2D"}},
                            {"up_block_types", {"UpBlock2D", "CrossAttnUpBlock2D"}},
                            {"layers_per_block", 1},
                            {"cross_attention_dim", 12},
                            {"attention_head_dim", 8},
                            {"norm_num_groups", 8},
                            {"in_channels", 4},
                            {"out_channels", 4},
                            {"sample_size", 8}};
  return sd::UNet2DConditionModel(sd::parse_unet_2d_condition_config(j, "unet/config.json"));
}

struct Case {
  std::string name;
  Net net;
  torch::Tensor x;
  Cond c;
};

std::vector<Case> cases() {
  std::vector<Case> out;
  torch::manual_seed(3);
  for (const char* arch : {"unet", "dit"}) {
    Net net = make_net(small_model(arch));
    // Parameters away from their zero initialisation (adaLN-Zero, zero output layers), so that
    // every gradient is non-zero.
    torch::NoGradGuard ng;
    for (auto& p : net->parameters()) p.add_(torch::randn_like(p) * 0.05);
    out.push_back({arch, net, torch::randn({3, 3, 16, 16}), Cond(torch::tensor({0, 2, 4}))});
  }
  Cond text;
  text.context = torch::randn({3, 5, 12});
  out.push_back({"sd-unet", std::make_shared<sd::SdUNetNetImpl>(small_sd_unet(), 1000), torch::randn({3, 4, 8, 8}), text});
  sd::UNet2DConditionModel unet = small_sd_unet();
  sd::ControlNetModel cn(sd::controlnet_config_from_unet(unet->config(), 3, {8, 16}));
  cn->copy_encoder_from(*unet);
  {
    torch::NoGradGuard ng;
    for (auto& p : cn->parameters()) p.add_(torch::randn_like(p) * 0.05);  // the zero convolutions too
  }
  auto control = std::make_shared<sd::SdControlNetNetImpl>(unet, cn, 1000);
  control->set_unet_loaded();
  Cond hint = text;
  hint.control = torch::rand({3, 1, 16, 16}) * 2 - 1;  // a one-channel map at twice the latents' size
  out.push_back({"sd-controlnet", control, torch::randn({3, 4, 8, 8}), hint});
  return out;
}

std::pair<torch::Tensor, torch::Tensor> output_and_grads(Case& k, bool recompute) {
  k.net->zero_grad();
  const torch::Tensor t = torch::tensor({0.1f, 0.5f, 0.9f});
  const Cond c = k.net->precompute(k.x, t, k.c);
  const torch::Tensor out = recompute ? forward_recomputed(*k.net, k.x, t, c) : k.net->forward(k.x, t, c);
  torch::manual_seed(9);
  (out * torch::randn_like(out)).sum().backward();
  std::vector<torch::Tensor> g;
  for (const auto& p : k.net->parameters())
    if (p.requires_grad()) g.push_back(p.grad().flatten());
  return {out.detach(), torch::cat(g)};
}

}  // namespace

// Output bit for bit (the units are forward); gradients within float32 rounding. A tensor read by
// several ops (a skip read by the next block and by the decoder, the time embedding) sums its
// gradient's parts per unit first, then over units: another association than the plain backward's.
// Here on one thread they come out bit for bit; on two, diffusers' UNet's differ in the last bits.
TEST(CheckpointActivations, OutputBitForBitAndGradientsWithinRounding) {
  for (Case& k : cases()) {
    SCOPED_TRACE(k.name);
    const auto [out, grads] = output_and_grads(k, false);
    const auto [out_r, grads_r] = output_and_grads(k, true);
    EXPECT_TRUE(out_r.equal(out));
    ASSERT_EQ(grads_r.sizes(), grads.sizes());
    EXPECT_GT((grads != 0).sum().item<int64_t>(), grads.numel() * 9 / 10);
    // Each element is a sum of products re-associated in a few places; 1e-5 of the largest gradient
    // is about a hundred float32 roundings of it.
    const double off = (grads_r - grads).abs().max().item<double>(), scale = grads.abs().max().item<double>();
    EXPECT_LE(off, 1e-5 * scale);
    ::testing::Test::RecordProperty(k.name + "_gradient_off_relative", std::to_string(off / scale));
  }
}

// Between forward and backward, what the unit-by-unit forward keeps (each unit's inputs) is a small
// part of what the plain forward keeps (every intermediate).
TEST(CheckpointActivations, HoldsLessMemoryBetweenForwardAndBackward) {
  ModelConfig m = small_model("unet");
  m.image_size = 32;
  torch::manual_seed(1);
  Net net = make_net(m);
  const torch::Tensor x = torch::randn({16, 3, 32, 32});
  const torch::Tensor t = torch::rand({16});
  const Cond c(torch::randint(0, 4, {16}));
  double held[2];
  for (const bool recompute : {false, true}) {
    const double before = allocated_bytes();
    torch::Tensor out = recompute ? forward_recomputed(*net, x, t, c) : net->forward(x, t, c);
    held[recompute] = allocated_bytes() - before;
    out.sum().backward();
  }
  ::testing::Test::RecordProperty("held_bytes_plain", std::to_string(held[0]));
  ::testing::Test::RecordProperty("held_bytes_checkpointed", std::to_string(held[1]));
  EXPECT_GT(held[0], 0);
  EXPECT_LT(held[1], 0.25 * held[0]) << "plain " << held[0] << " bytes, checkpointed " << held[1];
}

// A training step unit by unit trains what a plain one does, step after step, within rounding; under
// no-grad the recomputed net is the network itself.
TEST(CheckpointActivations, TrainStepTrainsAsWithoutWithinRounding) {
  RunConfig cfg;
  cfg.model = small_model("unet");
  cfg.train.warmup = 0;
  cfg.train.seed = 4;
  torch::manual_seed(2);
  const Batch batch{torch::rand({6, 3, 16, 16}) * 2 - 1, torch::randint(0, 4, {6}), torch::randint(0, 2, {6}), 0};
  std::vector<torch::Tensor> weights;
  std::vector<double> losses;
  for (const bool on : {false, true}) {
    RunConfig c = cfg;
    c.train.checkpoint_activations = on;
    torch::manual_seed(7);
    TrainStep step(c, make_net(c.model), make_objective(c));
    for (int64_t s = 0; s < 3; ++s) losses.push_back(step.run(batch, s).loss);
    weights.push_back(step.optim().flat_params().clone());
  }
  for (int s = 0; s < 3; ++s) EXPECT_NEAR(losses[3 + s], losses[s], 1e-5 * std::abs(losses[s]));
  EXPECT_LE((weights[1] - weights[0]).abs().max().item<double>(), 1e-5 * weights[0].abs().max().item<double>());
  EXPECT_FALSE(weights[0].equal(make_net(cfg.model)->parameters()[0]));

  auto net = make_net(cfg.model);
  RecomputedNetImpl recomputed(net);
  torch::NoGradGuard ng;
  EXPECT_TRUE(recomputed.forward(batch.x, torch::rand({6}), Cond(batch.y)).defined());
}

TEST(CheckpointActivations, NetworksAndLayoutsItCannotServeAreRefusedByName) {
  RunConfig cfg;
  cfg.model = small_model("autoencoder");
  cfg.model.latent_channels = 4;
  TrainStep step(cfg, make_net(cfg.model), make_objective(cfg));
  cfg.train.checkpoint_activations = true;
  try {
    TrainStep refused(cfg, make_net(cfg.model), make_objective(cfg));
    ADD_FAILURE() << "an autoencoder was checkpointed";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("train.checkpoint_activations: "), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("cannot be split"), std::string::npos) << e.what();
  }
  // A conditioning tensor that needs a gradient cannot flow through a unit.
  Net net = make_net(small_model("unet"));
  Cond c(torch::tensor({1}));
  c.embed = torch::randn({1, 4}).requires_grad_(true);
  EXPECT_THROW(forward_recomputed(*net, torch::randn({1, 3, 16, 16}), torch::rand({1}), c), Error);

  RunConfig pp;
  pp.model = small_model("unet");
  pp.parallel.pp = 2;
  pp.train.batch_size = 4;
  pp.train.checkpoint_activations = true;
  try {
    derive_layout(pp, 2, 0);
    ADD_FAILURE() << "pipeline stages were checkpointed";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("train.checkpoint_activations is not supported with pipeline stages"),
              std::string::npos)
        << e.what();
  }
}

// Each parameter's gradient reaches its accumulator in the outer backward, once, in the plain
// order: GradSync launches its buckets from the hooks while backward runs (no repeated firing, no
// re-entrant pass), the ranks agree bit for bit and hold the mean of their plain gradients within
// rounding.
TEST(CheckpointActivations, DataParallelHooksSeeOneOrdinaryBackward) {
  torch::set_num_threads(1);
  const ModelConfig m = small_model("unet");
  std::vector<torch::Tensor> plain(2), synced(2);
  std::vector<GradSyncStats> stats(2);
  const auto errors = test::run_ranks(2, test::short_timeouts(), [&](Comm& c) {
    const int r = c.rank();
    torch::manual_seed(100 + r);
    const torch::Tensor x = torch::randn({2, 3, 16, 16}), t = torch::rand({2});
    const Cond cond(torch::randint(0, 4, {2}));
    auto grads = [&](bool recompute, bool synchronized) {
      torch::manual_seed(0);
      Net net = make_net(m);
      FlatAdamW opt(*net, AdamWOptions{});
      std::unique_ptr<GradSync> sync;
      if (synchronized) sync = std::make_unique<GradSync>(std::shared_ptr<Comm>(&c, [](Comm*) {}), opt.params(), opt.flat_grad(), [] {
        GradSyncOptions o;
        o.first_bucket_bytes = o.bucket_cap_bytes = 16 << 10;  // a dozen buckets
        return o;
      }());
      const torch::Tensor out = recompute ? forward_recomputed(*net, x, t, cond) : net->forward(x, t, cond);
      out.square().mean().backward();
      if (sync) {
        sync->finish();
        stats[r] = sync->last_stats();
      }
      return opt.flat_grad().clone();
    };
    plain[r] = grads(/*recompute=*/false, /*synchronized=*/false);
    synced[r] = grads(/*recompute=*/true, /*synchronized=*/true);
  });
  ASSERT_EQ(errors[0], "");
  ASSERT_EQ(errors[1], "");
  EXPECT_TRUE(synced[1].equal(synced[0]));
  const torch::Tensor mean = plain[0] / 2 + plain[1] / 2;
  EXPECT_LE((synced[0] - mean).abs().max().item<double>(), 1e-5 * mean.abs().max().item<double>());
  for (const GradSyncStats& s : stats) {
    EXPECT_TRUE(s.from_hooks);
    EXPECT_EQ(s.repeated_hooks, 0);
    EXPECT_GT(s.launch_order.size(), 4u);
    EXPECT_GE(s.launched_early, static_cast<int>(s.launch_order.size()) - 1);
    std::vector<int> in_order(s.launch_order.size());
    std::iota(in_order.begin(), in_order.end(), 0);
    EXPECT_EQ(s.launch_order, in_order);  // last layers first, as without checkpointing
  }
}
