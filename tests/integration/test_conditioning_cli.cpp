// Conditioning end to end through the ddm binary on real Fashion-MNIST, on a tiny base U-Net trained
// once for the suite. ControlNet: `ddm train --controlnet BASE` (no --config: the base's own) resolves
// and pins the base, keeps none of its weights, trains, resumes bit for bit, and samples from control
// maps of test images or of a PNG; a changed, missing or unsuitable base and a mismatched config are
// clear errors. Self-conditioning: a self-conditioned model trains, resumes bit for bit and samples.
// Image embeddings: a model.embed model pins its frozen network, samples variations of reference
// images and reports their similarity; a changed or missing network is a clear error.
#include <gtest/gtest.h>

#include <filesystem>
#include <memory>
#include <string>

#include <torch/torch.h>

#include "core/config.h"
#include "core/fileio.h"
#include "core/safetensors.h"
#include "eval/feature_net.h"
#include "eval/grid.h"
#include "test_util.h"

namespace fs = std::filesystem;
using namespace ddm;

namespace {

const char* kTinyBase = R"(
[data]
limit = 256
[model]
preset = "unet-tiny"
channels = 8
groups = 4
[train]
steps = 6
batch_size = 16
warmup = 2
threads = 1
log_every = 3
ckpt_every = 3
seed = 1
[sample]
steps = 3
)";

using test::expect_error;

class ConditioningCli : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = std::make_unique<test::TempDir>();
    test::write_text(*dir_ / "base.toml", kTinyBase);
    base_result_ = test::run_ddm("train --quiet --config " + (*dir_ / "base.toml") + " --out " + base());
  }
  static void TearDownTestSuite() { dir_.reset(); }
  static std::string base() { return *dir_ / "base"; }
  static std::string path(const std::string& name) { return *dir_ / name; }
  static test::CommandResult train_cn(const std::string& out, const std::string& extra = "",
                                      const std::string& from = "") {
    return test::run_ddm("train --quiet --controlnet " + (from.empty() ? base() : from) +
                         " --set train.steps=6 --set train.ckpt_every=3 --out " + out + " " + extra);
  }
  static std::unique_ptr<test::TempDir> dir_;
  static test::CommandResult base_result_;
};
std::unique_ptr<test::TempDir> ConditioningCli::dir_;
test::CommandResult ConditioningCli::base_result_;

TEST_F(ConditioningCli, PinsItsBaseTrainsResumesAndSamplesFromControlMaps) {
  ASSERT_EQ(base_result_.exit_code, 0) << base_result_.output;
  const std::string run = path("cn");
  const auto r = train_cn(run);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  // The resolved config pins the base's latest checkpoint by hash; the model keys are the base's.
  const RunConfig cfg = load_config(run + "/config.toml");
  const RunConfig base_cfg = load_config(base() + "/config.toml");
  EXPECT_EQ(cfg.model.controlnet, fs::absolute(base() + "/ckpt/step-00000006").lexically_normal().string());
  EXPECT_EQ(cfg.model.controlnet_sha256, sha256_file(base() + "/ckpt/step-00000006/ema.safetensors"));
  EXPECT_EQ(cfg.model.control, "edges");
  EXPECT_EQ(cfg.model.channels, base_cfg.model.channels);
  EXPECT_EQ(cfg.model.channel_mult, base_cfg.model.channel_mult);
  EXPECT_EQ(cfg.data.limit, 256);  // the rest of the config is the base's too
  // Its checkpoints hold the trainable part only: the encoder copy, the hint block, the zero convolutions.
  for (const char* file : {"model.safetensors", "ema.safetensors", "optim.safetensors"})
    for (const auto& [name, t] : load_safetensors(run + "/ckpt/step-00000006/" + file).tensors) {
      const std::string& n = name;
      EXPECT_TRUE(n.find("control.") != std::string::npos || n.find("hint.") != std::string::npos ||
                  n.find("zero") != std::string::npos)
          << file << ": " << name;
      EXPECT_TRUE(n.find("dec0") == std::string::npos && n.find("out_conv") == std::string::npos) << file << ": " << name;
    }

  // Resume: 3 steps, then 3 more, gives the uninterrupted run's weights bit for bit.
  const std::string split = path("cn-split");
  ASSERT_EQ(train_cn(split, "--set train.steps=3").exit_code, 0);
  const auto resumed = train_cn(split, "--resume");
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  for (const char* file : {"model.safetensors", "ema.safetensors", "optim.safetensors"})
    EXPECT_EQ(test::read_text(split + "/ckpt/step-00000006/" + file), test::read_text(run + "/ckpt/step-00000006/" + file))
        << file;

  // Sampling from the control maps of test images, with their labels; both pictures written.
  auto s = test::run_ddm("sample --ckpt " + run + " --n 6 --control-from test --threads 1 --out " + path("s.png") +
                         " --raw " + path("s.safetensors"));
  ASSERT_EQ(s.exit_code, 0) << s.output;
  EXPECT_NE(s.output.find("control fidelity: edges-map MSE"), std::string::npos) << s.output;
  EXPECT_TRUE(fs::exists(path("s.png")) && fs::exists(path("s-control.png")));
  const auto labels = load_safetensors(path("s.safetensors")).tensors.at("labels");
  EXPECT_EQ(labels.sizes(), (std::vector<int64_t>{6}));
  // Without control maps a ControlNet cannot sample.
  expect_error(test::run_ddm("sample --ckpt " + run + " --n 2 --out " + path("none.png")), "--control-from test");
  EXPECT_FALSE(fs::exists(path("none.png")));

  // Control maps from a PNG: two 28x28 tiles side by side, repeated over the samples.
  auto tiles = torch::zeros({28, 56, 3}, torch::kUInt8);
  tiles.narrow(1, 10, 4).fill_(255);
  write_file_atomic(path("maps.png"), encode_png(tiles));
  s = test::run_ddm("sample --ckpt " + run + " --n 4 --control " + path("maps.png") + " --threads 1 --out " +
                    path("f.png"));
  EXPECT_EQ(s.exit_code, 0) << s.output;
  EXPECT_NE(s.output.find("2 edges map(s)"), std::string::npos) << s.output;
  write_file_atomic(path("odd.png"), encode_png(torch::zeros({30, 30, 3}, torch::kUInt8)));
  expect_error(test::run_ddm("sample --ckpt " + run + " --n 4 --control " + path("odd.png") + " --out " + path("o.png")),
               "a grid of them without margins");
  // The base model's fidelity to the same maps: the baseline of a ControlNet's.
  s = test::run_ddm("sample --ckpt " + base() + " --n 6 --control-from test --threads 1 --out " + path("b.png"));
  EXPECT_EQ(s.exit_code, 0) << s.output;
  EXPECT_NE(s.output.find("control fidelity"), std::string::npos) << s.output;
}

TEST_F(ConditioningCli, AChangedMissingOrUnsuitableBaseIsAClearError) {
  ASSERT_EQ(base_result_.exit_code, 0) << base_result_.output;
  {  // 16 images of 1x16x16: data of another shape than the base's
    SafetensorsFile f;
    f.tensors["images"] = torch::zeros({16, 1, 16, 16}, torch::kUInt8);
    save_safetensors(path("small.safetensors"), f);
  }
  expect_error(train_cn(path("bad1"), "", path("nope")), "no such directory");
  // A config whose [diffusion] differs from the base's.
  expect_error(test::run_ddm("train --quiet --config " + path("base.toml") + " --controlnet " + base() +
                             " --set diffusion.objective=eps --out " + path("bad2")),
               "[diffusion] sections differ");
  // A base that is not a U-Net, and one trained on images of another shape.
  ASSERT_EQ(test::run_ddm("train --quiet --config " + path("base.toml") + " --set model.preset=dit-tiny --set "
                          "model.width=32 --set model.depth=1 --set train.steps=1 --out " + path("dit-base"))
                .exit_code,
            0);
  expect_error(train_cn(path("bad4"), "", path("dit-base")), "a ControlNet steers a pixel U-Net");
  expect_error(test::run_ddm("train --quiet --config " + path("base.toml") + " --controlnet " + base() +
                             " --set data.source=safetensors --set data.root=" + path("small.safetensors") + " --out " +
                             path("bad5")),
               "the base was trained on 1x28x28 images");
  for (const char* bad : {"bad1", "bad2", "bad4", "bad5"}) EXPECT_FALSE(fs::exists(path(bad))) << bad;

  // A ControlNet whose base is later changed or removed refuses to load or resume, naming it.
  test::run_command("cp -r " + base() + " " + path("base-copy"));
  const std::string run = path("pinned");
  ASSERT_EQ(train_cn(run, "--set train.steps=3", path("base-copy")).exit_code, 0);
  expect_error(train_cn(path("bad3"), "", run), "is itself a ControlNet");
  // A valid checkpoint with other weights in the pinned one's place: the pin catches it.
  const std::string pinned = path("base-copy") + "/ckpt/step-00000006";
  fs::remove_all(pinned);
  fs::copy(path("base-copy") + "/ckpt/step-00000003", pinned);
  expect_error(test::run_ddm("sample --ckpt " + run + " --n 2 --control-from test --out " + path("p.png")),
               "model.controlnet_sha256");
  expect_error(test::run_ddm("train --quiet --config " + run + "/config.toml --out " + run + " --resume"),
               "the locked base changed");
  fs::remove_all(path("base-copy"));
  expect_error(test::run_ddm("sample --ckpt " + run + " --n 2 --control-from test --out " + path("p.png")),
               "do not exist (moved or deleted?)");
  EXPECT_FALSE(fs::exists(path("p.png")));
}

TEST_F(ConditioningCli, SelfConditionedModelTrainsResumesBitForBitAndSamples) {
  const std::string cfg = " --config " + path("base.toml") + " --set train.self_cond=0.5";
  const std::string run = path("sc"), split = path("sc-split");
  auto r = test::run_ddm("train --quiet" + cfg + " --out " + run);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(load_config(run + "/config.toml").model.self_cond);  // recorded: the network's input doubled
  EXPECT_EQ(load_safetensors(run + "/ckpt/step-00000006/model.safetensors").tensors.at("in_conv.weight").size(1), 2);
  ASSERT_EQ(test::run_ddm("train --quiet" + cfg + " --set train.steps=3 --out " + split).exit_code, 0);
  r = test::run_ddm("train --quiet" + cfg + " --out " + split + " --resume");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (const char* file : {"model.safetensors", "ema.safetensors", "optim.safetensors"})
    EXPECT_EQ(test::read_text(split + "/ckpt/step-00000006/" + file), test::read_text(run + "/ckpt/step-00000006/" + file))
        << file;
  for (const char* sampler : {"heun", "ddpm"}) {
    r = test::run_ddm("sample --ckpt " + run + " --n 4 --threads 1 --sampler " + sampler + " --out " + path("sc.png"));
    EXPECT_EQ(r.exit_code, 0) << r.output;
  }
  expect_error(test::run_ddm("train --quiet --controlnet " + run + " --out " + path("sc-cn")),
               "train.self_cond with model.controlnet is not supported");
  expect_error(test::run_ddm("train --quiet" + cfg + " --set train.self_cond=1.5 --out " + path("sc-bad")),
               "train.self_cond must be a probability");
}

TEST_F(ConditioningCli, ImageEmbeddingModelPinsItsNetworkAndSamplesVariations) {
  ASSERT_EQ(base_result_.exit_code, 0) << base_result_.output;
  const std::string net = path("fnet.safetensors"), run = path("emb");
  fs::copy_file(default_feature_net_path(), net);
  auto r = test::run_ddm("train --quiet --config " + path("base.toml") + " --set model.embed=" + net + " --out " + run);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const RunConfig cfg = load_config(run + "/config.toml");
  EXPECT_EQ(cfg.model.embed, fs::absolute(net).lexically_normal().string());
  EXPECT_EQ(cfg.model.embed_sha256, kDefaultFeatureNetSha256);
  EXPECT_EQ(cfg.model.embed_dim, 128);
  // Only the projection and the null embedding are new weights; the network is not in the checkpoint.
  const auto tensors = load_safetensors(run + "/ckpt/step-00000006/model.safetensors").tensors;
  EXPECT_EQ(tensors.count("embed.proj.weight"), 1u);
  EXPECT_EQ(tensors.count("embed.null"), 1u);
  for (const auto& [name, t] : tensors)  // the feature network's first conv, under any prefix
    EXPECT_TRUE(name.rfind("c1.", 0) != 0 && name.find(".c1.") == std::string::npos) << name;

  r = test::run_ddm("sample --ckpt " + run + " --n 4 --reference-from test --threads 1 --out " + path("v.png"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("embedding similarity"), std::string::npos) << r.output;
  EXPECT_TRUE(fs::exists(path("v-reference.png")));
  // Without references: the null embedding. A model without model.embed is only compared (a baseline).
  EXPECT_EQ(test::run_ddm("sample --ckpt " + run + " --n 2 --threads 1 --out " + path("n.png")).exit_code, 0);
  r = test::run_ddm("sample --ckpt " + base() + " --n 4 --reference-from test --threads 1 --out " + path("b.png"));
  EXPECT_NE(r.output.find("compared only"), std::string::npos) << r.output;
  expect_error(test::run_ddm("sample --ckpt " + run + " --n 4 --reference-from test --class 2 --out " + path("c.png")),
               "--class with --reference-from");

  expect_error(test::run_ddm("train --quiet --config " + path("base.toml") + " --set model.embed=" + path("nope") +
                             " --out " + path("bad-emb")),
               "no such file");
  EXPECT_FALSE(fs::exists(path("bad-emb")));
  // A changed network (other bytes) or a missing one: the pin names it.
  test::write_text(net, test::read_text(net) + " ");
  expect_error(test::run_ddm("sample --ckpt " + run + " --n 2 --out " + path("p.png")), "model.embed_sha256");
  fs::remove(net);
  expect_error(test::run_ddm("sample --ckpt " + run + " --n 2 --out " + path("p.png")), "does not exist");
  EXPECT_FALSE(fs::exists(path("p.png")));
}

}  // namespace
