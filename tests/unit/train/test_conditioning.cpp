// Tests for what a network is conditioned on besides the label. ControlNet (model/controlnet.h) and
// control maps (data/control.h): at initialization the output is the locked base's exactly; the
// precomputed locked encoder gives the same output as computing it in forward; only the control
// branch trains, and gradients reach it through the locked decoder; control maps against hand values.
// The conditioning struct slices and concatenates. Self-conditioning: the estimate as more input
// channels, the training pass's first-pass estimate for keyed chosen samples, and samplers feeding
// each evaluation's estimate to the next. Image embeddings: the learned null embedding, dropped with
// the label, the shipped network's normalized embeddings. Guidance: what each branch receives.
#include <map>
#include <string>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "core/config.h"
#include "core/error.h"
#include "data/control.h"
#include "data/dataset.h"
#include "diffusion/denoiser.h"
#include "diffusion/objective.h"
#include "diffusion/sampler.h"
#include "eval/feature_net.h"
#include "model/controlnet.h"
#include "model/dit.h"
#include "model/net.h"
#include "model/unet.h"
#include "train/embed.h"
#include "train/step.h"
#include "test_util.h"

namespace ddm {
namespace {

ModelConfig base_cfg() {
  ModelConfig c;
  c.arch = "unet";
  c.in_channels = 1;
  c.image_size = 8;
  c.num_classes = 3;
  c.channels = 8;
  c.channel_mult = {1, 2};
  c.res_blocks = 1;
  c.attn_levels = {1};
  c.heads = 2;
  c.groups = 4;
  return c;
}

void randomize(torch::nn::Module& m, double std = 0.3) {
  torch::NoGradGuard ng;
  for (auto& p : m.parameters()) p.normal_(0.0, std);
}

// A trained-looking base (random weights, so its output is not the zero of a fresh out_conv) and a
// ControlNet on it, wired as train/controlnet.h wires them: the base's weights, the copy from its encoder.
struct Pair {
  std::shared_ptr<UNetImpl> base;
  std::shared_ptr<ControlNetImpl> cn;
};
Pair make_pair(const std::string& control = "edges") {
  torch::manual_seed(3);
  Pair p;
  p.base = std::make_shared<UNetImpl>(base_cfg());
  randomize(*p.base);
  ModelConfig c = base_cfg();
  c.controlnet = "base";
  c.control = control;
  p.cn = std::make_shared<ControlNetImpl>(c);
  torch::NoGradGuard ng;
  const auto b = p.base->named_parameters();
  for (auto& q : p.cn->base().named_parameters()) q.value().copy_(b[q.key()]);
  for (auto& q : p.cn->control().named_parameters()) q.value().copy_(b[q.key()]);
  p.cn->set_base_loaded();
  return p;
}

struct Inputs {
  torch::Tensor x, t;
  Cond c;
};
Inputs inputs(int64_t b = 4) {
  torch::manual_seed(5);
  Inputs in;
  in.x = torch::randn({b, 1, 8, 8});
  in.t = torch::rand({b});
  in.c = Cond(torch::tensor({0, 1, 2, 3}, torch::kLong).narrow(0, 0, b));  // 3 = the null class
  in.c.control = torch::rand({b, 1, 8, 8}) * 2 - 1;
  return in;
}

TEST(ControlNet, EqualsTheLockedBaseExactlyAtInitialization) {
  Pair p = make_pair();
  const Inputs in = inputs();
  const auto want = p.base->forward(in.x, in.t, in.c.y);  // [B, 1, 8, 8]
  const auto got = p.cn->forward(in.x, in.t, in.c);
  EXPECT_TRUE(torch::equal(got, want)) << (got - want).abs().max().item<float>();
  // Every residual is an exact zero, whatever the control map.
  for (const auto& r : p.cn->residuals(in.x, in.t, in.c)) EXPECT_EQ(r.abs().max().item<float>(), 0.0f);
  // Once the zero convolutions have learnt something, the control map changes the output.
  {
    torch::NoGradGuard ng;
    for (auto& q : p.cn->named_parameters())
      if (q.key().rfind("zero", 0) == 0 || q.key().rfind("hint", 0) == 0) q.value().normal_(0.0, 0.3);
  }
  EXPECT_FALSE(torch::allclose(p.cn->forward(in.x, in.t, in.c), want, 1e-3, 1e-3));
}

TEST(ControlNet, PrecomputedLockedEncoderGivesTheSameOutput) {
  Pair p = make_pair("lowres");
  randomize(*p.cn);  // the trainable part, so the residuals are not zero
  const Inputs in = inputs();
  const Cond pre = p.cn->precompute(in.x, in.t, in.c);
  EXPECT_EQ(pre.frozen.size(), p.cn->base().skip_channels().size() + 2);
  for (const auto& f : pre.frozen) EXPECT_FALSE(f.requires_grad());
  EXPECT_TRUE(torch::equal(p.cn->forward(in.x, in.t, pre), p.cn->forward(in.x, in.t, in.c)));
}

TEST(ControlNet, OnlyTheControlBranchTrainsAndItsGradientPassesTheLockedDecoder) {
  Pair p = make_pair();
  // The base is not a registered submodule: none of its parameters is in the ControlNet's.
  for (const auto& q : p.cn->named_parameters()) {
    const std::string& k = q.key();
    EXPECT_TRUE(k.rfind("control.", 0) == 0 || k.rfind("hint.", 0) == 0 || k.rfind("zero", 0) == 0) << k;
  }
  for (const auto& q : p.cn->base().parameters()) EXPECT_FALSE(q.requires_grad());
  EXPECT_EQ(p.cn->named_parameters()["control.in_conv.weight"].numel(),
            p.base->named_parameters()["in_conv.weight"].numel());
  const Inputs in = inputs();
  const Cond pre = p.cn->precompute(in.x, in.t, in.c);
  p.cn->forward(in.x, in.t, pre).pow(2).sum().backward();
  // At initialization only the zero convolutions receive gradient (everything before them is
  // multiplied by their zero weights); it reached them through the locked decoder.
  for (const auto& q : p.cn->named_parameters()) {
    const bool zero_conv = q.key().rfind("zero", 0) == 0 && q.key().find("weight") != std::string::npos;
    if (zero_conv) {
      ASSERT_TRUE(q.value().grad().defined()) << q.key();
      EXPECT_GT(q.value().grad().abs().max().item<float>(), 0.0f) << q.key();
    }
  }
  for (const auto& q : p.cn->base().parameters()) EXPECT_FALSE(q.grad().defined());
}

TEST(ControlNet, TrainingStepsLeaveTheLockedBaseBitIdenticalAndOutOfTheOptimizer) {
  Pair p = make_pair();
  RunConfig cfg;
  cfg.model = base_cfg();
  cfg.model.controlnet = "base";
  cfg.train.lr = 1e-2;
  cfg.train.warmup = 0;
  std::map<std::string, torch::Tensor> before;
  for (const auto& q : p.cn->base().named_parameters()) before[q.key()] = q.value().clone();
  const auto copy_before = p.cn->control().named_parameters()["in_conv.weight"].clone();
  TrainStep step(cfg, p.cn, make_objective(cfg));
  // The optimizer holds the trainable part only: its flat buffer is the ControlNet's parameters.
  EXPECT_EQ(step.optim().numel(), count_params(*p.cn));
  for (const auto& [name, t] : step.optim().named_params())
    EXPECT_TRUE(name.rfind("control.", 0) == 0 || name.rfind("hint.", 0) == 0 || name.rfind("zero", 0) == 0) << name;
  torch::manual_seed(7);
  for (int64_t i = 0; i < 3; ++i) {
    Batch b{torch::rand({8, 1, 8, 8}) * 2 - 1, torch::randint(0, 3, {8}, torch::kLong), {}, 0};
    ASSERT_TRUE(step.run(b, i).finite);
  }
  for (const auto& q : p.cn->base().named_parameters()) {
    EXPECT_TRUE(torch::equal(q.value(), before[q.key()])) << q.key();
    EXPECT_FALSE(q.value().grad().defined()) << q.key();
  }
  // ... while the trainable copy did move (after the first step the zero convolutions are not zero).
  EXPECT_FALSE(torch::equal(p.cn->control().named_parameters()["in_conv.weight"], copy_before));
}

TEST(ControlNet, ControlMapsAreRequiredAndShapeChecked) {
  Pair p = make_pair();
  Inputs in = inputs();
  Cond none(in.c.y);
  EXPECT_THROW(p.cn->forward(in.x, in.t, none), Error);
  in.c.control = torch::zeros({4, 2, 8, 8});
  try {
    p.cn->forward(in.x, in.t, in.c);
    ADD_FAILURE() << "a 2-channel edges map was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("model.control = edges"), std::string::npos) << e.what();
  }
  // A ControlNet whose base was never loaded refuses to run instead of using random weights.
  ModelConfig c = base_cfg();
  c.controlnet = "base";
  ControlNetImpl unloaded(c);
  EXPECT_THROW(unloaded.forward(in.x, in.t, inputs().c), Error);
}

TEST(Cond, RowsAndCatKeepEveryPerSampleField) {
  Cond a(torch::tensor({1, 2, 3}, torch::kLong));
  a.control = torch::arange(3 * 4, torch::kFloat).view({3, 1, 2, 2});
  const Cond r = a.rows(1, 2);
  EXPECT_TRUE(torch::equal(r.y, torch::tensor({2, 3}, torch::kLong)));
  EXPECT_TRUE(torch::equal(r.control, a.control.narrow(0, 1, 2)));
  const Cond c = Cond::cat(a, r);
  EXPECT_EQ(c.y.size(0), 5);
  EXPECT_TRUE(torch::equal(c.control.narrow(0, 3, 2), r.control));
  EXPECT_THROW(Cond::cat(a, Cond(a.y)), Error);  // one with a control map, one without
}

TEST(ControlMap, EdgesOfAStepAndOfAFlatImage) {
  // A flat image has no edges: -1 everywhere.
  EXPECT_EQ(control_map("edges", torch::full({1, 1, 6, 6}, 0.3f)).max().item<float>(), -1.0f);
  // A vertical step from -1 to 1 between columns 2 and 3: the Sobel x-derivative there is
  // (1 + 2 + 1) * 2 = 8, |g| / 4 = 2, clamped to 1; two columns away it is 0.
  auto img = torch::full({1, 1, 6, 6}, -1.0f);
  img.narrow(3, 3, 3).fill_(1.0f);
  const auto e = control_map("edges", img);  // [1, 1, 6, 6]
  EXPECT_EQ(e.sizes(), (std::vector<int64_t>{1, 1, 6, 6}));
  for (int64_t r = 0; r < 6; ++r) {
    EXPECT_EQ(e[0][0][r][2].item<float>(), 1.0f);
    EXPECT_EQ(e[0][0][r][3].item<float>(), 1.0f);
    EXPECT_EQ(e[0][0][r][0].item<float>(), -1.0f);
    EXPECT_EQ(e[0][0][r][5].item<float>(), -1.0f);
  }
  // Channels are averaged first: a 3-channel image of the same step gives the same map.
  EXPECT_TRUE(torch::equal(control_map("edges", img.expand({1, 3, 6, 6})), e));
}

TEST(ControlMap, LowresIsTheBlockMeanEnlarged) {
  const auto img = torch::linspace(-1, 1, 64).view({1, 1, 8, 8});
  const auto m = control_map("lowres", img);  // [1, 1, 8, 8]
  const double block = img.narrow(2, 4, 4).narrow(3, 0, 4).mean().item<double>();
  for (int64_t r = 4; r < 8; ++r)
    for (int64_t c = 0; c < 4; ++c) EXPECT_NEAR(m[0][0][r][c].item<double>(), block, 1e-6);
  // A side not divisible by 4: the edge blocks are partial, and each pixel still takes its own block's mean.
  const auto odd = torch::linspace(-1, 1, 36).view({1, 1, 6, 6});
  const auto mo = control_map("lowres", odd);
  EXPECT_NEAR(mo[0][0][5][5].item<double>(), odd.narrow(2, 4, 2).narrow(3, 4, 2).mean().item<double>(), 1e-6);
  EXPECT_NEAR(mo[0][0][3][4].item<double>(), odd.narrow(2, 0, 4).narrow(3, 4, 2).mean().item<double>(), 1e-6);
  EXPECT_THROW(control_map("canny", img), Error);
  // Fidelity: a sample whose map is the given one scores 0; another scores more.
  EXPECT_EQ(control_error("lowres", img, m), 0.0);
  EXPECT_GT(control_error("lowres", -img, m), 0.1);
}

TEST(SelfCond, TheEstimateIsMoreInputChannelsAndAbsentMeansZeros) {
  for (const std::string arch : {"unet", "dit"}) {
    ModelConfig c = base_cfg();
    c.arch = arch;
    c.patch = 2;
    c.width = 16;
    c.depth = 1;
    c.self_cond = true;
    torch::manual_seed(1);
    Net net = make_net(c);
    randomize(*net);
    EXPECT_TRUE(net->self_conditioned()) << arch;
    const Inputs in = inputs();
    Cond zeros(in.c.y), est(in.c.y);
    zeros.self_cond = torch::zeros_like(in.x);
    est.self_cond = torch::randn_like(in.x);
    const auto none = net->forward(in.x, in.t, Cond(in.c.y));
    EXPECT_TRUE(torch::equal(none, net->forward(in.x, in.t, zeros))) << arch;
    EXPECT_FALSE(torch::allclose(none, net->forward(in.x, in.t, est), 1e-3, 1e-3)) << arch;
    c.self_cond = false;
    EXPECT_GT(forward_flops_per_image(base_cfg()), 0);
    EXPECT_FALSE(make_net(c)->self_conditioned());
  }
  EXPECT_GT(unet_forward_flops([] { ModelConfig c = base_cfg(); c.self_cond = true; return c; }()),
            unet_forward_flops(base_cfg()));
}

TEST(SelfCond, ChosenSamplesGetTheCurrentModelsEstimateKeyedPerSample) {
  RunConfig cfg;
  cfg.model = base_cfg();
  cfg.model.self_cond = true;
  cfg.train.self_cond = 0.5;
  cfg.train.label_dropout = 0;
  const Objective obj(cfg);
  torch::manual_seed(2);
  Net net = make_net(cfg.model);
  randomize(*net);
  const int64_t b = 64;
  Batch batch{torch::rand({b, 1, 8, 8}) * 2 - 1, torch::randint(0, 3, {b}, torch::kLong), {}, 0};
  torch::NoGradGuard ng;
  Prepared p = obj.prepare(batch, 5);
  obj.self_condition(*net, p, batch.first, 5);
  ASSERT_TRUE(p.cond.self_cond.defined());
  const NoisePath path = make_path(cfg.diffusion);
  Cond first(p.cond.y);
  const auto f = net->forward(p.xt, p.t, first);  // the first pass, on every sample
  const Scalings sc = scalings(path, prediction_for(cfg.diffusion), p.t);
  const auto x0 = sc.c_skip * p.xt + sc.c_out * f;
  int64_t chosen = 0;
  for (int64_t j = 0; j < b; ++j) {
    const auto got = p.cond.self_cond[j];
    if (got.abs().max().item<float>() == 0.0f) continue;
    ++chosen;
    // Batch composition may change float rounding inside the network: a float32 tolerance.
    EXPECT_TRUE(torch::allclose(got, x0[j], 1e-4, 1e-5)) << j;
  }
  EXPECT_GT(chosen, b / 4);
  EXPECT_LT(chosen, 3 * b / 4);
  // Which samples are chosen depends on their global position only, not on the split.
  Batch second{batch.x.narrow(0, 32, 32), batch.y.narrow(0, 32, 32), {}, 32};
  Prepared q = obj.prepare(second, 5);
  obj.self_condition(*net, q, second.first, 5);
  for (int64_t j = 0; j < 32; ++j)
    EXPECT_EQ(q.cond.self_cond[j].abs().max().item<float>() == 0.0f,
              p.cond.self_cond[32 + j].abs().max().item<float>() == 0.0f) << j;
  // The first pass runs under no-grad even when the caller records gradients: it leaves no graph.
  {
    torch::AutoGradMode on(true);
    Prepared g = obj.prepare(batch, 6);
    obj.self_condition(*net, g, batch.first, 6);
    EXPECT_FALSE(g.cond.self_cond.requires_grad());
    EXPECT_FALSE(g.cond.self_cond.grad_fn());
  }
  // Off (train.self_cond = 0): nothing is run and nothing set.
  cfg.train.self_cond = 0;
  Prepared r = Objective(cfg).prepare(batch, 5);
  Objective(cfg).self_condition(*net, r, 0, 5);
  EXPECT_FALSE(r.cond.self_cond.defined());
}

// Records what it is given and outputs x / 2 (any fixed function will do).
struct RecordingNet : NetImpl {
  std::vector<Cond> seen;
  std::vector<torch::Tensor> xs, ts;
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& t, const Cond& c) override {
    seen.push_back(c);
    xs.push_back(x);
    ts.push_back(t);
    return x * 0.5;
  }
  bool self_conditioned() const override { return true; }
};

TEST(SelfCond, SamplersFeedEachEvaluationsEstimateToTheNext) {
  torch::manual_seed(12);  // the same draws in every run: LibTorch seeds its default generator anew per process
  for (const std::string kind : {"euler", "heun", "ddim"}) {
    auto net = std::make_shared<RecordingNet>();
    const NoisePath path(PathKind::kFlow);
    Denoiser den(net, path, Prediction::kVelocity, 0);
    ASSERT_TRUE(den.self_conditioned());
    SampleOptions opt;
    opt.sampler = kind;
    opt.steps = 3;
    sample(den, torch::randn({2, 1, 4, 4}), Cond(torch::zeros({2}, torch::kLong)), opt);
    ASSERT_EQ(net->seen.size(), static_cast<size_t>(sampler_nfe(kind, 3))) << kind;
    EXPECT_FALSE(net->seen[0].self_cond.defined()) << kind;  // no estimate before the first evaluation
    for (size_t k = 1; k < net->seen.size(); ++k) {
      const Scalings sc = scalings(path, Prediction::kVelocity, net->ts[k - 1]);
      const auto want = sc.c_skip * net->xs[k - 1] + sc.c_out * (net->xs[k - 1] * 0.5);  // the previous x0
      ASSERT_TRUE(net->seen[k].self_cond.defined()) << kind << " " << k;
      EXPECT_TRUE(torch::allclose(net->seen[k].self_cond, want, 1e-6, 1e-6)) << kind << " " << k;
    }
  }
}

TEST(Guidance, BranchesShareControlEstimateAndEmbeddingButNotLabelOrEmbeddingUse) {
  torch::manual_seed(13);  // the same draws in every run: LibTorch seeds its default generator anew per process
  auto net = std::make_shared<RecordingNet>();
  Denoiser den(net, NoisePath(PathKind::kFlow), Prediction::kVelocity, 3);
  Cond c(torch::tensor({0, 2}, torch::kLong));
  c.control = torch::rand({2, 1, 4, 4});
  c.self_cond = torch::rand({2, 1, 4, 4});
  c.embed = torch::rand({2, 5});
  const auto x = torch::randn({2, 1, 4, 4}), t = torch::full({2}, 0.5);
  den.estimate(x, t, c, 2.0);
  ASSERT_EQ(net->seen.size(), 1u);
  const Cond& both = net->seen[0];  // one batch: conditional rows, then unconditional rows
  EXPECT_TRUE(torch::equal(both.y, torch::tensor({0, 2, 3, 3}, torch::kLong)));
  EXPECT_TRUE(torch::equal(both.control, torch::cat({c.control, c.control})));
  EXPECT_TRUE(torch::equal(both.self_cond, torch::cat({c.self_cond, c.self_cond})));
  EXPECT_TRUE(torch::equal(both.embed, torch::cat({c.embed, c.embed})));
  EXPECT_TRUE(torch::equal(both.embed_null, torch::tensor({false, false, true, true})));
  // w = 1: the conditional branch alone, as given.
  den.estimate(x, t, c, 1.0);
  EXPECT_TRUE(torch::equal(net->seen[1].y, c.y));
  EXPECT_FALSE(net->seen[1].embed_null.defined());
  // A model without classes is still guided over its embedding.
  auto net0 = std::make_shared<RecordingNet>();
  Denoiser den0(net0, NoisePath(PathKind::kFlow), Prediction::kVelocity, 0);
  den0.estimate(x, t, c, 2.0);
  EXPECT_EQ(net0->xs[0].size(0), 4);
  EXPECT_TRUE(torch::equal(net0->seen[0].y, torch::zeros({4}, torch::kLong)));
  Cond plain(c.y);
  den0.estimate(x, t, plain, 2.0);  // nothing to guide over: one branch
  EXPECT_EQ(net0->xs[1].size(0), 2);
}

TEST(Embed, NullRowsTakeTheLearnedNullEmbedding) {
  torch::manual_seed(4);
  EmbedProjector proj(5, 6);
  randomize(*proj);
  const auto null = proj->named_parameters()["null"];
  Cond c;
  c.embed = torch::rand({3, 5});
  c.embed_null = torch::tensor({false, true, false});
  const auto e = proj->forward(c, 3);  // [3, 6]
  EXPECT_TRUE(torch::equal(e[1], null));
  EXPECT_FALSE(torch::allclose(e[0], null));
  EXPECT_FALSE(torch::allclose(e[0], e[2]));
  EXPECT_TRUE(torch::equal(proj->forward(Cond(), 2), null.expand({2, 6})));  // no embedding: all null
  c.embed = torch::rand({3, 4});
  EXPECT_THROW(proj->forward(c, 3), Error);
  // A U-Net with an embedding: the null embedding starts at zero, so at first it changes nothing.
  ModelConfig m = base_cfg();
  m.embed_dim = 5;
  UNetImpl with(m), without(base_cfg());
  {
    torch::NoGradGuard ng;
    auto w = with.named_parameters();
    for (const auto& q : without.named_parameters()) w[q.key()].copy_(q.value());
  }
  const Inputs in = inputs();
  EXPECT_TRUE(torch::equal(with.encode(in.x, in.t, Cond(in.c.y)).h, without.encode(in.x, in.t, Cond(in.c.y)).h));
}

TEST(Embed, DroppedWithTheLabelInOneKeyedDraw) {
  torch::manual_seed(14);  // the same draws in every run: LibTorch seeds its default generator anew per process
  RunConfig cfg;
  cfg.model = base_cfg();
  cfg.train.label_dropout = 0.5;
  for (const int64_t classes : {3, 0}) {
    cfg.model.num_classes = classes;
    Objective obj(cfg);
    obj.set_embedder([](const torch::Tensor& x) { return x.flatten(1).narrow(1, 0, 5); });
    Batch b{torch::rand({200, 1, 8, 8}), torch::zeros({200}, torch::kLong), {}, 0};
    torch::NoGradGuard ng;
    const Prepared p = obj.prepare(b, 1);
    EXPECT_TRUE(torch::equal(p.cond.embed, b.x.flatten(1).narrow(1, 0, 5)));
    const double dropped = p.cond.embed_null.to(torch::kDouble).mean().item<double>();
    EXPECT_GT(dropped, 0.35);
    EXPECT_LT(dropped, 0.65);
    if (classes > 0) {
      EXPECT_TRUE(torch::equal(p.cond.embed_null, p.cond.y == classes));
    }
  }
}

TEST(Embed, TheShippedNetworksEmbeddingsHaveNormSqrtDAndSelfSimilarityOne) {
  torch::manual_seed(15);  // the same draws in every run: LibTorch seeds its default generator anew per process
  ModelConfig m;
  m.embed = default_feature_net_path();
  m.embed_sha256 = kDefaultFeatureNetSha256;
  const auto e = ImageEmbedder::load(m);
  EXPECT_EQ(e->dim(), 128);
  const auto imgs = torch::rand({6, 1, 28, 28}) * 2 - 1;
  const auto z = e->embed(imgs);  // [6, 128]
  EXPECT_TRUE(torch::allclose(z.norm(2, 1), torch::full({6}, std::sqrt(128.0)), 1e-4, 1e-4));
  EXPECT_NEAR(embed_similarity(*e, imgs, imgs), 1.0, 1e-5);
  EXPECT_LT(embed_similarity(*e, imgs, imgs.flip({0})), 1.0);
  m.embed_sha256 = std::string(64, '0');
  try {
    ImageEmbedder::load(m);
    ADD_FAILURE() << "a wrong hash was accepted";
  } catch (const Error& err) {
    EXPECT_NE(std::string(err.what()).find("model.embed_sha256"), std::string::npos) << err.what();
  }
}


// Caption dropout (train.caption_dropout, Objective::captions_after_dropout): one keyed draw per
// sample by its position in the global batch, so a batch split across ranks or micro-batches drops
// the same captions; about the configured share; a batch without captions is a clear error.
TEST(CaptionDropout, KeyedPerSampleAtTheConfiguredRate) {
  RunConfig cfg;
  cfg.model.in_channels = 1, cfg.model.image_size = 4;
  cfg.train.caption_dropout = 0.25;
  cfg.train.seed = 9;
  const Objective objective(cfg);
  Batch b;
  b.x = torch::zeros({4000, 1, 4, 4});
  b.y = torch::zeros({4000}, torch::kLong);
  for (int i = 0; i < 4000; ++i) b.captions.push_back("caption " + std::to_string(i));
  const auto out = objective.captions_after_dropout(b, 7);
  int64_t dropped = 0;
  for (size_t i = 0; i < out.size(); ++i) {
    if (out[i].empty()) ++dropped;
    else EXPECT_EQ(out[i], b.captions[i]);
  }
  // 4000 draws at p = 0.25: the share is within 5 standard deviations (0.034) of it.
  EXPECT_NEAR(static_cast<double>(dropped) / 4000, 0.25, 0.034);
  // Rows 1000..1999 alone drop what they dropped in the whole batch; another step drops others.
  const auto part = objective.captions_after_dropout(b.rows(1000, 1000), 7);
  EXPECT_EQ(part, std::vector<std::string>(out.begin() + 1000, out.begin() + 2000));
  EXPECT_NE(objective.captions_after_dropout(b, 8), out);
  b.captions.pop_back();
  EXPECT_NE(test::error_message([&] { objective.captions_after_dropout(b, 7); })
                .find("needs a caption for every sample, and this batch of 4000 has 3999"),
            std::string::npos);
}

}  // namespace
}  // namespace ddm
