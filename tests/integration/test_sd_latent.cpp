// A latent model on a diffusers VAE, through the ddm binary on real Fashion-MNIST: model.latent names
// the folder diffusers saved an AutoencoderKL in (tests/reference/diffusers_vae.py's one-channel one,
// made and saved by diffusers itself) or a pipeline directory holding it as vae/. The run pins it by
// sha256 and takes its scaling_factor, trains, resumes bit for bit and samples decoded images;
// `ddm encode --ae` writes its posteriors, on which a latent model trains; a VAE that changed, does
// not take the data's channels, or whose downsampling does not divide the images is a clear error.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "core/config.h"
#include "core/fileio.h"
#include "core/safetensors.h"
#include "data/shards.h"
#include "core/error.h"
#include "sd/autoencoder_kl.h"
#include "train/latent.h"
#include "test_util.h"

namespace fs = std::filesystem;
using namespace ddm;

namespace {

const char* kTinyLatent = R"(
[data]
limit = 64
[model]
preset = "latent-dit"
width = 32
depth = 2
heads = 2
patch = 2
[train]
steps = 4
batch_size = 8
warmup = 1
threads = 1
log_every = 1
ckpt_every = 2
seed = 2
)";

}  // namespace

TEST(SdLatent, ALatentModelTrainsOnADiffusersVaeAndSamplesThroughIt) {
  const auto made = test::reference_outputs("tests/reference/diffusers_vae.py", "{dir} small");
  ASSERT_EQ(made.run.exit_code, 0) << made.run.output;
  test::TempDir dir;
  // A pipeline directory as diffusers lays one out, the VAE in vae/ (copied: the test changes it later).
  const std::string pipe = dir / "pipe", vae = pipe + "/vae";
  fs::create_directories(vae);
  for (const char* f : {"config.json", "diffusion_pytorch_model.safetensors"})
    fs::copy_file(made.dir + "/gray/" + f, vae + "/" + f);
  test::write_text(pipe + "/model_index.json", R"({"_class_name": "StableDiffusionPipeline", "vae": ["diffusers", "AutoencoderKL"]})");
  test::write_text(dir / "latent.toml", kTinyLatent);
  const std::string train = "train --config " + (dir / "latent.toml") + " --set model.latent=" + pipe + " --out ";
  auto r = test::run_ddm(train + (dir / "run") + " --set train.steps=2");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("latent: 4x14x14 latents of the frozen autoencoder " + vae), std::string::npos) << r.output;
  const RunConfig cfg = load_config(dir / "run/config.toml");
  EXPECT_EQ(cfg.model.latent, vae);
  EXPECT_EQ(cfg.model.latent_sha256, sha256_file(vae + "/diffusion_pytorch_model.safetensors"));
  EXPECT_EQ(cfg.model.latent_scale, 0.18215);
  EXPECT_EQ(cfg.model.in_channels, 4);
  EXPECT_EQ(cfg.model.image_size, 14);
  // No VAE weight in the checkpoint.
  for (const auto& [name, t] : load_safetensors(dir / "run/ckpt/step-00000002/model.safetensors").tensors)
    EXPECT_EQ(name.find("decoder"), std::string::npos) << name;
  // Resumed to step 4: what an uninterrupted run of 4 steps writes, byte for byte.
  ASSERT_EQ(test::run_ddm(train + (dir / "run") + " --resume --quiet").exit_code, 0);
  ASSERT_EQ(test::run_ddm(train + (dir / "whole") + " --quiet").exit_code, 0);
  EXPECT_EQ(test::read_text(dir / "run/ckpt/step-00000004/model.safetensors"),
            test::read_text(dir / "whole/ckpt/step-00000004/model.safetensors"));
  // Sampling decodes through the VAE: 28x28 grey images.
  r = test::run_ddm("sample --ckpt " + (dir / "run") + " --n 4 --steps 3 --out " + (dir / "s.png"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(fs::exists(dir / "s.png"));
  // `ddm encode --ae` with the VAE: its posteriors, which are what the VAE itself gives.
  r = test::run_ddm("encode --ae " + vae + " --set data.limit=64 --out " + (dir / "enc"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  {
    auto kl = sd::load_autoencoder_kl(vae);
    DataConfig dc;
    dc.limit = 2;
    const torch::Tensor x = load_dataset(dc).images.to(torch::kFloat32) / 127.5 - 1;  // [2, 1, 28, 28]
    torch::NoGradGuard no_grad;
    const auto [mean, logvar] = kl->encode(x);
    TarShardReader shard(dir / "enc/latents-000000.tar");
    ShardSample s;
    for (int i = 0; i < 2; ++i) {
      ASSERT_TRUE(shard.next(s));
      const auto f = parse_safetensors(s.files.at("safetensors"), s.key);
      EXPECT_TRUE(torch::allclose(f.tensors.at("mean"), mean[i], 1e-5, 1e-5)) << s.key;
      EXPECT_TRUE(torch::allclose(f.tensors.at("logvar"), logvar[i], 1e-5, 1e-5)) << s.key;
    }
  }
  r = test::run_ddm(train + (dir / "from-enc") + " --set data.source=latents --set data.root=" + (dir / "enc") +
                    " --set data.limit=0 --quiet --set train.steps=2");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  // Bad input, each named: a changed VAE (sampling, or resuming from the run's own config), a VAE for RGB, a downsampling that does not
  // divide 28.
  auto w = load_safetensors(vae + "/diffusion_pytorch_model.safetensors");
  w.tensors.at("decoder.conv_out.bias").add_(1.0);
  save_safetensors(vae + "/diffusion_pytorch_model.safetensors", w);
  test::expect_error(test::run_ddm("sample --ckpt " + (dir / "run") + " --n 4 --steps 3 --out " + (dir / "t.png")),
                     "the frozen autoencoder changed: the weights of " + vae + " have sha256 ");
  test::expect_error(test::run_ddm("train --config " + (dir / "run/config.toml") + " --out " + (dir / "run") +
                                   " --resume --set train.steps=6"),
                     "the frozen autoencoder changed: model.latent_sha256 = " + cfg.model.latent_sha256);
  test::expect_error(test::run_ddm(train + (dir / "x") + " --set model.latent=" + made.dir + "/flux"),
                     "the VAE takes 3-channel images, but the data is 1x28x28");
  EXPECT_FALSE(fs::exists(dir / "x/ckpt"));
  ModelConfig m;
  m.latent = made.dir + "/gray";
  Dataset odd;
  odd.images = torch::zeros({1, 1, 27, 27}, torch::kUInt8);
  odd.description = "27x27 images";
  try {
    resolve_latent(m, odd);
    ADD_FAILURE() << "27x27 images accepted by a VAE that halves them";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("the VAE downsamples by 2, so the images must be square with a side that 2 "
                                         "divides, but the data is 1x27x27; set data.resolution to a multiple of 2"),
              std::string::npos)
        << e.what();
  }
}
