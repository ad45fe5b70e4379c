// Backbones as units for pipeline stages: running every unit in order equals forward bit for bit
// (U-Net with skips, DiT, ControlNet; labels, self-conditioning), every trainable parameter belongs
// to exactly one unit, and gradients through a chain of units equal forward's.
#include <gtest/gtest.h>

#include <set>

#include <torch/torch.h>

#include "core/config.h"
#include "core/presets.h"
#include "model/controlnet.h"
#include "model/net.h"
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
