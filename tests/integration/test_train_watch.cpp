// Training you can watch, through the ddm binary on real Fashion-MNIST with a tiny model:
// train.sample_every writes labelled grids into RUN/grids/ and the TensorBoard event files, which
// tensorboard's own reader (tests/reference/tensorboard_events.py) finds holding metrics.jsonl's
// numbers and the grids' PNGs; the grids leave training bit for bit as it was without them; a resume
// after a crash keeps one history in the event files; the last grid is what `ddm sample` makes of the
// last checkpoint (tests/integration/test_text_train.cpp checks a text model's, a row per prompt).
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/fileio.h"
#include "test_util.h"

namespace fs = std::filesystem;
using namespace ddm;

namespace {

const char* kTiny = R"(
[data]
limit = 256
[model]
preset = "unet-tiny"
channels = 8
channel_mult = [1, 2]
groups = 4
[train]
steps = 6
batch_size = 16
warmup = 2
threads = 1
log_every = 1
ckpt_every = 3
seed = 3
sample_every = 3
sample_n = 4
[sample]
steps = 2
)";

// What tensorboard's reader finds in DIR/tensorboard.
nlohmann::json tensorboard_events(const std::string& run) {
  const auto r = test::run_command(test::reference_python() + " " + test::source_dir() +
                                   "/tests/reference/tensorboard_events.py " + run + "/tensorboard 2>&1");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  return nlohmann::json::parse(r.output.substr(r.output.rfind('{', r.output.find("\"scalars\""))));
}

// metrics.jsonl's losses by step.
std::vector<std::pair<int64_t, double>> metric_losses(const std::string& run) {
  std::vector<std::pair<int64_t, double>> out;
  std::istringstream in(test::read_text(run + "/metrics.jsonl"));
  for (std::string line; std::getline(in, line);) {
    const auto j = nlohmann::json::parse(line);
    out.emplace_back(j["step"].get<int64_t>(), j["loss"].get<double>());
  }
  return out;
}

// The width and height of a PNG, from its header.
std::pair<int64_t, int64_t> png_size(const std::string& png) {
  auto be32 = [&](size_t at) {
    int64_t v = 0;
    for (size_t i = 0; i < 4; ++i) v = v << 8 | static_cast<uint8_t>(png[at + i]);
    return v;
  };
  return {be32(16), be32(20)};
}

}  // namespace

TEST(TrainWatch, GridsAndTensorBoardHoldWhatTheRunSawAndLeaveTrainingAsItWas) {
  test::TempDir dir;
  test::write_text(dir / "tiny.toml", kTiny);
  const std::string watched = dir / "watched", plain = dir / "plain";
  auto r = test::run_ddm("train --config " + (dir / "tiny.toml") + " --out " + watched);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("grids: every 3 steps, 4 samples (a row per class; EMA weights, euler, 2 steps"),
            std::string::npos) << r.output;
  EXPECT_NE(r.output.find("step 6: wrote " + watched + "/grids/step-00000006.png"), std::string::npos) << r.output;
  r = test::run_ddm("train --quiet --config " + (dir / "tiny.toml") + " --set train.sample_every=0 --out " + plain);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_FALSE(fs::exists(plain + "/grids"));
  // Sampling between steps changed nothing training computes: the same bytes.
  for (const char* step : {"step-00000003", "step-00000006"})
    for (const char* file : {"model.safetensors", "ema.safetensors", "optim.safetensors"})
      EXPECT_TRUE(test::read_text(watched + "/ckpt/" + step + "/" + file) ==
                  test::read_text(plain + "/ckpt/" + step + "/" + file))
          << step << "/" << file << " differs";
  // The grids: 4 samples of the first 4 classes, a row each with its name in a margin.
  std::vector<std::string> grids;
  for (const char* step : {"step-00000003", "step-00000006"}) {
    grids.push_back(test::read_text(watched + "/grids/" + step + ".png"));
    const auto [w, h] = png_size(grids.back());
    EXPECT_EQ(h, 4 * (28 * 2 + 2) + 2) << step;  // 4 rows of 2x-scaled 28 px tiles with 2 px gaps
    EXPECT_GT(w, 28 * 2 + 40) << step;           // one column and the class names' margin
  }
  EXPECT_NE(grids[0], grids[1]);  // training moved the weights between them
  // The last grid is what `ddm sample` makes of the last checkpoint with the run's seed.
  r = test::run_ddm("sample --ckpt " + watched + " --n 4 --seed 3 --threads 1 --out " + (dir / "s.png"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(test::read_text(dir / "s.png") == grids[1]);

  // tensorboard's reader: every record of metrics.jsonl as scalars (float32), and the grids.
  const nlohmann::json tb = tensorboard_events(watched);
  const auto losses = metric_losses(watched);
  const auto& loss = tb["scalars"]["train/loss"];
  ASSERT_EQ(loss.size(), losses.size()) << tb.dump();
  for (size_t i = 0; i < losses.size(); ++i) {
    EXPECT_EQ(loss[i][0].get<int64_t>(), losses[i].first);
    EXPECT_EQ(loss[i][1].get<double>(), static_cast<double>(static_cast<float>(losses[i].second))) << i;
  }
  for (const char* tag : {"train/lr", "train/grad_norm", "train/img_per_s", "train/data_wait", "train/peak_memory_bytes"})
    EXPECT_EQ(tb["scalars"][tag].size(), losses.size()) << tag;
  const auto& images = tb["images"]["samples"];
  ASSERT_EQ(images.size(), 2u) << tb.dump();
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(images[i][0].get<int64_t>(), 3 * static_cast<int64_t>(i + 1));
    EXPECT_EQ(images[i][1].get<int64_t>(), png_size(grids[i]).first);
    EXPECT_EQ(images[i][2].get<int64_t>(), png_size(grids[i]).second);
    EXPECT_EQ(images[i][3].get<std::string>(), sha256_hex(grids[i]));
  }

  // A crash after step 5 had been logged, before its checkpoint: the resume from step 3 repeats steps
  // 4 and 5, and the event files hold each step once, as the uninterrupted run's do.
  const std::string crashed = dir / "crashed";
  r = test::run_ddm("train --quiet --config " + (dir / "tiny.toml") + " --set train.steps=5 --out " + crashed);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  fs::remove_all(crashed + "/ckpt/step-00000005");
  r = test::run_ddm("train --quiet --config " + (dir / "tiny.toml") + " --out " + crashed + " --resume");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(tensorboard_events(crashed)["scalars"]["train/loss"], loss);
  EXPECT_EQ(tensorboard_events(crashed)["images"]["samples"], images);
  int files = 0;
  for (const auto& e : fs::directory_iterator(crashed + "/tensorboard")) files += e.path().filename().string().find("tfevents") != std::string::npos;
  EXPECT_EQ(files, 1);
}

TEST(TrainWatch, GridsThatCannotBeMadeAreClearErrors) {
  test::TempDir dir;
  test::write_text(dir / "tiny.toml", kTiny);
  const std::string train = "train --config " + (dir / "tiny.toml") + " --out " + (dir / "run");
  test::expect_error(test::run_ddm(train + " --set train.sample_n=0"), "train.sample_n must be >= 1");
  test::expect_error(test::run_ddm(train + " --set 'train.sample_prompts=[\"a red square\"]'"),
                     "train.sample_prompts is set, but the model is not conditioned on text");
  test::expect_error(test::run_ddm(train + " --set parallel.pp=2"),
                     "with parallel.pp = 2 no process holds it: set train.sample_every = 0");
  EXPECT_FALSE(fs::exists(dir / "run/ckpt"));
}

// A ControlNet's and a model.embed model's grids: a row per image of the data (the first 4), each led
// by what its samples are conditioned on (its edge map, its reference image), then its samples.
TEST(TrainWatch, ControlNetAndEmbedGridsLeadEachRowWithItsConditioning) {
  test::TempDir dir;
  test::write_text(dir / "tiny.toml", kTiny);
  auto r = test::run_ddm("train --quiet --config " + (dir / "tiny.toml") + " --out " + (dir / "base") +
                         " --set train.sample_every=0");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  // 8 samples over 4 rows: 2 per row, after each row's map; a grid at steps 2 and 4.
  r = test::run_ddm("train --controlnet " + (dir / "base") + " --out " + (dir / "cn") +
                    " --set train.steps=4 --set train.sample_every=2 --set train.sample_n=8");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("grids: every 2 steps, 8 samples (4 row(s) of the data's first images, each led by its "
                          "edges map;"), std::string::npos) << r.output;
  const auto cn = png_size(test::read_text(dir / "cn/grids/step-00000004.png"));
  ASSERT_TRUE(fs::exists(dir / "cn/grids/step-00000002.png"));
  // model.embed: each row led by its reference image; 4 samples over 4 rows, one each.
  r = test::run_ddm("train --config " + (dir / "tiny.toml") + " --out " + (dir / "embed") +
                    " --set model.embed=feature-net --set train.steps=2 --set train.sample_every=2 --set train.sample_n=4");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("(4 row(s) of the data's first images, each led by its reference image;"), std::string::npos)
      << r.output;
  const auto embed = png_size(test::read_text(dir / "embed/grids/step-00000002.png"));
  // The same 4 rows (the same images' class names in the margin): 3 tiles a row against 2, so the
  // ControlNet's grid is one tile wider, as its rows are as high.
  EXPECT_EQ(cn.second, embed.second);
  EXPECT_GT(cn.first, embed.first);
  EXPECT_LT(cn.first - embed.first, embed.first / 2);
  // A plain grid of 8 samples (a row per class: 1 tile a row) is higher: more rows.
  EXPECT_EQ(test::run_ddm("train --quiet --config " + (dir / "tiny.toml") + " --out " + (dir / "plain") +
                          " --set train.steps=2 --set train.sample_every=2 --set train.sample_n=8").exit_code, 0);
  EXPECT_GT(png_size(test::read_text(dir / "plain/grids/step-00000002.png")).second, cn.second);
}
