// Backbones as units for pipeline stages: running every unit in order equals forward bit for bit
// (U-Net with skips, DiT, ControlNet; labels, self-conditioning), every trainable parameter belongs
// to exactly one unit, and gradients through a chain of units equal forward's. And a stage's
// backward split into I and W (pipeline/split_backward.h): the same gradients as one backward, the
// input-gradient chain run once, a parameter read twice.
#include <gtest/gtest.h>

#include <set>

#include <torch/torch.h>

#include "core/config.h"
#include "core/presets.h"
#include "model/controlnet.h"
#include "model/net.h"
#include "pipeline/split_backward.h"
#include "test_util.h"

using namespace ddm;

namespace {

ModelConfig small(const std::string& arch, bool self_cond) {
  ModelConfig m;
  apply_preset(arch == "unet" ? "unet-small" : "dit-tiny", m);  // unet-small: attention and 2 blocks per level
  m.in_channels = 1, m.image_size = 16, m.num_classes = 10, m.self_cond = self_cond;
  return m;
}

void check_units(const ModelConfig& cfg) {
  torch::manual_seed(3);
  Net net = make_net(cfg);
  // Non-zero output layers, so the comparison is not of zeros.
  for (auto& p : net->named_parameters()) p.value().data().normal_(0, 0.05);
  const auto x = torch::randn({3, 1, 16, 16}), t = torch::rand({3});
  Cond c(torch::tensor({1, 4, 10}, torch::kLong));
  if (cfg.self_cond) c.self_cond = torch::randn({3, 1, 16, 16});
  const auto want = net->forward(x, t, c);
  const std::vector<NetUnit> units = net->units();
  NetCarry k{x, {}, {}};
  for (const NetUnit& u : units) u.run(k, t, c);
  EXPECT_TRUE(torch::equal(k.h, want)) << cfg.arch;
  EXPECT_TRUE(k.skips.empty());
  // Each parameter in exactly one unit.
  std::set<const void*> seen;
  size_t n = 0;
  for (const NetUnit& u : units)
    for (const torch::Tensor& p : u.params) seen.insert(p.unsafeGetTensorImpl()), ++n;
  EXPECT_EQ(n, seen.size());
  EXPECT_EQ(n, net->parameters().size());
  // Gradients through the chain equal forward's.
  net->zero_grad();
  net->forward(x, t, c).pow(2).sum().backward();
  std::vector<torch::Tensor> g;
  for (const auto& p : net->parameters()) g.push_back(p.grad().clone());
  net->zero_grad();
  NetCarry k2{x, {}, {}};
  for (const NetUnit& u : units) u.run(k2, t, c);
  k2.h.pow(2).sum().backward();
  const auto ps = net->parameters();
  for (size_t i = 0; i < ps.size(); ++i) EXPECT_TRUE(torch::equal(ps[i].grad(), g[i])) << cfg.arch << " param " << i;
}

}  // namespace

TEST(PipeUnits, UNetUnitsAreForward) {
  check_units(small("unet", false));
  check_units(small("unet", true));
  const std::vector<NetUnit> u = make_net(small("unet", false))->units();
  EXPECT_EQ(u.front().name, "in");
  EXPECT_EQ(u.back().name, "out");
}

TEST(PipeUnits, DiTUnitsAreForward) {
  check_units(small("dit", false));
  check_units(small("dit", true));
}

TEST(PipeUnits, CarryCountsOpenSkips) {
  Net net = make_net(small("unet", false));
  const auto x = torch::randn({2, 1, 16, 16}), t = torch::rand({2});
  Cond c(torch::tensor({1, 2}, torch::kLong));
  NetCarry k{x, {}, {}};
  int64_t most = 0;
  for (const NetUnit& u : net->units()) {
    u.run(k, t, c);
    most = std::max<int64_t>(most, static_cast<int64_t>(k.skips.size()));
    int64_t b = 0;
    for (const auto& s : k.tensors()) b += s.numel() * 4;
    EXPECT_EQ(k.bytes(), b);
  }
  EXPECT_GT(most, 1);
}

// A ControlNet as units: the copy's encoder (its first unit with the hint block), the zero
// convolutions onto the locked encoder's precomputed features, the locked decoder without
// trainable parameters; equal to forward, gradients included.
TEST(PipeUnits, ControlNetUnitsAreForward) {
  ModelConfig cfg = small("unet", false);
  cfg.controlnet = "base", cfg.control = "edges";
  torch::manual_seed(5);
  auto cn = std::make_shared<ControlNetImpl>(cfg);
  {
    torch::NoGradGuard ng;
    for (auto& p : cn->base().parameters()) p.normal_(0, 0.05);
    for (auto& p : cn->parameters()) p.normal_(0, 0.05);
  }
  cn->set_base_loaded();
  const auto x = torch::randn({3, 1, 16, 16}), t = torch::rand({3});
  Cond c(torch::tensor({1, 4, 10}, torch::kLong));
  c.control = torch::rand({3, 1, 16, 16}) * 2 - 1;
  const Cond pre = cn->precompute(x, t, c);
  cn->zero_grad();
  const auto want = cn->forward(x, t, pre);
  want.pow(2).sum().backward();
  std::vector<torch::Tensor> g;
  for (const auto& p : cn->parameters()) g.push_back(p.grad().clone());
  cn->zero_grad();
  const std::vector<NetUnit> units = cn->units();
  NetCarry k{x, {}, {}};
  for (const NetUnit& u : units) u.run(k, t, pre);
  EXPECT_TRUE(torch::equal(k.h, want));
  k.h.pow(2).sum().backward();
  const auto ps = cn->parameters();
  for (size_t i = 0; i < ps.size(); ++i) EXPECT_TRUE(torch::equal(ps[i].grad(), g[i])) << i;
  size_t n = 0, frozen = 0;
  for (const NetUnit& u : units)
    for (const torch::Tensor& p : u.params) ++(p.requires_grad() ? n : frozen);
  EXPECT_EQ(n, ps.size());
  EXPECT_GT(frozen, 0u);  // the locked decoder's, listed so that they count in a stage's work
  EXPECT_EQ(units.front().name, "control.in");
  EXPECT_EQ(units.back().name, "locked.out");
  EXPECT_FALSE(units.back().params.empty());
  for (const torch::Tensor& p : units.back().params) EXPECT_FALSE(p.requires_grad());
  // Without the precomputed features the zero unit says what it needs.
  NetCarry k2{x, {}, {}};
  const std::string e = ddm::test::error_message([&] {
    for (const NetUnit& u : units) u.run(k2, t, c);
  });
  EXPECT_NE(e.find("needs the locked encoder's features"), std::string::npos) << e;
}

// ---- The split backward (I now, W later) ----

namespace {

int g_count_calls = 0;
// The identity, counting how often its backward runs.
struct CountBackward : torch::autograd::Function<CountBackward> {
  static torch::Tensor forward(torch::autograd::AutogradContext*, torch::Tensor x) { return x.clone(); }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*, torch::autograd::variable_list g) {
    ++g_count_calls;
    return {g[0]};
  }
};

// Gradients of `inputs` and `params` from one plain backward.
std::vector<torch::Tensor> plain_grads(const std::vector<torch::Tensor>& roots, const std::vector<torch::Tensor>& grads,
                                       const std::vector<torch::Tensor>& inputs, const std::vector<torch::Tensor>& params) {
  std::vector<torch::Tensor> all = inputs;
  all.insert(all.end(), params.begin(), params.end());
  return torch::autograd::grad(roots, all, grads, /*retain_graph=*/true, false, /*allow_unused=*/true);
}

// I then W against the plain backward. Float32 sums may be added in another order: within 1e-5.
void expect_split_equals_plain(const std::vector<torch::Tensor>& roots, const std::vector<torch::Tensor>& grads,
                               const std::vector<torch::Tensor>& inputs, const std::vector<torch::Tensor>& params,
                               bool want_split, const std::string& what) {
  const std::vector<torch::Tensor> want = plain_grads(roots, grads, inputs, params);
  for (const torch::Tensor& p : params) p.mutable_grad() = torch::Tensor();
  SplitBackward sb;
  const std::vector<torch::Tensor> gi = sb.input_grads(roots, grads, inputs, params);
  EXPECT_EQ(sb.split(), want_split) << what;
  for (const torch::Tensor& p : params) EXPECT_FALSE(p.grad().defined()) << what << ": I wrote a parameter's gradient";
  sb.weight_grads();
  ASSERT_EQ(gi.size(), inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    ASSERT_EQ(gi[i].defined(), want[i].defined()) << what << " input " << i;
    if (gi[i].defined()) {
      EXPECT_TRUE(torch::allclose(gi[i], want[i], 1e-5, 1e-7)) << what << " input " << i;
    }
  }
  for (size_t j = 0; j < params.size(); ++j) {
    const torch::Tensor& w = want[inputs.size() + j];
    if (!w.defined()) continue;  // a parameter this graph does not read
    ASSERT_TRUE(params[j].grad().defined()) << what << " param " << j;
    EXPECT_TRUE(torch::allclose(params[j].grad(), w, 1e-5, 1e-7))
        << what << " param " << j << ": " << (params[j].grad() - w).abs().max().item<double>();
  }
}

}  // namespace

// A small graph with what stages have: a residual, a normalization, a parameter-only branch into
// the output, two roots (one reaching no input). I runs the input-gradient chain once and writes no
// parameter's gradient; W does not run it again; together they equal one backward.
TEST(SplitBackward, RunsTheInputChainOnceAndEqualsOneBackward) {
  torch::manual_seed(1);
  auto l1 = torch::nn::Linear(6, 8), l2 = torch::nn::Linear(8, 8);
  auto ln = torch::nn::LayerNorm(torch::nn::LayerNormOptions({8}));
  const torch::Tensor bias = torch::randn({8}, torch::requires_grad()), scale = torch::randn({8}, torch::requires_grad());
  std::vector<torch::Tensor> params = {l1->weight, l1->bias, l2->weight, l2->bias, ln->weight, ln->bias, bias, scale};
  const torch::Tensor x = torch::randn({4, 6}, torch::requires_grad());
  auto build = [&] {
    torch::Tensor h = CountBackward::apply(l1->forward(x));                      // [4, 8]
    h = ln->forward(h + torch::gelu(l2->forward(h))) + bias.tanh();             // [4, 8]
    return std::vector<torch::Tensor>{h, scale * 3};                                // the second reaches no input
  };
  std::vector<torch::Tensor> roots = build();
  const std::vector<torch::Tensor> grads = {torch::randn({4, 8}), torch::randn({8})};
  g_count_calls = 0;
  SplitBackward sb;
  const auto gi = sb.input_grads(roots, grads, {x}, params);
  EXPECT_TRUE(sb.split());
  EXPECT_EQ(g_count_calls, 1);
  sb.weight_grads();
  EXPECT_EQ(g_count_calls, 1) << "W walked the input-gradient chain again";
  roots = build();
  expect_split_equals_plain(roots, grads, {x}, params, true, "toy");
  // Without inputs (a first stage): W is the whole backward.
  roots = build();
  expect_split_equals_plain(roots, grads, {}, params, true, "no inputs");
  // A scalar root without a given gradient.
  roots = build();
  expect_split_equals_plain({roots[0].pow(2).sum()}, {}, {x}, params, true, "loss");
}

// A parameter read in two places on the input's path (a layer applied twice; a transposed weight
// made once and read by two products): each frontier node brings its own contribution.
TEST(SplitBackward, AParameterReadTwiceGetsBothContributions) {
  torch::manual_seed(2);
  auto l = torch::nn::Linear(5, 5);
  const torch::Tensor x = torch::randn({3, 5}, torch::requires_grad());
  const torch::Tensor y = l->forward(torch::relu(l->forward(x)));  // [3, 5]
  expect_split_equals_plain({y}, {torch::randn({3, 5})}, {x}, {l->weight, l->bias}, true, "layer twice");
  const torch::Tensor w = torch::randn({5, 5}, torch::requires_grad());
  const torch::Tensor wt = w.t();
  const torch::Tensor z = torch::tanh(x.mm(wt)).mm(wt);  // [3, 5]
  expect_split_equals_plain({z}, {torch::randn({3, 5})}, {x}, {w}, true, "shared transpose");
}

// Stages of the real backbones (a middle stage with open U-Net skips and the conditioning carried
// in; a last stage with the loss) split exactly.
TEST(SplitBackward, StagesOfTheBackbonesSplitExactly) {
  for (const std::string arch : {"unet", "dit"}) {
    torch::manual_seed(4);
    Net net = make_net(small(arch, false));
    for (auto& p : net->named_parameters()) p.value().data().normal_(0, 0.05);
    const auto x = torch::randn({2, 1, 16, 16}), t = torch::rand({2});
    Cond c(torch::tensor({1, 4}, torch::kLong));
    const std::vector<NetUnit> units = net->units();
    const size_t n = units.size(), a = n / 3, b = 2 * n / 3;
    NetCarry k{x, {}, {}};
    {
      torch::NoGradGuard ng;
      for (size_t u = 0; u < a; ++u) units[u].run(k, t, c);
    }
    auto stage = [&](size_t from, size_t to, NetCarry in, std::vector<torch::Tensor>& inputs, std::vector<torch::Tensor>& params) {
      auto leaf = [&](torch::Tensor& y) {
        if (y.defined()) y = y.detach().clone().requires_grad_(true), inputs.push_back(y);
      };
      leaf(in.h), leaf(in.emb);
      for (torch::Tensor& s : in.skips) leaf(s);
      for (size_t u = from; u < to; ++u) {
        units[u].run(in, t, c);
        for (const torch::Tensor& p : units[u].params) params.push_back(p);
      }
      return in;
    };
    std::vector<torch::Tensor> inputs, params;
    NetCarry mid = stage(a, b, k, inputs, params);
    std::vector<torch::Tensor> roots, grads;
    for (const torch::Tensor& y : mid.tensors())
      if (y.requires_grad()) roots.push_back(y), grads.push_back(torch::randn_like(y));
    expect_split_equals_plain(roots, grads, inputs, params, true, arch + " middle stage");
    std::vector<torch::Tensor> inputs2, params2;
    NetCarry end = stage(b, n, mid, inputs2, params2);
    expect_split_equals_plain({end.h.pow(2).mean()}, {}, inputs2, params2, true, arch + " last stage");
  }
}
