// Latent diffusion end to end through the ddm binary on real Fashion-MNIST, with a tiny autoencoder
// trained once for the suite: `ddm train-autoencoder` writes its report and picture; a latent model
// resolves and pins its frozen autoencoder, keeps none of its weights, trains, resumes bit for bit
// and samples decoded images; a changed, missing or wrong autoencoder is a clear error; latent
// experts (partitioned on the latents, in memory or streamed from shards alike, routed by a latent
// router) form an ensemble that samples images, refuses a pixel expert, and distills into a latent
// student.
#include <gtest/gtest.h>

#include <filesystem>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/config.h"
#include "core/fileio.h"
#include "core/safetensors.h"
#include "decentral/partition.h"
#include "test_util.h"

namespace fs = std::filesystem;
using namespace ddm;

namespace {

const char* kTinyAutoencoder = R"(
[data]
limit = 256
[model]
preset = "ae-f4"
channels = 8
groups = 4
[train]
steps = 10
batch_size = 16
lr = 2e-3
warmup = 2
threads = 1
log_every = 5
ckpt_every = 5
seed = 1
)";

const char* kTinyLatent = R"(
[data]
limit = 256
[model]
preset = "latent-dit"
width = 32
depth = 2
heads = 2
[train]
steps = 6
batch_size = 16
warmup = 2
threads = 1
log_every = 1
ckpt_every = 3
seed = 2
)";

using test::expect_error;

class Latent : public ::testing::Test {
 protected:
  // One autoencoder for the suite (its training and report take ~20 s on one thread).
  static void SetUpTestSuite() {
    dir_ = std::make_unique<test::TempDir>();
    test::write_text(*dir_ / "ae.toml", kTinyAutoencoder);
    test::write_text(*dir_ / "latent.toml", kTinyLatent);
    ae_result_ = test::run_ddm("train-autoencoder --quiet --config " + (*dir_ / "ae.toml") + " --out " + ae() +
                               " --n 200 --stats-n 256");
  }
  static void TearDownTestSuite() { dir_.reset(); }
  static std::string ae() { return *dir_ / "ae"; }
  static std::string path(const std::string& name) { return *dir_ / name; }
  static test::CommandResult train_latent(const std::string& out, const std::string& extra = "") {
    return test::run_ddm("train --quiet --config " + path("latent.toml") + " --set model.latent=" + ae() + " --out " +
                         out + " " + extra);
  }
  static std::unique_ptr<test::TempDir> dir_;
  static test::CommandResult ae_result_;
};
std::unique_ptr<test::TempDir> Latent::dir_;
test::CommandResult Latent::ae_result_;

TEST_F(Latent, TrainAutoencoderWritesItsReportAndPicture) {
  ASSERT_EQ(ae_result_.exit_code, 0) << ae_result_.output;
  const auto j = nlohmann::json::parse(test::read_text(ae() + "/autoencoder.json"));
  EXPECT_EQ(j["checkpoint"], "step-00000010");
  EXPECT_EQ(j["latent_shape"], (std::vector<int64_t>{4, 7, 7}));
  EXPECT_EQ(j["weights_sha256"], sha256_file(ae() + "/ckpt/step-00000010/ema.safetensors"));
  EXPECT_GT(j["latent_scale"].get<double>(), 0);
  EXPECT_GT(j["psnr_db"].get<double>(), 5);  // better than nothing after 10 steps, not yet good
  EXPECT_GT(j["eval"]["fd_fmnist"].get<double>(), 0);
  EXPECT_EQ(j["eval"]["n"], 200);
  EXPECT_EQ(test::read_text(ae() + "/reconstructions.png").substr(1, 3), "PNG");
  EXPECT_NE(ae_result_.output.find("PSNR"), std::string::npos) << ae_result_.output;
  // Sampling an autoencoder, or training one with the wrong command, says what to do instead.
  expect_error(test::run_ddm("sample --ckpt " + ae() + " --out " + path("x.png")), "holds an autoencoder");
  expect_error(test::run_ddm("train-autoencoder --config " + path("latent.toml") + " --out " + path("not-ae")),
               "but train-autoencoder trains an autoencoder");
  EXPECT_FALSE(fs::exists(path("not-ae")));
}

TEST_F(Latent, ModelPinsItsAutoencoderTrainsResumesAndSamplesImages) {
  ASSERT_EQ(ae_result_.exit_code, 0) << ae_result_.output;
  const std::string run = path("latent");
  // With grids while it trains (the split run below has none and trains the same bytes).
  const auto r = train_latent(run, "--set train.sample_every=6 --set train.sample_n=2 --set sample.steps=2");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  // The grid holds decoded images: 2 rows (a class each) of 28 px tiles, scaled 2x with 2 px gaps.
  const std::string grid = test::read_text(run + "/grids/step-00000006.png");
  ASSERT_GT(grid.size(), 24u);
  EXPECT_EQ((static_cast<uint8_t>(grid[22]) << 8) | static_cast<uint8_t>(grid[23]), 2 * (28 * 2 + 2) + 2);
  // The resolved config pins the measured checkpoint by hash and trains on its latents.
  const RunConfig cfg = load_config(run + "/config.toml");
  EXPECT_EQ(fs::path(cfg.model.latent).filename(), "step-00000010");
  EXPECT_EQ(cfg.model.latent_sha256, sha256_file(ae() + "/ckpt/step-00000010/ema.safetensors"));
  EXPECT_EQ(cfg.model.in_channels, 4);
  EXPECT_EQ(cfg.model.image_size, 7);
  const auto rec = nlohmann::json::parse(test::read_text(ae() + "/autoencoder.json"));
  EXPECT_EQ(cfg.model.latent_scale, rec["latent_scale"].get<double>());
  EXPECT_EQ(cfg.model.latent_shift, rec["latent_shift"].get<double>());
  // Its checkpoints hold the backbone only: no autoencoder weights, no optimizer state for them.
  for (const char* file : {"model.safetensors", "ema.safetensors", "optim.safetensors"})
    for (const auto& [name, t] : load_safetensors(run + "/ckpt/step-00000006/" + file).tensors)
      EXPECT_TRUE(name.find("enc_") == std::string::npos && name.find("quant") == std::string::npos) << file << ": " << name;

  EXPECT_TRUE(fs::path(cfg.model.latent).is_absolute()) << cfg.model.latent;  // readable from any directory

  // Resume: 3 steps, then 3 more, gives the uninterrupted run's weights bit for bit.
  const std::string split = path("latent-split");
  ASSERT_EQ(train_latent(split, "--set train.steps=3").exit_code, 0);
  const auto resumed = train_latent(split, "--resume");
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  for (const char* file : {"model.safetensors", "ema.safetensors", "optim.safetensors"})
    EXPECT_EQ(test::read_text(split + "/ckpt/step-00000006/" + file), test::read_text(run + "/ckpt/step-00000006/" + file))
        << file;
  // Its own resolved config.toml (a checkpoint, pinned) resumes it too, and continues it.
  const auto again = test::run_ddm("train --quiet --config " + split + "/config.toml --set train.steps=7 --out " + split +
                                   " --resume");
  EXPECT_EQ(again.exit_code, 0) << again.output;

  // Sampling decodes: 28x28x1 images, not 7x7x4 latents.
  const auto s = test::run_ddm("sample --ckpt " + run + " --n 10 --steps 3 --out " + path("grid.png") + " --raw " +
                               path("s.safetensors"));
  ASSERT_EQ(s.exit_code, 0) << s.output;
  const auto samples = load_safetensors(path("s.safetensors")).tensors.at("samples");
  EXPECT_EQ(samples.sizes(), (std::vector<int64_t>{10, 1, 28, 28}));
  EXPECT_LE(samples.abs().max().item<float>(), 1.0f);
  // And `ddm eval` measures the decoded images (it once checked the latents' shape against the network).
  const auto e = test::run_ddm("eval --ckpt " + run + " --n 200 --steps 2 --cache-dir " + path("cache") + " --out " +
                               path("eval"));
  ASSERT_EQ(e.exit_code, 0) << e.output;
  EXPECT_NE(e.output.find("FD-fmnist"), std::string::npos) << e.output;
}

// The losses of a run's metrics.jsonl, step by step.
std::vector<double> losses(const std::string& run) {
  std::vector<double> out;
  std::istringstream in(test::read_text(run + "/metrics.jsonl"));
  for (std::string line; std::getline(in, line);) {
    const auto j = nlohmann::json::parse(line);
    if (j.contains("loss") && j.contains("step")) out.push_back(j["loss"].get<double>());
  }
  return out;
}

TEST_F(Latent, CachedLatentsTrainAsFreshEncodesDoAndRefuseFlips) {
  ASSERT_EQ(ae_result_.exit_code, 0) << ae_result_.output;
  const std::string cached = path("cached"), fresh = path("fresh");
  auto r = train_latent(cached, "--set train.cache_latents=true");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  ASSERT_EQ(train_latent(fresh).exit_code, 0);
  // The same posterior samples, from an encoder run over other batches: equal up to float32 rounding.
  const auto a = losses(cached), b = losses(fresh);
  ASSERT_EQ(a.size(), 6u);
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(a[i], b[i], 1e-3 * b[i]) << "step " << i + 1;
  expect_error(train_latent(path("flip"), "--set train.cache_latents=true --set data.hflip=true"),
               "train.cache_latents with data.hflip");
  expect_error(test::run_ddm("train --quiet --config " + path("latent.toml") + " --set model.preset=unet-tiny "
                             "--set train.cache_latents=true --out " + path("pixel-cache")),
               "model.latent is not set");
}

TEST_F(Latent, AChangedMissingOrWrongAutoencoderIsAClearError) {
  ASSERT_EQ(ae_result_.exit_code, 0) << ae_result_.output;
  // Not an autoencoder run, not a directory, an unfinished run (no report).
  expect_error(train_latent(path("bad1"), "--set model.latent=" + path("nope")), "no such directory");
  test::run_command("mkdir -p " + path("unfinished") + " && cp -r " + ae() + "/ckpt " + path("unfinished/"));
  expect_error(test::run_ddm("train --quiet --config " + path("latent.toml") + " --set model.latent=" +
                             path("unfinished") + " --out " + path("bad2")),
               "is not a finished `ddm train-autoencoder` run");
  expect_error(test::run_ddm("train --quiet --config " + path("latent.toml") + " --set model.latent=" + ae() +
                             "/ckpt/step-00000005 --out " + path("bad3")),
               "measured");
  for (const char* bad : {"bad1", "bad2", "bad3"}) EXPECT_FALSE(fs::exists(path(bad))) << bad;

  // A latent model whose autoencoder is later changed or removed refuses to load, naming it.
  const std::string run = path("pinned");
  test::run_command("cp -r " + ae() + " " + path("ae-copy"));
  ASSERT_EQ(test::run_ddm("train --quiet --config " + path("latent.toml") + " --set model.latent=" + path("ae-copy") +
                          " --set train.steps=2 --out " + run)
                .exit_code,
            0);
  // A valid, self-consistent checkpoint with other weights in its place (as a retrained autoencoder
  // would leave): the pin, not a checksum, catches it.
  const std::string pinned = path("ae-copy") + "/ckpt/step-00000010";
  fs::remove_all(pinned);
  fs::copy(path("ae-copy") + "/ckpt/step-00000005", pinned);
  expect_error(test::run_ddm("sample --ckpt " + run + " --n 2 --out " + path("p.png")), "model.latent_sha256");
  expect_error(test::run_ddm("train --quiet --config " + run + "/config.toml --out " + run + " --resume"),
               "the frozen autoencoder changed");
  fs::remove_all(path("ae-copy"));
  expect_error(test::run_ddm("sample --ckpt " + run + " --n 2 --out " + path("p.png")), "do not exist (moved or deleted?)");
  EXPECT_FALSE(fs::exists(path("p.png")));
}

TEST_F(Latent, ExpertsOnOneAutoencoderMakeAnEnsembleThatSamplesImagesAndDistills) {
  ASSERT_EQ(ae_result_.exit_code, 0) << ae_result_.output;
  const std::string part = path("p");
  auto r = test::run_ddm("partition --limit 256 --k 2 --fine 16 --features latent:" + ae() + " --out " + part);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("latents of"), std::string::npos) << r.output;
  // The same 256 images as tar shards, partitioned by the same latents while streamed: the same
  // partition, label for label.
  ASSERT_EQ(test::run_ddm("shards write --set data.limit=256 --shard-size 64 --out " + path("shards")).exit_code, 0);
  test::write_text(path("shards.toml"), "[data]\nsource = \"shards\"\nresolution = 28\nroot = \"" + path("shards") +
                                            "/train-{000000..000003}.tar\"\n");
  r = test::run_ddm("partition --config " + path("shards.toml") + " --k 2 --fine 16 --features latent:" + ae() +
                    " --out " + path("ps"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("latents of"), std::string::npos) << r.output;
  EXPECT_TRUE(torch::equal(load_partition(part).labels, load_partition(path("ps")).labels));
  const std::string cfg = " --config " + path("latent.toml") + " --set model.latent=" + ae() + " --partition " + part;
  for (const char* k : {"0", "1"})
    ASSERT_EQ(test::run_ddm("train --quiet" + cfg + " --expert " + k + " --out " + path(std::string("e") + k)).exit_code, 0);
  r = test::run_ddm("train-router --quiet" + cfg + " --holdout 32 --set train.steps=4 "
                    "--buckets 2 --out " + path("r"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const RunConfig router = load_config(path("r/config.toml"));
  EXPECT_EQ(router.model.in_channels, 4);  // it routes latents, as the experts denoise them
  EXPECT_EQ(router.model.preset, "latent-router-dit");  // the default for latent experts
  EXPECT_EQ(router.model.patch, 1);
  EXPECT_EQ(router.model.latent_sha256, load_config(path("e0/config.toml")).model.latent_sha256);

  r = test::run_ddm("ensemble --out " + path("ens") + " --partition " + part + " --router " + path("r") + " --expert " +
                    path("e0") + " --expert " + path("e1"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = test::run_ddm("sample --ensemble " + path("ens") + " --n 4 --steps 2 --threads 1 --out " + path("g.png") +
                    " --raw " + path("g.safetensors"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const SafetensorsFile seeded = load_safetensors(path("g.safetensors"));
  EXPECT_EQ(seeded.tensors.at("samples").sizes(), (std::vector<int64_t>{4, 1, 28, 28}));
  // --init-noise: an ensemble starts from the given latents, whatever the seed (the routed experts
  // and the router see them as they would the seeded draw); a file of pixel shape is refused.
  SafetensorsFile noise;
  noise.tensors["noise"] = torch::randn(seeded.tensors.at("latents").sizes(), torch::TensorOptions().dtype(torch::kFloat));
  save_safetensors(path("noise.safetensors"), noise);
  const std::string from_noise = "sample --ensemble " + path("ens") + " --n 4 --steps 2 --threads 1 --init-noise " +
                                 path("noise.safetensors") + " --out " + path("n.png");
  for (const char* seed : {"1", "2"}) {
    r = test::run_ddm(from_noise + " --seed " + seed + " --raw " + path(std::string("n") + seed + ".safetensors"));
    ASSERT_EQ(r.exit_code, 0) << r.output;
  }
  const auto n1 = load_safetensors(path("n1.safetensors")).tensors, n2 = load_safetensors(path("n2.safetensors")).tensors;
  EXPECT_TRUE(torch::equal(n1.at("latents"), n2.at("latents")));
  EXPECT_FALSE(torch::equal(n1.at("latents"), seeded.tensors.at("latents")));
  noise.tensors["noise"] = torch::zeros({4, 1, 28, 28});
  save_safetensors(path("pixels.safetensors"), noise);
  expect_error(test::run_ddm("sample --ensemble " + path("ens") + " --n 4 --steps 2 --init-noise " +
                             path("pixels.safetensors") + " --out " + path("p.png")),
               "--init-noise " + path("pixels.safetensors"));
  // The oracle router knows the training data as the experts learned it: encoded.
  r = test::run_ddm("sample --ensemble " + path("ens") + " --routing oracle --n 4 --steps 2 --threads 1 --out " +
                    path("o.png"));
  ASSERT_EQ(r.exit_code, 0) << r.output;

  // An expert on pixels does not belong in a latent ensemble.
  ASSERT_EQ(test::run_ddm("train --quiet --config " + path("latent.toml") +
                          " --set model.preset=unet-tiny --set model.channels=8 --set model.groups=4 --partition " +
                          part + " --expert 1 --out " + path("pixel1"))
                .exit_code,
            0);
  expect_error(test::run_ddm("ensemble --out " + path("mixed") + " --partition " + part + " --router " + path("r") +
                             " --expert " + path("e0") + " --expert " + path("pixel1")),
               "must share one frozen autoencoder");

  // Distillation: the student takes expert 0's config, latents included (also under another preset);
  // a student config on pixels is told what to set.
  const std::string distill = "distill --quiet --ensemble " + path("ens") + " --set train.steps=2 --set data.limit=256 ";
  r = test::run_ddm(distill + "--preset latent-unet --set model.channels=16 --out " + path("student"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(load_config(path("student/config.toml")).model.latent_sha256, router.model.latent_sha256);
  expect_error(test::run_ddm(distill + "--config " + path("latent.toml") + " --out " + path("pixel-student")),
               "a student learns the space of its teachers");
}

}  // namespace
