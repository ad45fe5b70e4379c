// diffusers' ControlNetModel in ddm (src/sd/controlnet_model.*) against diffusers itself: diffusers
// makes a ControlNet of a small SD 1.5-kind and SD 2.1-kind UNet (from_unet, then every parameter
// moved; sd21's reads its control image as bgr), saves both, and computes the residuals, the UNet's
// output with them and one loss's gradients of the ControlNet's parameters
// (tests/reference/diffusers_controlnet.py); ddm loads the same folders and must give the same. At
// full size (ControlNet v1.0 on SD 1.5) with DDM_FULL_SIZE=1.
// from_unet's copy, the configs ddm writes, its FLOP count and the refusals are checked too.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <sstream>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/safetensors.h"
#include "sd/controlnet_model.h"
#include "sd/controlnet_net.h"
#include "test_util.h"

using ddm::test::TempDir;
namespace sd = ddm::sd;

namespace {

double relative(const torch::Tensor& got, const torch::Tensor& want) {
  return (got - want).abs().max().item<double>() / want.abs().max().item<double>();
}

ddm::test::ReferenceOutputs made() {
  static const auto m = ddm::test::reference_outputs("tests/reference/diffusers_controlnet.py", "{dir}");
  return m;
}

nlohmann::json read_json(const std::string& path) { return nlohmann::json::parse(ddm::test::read_text(path)); }

// The residuals, the UNet's output with them and the loss's gradients of diffusers' reference `made`
// for each UNet kind in `names`.
void check_against_diffusers(const ddm::test::ReferenceOutputs& made, const std::vector<std::string>& names) {
  ASSERT_EQ(made.run.exit_code, 0) << made.run.output;
  for (const std::string& name : names) {
    SCOPED_TRACE(name);
    const std::string dir = made.dir + "/" + name;
    const auto ref = ddm::load_safetensors(dir + "/reference.safetensors").tensors;
    auto unet = sd::load_unet_2d_condition(dir + "/unet");
    auto cn = sd::load_controlnet_model(dir + "/controlnet");
    EXPECT_EQ(cn->config().bgr, name == "sd21");
    const auto& sample = ref.at("sample");
    const auto& t = ref.at("timestep");
    const auto& ctx = ref.at("context");
    const sd::UNetResiduals r = cn->forward(sample, t, ctx, ref.at("cond"), ref.at("scale").item<double>());
    std::ostringstream s;
    s << std::scientific;
    // Small: conv_in's, down_blocks.0's resnet and downsampler, down_blocks.1's resnet; full: 12.
    size_t want = 0;
    while (ref.count("down." + std::to_string(want))) ++want;
    ASSERT_EQ(r.down.size(), want);
    EXPECT_GE(want, 4u);
    for (size_t i = 0; i < r.down.size(); ++i) {
      const double d = relative(r.down[i].detach(), ref.at("down." + std::to_string(i)));
      EXPECT_LT(d, 1e-4) << "down." << i;
      s << "down." << i << " " << d << " ";
    }
    const double m = relative(r.mid.detach(), ref.at("mid"));
    EXPECT_LT(m, 1e-4);
    const torch::Tensor out = unet->forward(sample, t, ctx, &r);
    const double o = relative(out.detach(), ref.at("out"));
    EXPECT_LT(o, 1e-4);
    s << "mid " << m << " out " << o;
    (out * ref.at("weight")).sum().backward();
    auto params = cn->named_parameters();
    int grads = 0;
    for (const auto& [key, want] : ref) {
      if (key.rfind("grad.", 0) != 0) continue;
      const std::string param = key.substr(5);
      ASSERT_TRUE(params.contains(param)) << param;
      const double g = relative(params[param].grad(), want);
      EXPECT_LT(g, 1e-4) << param;
      s << " " << param << " " << g;
      ++grads;
    }
    EXPECT_EQ(grads, 8);
    ::testing::Test::RecordProperty(name + "_relative", s.str());
  }
}

}  // namespace

TEST(ControlNetModel, ResidualsOutputAndGradientsEqualDiffusers) { check_against_diffusers(made(), {"sd15", "sd21"}); }

// ControlNet v1.0 on SD 1.5's UNet at full size (860M + 361M parameters), 256 px control images.
TEST(ControlNetModel, EqualsDiffusersAtFullSize) {
  if (!std::getenv("DDM_FULL_SIZE")) GTEST_SKIP() << "full size (ControlNet v1.0 on SD 1.5, 1.2B parameters): set DDM_FULL_SIZE=1";
  check_against_diffusers(ddm::test::reference_outputs("tests/reference/diffusers_controlnet.py", "{dir} full"), {"sd15"});
}

// ddm's from_unet: the UNet's encoder copied (the same tensors diffusers' from_unet holds), the zero
// convolutions zero, and the config diffusers writes for it, key for key.
TEST(ControlNetModel, FromUnetIsDiffusersFromUnet) {
  ASSERT_EQ(made().run.exit_code, 0) << made().run.output;
  for (const char* name : {"sd15", "sd21"}) {
    SCOPED_TRACE(name);
    const std::string dir = made().dir + "/" + name;
    auto unet = sd::load_unet_2d_condition(dir + "/unet");
    sd::ControlNetModel cn(sd::controlnet_config_from_unet(unet->config(), 3));
    cn->copy_encoder_from(*unet);
    const auto theirs = ddm::load_safetensors(dir + "/from_unet/diffusion_pytorch_model.safetensors").tensors;
    const auto mine = cn->named_parameters();
    EXPECT_EQ(mine.size(), theirs.size());
    int copied = 0, zero = 0;
    for (const auto& p : mine) {
      ASSERT_TRUE(theirs.count(p.key())) << p.key();
      const torch::Tensor& want = theirs.at(p.key());
      ASSERT_EQ(p.value().sizes(), want.sizes()) << p.key();
      const bool embedding = p.key().rfind("controlnet_cond_embedding.", 0) == 0 &&
                             p.key().rfind("controlnet_cond_embedding.conv_out.", 0) != 0;
      if (embedding) continue;  // randomly initialised by each
      EXPECT_TRUE(p.value().equal(want)) << p.key();
      if (want.abs().max().item<float>() == 0) ++zero; else ++copied;
    }
    EXPECT_EQ(zero, 2 * (4 + 1 + 1));  // controlnet_down_blocks, the middle's, conv_out: weight and bias each
    EXPECT_GT(copied, 50);
    auto mine_json = sd::controlnet_model_config_json(cn->config());
    auto want_json = read_json(dir + "/from_unet/config.json");
    mine_json.erase("_diffusers_version");
    want_json.erase("_diffusers_version");
    EXPECT_EQ(mine_json, want_json) << mine_json.dump(1) << "\n" << want_json.dump(1);
  }
}

TEST(ControlNetModel, SavesWhatItLoadsAndCountsFlopsAsTorch) {
  ASSERT_EQ(made().run.exit_code, 0) << made().run.output;
  const std::string dir = made().dir + "/sd21";
  TempDir out;
  auto cn = sd::load_controlnet_model(dir + "/controlnet");
  sd::save_controlnet_model(cn, out / "controlnet");
  const auto original = ddm::load_safetensors(dir + "/controlnet/diffusion_pytorch_model.safetensors").tensors;
  const auto written = ddm::load_safetensors(out / "controlnet/diffusion_pytorch_model.safetensors").tensors;
  ASSERT_EQ(written.size(), original.size());
  for (const auto& [key, t] : original) EXPECT_TRUE(written.at(key).equal(t)) << key;
  auto a = read_json(dir + "/controlnet/config.json"), b = read_json(out / "controlnet/config.json");
  a.erase("_diffusers_version");
  b.erase("_diffusers_version");
  EXPECT_EQ(a, b);
  const auto ref = ddm::load_safetensors(dir + "/reference.safetensors").tensors;
  for (const char* name : {"sd15", "sd21"}) {
    const auto c = sd::load_controlnet_model_config(made().dir + "/" + name + "/controlnet");
    const auto r = ddm::load_safetensors(made().dir + "/" + name + "/reference.safetensors").tensors;
    EXPECT_DOUBLE_EQ(sd::controlnet_model_flops(c, 8, 8, 7), r.at("flops").item<double>()) << name;
  }
}

TEST(ControlNetModel, WrongConfigsInputsAndUnetsAreRefusedByName) {
  ASSERT_EQ(made().run.exit_code, 0) << made().run.output;
  const auto good = read_json(made().dir + "/sd15/controlnet/config.json");
  auto refused = [&](const std::string& key, const nlohmann::json& value, const std::string& needle) {
    auto j = good;
    j[key] = value;
    const std::string msg = ddm::test::error_message([&] { sd::parse_controlnet_model_config(j, "controlnet/config.json"); });
    EXPECT_NE(msg.find(needle), std::string::npos) << key << ": " << msg;
  };
  refused("global_pool_conditions", true, "controlnet/config.json: global_pool_conditions = true: ddm's ControlNetModel builds only false");
  refused("controlnet_conditioning_channel_order", "gbr", "controlnet_conditioning_channel_order = \"gbr\"; diffusers knows rgb and bgr");
  refused("up_block_types", {"UpBlock2D", "CrossAttnUpBlock2D"}, "\"up_block_types\" is not a key of diffusers' ControlNetModel");
  refused("_class_name", "UNet2DConditionModel", "_class_name \"UNet2DConditionModel\": ddm reads diffusers' ControlNetModel here");
  refused("conditioning_embedding_out_channels", nlohmann::json::array(), "conditioning_embedding_out_channels must be a list of 1 to 16 widths");
  // A UNet's folder is not a ControlNet's, and a ControlNet of another UNet is refused.
  EXPECT_NE(ddm::test::error_message([&] { sd::load_controlnet_model(made().dir + "/sd15/unet"); })
                .find("_class_name \"UNet2DConditionModel\""),
            std::string::npos);
  auto unet21 = sd::load_unet_2d_condition(made().dir + "/sd21/unet");
  auto cn15 = sd::load_controlnet_model(made().dir + "/sd15/controlnet");
  EXPECT_NE(ddm::test::error_message([&] { cn15->copy_encoder_from(*unet21); }).find("not a ControlNet of that UNet"),
            std::string::npos);
  // A control image of the latents' size (not 8 x) is refused with the size it needs.
  const auto ref = ddm::load_safetensors(made().dir + "/sd15/reference.safetensors").tensors;
  const std::string msg = ddm::test::error_message(
      [&] { cn15->forward(ref.at("sample"), ref.at("timestep"), ref.at("context"), torch::zeros({2, 3, 8, 8})); });
  EXPECT_NE(msg.find("the control image must be [2, 3, 64, 64] (8 x the sample's size), got [2, 3, 8, 8]"),
            std::string::npos)
      << msg;
}

// The Net adapter (sd/controlnet_net.h): the locked UNet's encoder half precomputed (the training
// step's prepare phase) gives forward's output and the ControlNet's gradients bit for bit; the locked
// UNet has no trainable parameter and holds no gradient; an edge map in [-1, 1] becomes a 3-channel
// control image in [0, 1].
TEST(ControlNetModel, TheNetPrecomputesTheLockedEncoderBitForBit) {
  ASSERT_EQ(made().run.exit_code, 0) << made().run.output;
  const std::string dir = made().dir + "/sd21";
  const auto ref = ddm::load_safetensors(dir + "/reference.safetensors").tensors;
  auto net = std::make_shared<sd::SdControlNetNetImpl>(sd::load_unet_2d_condition(dir + "/unet"),
                                                      sd::load_controlnet_model(dir + "/controlnet"), 1000);
  net->set_unet_loaded();
  ddm::Cond c;
  c.context = ref.at("context");
  c.control = ref.at("cond").mean(1, /*keepdim=*/true) * 2 - 1;  // [2, 1, 64, 64] in [-1, 1]
  const torch::Tensor image = net->control_image(c.control);
  EXPECT_EQ(image.sizes(), (std::vector<int64_t>{2, 3, 64, 64}));
  EXPECT_TRUE(image.select(1, 2).equal((c.control.squeeze(1) + 1) * 0.5));
  const torch::Tensor t = torch::tensor({0.018f, 0.804f});
  std::vector<torch::Tensor> outs, grads;
  for (const bool pre : {false, true}) {
    net->zero_grad();
    const ddm::Cond cc = pre ? net->precompute(ref.at("sample"), t, c) : c;
    EXPECT_EQ(cc.frozen.size(), pre ? 6u : 0u);  // time embedding, middle, 4 skips
    const torch::Tensor out = net->forward(ref.at("sample"), t, cc);
    (out * ref.at("weight")).sum().backward();
    outs.push_back(out.detach());
    std::vector<torch::Tensor> g;
    for (const auto& p : net->parameters()) g.push_back(p.grad().flatten());
    grads.push_back(torch::cat(g));
  }
  EXPECT_TRUE(outs[0].equal(outs[1]));
  EXPECT_TRUE(grads[0].equal(grads[1]));
  EXPECT_GT(grads[0].abs().max().item<float>(), 0);
  for (const auto& p : net->unet()->parameters()) {
    EXPECT_FALSE(p.requires_grad());
    EXPECT_FALSE(p.grad().defined());
  }
  EXPECT_EQ(net->parameters().size(), net->controlnet()->parameters().size());
  // As units (pipeline stages): the ControlNet's encoder, the zero convolutions on the precomputed
  // features, the locked decoder; forward's output bit for bit, every trainable parameter in one unit.
  const ddm::Cond pre = net->precompute(ref.at("sample"), t, c);
  ddm::NetCarry k{ref.at("sample"), {}, {}};
  std::map<const void*, int> owners;
  std::vector<std::string> names;
  for (const ddm::NetUnit& u : net->units()) {
    u.run(k, t, pre);
    names.push_back(u.name);
    for (const auto& p : u.params)
      if (p.requires_grad()) ++owners[p.data_ptr()];
  }
  EXPECT_TRUE(k.h.detach().equal(outs[0]));
  EXPECT_EQ(owners.size(), net->parameters().size());
  for (const auto& [p, n] : owners) EXPECT_EQ(n, 1);
  EXPECT_EQ(names.front(), "control.in");
  EXPECT_EQ(names.back(), "locked.out");
  EXPECT_NE(std::find(names.begin(), names.end(), "zero"), names.end());
}
