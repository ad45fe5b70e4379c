// diffusers' UNet2DConditionModel in ddm (src/sd/unet_2d_condition.*) against diffusers itself:
// diffusers builds SD 1.5's and SD 2.1's UNets from their configs (1x1 conv projections and 8 heads;
// linear projections and heads of 64 channels), saves them with save_pretrained, and computes the
// output for seeded latents, timesteps and context, and one loss's gradients
// (tests/reference/diffusers_unet.py); ddm loads the same folders and must give the same. Cut to
// small widths in the fast test; at full size (SD 2.1's 865M parameters) with DDM_FULL_SIZE=1.
#include <gtest/gtest.h>

#include <cstdlib>
#include <sstream>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/safetensors.h"
#include "sd/unet_2d_condition.h"
#include "test_util.h"

using ddm::test::TempDir;

namespace {

double relative(const torch::Tensor& got, const torch::Tensor& want) {
  return (got - want).abs().max().item<double>() / want.abs().max().item<double>();
}

void check_against_diffusers(const std::string& size) {
  TempDir scratch;
  const auto made = size == "full" ? ddm::test::ReferenceOutputs{ddm::test::run_command(
                                         ddm::test::reference_python() + " " + ddm::test::source_dir() +
                                         "/tests/reference/diffusers_unet.py " + scratch.path + " full 2>&1"),
                                     scratch.path}
                                   : ddm::test::reference_outputs("tests/reference/diffusers_unet.py", "{dir} small");
  ASSERT_EQ(made.run.exit_code, 0) << made.run.output;
  for (const char* name : {"sd15", "sd21"}) {
    SCOPED_TRACE(name);
    const std::string dir = made.dir + "/" + name;
    const auto ref = ddm::load_safetensors(dir + "/reference.safetensors").tensors;
    auto unet = ddm::sd::load_unet_2d_condition(dir);
    const torch::Tensor out = unet->forward(ref.at("sample"), ref.at("timestep"), ref.at("context"));
    const double r_out = relative(out.detach(), ref.at("out"));
    EXPECT_LT(r_out, 1e-4);
    (out * ref.at("weight")).sum().backward();
    auto params = unet->named_parameters();
    std::ostringstream s;
    s << std::scientific << "out " << r_out;
    int grads = 0;
    for (const auto& [key, want] : ref) {
      if (key.rfind("grad.", 0) != 0) continue;
      const std::string param = key.substr(5);
      ASSERT_TRUE(params.contains(param)) << param;
      const double r = relative(params[param].grad(), want);
      EXPECT_LT(r, 1e-4) << param;
      s << " " << param << " " << r;
      ++grads;
    }
    EXPECT_EQ(grads, 6);
    ::testing::Test::RecordProperty(std::string(name) + "_" + size + "_relative", s.str());
  }
}

}  // namespace

TEST(UNet2DCondition, EqualsDiffusersOnStableDiffusion15And21) { check_against_diffusers("small"); }

TEST(UNet2DCondition, EqualsDiffusersAtFullSize) {
  if (!std::getenv("DDM_FULL_SIZE")) GTEST_SKIP() << "full size (SD 1.5's and 2.1's UNets, 860M parameters each): set DDM_FULL_SIZE=1";
  check_against_diffusers("full");
}

// Saved by ddm and loaded again: the tensors diffusers wrote, the config keys it wrote.
TEST(UNet2DCondition, SavesWhatItLoads) {
  const auto made = ddm::test::reference_outputs("tests/reference/diffusers_unet.py", "{dir} small");
  ASSERT_EQ(made.run.exit_code, 0) << made.run.output;
  TempDir dir;
  auto unet = ddm::sd::load_unet_2d_condition(made.dir + "/sd21");
  ddm::sd::save_unet_2d_condition(unet, dir / "unet");
  const auto original = ddm::load_safetensors(made.dir + "/sd21/diffusion_pytorch_model.safetensors").tensors;
  const auto written = ddm::load_safetensors(dir / "unet/diffusion_pytorch_model.safetensors").tensors;
  ASSERT_EQ(written.size(), original.size());
  for (const auto& [key, t] : original) EXPECT_TRUE(written.at(key).equal(t)) << key;
  const auto a = nlohmann::json::parse(ddm::test::read_text(made.dir + "/sd21/config.json"));
  const auto b = nlohmann::json::parse(ddm::test::read_text(dir / "unet/config.json"));
  for (const auto& [key, value] : a.items()) {
    if (key == "_diffusers_version") continue;
    EXPECT_EQ(b.at(key), value) << key;
  }
  ddm::sd::load_unet_2d_condition(dir / "unet");
}

// Config values ddm does not build, refused by name.
TEST(UNet2DCondition, ConfigsItDoesNotBuildAreRefusedByName) {
  const auto made = ddm::test::reference_outputs("tests/reference/diffusers_unet.py", "{dir} small");
  ASSERT_EQ(made.run.exit_code, 0) << made.run.output;
  const auto good = nlohmann::json::parse(ddm::test::read_text(made.dir + "/sd15/config.json"));
  auto refused = [&](const std::string& key, const nlohmann::json& value, const std::string& needle) {
    auto j = good;
    j[key] = value;
    try {
      ddm::sd::parse_unet_2d_condition_config(j, "unet/config.json");
      ADD_FAILURE() << key << " = " << value.dump() << " accepted";
    } catch (const ddm::Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  refused("num_class_embeds", 10, "unet/config.json: num_class_embeds = 10: ddm's UNet2DConditionModel builds only null");
  refused("addition_embed_type", "text_time", "addition_embed_type = \"text_time\"");
  refused("transformer_layers_per_block", 2, "transformer_layers_per_block = 2");
  refused("down_block_types", {"SimpleCrossAttnDownBlock2D", "DownBlock2D"}, "holds \"SimpleCrossAttnDownBlock2D\"");
  refused("attention_head_dim", 3, "the 3 heads of level 0 (attention_head_dim) do not divide its width 32");
  refused("some_new_key", true, "\"some_new_key\" is not a key of diffusers' UNet2DConditionModel");
  refused("_class_name", "UNet2DModel", "_class_name \"UNet2DModel\"");
  refused("_class_name", 1, "unet/config.json: _class_name must be a string, got 1");  // found by fuzz_diffusers_configs
}
