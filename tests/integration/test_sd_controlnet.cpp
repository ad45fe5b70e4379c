// A ControlNet (diffusers' ControlNetModel) trained by ddm on Stable Diffusion's locked UNet, through
// the ddm binary: the pipeline diffusers wrote (tests/reference/diffusers_pipeline.py) gives the UNet,
// VAE, text encoder and schedule; model.controlnet = "from-unet" starts the ControlNet as diffusers'
// from_unet does. The run holds only the ControlNet, pins the UNet's weights by sha256, resumes bit
// for bit and samples from control maps, on the pipeline's VAE or on ddm's own autoencoder (which no
// export takes); a ControlNet that does not fit, a UNet without weights and a changed UNet are clear
// errors.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>

#include <torch/torch.h>

#include "core/config.h"
#include "core/fileio.h"
#include "core/safetensors.h"
#include "data/shard_write.h"
#include "test_util.h"

namespace fs = std::filesystem;
using namespace ddm;

namespace {

const test::ReferenceOutputs& pipeline() {
  static const test::ReferenceOutputs made = test::reference_outputs("tests/reference/diffusers_pipeline.py", "{dir}");
  return made;
}

// 12 RGB images of side 16: a coloured square on black, captioned with its colour.
void captioned_squares(const std::string& root) {
  fs::create_directories(root);
  const char* names[] = {"red", "green", "blue"};
  for (int i = 0; i < 12; ++i) {
    auto img = torch::zeros({3, 16, 16}, torch::kUInt8);
    const int64_t a = 2 + i % 4, b = 10 + i % 3;
    img[i % 3].slice(0, a, b).slice(1, a, b).fill_(220);
    const std::string stem = root + "/" + zero_padded(i, 3);
    test::write_text(stem + ".png", png_of(img));
    test::write_text(stem + ".txt", std::string("a ") + names[i % 3] + " square\n");
  }
}

std::string config(const std::string& root, const std::string& sd, const std::string& controlnet) {
  return "[data]\nsource = \"folder\"\nroot = \"" + root + "\"\n[model]\narch = \"sd-unet\"\nunet = \"" + sd +
         "\"\nlatent = \"" + sd + "\"\ntext_encoder = \"" + sd + "\"\ncontrolnet = \"" + controlnet +
         "\"\ncontrol = \"edges\"\n[diffusion]\nobjective = \"v\"\nscheduler = \"" + sd +
         "\"\n[train]\nsteps = 4\nbatch_size = 4\nwarmup = 1\nthreads = 1\nlog_every = 1\nckpt_every = 2\nseed = 5\n";
}

}  // namespace

TEST(SdControlNet, FromTheUnetTrainsResumesBitForBitAndSamplesFromControlMaps) {
  ASSERT_EQ(pipeline().run.exit_code, 0) << pipeline().run.output;
  test::TempDir dir;
  const std::string sd = pipeline().dir + "/sd";
  captioned_squares(dir / "images");
  test::write_text(dir / "cn.toml", config(dir / "images", sd, "from-unet"));
  const std::string train = "train --config " + (dir / "cn.toml") + " --out ";
  auto r = test::run_ddm(train + (dir / "run") + " --set train.steps=2");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("sd-unet ControlNet (diffusers' ControlNetModel on the locked UNet2DConditionModel of " + sd +
                          "/unet)"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("started the ControlNet as a copy of the UNet's encoder"), std::string::npos) << r.output;
  const RunConfig cfg = load_config(dir / "run/config.toml");
  EXPECT_EQ(cfg.model.controlnet, "from-unet");
  EXPECT_EQ(cfg.model.controlnet_sha256, sha256_file(sd + "/unet/diffusion_pytorch_model.safetensors"));
  // The checkpoint holds the ControlNet alone, under diffusers' names.
  const auto saved = load_safetensors(dir / "run/ckpt/step-00000002/model.safetensors").tensors;
  EXPECT_TRUE(saved.count("controlnet.controlnet_mid_block.weight"));
  EXPECT_TRUE(saved.count("controlnet.controlnet_cond_embedding.blocks.1.weight"));  // the VAE halves: 16 -> 8
  for (const auto& [name, t] : saved) EXPECT_EQ(name.rfind("controlnet.", 0), 0u) << name;
  // Resumed to step 4: what an uninterrupted run of 4 steps writes, byte for byte.
  r = test::run_ddm(train + (dir / "run") + " --resume");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(r.output.find("started the ControlNet"), std::string::npos) << r.output;
  ASSERT_EQ(test::run_ddm(train + (dir / "whole") + " --quiet").exit_code, 0);
  EXPECT_EQ(test::read_text(dir / "run/ckpt/step-00000004/model.safetensors"),
            test::read_text(dir / "whole/ckpt/step-00000004/model.safetensors"));
  // from_unet: with a step too small to move them, the encoder is the UNet's and the zero convolutions ~0.
  ASSERT_EQ(test::run_ddm(train + (dir / "still") + " --quiet --set train.steps=1 --set train.lr=1e-30 "
                                                     "--set train.grad_clip=0")
                .exit_code,
            0);
  const auto still = load_safetensors(dir / "still/ckpt/step-00000001/model.safetensors").tensors;
  const auto unet = load_safetensors(sd + "/unet/diffusion_pytorch_model.safetensors").tensors;
  int copied = 0, zero = 0;
  for (const auto& [name, t] : still) {
    const std::string key = name.substr(std::string("controlnet.").size());
    if (unet.count(key)) {
      EXPECT_TRUE(torch::equal(t, unet.at(key))) << key;
      ++copied;
    } else if (key.rfind("controlnet_down_blocks.", 0) == 0 || key.rfind("controlnet_mid_block.", 0) == 0) {
      EXPECT_LT(t.abs().max().item<double>(), 1e-20) << key;
      ++zero;
    }
  }
  EXPECT_GT(copied, 40);
  EXPECT_EQ(zero, 2 * (4 + 1));
  // Sampling from an edge map (a square's outline, as a PNG).
  auto map = torch::zeros({1, 16, 16}, torch::kUInt8);
  map.slice(1, 4, 12).select(2, 4).fill_(255);
  map.slice(1, 4, 12).select(2, 11).fill_(255);
  map.slice(2, 4, 12).select(1, 4).fill_(255);
  map.slice(2, 4, 12).select(1, 11).fill_(255);
  test::write_text(dir / "edges.png", png_of(map));
  const std::string sample = "sample --ckpt " + (dir / "run") + " --n 2 --steps 3 --cfg 2 --prompt 'a red square' --out " +
                             (dir / "s.png");
  r = test::run_ddm(sample + " --control " + (dir / "edges.png") + " --raw " + (dir / "s.safetensors"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(load_safetensors(dir / "s.safetensors").tensors.at("images").sizes(), (std::vector<int64_t>{2, 3, 16, 16}));
  // (--control-from is not offered: a folder of images has no train/test splits.)
  test::expect_error(test::run_ddm(sample), "is a ControlNet (model.control = edges): give its control maps with --control FILE\n");
  // Exported as a StableDiffusionControlNetPipeline and sampled by diffusers itself from the same noise,
  // prompts, control images, guidance and steps: what `ddm sample` gives, within float32 rounding.
  const std::string exported = dir / "exported";
  // (A run at a large learning rate, exported with its raw weights: after 4 steps at the default one the
  // zero convolutions have hardly moved, and the control maps would hardly matter: below the tolerance.)
  ASSERT_EQ(test::run_ddm(train + (dir / "strong") + " --quiet --set train.lr=0.05").exit_code, 0);
  r = test::run_ddm("export --no-ema --ckpt " + (dir / "strong") + " --diffusers " + exported);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("a StableDiffusionControlNetPipeline (controlnet/ from step 4, unet/ the locked UNet's"),
            std::string::npos)
      << r.output;
  EXPECT_EQ(test::read_text(exported + "/unet/diffusion_pytorch_model.safetensors"),
            test::read_text(sd + "/unet/diffusion_pytorch_model.safetensors"));
  SafetensorsFile noise, control;
  noise.tensors["noise"] = torch::randn({2, 4, 8, 8}, at::detail::createCPUGenerator(13));
  save_safetensors(dir / "noise.safetensors", noise);
  control.tensors["image"] = (map.to(torch::kFloat) / 255).unsqueeze(0).expand({2, 3, 16, 16}).contiguous();
  save_safetensors(dir / "control.safetensors", control);
  const std::string same = "sample --no-ema --ckpt " + (dir / "strong") + " --n 2 --steps 6 --cfg 3 --sampler ddim --prompt 'a red "
                           "square' --prompt 'a blue square' --init-noise " + (dir / "noise.safetensors") + " --out " +
                           (dir / "d.png") + " --control ";
  r = test::run_ddm(same + (dir / "edges.png") + " --raw " + (dir / "d.safetensors"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto py = test::run_command(test::reference_python() + " " + test::source_dir() +
                                    "/tests/reference/diffusers_sample.py --control " + (dir / "control.safetensors") +
                                    " " + exported + " " + (dir / "noise.safetensors") + " " + (dir / "py.safetensors") +
                                    " 6 3 'a red square' 'a blue square' 2>&1");
  ASSERT_EQ(py.exit_code, 0) << py.output;
  const auto ours = load_safetensors(dir / "d.safetensors").tensors, theirs = load_safetensors(dir / "py.safetensors").tensors;
  auto relative = [](const torch::Tensor& a, const torch::Tensor& b) {
    return (a - b).abs().max().item<double>() / b.abs().max().item<double>();
  };
  EXPECT_LT(relative(ours.at("latents"), theirs.at("latents")), 1e-5);
  EXPECT_LT(relative(ours.at("samples"), theirs.at("images")), 1e-5);
  RecordProperty("relative", std::to_string(relative(ours.at("latents"), theirs.at("latents"))) + " " +
                                 std::to_string(relative(ours.at("samples"), theirs.at("images"))));
  // The check can fail: another control map gives other latents.
  test::write_text(dir / "blank.png", png_of(torch::zeros({1, 16, 16}, torch::kUInt8)));
  r = test::run_ddm(same + (dir / "blank.png") + " --raw " + (dir / "b.safetensors"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const double other = relative(load_safetensors(dir / "b.safetensors").tensors.at("latents"), theirs.at("latents"));
  EXPECT_GT(other, 1e-3);  // 100 x the tolerance
  RecordProperty("blank_map_relative", std::to_string(other));
  // A changed UNet (its weights): refused on sampling and on resume.
  const std::string moved = dir / "moved";
  fs::copy(sd, moved, fs::copy_options::recursive);
  test::write_text(dir / "moved.toml", config(dir / "images", moved, "from-unet"));
  ASSERT_EQ(test::run_ddm("train --quiet --config " + (dir / "moved.toml") + " --set train.steps=1 --out " + (dir / "m"))
                .exit_code,
            0);
  auto w = load_safetensors(moved + "/unet/diffusion_pytorch_model.safetensors");
  w.tensors.at("conv_in.bias").add_(1e-3);
  save_safetensors(moved + "/unet/diffusion_pytorch_model.safetensors", w);
  test::expect_error(test::run_ddm("sample --ckpt " + (dir / "m") + " --n 1 --prompt a --control " + (dir / "edges.png") +
                                   " --out " + (dir / "x.png")),
                     "the locked UNet changed: the weights of " + moved + "/unet have sha256");
  test::expect_error(test::run_ddm("train --config " + (dir / "m/config.toml") + " --set train.steps=2 --resume --out " +
                                   (dir / "m")),
                     "the locked UNet changed");
}

TEST(SdControlNet, OnDdmsOwnAutoencoderItTrainsAndSamplesAndNeitherItNorItsUnetIsExported) {
  // Stable Diffusion's UNet and a ControlNet on it, both on the latents of ddm's own autoencoder (4
  // channels, 4 times smaller than the images, where the pipeline's VAE halves them): from_unet makes
  // a conditioning embedding that downsamples by 4, the run trains and samples from a control map,
  // and `ddm export --diffusers` refuses both models by name (a Stable Diffusion pipeline holds
  // diffusers' AutoencoderKL), writing nothing.
  ASSERT_EQ(pipeline().run.exit_code, 0) << pipeline().run.output;
  test::TempDir dir;
  const std::string sd = pipeline().dir + "/sd", ae = dir / "ae";
  captioned_squares(dir / "images");
  test::write_text(dir / "ae.toml", "[data]\nsource = \"folder\"\nroot = \"" + (dir / "images") +
                                        "\"\n[model]\npreset = \"ae-f4\"\nchannels = 8\ngroups = 4\n"
                                        "[train]\nsteps = 4\nbatch_size = 4\nwarmup = 1\nthreads = 1\nckpt_every = 4\n");
  auto r = test::run_ddm("train-autoencoder --quiet --config " + (dir / "ae.toml") + " --out " + ae + " --n 4 --stats-n 12");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::string cn = config(dir / "images", sd, "from-unet");
  cn.replace(cn.find("latent = \"" + sd + "\""), 11 + sd.size(), "latent = \"" + ae + "\"");
  test::write_text(dir / "cn.toml", cn);
  r = test::run_ddm("train --config " + (dir / "cn.toml") + " --out " + (dir / "cn") + " --set train.steps=2");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto saved = load_safetensors(dir / "cn/ckpt/step-00000002/model.safetensors").tensors;
  EXPECT_TRUE(saved.count("controlnet.controlnet_cond_embedding.blocks.3.weight"));  // two stride-2 steps: 16 -> 4
  EXPECT_FALSE(saved.count("controlnet.controlnet_cond_embedding.blocks.4.weight"));
  EXPECT_EQ(load_config(dir / "cn/config.toml").model.latent, ae + "/ckpt/step-00000004");  // resolved to its checkpoint
  auto map = torch::zeros({1, 16, 16}, torch::kUInt8);
  map.slice(1, 4, 12).select(2, 4).fill_(255);
  test::write_text(dir / "edges.png", png_of(map));
  r = test::run_ddm("sample --ckpt " + (dir / "cn") + " --n 2 --steps 3 --cfg 2 --prompt 'a red square' --control " +
                    (dir / "edges.png") + " --out " + (dir / "s.png") + " --raw " + (dir / "s.safetensors"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto images = load_safetensors(dir / "s.safetensors").tensors.at("images");
  EXPECT_EQ(images.sizes(), (std::vector<int64_t>{2, 3, 16, 16}));
  // The UNet alone on the same latents.
  std::string plain = config(dir / "images", sd, "from-unet");
  plain.replace(plain.find("latent = \"" + sd + "\""), 11 + sd.size(), "latent = \"" + ae + "\"");
  plain.erase(plain.find("controlnet = "), plain.find("[diffusion]") - plain.find("controlnet = "));
  test::write_text(dir / "unet.toml", plain);
  ASSERT_EQ(test::run_ddm("train --quiet --config " + (dir / "unet.toml") + " --out " + (dir / "unet") +
                          " --set train.steps=1")
                .exit_code,
            0);
  for (const char* run : {"cn", "unet"}) {
    test::expect_error(test::run_ddm("export --ckpt " + (dir / run) + " --diffusers " + (dir / "x")),
                       "model.latent = " + ae + "/ckpt/step-00000004 is ddm's own autoencoder; a Stable Diffusion pipeline needs diffusers' "
                                                "AutoencoderKL");
    EXPECT_FALSE(fs::exists(dir / "x")) << run;
  }
}

TEST(SdControlNet, ControlNetsThatDoNotFitAndUnetsWithoutWeightsAreClearErrors) {
  ASSERT_EQ(pipeline().run.exit_code, 0) << pipeline().run.output;
  const auto other = test::reference_outputs("tests/reference/diffusers_controlnet.py", "{dir}");
  ASSERT_EQ(other.run.exit_code, 0) << other.run.output;
  test::TempDir dir;
  const std::string sd = pipeline().dir + "/sd";
  captioned_squares(dir / "images");
  auto refused = [&](const std::string& controlnet, const std::string& needle, const std::string& extra = "") {
    test::write_text(dir / "x.toml", config(dir / "images", sd, controlnet) + extra);
    test::expect_error(test::run_ddm("train --config " + (dir / "x.toml") + " --out " + (dir / "x")), needle);
    EXPECT_FALSE(fs::exists(dir / "x"));
  };
  refused(dir / "nowhere", "model.controlnet = " + (dir / "nowhere") + ": no such directory");
  // A ControlNet of another UNet (1x1 conv projections, where this one's are linear).
  refused(other.dir + "/sd15/controlnet", ": not a ControlNet of the UNet " + sd + "/unet: attention_head_dim is 2");
  // The pipeline's UNet as a ControlNet.
  refused(sd + "/unet", "_class_name \"UNet2DConditionModel\": ddm reads diffusers' ControlNetModel here");
  // A pipeline without a ControlNet: from-unet makes one.
  refused(sd, "model_index.json: the pipeline has no \"controlnet\" component (it lists feature_extractor, "
              "image_encoder, safety_checker, scheduler, text_encoder, tokenizer, unet, vae); name the component's own "
              "folder instead, or model.controlnet = \"from-unet\" for a new one made from the UNet");
  // A UNet given by its config alone has nothing to steer.
  test::write_text(dir / "y.toml", "[data]\nsource = \"folder\"\nroot = \"" + (dir / "images") +
                                       "\"\n[model]\narch = \"sd-unet\"\nunet = \"" + pipeline().dir +
                                       "/pixel-unet\"\ntext_encoder = \"" + sd +
                                       "\"\ncontrolnet = \"from-unet\"\n[train]\nsteps = 1\n");
  test::expect_error(test::run_ddm("train --config " + (dir / "y.toml") + " --out " + (dir / "y")),
                     "a ControlNet steers a trained UNet, but model.unet = " + pipeline().dir +
                         "/pixel-unet holds its config.json alone");
}

TEST(SdControlNet, PlansAndTrainsAsAPipelineOfTwoStagesAsOneProcessTrains) {
  // `ddm plan` splits the ControlNet into its units (the ControlNet's encoder, the zero convolutions,
  // the locked UNet's decoder) and profiles the frozen work that bubble filling places: the VAE's and
  // the text encoder, the control maps and the locked UNet's encoder half. A pipeline of 2 stages
  // (real processes, bubbles filled) trains what one process trains, within float32 rounding.
  ASSERT_EQ(pipeline().run.exit_code, 0) << pipeline().run.output;
  test::TempDir dir;
  const std::string sd = pipeline().dir + "/sd";
  captioned_squares(dir / "images");
  test::write_text(dir / "cn.toml", config(dir / "images", sd, "from-unet"));
  const auto r = test::run_ddm("plan --config " + (dir / "cn.toml") + " --devices 2 --rows 1 --repeats 1 --batch 4 "
                               "--save-profile " + (dir / "profile.json"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("ControlNet (edges maps, locked encoder)"), std::string::npos) << r.output;
  const std::string profile = test::read_text(dir / "profile.json");
  for (const char* unit : {"\"control.in\"", "\"control.down0_0\"", "\"control.mid\"", "\"zero\"", "\"locked.up0_0\"",
                           "\"locked.out\""})
    EXPECT_NE(profile.find(unit), std::string::npos) << unit;
  // Micro-batches of one row: the stages prepare a row at a time (pipeline/prepare.h), and so does
  // the one process then, so the two differ only in the order of the gradients' sums.
  const std::string steps = " --config " + (dir / "cn.toml") + " --set train.steps=3 --set train.grad_accum=4 --set train.threads=1 --out ";
  auto p = test::run_ddm("launch --nproc 2 -- train" + steps + (dir / "pp") + " --set parallel.pp=2");
  ASSERT_EQ(p.exit_code, 0) << p.output;
  EXPECT_NE(p.output.find("a pipeline of 2 stages"), std::string::npos) << p.output;
  EXPECT_NE(p.output.find("parallel.fill after step 2"), std::string::npos) << p.output;
  ASSERT_EQ(test::run_ddm("train --quiet" + steps + (dir / "one")).exit_code, 0);
  const auto a = load_safetensors(dir / "pp/ckpt/step-00000003/model.safetensors").tensors;
  const auto b = load_safetensors(dir / "one/ckpt/step-00000003/model.safetensors").tensors;
  ASSERT_EQ(a.size(), b.size());
  double worst = 0;
  for (const auto& [name, t] : b)
    worst = std::max(worst, (a.at(name) - t).abs().max().item<double>() / std::max(t.abs().max().item<double>(), 1e-30));
  EXPECT_LE(worst, 1e-5);  // 3 AdamW steps from the same gradients up to float32 summation order
  RecordProperty("pipeline_vs_one_process_relative", std::to_string(worst));
}
