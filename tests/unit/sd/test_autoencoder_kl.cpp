// diffusers' AutoencoderKL in ddm (src/sd/autoencoder_kl.*) against diffusers itself: diffusers
// builds each model from the configs users keep (SD 1.x / 2.x's VAE, SDXL's, a 16-channel one
// without quant convolutions), saves it with save_pretrained and encodes and decodes seeded inputs
// (tests/reference/diffusers_vae.py); ddm loads the same directories and must give the same
// posterior and images. Cut to small widths in the fast test; at full size (83.7M parameters) with
// DDM_FULL_SIZE=1. And what a user can get wrong in such a directory, refused by name.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <sstream>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/safetensors.h"
#include "sd/autoencoder_kl.h"
#include "test_util.h"

namespace fs = std::filesystem;
using ddm::test::TempDir;

namespace {

// max |got - want| over max |want|: the difference relative to the output's scale.
double relative(const torch::Tensor& got, const torch::Tensor& want) {
  return (got - want).abs().max().item<double>() / want.abs().max().item<double>();
}

void check_against_diffusers(const std::string& size) {
  TempDir scratch;
  const auto made = size == "full" ? ddm::test::ReferenceOutputs{ddm::test::run_command(
                                         ddm::test::reference_python() + " " + ddm::test::source_dir() +
                                         "/tests/reference/diffusers_vae.py " + scratch.path + " full 2>&1"),
                                     scratch.path}
                                   : ddm::test::reference_outputs("tests/reference/diffusers_vae.py", "{dir} small");
  ASSERT_EQ(made.run.exit_code, 0) << made.run.output;
  for (const char* name : {"sd", "sdxl", "flux"}) {
    SCOPED_TRACE(name);
    const std::string dir = made.dir + "/" + name;
    const auto ref = ddm::load_safetensors(dir + "/reference.safetensors").tensors;
    auto vae = ddm::sd::load_autoencoder_kl(dir);
    const auto config = nlohmann::json::parse(ddm::test::read_text(dir + "/config.json"));
    EXPECT_EQ(vae->config().scaling_factor, config["scaling_factor"].get<double>());
    EXPECT_EQ(vae->config().latent_channels, config["latent_channels"].get<int64_t>());
    torch::NoGradGuard no_grad;
    const auto [mean, logvar] = vae->encode(ref.at("x"));
    const torch::Tensor decoded = vae->decode(ref.at("z"));
    // Float32 through the same convolutions summed in other orders: within 1e-4 of each output's
    // largest magnitude, as the issue asks (measured: recorded below).
    const double r_mean = relative(mean, ref.at("mean")), r_logvar = relative(logvar, ref.at("logvar")),
                 r_dec = relative(decoded, ref.at("decoded"));
    EXPECT_LT(r_mean, 1e-4);
    EXPECT_LT(r_logvar, 1e-4);
    EXPECT_LT(r_dec, 1e-4);
    std::ostringstream s;
    s << std::scientific << r_mean << " " << r_logvar << " " << r_dec;
    ::testing::Test::RecordProperty(std::string(name) + "_" + size + "_relative_mean_logvar_decoded", s.str());
  }
}

}  // namespace

TEST(AutoencoderKL, EqualsDiffusersOnTheConfigsUsersKeep) { check_against_diffusers("small"); }

TEST(AutoencoderKL, EqualsDiffusersAtFullSize) {
  if (!std::getenv("DDM_FULL_SIZE")) GTEST_SKIP() << "full size (83.7M parameters, 3 models): set DDM_FULL_SIZE=1";
  check_against_diffusers("full");
}

// Saved by ddm and loaded again: the same files diffusers reads (config.json with diffusers' keys,
// the weights under diffusers' names), the same outputs bit for bit.
TEST(AutoencoderKL, SavesWhatItLoads) {
  const auto made = ddm::test::reference_outputs("tests/reference/diffusers_vae.py", "{dir} small");
  ASSERT_EQ(made.run.exit_code, 0) << made.run.output;
  TempDir dir;
  auto vae = ddm::sd::load_autoencoder_kl(made.dir + "/flux");
  ddm::sd::save_autoencoder_kl(vae, dir / "vae");
  auto again = ddm::sd::load_autoencoder_kl(dir / "vae");
  const auto original = ddm::load_safetensors(made.dir + "/flux/diffusion_pytorch_model.safetensors").tensors;
  const auto written = ddm::load_safetensors(dir / "vae/diffusion_pytorch_model.safetensors").tensors;
  ASSERT_EQ(written.size(), original.size());
  for (const auto& [key, t] : original) EXPECT_TRUE(written.at(key).equal(t)) << key;
  const auto a = nlohmann::json::parse(ddm::test::read_text(made.dir + "/flux/config.json"));
  auto b = nlohmann::json::parse(ddm::test::read_text(dir / "vae/config.json"));
  for (auto& [key, value] : a.items())
    if (key != "_diffusers_version") {
      EXPECT_EQ(b[key], value) << key;
    }
}

// A directory a user can get wrong: each refused with the file and the key or tensor named.
TEST(AutoencoderKL, BadDirectoriesAreRefusedByName) {
  const auto made = ddm::test::reference_outputs("tests/reference/diffusers_vae.py", "{dir} small");
  ASSERT_EQ(made.run.exit_code, 0) << made.run.output;
  const std::string good = made.dir + "/sd";
  auto expect_refused = [&](const std::function<void(const std::string&)>& spoil, const std::string& needle) {
    TempDir dir;
    const std::string d = dir / "vae";
    fs::create_directories(d);
    for (const char* f : {"config.json", "diffusion_pytorch_model.safetensors"}) fs::copy_file(good + "/" + f, d + "/" + f);
    spoil(d);
    try {
      ddm::sd::load_autoencoder_kl(d);
      ADD_FAILURE() << "accepted: " << needle;
    } catch (const ddm::Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  auto edit_config = [](const std::function<void(nlohmann::json&)>& edit) {
    return [edit](const std::string& d) {
      auto j = nlohmann::json::parse(ddm::test::read_text(d + "/config.json"));
      edit(j);
      ddm::test::write_text(d + "/config.json", j.dump());
    };
  };
  auto edit_weights = [](const std::function<void(ddm::SafetensorsFile&)>& edit) {
    return [edit](const std::string& d) {
      auto f = ddm::load_safetensors(d + "/diffusion_pytorch_model.safetensors");
      edit(f);
      ddm::save_safetensors(d + "/diffusion_pytorch_model.safetensors", f);
    };
  };
  expect_refused(edit_config([](nlohmann::json& j) { j["_class_name"] = "AsymmetricAutoencoderKL"; }),
                 "_class_name \"AsymmetricAutoencoderKL\"");
  expect_refused(edit_config([](nlohmann::json& j) { j["use_tiling"] = true; }),
                 "\"use_tiling\" is not a key of diffusers' AutoencoderKL that ddm reads");
  expect_refused(edit_config([](nlohmann::json& j) { j["latents_mean"] = {0.1, 0.2, 0.3, 0.4}; }),
                 "latents_mean is set");
  expect_refused(edit_config([](nlohmann::json& j) { j["up_block_types"][1] = "AttnUpDecoderBlock2D"; }),
                 "up_block_types holds \"AttnUpDecoderBlock2D\"");
  expect_refused(edit_config([](nlohmann::json& j) { j["latent_channels"] = 8; }),
                 "\"encoder.conv_out.weight\" has shape [8, 64, 3, 3], but ");
  expect_refused(edit_weights([](ddm::SafetensorsFile& f) { f.tensors.erase("decoder.mid_block.attentions.0.to_q.bias"); }),
                 "no tensor \"decoder.mid_block.attentions.0.to_q.bias\"");
  expect_refused(edit_weights([](ddm::SafetensorsFile& f) { f.tensors["decoder.extra.weight"] = torch::zeros({2}); }),
                 "\"decoder.extra.weight\" (and 0 more) has no place in the model");
  expect_refused([](const std::string& d) { fs::remove(d + "/diffusion_pytorch_model.safetensors"); },
                 "diffusion_pytorch_model");
  expect_refused([](const std::string& d) { fs::remove(d + "/config.json"); }, "no config.json");
}

// The same VAE saved by diffusers in shards (an index and 22 files) loads to the same weights; saved
// as a PyTorch pickle, it is refused with the reason and the one-line conversion, which works.
TEST(AutoencoderKL, ReadsShardedWeightsAndRefusesPickles) {
  const auto made = ddm::test::reference_outputs("tests/reference/diffusers_vae.py", "{dir} small");
  ASSERT_EQ(made.run.exit_code, 0) << made.run.output;
  ASSERT_TRUE(fs::exists(made.dir + "/gray-sharded/diffusion_pytorch_model.safetensors.index.json"));
  auto whole = ddm::sd::load_autoencoder_kl(made.dir + "/gray");
  auto sharded = ddm::sd::load_autoencoder_kl(made.dir + "/gray-sharded");
  const auto a = whole->named_parameters(), b = sharded->named_parameters();
  ASSERT_EQ(a.size(), b.size());
  for (const auto& p : a) EXPECT_TRUE(p.value().equal(b[p.key()])) << p.key();
  TempDir dir;
  fs::copy(made.dir + "/gray-bin", dir / "vae");
  std::string message;
  try {
    ddm::sd::load_autoencoder_kl(dir / "vae");
    ADD_FAILURE() << "a pickle was read";
  } catch (const ddm::Error& e) {
    message = e.what();
  }
  const size_t at = message.find("python3 -c \"");
  ASSERT_NE(at, std::string::npos) << message;
  EXPECT_NE(message.find("it has diffusion_pytorch_model.bin, a PyTorch pickle"), std::string::npos) << message;
  const size_t from = at + std::string("python3 -c ").size();
  const std::string command = message.substr(from, message.rfind('"') + 1 - from);  // "import torch, ...'", quoted
  const auto run = ddm::test::run_command(ddm::test::reference_python() + " -c " + command + " 2>&1");
  ASSERT_EQ(run.exit_code, 0) << run.output;
  auto converted = ddm::sd::load_autoencoder_kl(dir / "vae");
  for (const auto& p : whole->named_parameters()) EXPECT_TRUE(p.value().equal(converted->named_parameters()[p.key()])) << p.key();
}
