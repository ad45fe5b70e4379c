// Stable Diffusion's UNet trained and sampled by ddm, through the ddm binary: a pipeline directory
// that diffusers itself wrote (tests/reference/diffusers_pipeline.py: UNet, VAE, CLIP text encoder,
// tokenizer, scheduler) is named as model.unet, model.latent, model.text_encoder and
// diffusion.scheduler. The run takes the scheduler's discrete schedule and prediction type, starts
// from the UNet's weights, pins its architecture by sha256, resumes bit for bit and samples. A UNet
// given by its config.json alone trains from its initialisation, and learns captioned colours in
// pixel space (400 steps); a ControlNet on it then learns to draw its maps' colours. Wrong folders, a
// UNet that does not fit the data or the encoder, and a changed UNet are clear errors.
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

// 24 RGB images of side `side`, each one colour, captioned with it.
void captioned_folder(const std::string& root, int64_t side) {
  fs::create_directories(root);
  const char* names[] = {"red", "green", "blue"};
  for (int i = 0; i < 24; ++i) {
    auto img = torch::zeros({3, side, side}, torch::kUInt8);
    img[i % 3].fill_(200);
    const std::string stem = root + "/" + zero_padded(i, 3);
    test::write_text(stem + ".png", png_of(img));
    test::write_text(stem + ".txt", std::string("a ") + names[i % 3] + " square\n");
  }
}

std::string config(const std::string& root, const std::string& sd) {
  return "[data]\nsource = \"folder\"\nroot = \"" + root + "\"\n[model]\narch = \"sd-unet\"\nunet = \"" + sd +
         "\"\nlatent = \"" + sd + "\"\ntext_encoder = \"" + sd + "\"\n[diffusion]\nobjective = \"v\"\nscheduler = \"" +
         sd + "\"\n[train]\nsteps = 4\nbatch_size = 4\nwarmup = 1\nthreads = 1\nlog_every = 1\nckpt_every = 2\nseed = 3\n";
}

// DIR/images (16 px) and DIR/sd.toml naming the pipeline for every part; returns the pipeline's directory.
std::string write_sd_config(const test::TempDir& dir) {
  const std::string sd = pipeline().dir + "/sd";
  captioned_folder(dir / "images", 16);
  test::write_text(dir / "sd.toml", config(dir / "images", sd));
  return sd;
}

}  // namespace

TEST(SdTrain, AStableDiffusionPipelineFineTunesResumesBitForBitAndSamples) {
  ASSERT_EQ(pipeline().run.exit_code, 0) << pipeline().run.output;
  test::TempDir dir;
  const std::string sd = write_sd_config(dir), root = dir / "images";
  const std::string train = "train --config " + (dir / "sd.toml") + " --out ";
  auto r = test::run_ddm(train + (dir / "run") + " --set train.steps=2");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("started from the UNet's weights in " + sd + "/unet"), std::string::npos) << r.output;
  // ddm's default rate is for training anew: fine-tuning at it is said to be too much.
  EXPECT_NE(r.output.find("note: fine-tuning pretrained weights at train.lr = 0.002"), std::string::npos) << r.output;
  const RunConfig cfg = load_config(dir / "run/config.toml");
  EXPECT_EQ(cfg.model.unet, sd + "/unet");
  EXPECT_EQ(cfg.model.unet_sha256, sha256_file(sd + "/unet/config.json"));
  EXPECT_EQ(cfg.model.num_classes, 0);
  EXPECT_EQ(cfg.model.in_channels, 4);
  EXPECT_EQ(cfg.model.image_size, 8);
  EXPECT_EQ(cfg.model.text_dim, 32);
  EXPECT_EQ(cfg.diffusion.schedule, "discrete");
  EXPECT_EQ(cfg.diffusion.beta_schedule, "scaled_linear");
  EXPECT_EQ(cfg.diffusion.beta_start, 0.00085);
  EXPECT_EQ(cfg.diffusion.beta_end, 0.012);
  EXPECT_EQ(cfg.diffusion.timesteps, 1000);
  EXPECT_EQ(cfg.diffusion.scheduler, sd + "/scheduler/scheduler_config.json");
  // The checkpoint holds the UNet under diffusers' names.
  const auto saved = load_safetensors(dir / "run/ckpt/step-00000002/model.safetensors").tensors;
  const auto diffusers = load_safetensors(sd + "/unet/diffusion_pytorch_model.safetensors").tensors;
  EXPECT_EQ(saved.size(), diffusers.size());
  for (const auto& [name, t] : diffusers) EXPECT_TRUE(saved.count("unet." + name)) << name;
  // Resumed to step 4: what an uninterrupted run of 4 steps writes, byte for byte. The weights come from the
  // checkpoint alone: the UNet's own are not read again.
  r = test::run_ddm(train + (dir / "run") + " --resume");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("resuming from"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("started from"), std::string::npos) << r.output;
  ASSERT_EQ(test::run_ddm(train + (dir / "whole") + " --quiet").exit_code, 0);
  EXPECT_EQ(test::read_text(dir / "run/ckpt/step-00000004/model.safetensors"),
            test::read_text(dir / "whole/ckpt/step-00000004/model.safetensors"));
  // Fine-tuning starts from diffusers' weights: with a step too small to move them, every tensor is theirs.
  // (--resume with no checkpoint yet starts there too, not from the UNet's initialization.)
  r = test::run_ddm(train + (dir / "still") + " --resume --set train.steps=1 --set train.lr=1e-30 --set train.grad_clip=0");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("started from the UNet's weights"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("note: fine-tuning"), std::string::npos) << r.output;
  const auto still = load_safetensors(dir / "still/ckpt/step-00000001/model.safetensors").tensors;
  for (const auto& [name, t] : diffusers) EXPECT_TRUE(torch::equal(still.at("unet." + name), t)) << name;
  // Sampling: the VAE decodes 16x16 RGB images.
  r = test::run_ddm("sample --ckpt " + (dir / "run") + " --n 2 --steps 3 --cfg 2 --prompt 'a red square' --out " +
                    (dir / "s.png") + " --raw " + (dir / "s.safetensors"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(load_safetensors(dir / "s.safetensors").tensors.at("images").sizes(), (std::vector<int64_t>{2, 3, 16, 16}));
  // Exported as a diffusers pipeline and sampled by diffusers itself from the same noise, prompts,
  // guidance and steps: what `ddm sample` gives, within float32 rounding.
  const std::string exported = dir / "exported";
  r = test::run_ddm("export --ckpt " + (dir / "run") + " --diffusers " + exported + "/");  // a trailing slash, too
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("wrote " + exported + ": a StableDiffusionPipeline (unet/ from step 4"), std::string::npos)
      << r.output;
  test::expect_error(test::run_ddm("export --ckpt " + (dir / "run") + " --diffusers " + exported),
                     exported + " exists: remove it or name another directory");
  SafetensorsFile noise;
  noise.tensors["noise"] = torch::randn({2, 4, 8, 8}, at::detail::createCPUGenerator(11));
  save_safetensors(dir / "noise.safetensors", noise);
  const std::string prompts = " 'a red square' 'a blue square'";
  r = test::run_ddm("sample --ckpt " + (dir / "run") + " --n 2 --steps 6 --cfg 3 --sampler ddim --prompt 'a red square' "
                    "--prompt 'a blue square' --init-noise " + (dir / "noise.safetensors") + " --out " + (dir / "d.png") +
                    " --raw " + (dir / "d.safetensors"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto py = test::run_command(test::reference_python() + " " + test::source_dir() +
                                    "/tests/reference/diffusers_sample.py " + exported + " " + (dir / "noise.safetensors") +
                                    " " + (dir / "py.safetensors") + " 6 3" + prompts + " 2>&1");
  ASSERT_EQ(py.exit_code, 0) << py.output;
  const auto ours = load_safetensors(dir / "d.safetensors").tensors, theirs = load_safetensors(dir / "py.safetensors").tensors;
  auto relative = [](const torch::Tensor& a, const torch::Tensor& b) {
    return (a - b).abs().max().item<double>() / b.abs().max().item<double>();
  };
  EXPECT_LT(relative(ours.at("latents"), theirs.at("latents")), 1e-5);
  EXPECT_LT(relative(ours.at("samples"), theirs.at("images")), 1e-5);
  // The check can fail: ddm's Euler step in t (not diffusers' Euler in sigma) from the same noise is further off.
  r = test::run_ddm("sample --ckpt " + (dir / "run") + " --n 2 --steps 6 --cfg 3 --sampler euler --prompt 'a red square' "
                    "--prompt 'a blue square' --init-noise " + (dir / "noise.safetensors") + " --out " + (dir / "e.png") +
                    " --raw " + (dir / "e.safetensors"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_GT(relative(load_safetensors(dir / "e.safetensors").tensors.at("latents"), theirs.at("latents")), 1e-3);
  // Initial noise that does not fit is refused before sampling.
  noise.tensors["noise"] = torch::randn({1, 4, 8, 8});
  save_safetensors(dir / "one.safetensors", noise);
  const std::string sample2 = "sample --ckpt " + (dir / "run") + " --n 2 --prompt a --out " + (dir / "x.png") + " --init-noise ";
  test::expect_error(test::run_ddm(sample2 + (dir / "one.safetensors")),
                     "\"noise\" is Float [1, 4, 8, 8], but --n 2 samples of this model start from float [2, 4, 8, 8] (its latents)");
  test::expect_error(test::run_ddm(sample2 + (dir / "d.safetensors")), "no tensor named \"noise\"");
  test::expect_error(test::run_ddm(sample2 + (dir / "none.safetensors")), "--init-noise " + (dir / "none.safetensors"));
  // A changed UNet config: refused on sampling and on resume.
  const std::string moved = dir / "moved";
  fs::copy(sd, moved, fs::copy_options::recursive);
  test::write_text(dir / "moved.toml", config(root, moved));
  ASSERT_EQ(test::run_ddm("train --quiet --config " + (dir / "moved.toml") + " --set train.steps=1 --out " + (dir / "m"))
                .exit_code,
            0);
  test::write_text(moved + "/unet/config.json", test::read_text(moved + "/unet/config.json") + "\n");
  test::expect_error(test::run_ddm("sample --ckpt " + (dir / "m") + " --n 1 --prompt a --out " + (dir / "x.png")),
                     "the UNet's architecture changed: " + moved + "/unet/config.json");
  test::expect_error(test::run_ddm("train --config " + (dir / "m/config.toml") + " --set train.steps=2 --resume --out " +
                                   (dir / "m")),
                     "the UNet's architecture changed");
  EXPECT_FALSE(fs::exists(dir / "x.png"));
}

TEST(SdTrain, AUnetFromItsConfigAloneLearnsCaptionedColoursInPixelSpace) {
  ASSERT_EQ(pipeline().run.exit_code, 0) << pipeline().run.output;
  test::TempDir dir;
  const std::string sd = pipeline().dir + "/sd", unet = pipeline().dir + "/pixel-unet", root = dir / "images";
  captioned_folder(root, 8);
  test::write_text(dir / "px.toml", "[data]\nsource = \"folder\"\nroot = \"" + root + "\"\n[model]\narch = \"sd-unet\"\n"
                                    "unet = \"" + unet + "\"\ntext_encoder = \"" + sd + "\"\n[diffusion]\nobjective = \"v\"\n"
                                    "schedule = \"discrete\"\n[train]\nsteps = 400\nbatch_size = 6\nwarmup = 5\n"
                                    "threads = 1\nlog_every = 100\nckpt_every = 400\nseed = 3\n");
  const std::string run = dir / "run";
  auto r = test::run_ddm("train --config " + (dir / "px.toml") + " --out " + run);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(r.output.find("started from"), std::string::npos) << r.output;
  test::expect_error(test::run_ddm("export --ckpt " + run + " --diffusers " + (dir / "x")),
                     "is a pixel model, and a Stable Diffusion pipeline samples latents");
  EXPECT_FALSE(fs::exists(dir / "x"));
  r = test::run_ddm("sample --ckpt " + run + " --steps 10 --cfg 3 --n 12 --prompt 'a red square' --prompt "
                    "'a green square' --prompt 'a blue square' --out " + (dir / "s.png") + " --raw " + (dir / "s.safetensors"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto images = load_safetensors(dir / "s.safetensors").tensors.at("images").to(torch::kFloat);  // [12, 3, 8, 8]
  // Each sample's brightest channel is its prompt's colour: at least 11 of the 12, and most of each row
  // (at 200 steps red and blue were still confused: 2 of 5 red samples were blue).
  const auto right = images.mean({2, 3}).argmax(1).eq(torch::arange(3, torch::kLong).repeat_interleave(4));  // [12]
  EXPECT_GE(right.sum().item<int64_t>(), 11) << right;
  EXPECT_TRUE(right.view({3, 4}).sum(1).ge(3).all().item<bool>()) << right;

  // A ControlNet learns to steer it: diffusers' ControlNetModel made from_unet on this run's UNet (its
  // EMA weights under diffusers' names, in a UNet folder of their own), trained on lowres maps with
  // the caption dropped half the time. Sampled with the empty prompt, which names no colour, each
  // sample draws its map's colour (where the UNet alone would draw one of the three by chance).
  const std::string base = dir / "base-unet";
  fs::create_directories(base);
  fs::copy_file(unet + "/config.json", base + "/config.json");
  SafetensorsFile weights;
  for (const auto& [name, t] : load_safetensors(run + "/ckpt/step-00000400/ema.safetensors").tensors)
    weights.tensors[name.substr(std::string("unet.").size())] = t;
  save_safetensors(base + "/diffusion_pytorch_model.safetensors", weights);
  test::write_text(dir / "cn.toml", "[data]\nsource = \"folder\"\nroot = \"" + root + "\"\n[model]\narch = \"sd-unet\"\n"
                                    "unet = \"" + base + "\"\ntext_encoder = \"" + sd + "\"\ncontrolnet = \"from-unet\"\n"
                                    "control = \"lowres\"\n[diffusion]\nobjective = \"v\"\nschedule = \"discrete\"\n[train]\n"
                                    "steps = 150\nbatch_size = 6\nwarmup = 5\nlr = 1e-3\ncaption_dropout = 0.5\nthreads = 1\n"
                                    "log_every = 50\nckpt_every = 150\nseed = 4\n");
  r = test::run_ddm("train --config " + (dir / "cn.toml") + " --out " + (dir / "cn"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  // The maps: a row of 4 tiles each of blue, red and green (8 px lowres maps of one colour are that colour).
  auto maps = torch::zeros({3, 8, 12 * 8}, torch::kUInt8);
  const int64_t order[] = {2, 0, 1};
  for (int64_t i = 0; i < 12; ++i) maps[order[i / 4]].slice(1, 8 * i, 8 * i + 8).fill_(200);
  test::write_text(dir / "maps.png", png_of(maps));
  r = test::run_ddm("sample --ckpt " + (dir / "cn") + " --steps 10 --cfg 1 --n 12 --prompt '' --control " +
                    (dir / "maps.png") + " --out " + (dir / "c.png") + " --raw " + (dir / "c.safetensors"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto steered = load_safetensors(dir / "c.safetensors").tensors.at("images").to(torch::kFloat);  // [12, 3, 8, 8]
  const auto follows = steered.mean({2, 3}).argmax(1).eq(torch::tensor({2, 0, 1}).repeat_interleave(4));  // [12]
  EXPECT_GE(follows.sum().item<int64_t>(), 11) << follows;
  RecordProperty("controlnet_follows_of_12", std::to_string(follows.sum().item<int64_t>()));
}

TEST(SdTrain, WrongFoldersAndMisfitUnetsAreClearErrors) {
  ASSERT_EQ(pipeline().run.exit_code, 0) << pipeline().run.output;
  test::TempDir dir;
  const std::string sd = write_sd_config(dir), root = dir / "images";
  const std::string train = "train --config " + (dir / "sd.toml") + " --set train.steps=1 --out " + (dir / "run");
  // No such folder; a folder without config.json; a pipeline without unet/.
  test::expect_error(test::run_ddm(train + " --set model.unet=" + (dir / "none")), "model.unet = " + (dir / "none") + ": no such directory");
  fs::create_directories(dir / "empty");
  test::expect_error(test::run_ddm(train + " --set model.unet=" + (dir / "empty")), "no config.json");
  // Pipeline directories that do not hold what their model_index.json says, or hold something else.
  const std::string pipe = dir / "pipe";
  fs::create_directories(pipe);
  fs::copy_file(sd + "/model_index.json", pipe + "/model_index.json");
  test::expect_error(test::run_ddm(train + " --set model.unet=" + pipe),
                     "model_index.json lists the unet (UNet2DConditionModel), but " + pipe + "/unet is missing");
  test::expect_error(test::run_ddm(train + " --set model.latent=" + pipe),
                     "model.latent = " + pipe + ": " + pipe + "/model_index.json lists the vae (AutoencoderKL), but");
  test::expect_error(test::run_ddm(train + " --set model.text_encoder=" + pipe),
                     "model.text_encoder = " + pipe + ": " + pipe + "/model_index.json lists the text_encoder (CLIPTextModel), but");
  std::string index = test::read_text(sd + "/model_index.json");
  index.replace(index.find("\"UNet2DConditionModel\""), 22, "\"UNet2DModel\"");
  index.replace(index.find("\"DDIMScheduler\""), 15, "null");
  test::write_text(pipe + "/model_index.json", index);
  test::expect_error(test::run_ddm(train + " --set model.unet=" + pipe),
                     "the pipeline's unet is a UNet2DModel, and ddm reads UNet2DConditionModel there");
  test::expect_error(test::run_ddm(train + " --set diffusion.scheduler=" + pipe),
                     "diffusion.scheduler = " + pipe + ": " + pipe + "/model_index.json: the pipeline was saved without a scheduler");
  test::write_text(pipe + "/model_index.json", "[1, 2]");
  test::expect_error(test::run_ddm(train + " --set model.unet=" + pipe), "not a JSON object");
  // A UNet of 3 channels on 4-channel latents; an encoder of another width.
  test::expect_error(test::run_ddm(train + " --set model.unet=" + pipeline().dir + "/pixel-unet"),
                     "the UNet takes 3 and gives 3 channels, but the model's input has 4 (model.latent's latents)");
  test::expect_error(test::run_ddm(train + " --set model.text_encoder=" + test::minilm_package_dir() + "/model"),
                     "the UNet attends to states of width 32 (cross_attention_dim), but the text encoder");
  // The objective must be what the scheduler's UNet predicts.
  test::expect_error(test::run_ddm(train + " --set diffusion.objective=eps"),
                     "its model predicts v_prediction, so set diffusion.objective = v (it is eps)");
  // Weights kept as a pickle are not taken for a config alone.
  const std::string pickled = dir / "pickled";
  fs::create_directories(pickled);
  fs::copy_file(sd + "/unet/config.json", pickled + "/config.json");
  test::write_text(pickled + "/diffusion_pytorch_model.bin", "not read");
  test::expect_error(test::run_ddm(train + " --set model.unet=" + pickled), "safetensors");
  // A pipeline copied without its model_index.json: each key says what is missing, and where the part is.
  const std::string unindexed = dir / "unindexed";
  fs::copy(sd, unindexed, fs::copy_options::recursive);
  fs::remove(unindexed + "/model_index.json");
  for (const auto& [key, part] : {std::pair{"unet", "unet"}, std::pair{"latent", "vae"}, std::pair{"text_encoder", "text_encoder"}})
    test::expect_error(test::run_ddm(train + " --set model." + key + "=" + unindexed),
                       std::string("; it holds ") + part + "/ but no model_index.json, which a pipeline directory needs: "
                       "restore it, or name " + unindexed + "/" + part);
  // An index without the pipeline's class is not diffusers'.
  std::string classless = test::read_text(sd + "/model_index.json");
  classless.replace(classless.find("\"_class_name\""), 13, "\"_not_class\"");
  test::write_text(unindexed + "/model_index.json", classless);
  test::expect_error(test::run_ddm(train + " --set model.unet=" + unindexed),
                     "model_index.json: no \"_class_name\" naming the pipeline's class");
  // A VAE folder whose config.json lost its class is named as damaged, not taken for a ddm run.
  test::write_text(unindexed + "/vae/config.json", "{}");
  test::expect_error(test::run_ddm(train + " --set model.latent=" + unindexed + "/vae"),
                     unindexed + "/vae/config.json: no _class_name, so not the config.json of diffusers' AutoencoderKL");
  // transformers' pickle of the text encoder: refused with the conversion to safetensors.
  fs::remove(unindexed + "/text_encoder/model.safetensors");
  test::write_text(unindexed + "/text_encoder/pytorch_model.bin", "not read");
  test::expect_error(test::run_ddm(train + " --set model.text_encoder=" + unindexed + "/text_encoder"),
                     "or convert it: python3 -c \"import torch, safetensors.torch as st;");
  // Weights that do not fit the UNet's config: bad input (exit 2, not restarted by a supervisor).
  const std::string misfit = dir / "misfit";
  fs::create_directories(misfit);
  fs::copy_file(sd + "/unet/config.json", misfit + "/config.json");
  SafetensorsFile unet_weights = load_safetensors(sd + "/unet/diffusion_pytorch_model.safetensors");
  unet_weights.tensors["conv_in.bias"] = torch::zeros({7});
  save_safetensors(misfit + "/diffusion_pytorch_model.safetensors", unet_weights);
  auto r = test::run_ddm(train + " --set model.unet=" + misfit);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("\"conv_in.bias\" has shape [7], but " + misfit + "/config.json makes it [32]"), std::string::npos)
      << r.output;
  EXPECT_FALSE(fs::exists(dir / "run/ckpt"));
  // A ddm run of this UNet where diffusers' folder is wanted: export it first. (The run names each
  // part's folder with a trailing slash: the tokenizer is still found beside text_encoder/.)
  r = test::run_ddm(train + " --quiet --set model.unet=" + sd + "/unet/ --set model.latent=" + sd +
                    "/vae/ --set model.text_encoder=" + sd + "/text_encoder/");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(load_config(dir / "run/config.toml").model.text_encoder, sd + "/text_encoder");
  test::expect_error(test::run_ddm("train --config " + (dir / "sd.toml") + " --set model.unet=" + (dir / "run") +
                                   " --out " + (dir / "run2")),
                     "; it is a ddm run: `ddm export --ckpt " + (dir / "run") + " --diffusers OUT` writes its UNet");
  test::expect_error(test::run_ddm("train --controlnet " + (dir / "run") + " --out " + (dir / "run2")),
                     "holds diffusers' UNet (model.arch = sd-unet), whose ControlNet is diffusers' ControlNetModel: "
                     "write the run out with `ddm export");
  EXPECT_FALSE(fs::exists(dir / "run2"));
}

TEST(SdTrain, PlanProfilesTheUnetsUnitsAndItsFrozenWork) {
  // `ddm plan` splits diffusers' UNet into its units (time embedding and conv_in, each down block's
  // resnet and transformer, the middle, each up block's, the output) and profiles the VAE's encoder
  // and the text encoder as the frozen work that bubble filling places.
  ASSERT_EQ(pipeline().run.exit_code, 0) << pipeline().run.output;
  test::TempDir dir;
  const std::string sd = write_sd_config(dir), root = dir / "images";
  const auto r = test::run_ddm("plan --config " + (dir / "sd.toml") + " --devices 2 --rows 1 --repeats 1 --batch 4 "
                               "--save-profile " + (dir / "profile.json"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("profiling sd-unet (diffusers' UNet2DConditionModel of " + sd + "/unet) and its frozen work "
                          "(latent encoder + text encoder)"),
            std::string::npos)
      << r.output;
  const std::string profile = test::read_text(dir / "profile.json");
  for (const char* unit : {"\"in\"", "\"down0_0\"", "\"downsample0\"", "\"mid\"", "\"up1_1\"", "\"upsample0\"", "\"out\""})
    EXPECT_NE(profile.find(unit), std::string::npos) << unit;
}
