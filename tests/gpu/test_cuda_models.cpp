// GPU checks of the models beyond a class-conditional U-Net or DiT, run as users run them, through
// the ddm binary (label gpu: each skips, saying why, where no CUDA GPU is present). Each trains on
// CUDA what it trains on the CPU, within the bounds of "the same training in another float32 order"
// (gpu_test_util.h), and its samples drawn on CUDA from one checkpoint are the CPU's within 1e-3:
//   - on Fashion-MNIST: a router, a ControlNet on a trained U-Net (its locked encoder in the no-grad
//     prepare phase, the maps computed from the batch on the device), an image-embedding model (the
//     frozen feature network on the GPU) and a latent model on ddm's own autoencoder (encoding in
//     training and decoding in sampling on the GPU);
//   - Stable Diffusion from a pipeline directory that diffusers wrote (tests/reference/
//     diffusers_pipeline.py: UNet, AutoencoderKL, CLIP text encoder and tokenizer, its discrete
//     v-prediction scheduler), fine-tuned on captioned images and in bf16 following fp32; and
//     diffusers' ControlNetModel made from that UNet, trained on low-resolution maps.
// scripts/gpu-check.sh runs them with the pack's Fashion-MNIST (DDM_FASHION_MNIST) and a pipeline it
// makes on the GPU machine (DDM_TEST_SD_PIPELINE; the weights of one do not fit what a call carries).
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <string>
#include <utility>

#include <torch/torch.h>

#include "core/fileio.h"
#include "core/safetensors.h"
#include "data/dataset.h"
#include "data/shard_write.h"
#include "gpu/gpu_test_util.h"
#include "test_util.h"

namespace fs = std::filesystem;
using namespace ddm;
using namespace ddm::test;

namespace {

constexpr const char* kGpu = "cuda";

// Fashion-MNIST where scripts/gpu-check.sh carried it, else Debian's.
std::string fashion_mnist() {
  const char* carried = std::getenv("DDM_FASHION_MNIST");
  return carried && *carried ? carried : kFashionMnistRoot;
}

// `ddm ARGS` trained twice, into DIR/NAME-cpu on the CPU and DIR/NAME-gpu on CUDA; the two runs must agree.
void expect_trains_on_cuda_as_on_the_cpu(const TempDir& dir, const std::string& name, const std::string& args) {
  for (const auto& [where, device] : {std::pair{"cpu", "cpu"}, std::pair{"gpu", kGpu}}) {
    const CommandResult r = run_ddm(args + " --set train.device=" + device + " --out " + (dir / (name + "-" + where)));
    ASSERT_EQ(r.exit_code, 0) << name << " on " << device << ":\n" << r.output;
  }
  expect_same_training(dir / (name + "-gpu"), dir / (name + "-cpu"), name + " on cuda against the cpu");
}

// `ddm sample --ckpt RUN FLAGS --device DEVICE`'s samples (float, [-1, 1], pixels); `where` names the file.
torch::Tensor samples(const TempDir& dir, const std::string& run, const std::string& flags, const std::string& where,
                      const std::string& device) {
  const std::string raw = dir / (fs::path(run).filename().string() + "-samples-" + where + ".safetensors");
  const CommandResult r = run_ddm("sample --ckpt " + run + " " + flags + " --device " + device + " --out " +
                                  (dir / "grid.png") + " --raw " + raw);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  return r.exit_code == 0 ? load_safetensors(raw).tensors.at("samples") : torch::Tensor();
}

// The same checkpoint sampled on the CPU and on CUDA: the same images within 1e-3.
void expect_samples_on_cuda_as_on_the_cpu(const TempDir& dir, const std::string& run, const std::string& flags,
                                          const std::string& what) {
  const torch::Tensor cpu = samples(dir, run, flags, "cpu", "cpu"), gpu = samples(dir, run, flags, "gpu", kGpu);
  ASSERT_TRUE(cpu.defined() && gpu.defined()) << what;
  ASSERT_EQ(cpu.sizes(), gpu.sizes()) << what;
  const double diff = (cpu - gpu).abs().max().item<double>();
  EXPECT_LE(diff, 1e-3) << what;
  std::printf("%s: max |gpu - cpu| over the samples %.2e\n", what.c_str(), diff);
}

// A tiny U-Net on 600 Fashion-MNIST images, 6 steps.
std::string tiny_config(const TempDir& dir) {
  write_text(dir / "tiny.toml", "[data]\nlimit = 600\nroot = \"" + fashion_mnist() +
                                    "\"\n[model]\nchannels = 8\nchannel_mult = [1, 2]\ngroups = 4\n[train]\nsteps = 6\n"
                                    "batch_size = 16\nthreads = 1\nlog_every = 1\nckpt_every = 6\n");
  return dir / "tiny.toml";
}

}  // namespace

TEST(GpuModels, ARouterTrainsOnCudaAsOnTheCpu) {
  if (no_gpu()) GTEST_SKIP() << kNoGpu;
  TempDir dir;
  const std::string cfg = tiny_config(dir);
  const CommandResult r =
      run_ddm("partition --limit 600 --k 2 --fine 20 --data-root " + fashion_mnist() + " --out " + (dir / "p"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  expect_trains_on_cuda_as_on_the_cpu(dir, "router", "train-router --quiet --config " + cfg + " --partition " + (dir / "p") +
                                                         " --preset router-conv-tiny --holdout 100 --set train.steps=10");
}

TEST(GpuModels, AControlNetTrainsAndSamplesOnCudaAsOnTheCpu) {
  if (no_gpu()) GTEST_SKIP() << kNoGpu;
  TempDir dir;
  const CommandResult r = run_ddm("train --quiet --config " + tiny_config(dir) + " --out " + (dir / "base"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  expect_trains_on_cuda_as_on_the_cpu(dir, "controlnet", "train --quiet --controlnet " + (dir / "base"));
  expect_samples_on_cuda_as_on_the_cpu(dir, dir / "controlnet-cpu", "--control-from test --n 8 --steps 4 --cfg 2",
                                       "ControlNet sampled from test maps");
}

TEST(GpuModels, AnImageEmbeddingModelTrainsAndSamplesOnCudaAsOnTheCpu) {
  if (no_gpu()) GTEST_SKIP() << kNoGpu;
  TempDir dir;
  expect_trains_on_cuda_as_on_the_cpu(dir, "embed", "train --quiet --config " + tiny_config(dir) +
                                                        " --set model.embed=feature-net");
  expect_samples_on_cuda_as_on_the_cpu(dir, dir / "embed-cpu", "--reference-from test --n 8 --steps 4 --cfg 2",
                                       "image-embedding model sampled from test references");
}

TEST(GpuModels, ALatentModelTrainsAndSamplesOnCudaAsOnTheCpu) {
  if (no_gpu()) GTEST_SKIP() << kNoGpu;
  TempDir dir;
  const std::string data = "[data]\nlimit = 256\nroot = \"" + fashion_mnist() + "\"\n";
  write_text(dir / "ae.toml", data + "[model]\npreset = \"ae-f4\"\nchannels = 8\ngroups = 4\n[train]\nsteps = 10\n"
                                     "batch_size = 16\nlr = 2e-3\nwarmup = 2\nthreads = 1\nlog_every = 5\nckpt_every = 10\n");
  const CommandResult r = run_ddm("train-autoencoder --quiet --config " + (dir / "ae.toml") + " --out " + (dir / "ae") +
                                  " --n 200 --stats-n 256");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  write_text(dir / "latent.toml", data + "[model]\npreset = \"latent-dit\"\nwidth = 32\ndepth = 2\nheads = 2\n[train]\n"
                                         "steps = 6\nbatch_size = 16\nwarmup = 2\nthreads = 1\nlog_every = 1\nckpt_every = 6\n");
  expect_trains_on_cuda_as_on_the_cpu(dir, "latent", "train --quiet --config " + (dir / "latent.toml") +
                                                         " --set model.latent=" + (dir / "ae"));
  expect_samples_on_cuda_as_on_the_cpu(dir, dir / "latent-cpu", "--n 8 --steps 4 --cfg 2",
                                       "latent model sampled and decoded");
}

TEST(GpuModels, StableDiffusionFromDiffusersTrainsAndSamplesOnCudaAsOnTheCpu) {
  if (no_gpu()) GTEST_SKIP() << kNoGpu;
  const char* made = std::getenv("DDM_TEST_SD_PIPELINE");
  if (!made || !*made)
    GTEST_SKIP() << "DDM_TEST_SD_PIPELINE names no diffusers pipeline (tests/reference/diffusers_pipeline.py's OUT_DIR; "
                    "scripts/gpu-check.sh makes one)";
  const std::string sd = std::string(made) + "/sd";
  TempDir dir;
  // 24 RGB images of 16 px, each one colour, captioned with it.
  const std::string root = dir / "images";
  fs::create_directories(root);
  const char* colours[] = {"red", "green", "blue"};
  for (int i = 0; i < 24; ++i) {
    auto img = torch::zeros({3, 16, 16}, torch::kUInt8);
    img[i % 3].fill_(200);
    write_text(root + "/" + zero_padded(i, 3) + ".png", png_of(img));
    write_text(root + "/" + zero_padded(i, 3) + ".txt", std::string("a ") + colours[i % 3] + " square\n");
  }
  const std::string head = "[data]\nsource = \"folder\"\nroot = \"" + root + "\"\n[model]\narch = \"sd-unet\"\nunet = \"" +
                           sd + "\"\nlatent = \"" + sd + "\"\ntext_encoder = \"" + sd + "\"\n";
  const std::string tail = "[diffusion]\nobjective = \"v\"\nscheduler = \"" + sd +
                           "\"\n[train]\nsteps = 20\nbatch_size = 4\nwarmup = 2\ncaption_dropout = 0.2\nthreads = 1\n"
                           "log_every = 1\nckpt_every = 20\nseed = 3\n";
  write_text(dir / "sd.toml", head + tail);
  expect_trains_on_cuda_as_on_the_cpu(dir, "sd", "train --quiet --config " + (dir / "sd.toml"));
  expect_samples_on_cuda_as_on_the_cpu(dir, dir / "sd-cpu", "--n 4 --steps 4 --cfg 3 --prompt 'a red square' --prompt 'a "
                                                            "blue square'", "Stable Diffusion sampled from prompts");
  // bf16 autocast on CUDA follows fp32 there (the mean loss of the last 5 steps within 5%).
  const CommandResult r = run_ddm("train --quiet --config " + (dir / "sd.toml") + " --set train.device=" + kGpu +
                                  " --set train.precision=bf16 --out " + (dir / "sd-bf16"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto lf = losses(dir / "sd-gpu"), lb = losses(dir / "sd-bf16");
  ASSERT_EQ(lb.size(), lf.size());
  EXPECT_NE(lb, lf) << "bf16 trained exactly what fp32 did: autocast was not on";
  double tail_f = 0, tail_b = 0;
  for (size_t i = lf.size() - 5; i < lf.size(); ++i) tail_f += lf[i] / 5, tail_b += lb[i] / 5;
  EXPECT_LE(std::abs(tail_b - tail_f) / tail_f, 5e-2);
  std::printf("Stable Diffusion: bf16 against fp32 on cuda: mean loss of the last 5 steps %.4f against %.4f\n", tail_b,
              tail_f);
  // diffusers' ControlNetModel from that UNet, on low-resolution maps, steered by a row of image tiles.
  write_text(dir / "cn.toml", head + "controlnet = \"from-unet\"\ncontrol = \"lowres\"\n" + tail);
  expect_trains_on_cuda_as_on_the_cpu(dir, "sd-controlnet", "train --quiet --config " + (dir / "cn.toml"));
  auto maps = torch::zeros({3, 16, 4 * 16}, torch::kUInt8);  // red, green, blue, red
  for (int64_t i = 0; i < 4; ++i) maps[i % 3].slice(1, 16 * i, 16 * i + 16).fill_(200);
  write_text(dir / "maps.png", png_of(maps));
  expect_samples_on_cuda_as_on_the_cpu(dir, dir / "sd-controlnet-cpu",
                                       "--n 4 --steps 4 --cfg 2 --prompt '' --control " + (dir / "maps.png"),
                                       "Stable Diffusion's ControlNet sampled from maps");
}
