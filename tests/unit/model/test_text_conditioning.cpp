// Text conditioning in the backbones (model/text_layers.h; unet.h, dit.h with model.text_dim and
// model.text_pooled_dim): the new attention starts as nothing (zero output linears), then the output
// depends on the token states and the pooled embedding, not on masked-out tokens; units() still
// compute forward bit for bit; gradients reach the cross-attention; the FLOP count adds up by hand;
// a text model without its text is a clear error.
#include <gtest/gtest.h>

#include "core/config.h"
#include "model/dit.h"
#include "model/flops.h"
#include "model/net.h"
#include "model/text_layers.h"
#include "model/unet.h"
#include "test_util.h"

using namespace ddm;

namespace {

ModelConfig text_unet() {
  ModelConfig m;
  m.arch = "unet";
  m.in_channels = 3, m.image_size = 8, m.num_classes = 0;
  m.channels = 16, m.channel_mult = {1, 2}, m.res_blocks = 1, m.attn_levels = {1}, m.groups = 4, m.heads = 2;
  m.text_dim = 12, m.text_pooled_dim = 6, m.text_tokens = 5;
  return m;
}

ModelConfig text_dit() {
  ModelConfig m;
  m.arch = "dit";
  m.in_channels = 3, m.image_size = 8, m.num_classes = 0;
  m.patch = 2, m.width = 32, m.depth = 2, m.heads = 4, m.mlp_ratio = 2.0;
  m.text_dim = 12, m.text_pooled_dim = 6, m.text_tokens = 5;
  return m;
}

// Every parameter drawn at random: the zero-initialized output linears no longer hide anything.
void randomize(torch::nn::Module& m, uint64_t seed) {
  torch::manual_seed(seed);
  torch::NoGradGuard ng;
  for (auto& p : m.parameters()) p.normal_(0.0, 0.2);
}

Cond text_cond(int64_t B, uint64_t seed) {
  torch::manual_seed(seed);
  Cond c;
  c.context = torch::randn({B, 5, 12});
  c.context_mask = torch::ones({B, 5}, torch::kInt64);
  c.context_mask[0][3] = 0, c.context_mask[0][4] = 0;  // sample 0: a shorter text, padded
  c.pooled = torch::randn({B, 6});
  return c;
}

}  // namespace

TEST(TextConditioning, NewAttentionStartsAsNothingThenTheOutputFollowsTheText) {
  for (const ModelConfig& cfg : {text_unet(), text_dit()}) {
    SCOPED_TRACE(cfg.arch);
    Net net = make_net(cfg);
    // The cross-attentions' (and SD transformers') output linears start at zero.
    int zeroed = 0;
    for (const auto& item : net->named_parameters()) {
      const std::string& name = item.key();
      if (name.find("cross.out") != std::string::npos || name.find("proj_out") != std::string::npos) {
        EXPECT_EQ(item.value().abs().max().item<float>(), 0.0f) << name;
        ++zeroed;
      }
    }
    EXPECT_GT(zeroed, 0);
    randomize(*net, 1);
    const auto x = torch::randn({3, 3, 8, 8}), t = torch::rand({3});
    const Cond c = text_cond(3, 2);
    const auto out = net->forward(x, t, c);
    ASSERT_EQ(out.sizes(), x.sizes());
    // Another text changes every sample's output; another pooled embedding too.
    Cond other = c;
    other.context = c.context + 0.5;
    EXPECT_GT((net->forward(x, t, other) - out).abs().amax({1, 2, 3}).min().item<float>(), 1e-4);
    other = c;
    other.pooled = c.pooled + 0.5;
    EXPECT_GT((net->forward(x, t, other) - out).abs().amax({1, 2, 3}).min().item<float>(), 1e-4);
    // Masked-out tokens change nothing: sample 0's padding replaced by noise gives the same output.
    other = c;
    other.context = c.context.clone();
    other.context[0].slice(0, 3, 5).normal_();
    EXPECT_TRUE(net->forward(x, t, other)[0].equal(out[0]));
    // The pipeline's units compute forward bit for bit.
    NetCarry k{x, {}, {}};
    for (const NetUnit& u : net->units()) u.run(k, t, c);
    EXPECT_TRUE(k.h.equal(out));
    // Gradients reach the cross-attention's key and value projections.
    net->zero_grad();
    net->forward(x, t, c).square().mean().backward();
    int reached = 0;
    for (const auto& item : net->named_parameters())
      if (item.key().find("cross.k") != std::string::npos || item.key().find("cross.v") != std::string::npos) {
        ASSERT_TRUE(item.value().grad().defined()) << item.key();
        EXPECT_GT(item.value().grad().abs().max().item<float>(), 0.0f) << item.key();
        ++reached;
      }
    EXPECT_GT(reached, 0);
    // Without its text, a clear error.
    const std::string e = test::error_message([&] { net->forward(x, t, Cond()); });
    EXPECT_NE(e.find("text-conditioned model needs each sample's text encoding [B, T, 12]"), std::string::npos) << e;
  }
}

TEST(TextConditioning, CondCarriesTheTextThroughRowsSelectAndCat) {
  const Cond c = text_cond(4, 3);
  const Cond r = c.rows(1, 2);
  EXPECT_TRUE(r.context.equal(c.context.slice(0, 1, 3)));
  EXPECT_TRUE(r.pooled.equal(c.pooled.slice(0, 1, 3)));
  const Cond s = c.select(torch::tensor({3, 0}, torch::kInt64));
  EXPECT_TRUE(s.context_mask[1].equal(c.context_mask[0]));
  const Cond both = Cond::cat(r, s);
  EXPECT_EQ(both.context.size(0), 4);
  EXPECT_NE(test::error_message([&] { Cond::cat(r, Cond()); }).find("carry different fields"), std::string::npos);
}

TEST(TextConditioning, CrossAttentionIsAttentionOverTheUnmaskedTokensByHand) {
  torch::manual_seed(4);
  CrossAttention a(8, 6, 2);
  randomize(*a, 5);
  const auto x = torch::randn({2, 3, 8}), ctx = torch::randn({2, 4, 6});
  const auto mask = torch::tensor({{1, 1, 0, 0}, {1, 1, 1, 1}}, torch::kInt64);
  const auto got = a->forward(x, ctx, mask);
  // By hand, head by head, in float64.
  const auto params = a->named_parameters();
  const auto Wq = params["q.weight"].to(torch::kFloat64), Wk = params["k.weight"].to(torch::kFloat64),
             Wv = params["v.weight"].to(torch::kFloat64), Wo = params["out.weight"].to(torch::kFloat64),
             bo = params["out.bias"].to(torch::kFloat64);
  for (int64_t b = 0; b < 2; ++b) {
    const auto xb = x[b].to(torch::kFloat64), cb = ctx[b].to(torch::kFloat64);
    const int64_t keep = mask[b].sum().item<int64_t>();
    std::vector<torch::Tensor> heads;
    for (int64_t h = 0; h < 2; ++h) {
      const auto q = xb.matmul(Wq.slice(0, 4 * h, 4 * h + 4).t());                     // [3, 4]
      const auto k = cb.slice(0, 0, keep).matmul(Wk.slice(0, 4 * h, 4 * h + 4).t());  // [keep, 4]
      const auto v = cb.slice(0, 0, keep).matmul(Wv.slice(0, 4 * h, 4 * h + 4).t());  // [keep, 4]
      heads.push_back(torch::softmax(q.matmul(k.t()) / 2.0, -1).matmul(v));            // [3, 4]
    }
    const auto want = torch::cat(heads, 1).matmul(Wo.t()) + bo;                         // [3, 8]
    EXPECT_LT((got[b].to(torch::kFloat64) - want).abs().max().item<double>(), 1e-5);
  }
}

TEST(TextConditioning, FlopsAddTheTextPartsByHand) {
  ModelConfig plain = text_dit();
  plain.text_dim = 0, plain.text_pooled_dim = 0;
  const ModelConfig text = text_dit();
  const int64_t N = 16, W = 32, T = 5, D = 12;
  const double per_block = flops::linear(W, W, N) * 2 + flops::linear(D, W, T) * 2 + 2.0 * 2.0 * N * T * W;
  EXPECT_EQ(forward_flops_per_image(text), forward_flops_per_image(plain) + 2 * per_block + flops::linear(6, W));
  ModelConfig unet_plain = text_unet();
  unet_plain.text_dim = 0, unet_plain.text_pooled_dim = 0;
  const int64_t c = 32, n = 16;  // the attention level: 32 channels at 4 x 4
  const double self_attn = flops::conv2d(c, 3 * c, 1, 4, 4) + flops::attention(n, c) + flops::conv2d(c, c, 1, 4, 4);
  const double transformer = flops::linear(c, c, n) * 2 + flops::linear(c, 3 * c, n) + flops::attention(n, c) +
                             flops::linear(c, c, n) + flops::linear(c, c, n) * 2 + flops::linear(D, c, T) * 2 +
                             2.0 * 2.0 * n * T * c + flops::linear(c, 8 * c, n) + flops::linear(4 * c, c, n);
  // One attention stage at the lowest level (res_blocks = 1, two levels: it is the middle).
  EXPECT_EQ(forward_flops_per_image(text_unet()),
            forward_flops_per_image(unet_plain) - self_attn + transformer + flops::linear(6, 4 * 16));
}
