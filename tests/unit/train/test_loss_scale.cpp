// Training in float16 with dynamic loss scaling (train/loss_scale.h, train.precision = fp16): the
// scale follows the update kernel of PyTorch's GradScaler (at::_amp_update_scale_) step for step;
// a run started at a scale that float16 overflows skips those steps and halves the scale, and one
// process, two data-parallel ranks and a two-stage pipeline skip the same steps and train the same
// model; a resume from a checkpoint in the middle of the skipping repeats the uninterrupted run bit
// for bit; DiLoCo's replicas keep their own scales through a checkpoint; a run that overflows
// whatever the scale stops with a clear message.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <string>
#include <vector>

#include <ATen/ops/_amp_update_scale.h>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/fileio.h"
#include "test_util.h"
#include "train/loss_scale.h"
#include "unit/run/train_test_util.h"

using namespace ddm;
using namespace ddm::test;
namespace fs = std::filesystem;

namespace {

// Each metrics record's loss scale and the steps of its interval that were skipped (log_every 1:
// whether that step was).
std::vector<std::pair<double, int64_t>> scales(const std::string& run) {
  std::vector<std::pair<double, int64_t>> out;
  std::ifstream in(run + "/metrics.jsonl");
  std::string line;
  while (std::getline(in, line)) {
    const auto j = nlohmann::json::parse(line);
    out.emplace_back(j.at("loss_scale").get<double>(), j.at("skipped_steps").get<int64_t>());
  }
  return out;
}

nlohmann::json state_of(const std::string& ckpt) { return nlohmann::json::parse(read_file(ckpt + "/state.json")); }

// A tiny U-Net in fp16 that starts at a loss scale of 2^30: the gradient of its output, 2^30 / 1024
// of the loss's, overflows float16 (65504) until the scale has halved several times.
RunConfig fp16(double loss_scale = std::ldexp(1.0, 30)) {
  RunConfig cfg = tiny("unet");
  cfg.train.precision = Precision::kFp16;
  cfg.train.loss_scale = loss_scale;
  cfg.train.grad_accum = 4;  // the pipeline's micro-batches; one process accumulates the same ones
  return cfg;
}

}  // namespace

TEST(LossScale, FollowsTheUpdateOfPyTorchsGradScalerStepForStep) {
  const int64_t n = LossScale::kGrowthInterval;
  // Overflows at the start (backoff), then long finite stretches (growth), one overflow within one.
  const std::vector<int64_t> overflows = {0, 1, 2, 3, 4, n + 500, n + 501, 3 * n + 700};
  torch::Tensor scale = torch::full({1}, 65536.0f), tracker = torch::zeros({1}, torch::kInt);
  LossScale mine(65536);
  int grew = 0, backed_off = 0;
  for (int64_t i = 0; i < 5 * n; ++i) {
    const bool inf = std::find(overflows.begin(), overflows.end(), i) != overflows.end();
    const double before = mine.scale();
    at::_amp_update_scale_(scale, tracker, torch::full({1}, inf ? 1.0f : 0.0f), LossScale::kGrowth,
                           LossScale::kBackoff, LossScale::kGrowthInterval);
    mine.update(!inf);
    ASSERT_EQ(mine.scale(), static_cast<double>(scale.item<float>())) << "step " << i;
    ASSERT_EQ(mine.good_steps(), tracker.item<int>()) << "step " << i;
    grew += mine.scale() > before, backed_off += mine.scale() < before;
  }
  EXPECT_EQ(backed_off, 8);
  EXPECT_EQ(grew, 4);  // at steps 2004, 4501, 6501 and 8700
  EXPECT_EQ(mine.skips(), 8);
  EXPECT_EQ(mine.skips_in_a_row(), 0);
}

TEST(LossScale, ItsStateRoundTripsAndABadOneIsNamed) {
  LossScale a(1024);
  for (const bool finite : {false, false, true, false}) a.update(finite);
  EXPECT_EQ(a.scale(), 128);
  EXPECT_EQ(a.skips_in_a_row(), 1);
  LossScale b;
  EXPECT_FALSE(b.on());
  EXPECT_EQ(b.scale(), 1.0);
  b.update(false);  // off: nothing changes it
  EXPECT_EQ(b.scale(), 1.0);
  b.from_json(a.to_json(), "ck/state.json");
  EXPECT_TRUE(b.on());
  EXPECT_EQ(b.to_json(), a.to_json());
  const std::string missing = error_message([&] { b.from_json({{"scale", 2.0}}, "ck/state.json"); });
  EXPECT_NE(missing.find("ck/state.json: \"loss_scale\" needs a number \"good_steps\""), std::string::npos) << missing;
  const std::string range = error_message(
      [&] { b.from_json({{"scale", -2.0}, {"good_steps", 0}, {"skips_in_a_row", 0}}, "ck/state.json"); });
  EXPECT_NE(range.find("ck/state.json: \"loss_scale\" is out of range"), std::string::npos) << range;
  EXPECT_NE(error_message([] { LossScale(0.0); }).find("train.loss_scale must be a finite number > 0"),
            std::string::npos);
}

// One process, two data-parallel ranks and a two-stage pipeline, from a scale float16 overflows: the
// same steps are skipped (the decision is the global gradient's, taken alike on every rank) and the
// same model comes out, within what float16 makes of float32's rounding in another summation order.
TEST(LossScale, OneProcessDataParallelAndAPipelineSkipTheSameStepsAndTrainTheSameModel) {
  TempDir dir;
  const RunConfig one = fp16();
  ASSERT_EQ(train_ranks(1, {one}, dir / "one"), std::vector<std::string>{""});
  const auto want = scales(dir / "one");
  ASSERT_EQ(want.size(), 20u);
  // The scale halves at each skipped step, from the start, until float16 holds the gradient.
  int64_t skipped = 0;
  while (skipped < 20 && want[static_cast<size_t>(skipped)].second == 1) ++skipped;
  EXPECT_GE(skipped, 3);
  EXPECT_LT(skipped, 20);
  for (size_t i = 0; i < want.size(); ++i) {
    const int64_t halvings = std::min<int64_t>(static_cast<int64_t>(i), skipped);
    EXPECT_EQ(want[i].first, std::ldexp(1.0, 30 - static_cast<int>(halvings))) << "step " << i + 1;
    EXPECT_EQ(want[i].second, static_cast<int64_t>(i) < skipped ? 1 : 0) << "step " << i + 1;
  }
  const auto state = state_of(*latest_checkpoint(dir / "one"));
  EXPECT_EQ(state["loss_scale"]["scale"], std::ldexp(1.0, 30 - static_cast<int>(skipped))) << state.dump();
  EXPECT_EQ(state["loss_scale"]["good_steps"], 20 - skipped) << state.dump();
  EXPECT_EQ(state["optimizer_step"], 20 - skipped) << state.dump();  // a skipped step took no AdamW step
  const auto l = losses(dir / "one");
  EXPECT_LT(l.back(), l.front());

  // Each data-parallel rank's backward is of its own mean loss (the gradients are averaged after it),
  // so with 2 ranks it carries twice one process's gradient per sample: started at half the scale it
  // meets float16 exactly as one process does, and its scale is one process's halved all along.
  RunConfig dp = one;
  dp.train.grad_accum = 2;  // 2 ranks x 2 micro-batches of 4: the same micro-batches
  dp.train.loss_scale = one.train.loss_scale / 2;
  ASSERT_EQ(train_ranks(2, {dp, dp}, dir / "dp"), (std::vector<std::string>{"", ""}));
  RunConfig pp = one;
  pp.parallel.pp = 2;
  pp.parallel.schedule = parse_config("", "t.toml", {"parallel.schedule=1f1b"}).parallel.schedule;
  ASSERT_EQ(train_ranks(2, {pp, pp}, dir / "pp"), (std::vector<std::string>{"", ""}));
  auto halved = want;
  for (auto& [scale, skipped_here] : halved) scale /= 2;
  EXPECT_EQ(scales(dir / "dp"), halved);
  // A sharded optimizer (each rank updates its range, then the ranges are gathered) skips alike.
  RunConfig sharded = dp;
  sharded.parallel.shard_optimizer = true;
  ASSERT_EQ(train_ranks(2, {sharded, sharded}, dir / "sharded"), (std::vector<std::string>{"", ""}));
  EXPECT_EQ(scales(dir / "sharded"), halved);
  EXPECT_EQ(max_weight_difference(final_weights(dir / "sharded"), final_weights(dir / "dp")), 0.0);
  // Started at one process's scale it overflows once more, at the scale one process settles at.
  dp.train.loss_scale = one.train.loss_scale;
  ASSERT_EQ(train_ranks(2, {dp, dp}, dir / "dp-same-start"), (std::vector<std::string>{"", ""}));
  const auto same_start = scales(dir / "dp-same-start");
  ASSERT_EQ(same_start.size(), want.size());
  EXPECT_EQ(same_start[static_cast<size_t>(skipped)], std::make_pair(want.back().first, int64_t{1}));
  EXPECT_EQ(same_start.back(), halved.back());
  for (const char* run : {"dp", "pp"}) {
    if (std::string(run) == "pp") {
      EXPECT_EQ(scales(dir / run), want);
    }
    const auto got = losses(dir / run);
    ASSERT_EQ(got.size(), l.size()) << run;
    double worst = 0;
    for (size_t i = 0; i < l.size(); ++i) worst = std::max(worst, std::abs(got[i] - l[i]) / l[i]);
    const double w = max_weight_difference(final_weights(dir / run), final_weights(dir / "one"));
    // A pipeline's float32 sums in another order round differently (test_pipeline_train.cpp's bounds:
    // losses 1e-4, weights 1e-3); float16 then rounds the activations to 11 bits, so where a float32
    // difference moves one across a rounding boundary it changes by 2^-11 = 4.9e-4 relative, and the
    // weights by up to AdamW's step (lr 2e-3) where that flips a small gradient's sign. Measured:
    // losses 2.8e-6, weights 5.3e-4 (data parallelism: 0 and 1.5e-8).
    EXPECT_LE(worst, 1e-3) << run;
    EXPECT_LE(w, 2e-3) << run;
    std::printf("fp16 %s: losses within %.2e (relative) of one process's, weights within %.2e\n", run, worst, w);
  }
}

// A checkpoint taken while steps are being skipped holds the scale and its counters; the resumed
// run goes on from them and repeats the uninterrupted run bit for bit (starting again from
// train.loss_scale would skip more steps).
TEST(LossScale, AResumeInTheMiddleOfTheSkippingRepeatsTheUninterruptedRun) {
  TempDir dir;
  RunConfig cfg = fp16();
  cfg.train.steps = 12;
  cfg.train.ckpt_every = 2;
  cfg.train.keep_ckpts = 10;
  cfg.train.log_every = 4;  // the checkpoint at step 2 is inside an interval: its skipped steps travel too
  ASSERT_EQ(train_ranks(1, {cfg}, dir / "ref"), std::vector<std::string>{""});
  const auto at2 = state_of(dir / "ref/ckpt/step-00000002");
  ASSERT_EQ(at2["loss_scale"]["scale"], std::ldexp(1.0, 28)) << at2.dump();
  ASSERT_EQ(at2["loss_scale"]["skips_in_a_row"], 2) << at2.dump();
  ASSERT_EQ(at2["log_interval"]["skipped"], 2) << at2.dump();
  ASSERT_EQ(scales(dir / "ref").front(), std::make_pair(std::ldexp(1.0, 27), int64_t{4}));  // step 4's record
  const std::string out = dir / "resumed";
  fs::copy(dir / "ref", out, fs::copy_options::recursive);
  for (const auto& ck : list_checkpoints(out))
    if (ck > out + "/ckpt/step-00000002") fs::remove_all(ck);
  ASSERT_EQ(train_ranks(1, {cfg}, out, /*resume=*/true), std::vector<std::string>{""});
  EXPECT_EQ(scales(out), scales(dir / "ref"));
  EXPECT_EQ(losses(out), losses(dir / "ref"));
  for (const char* file : {"model.safetensors", "ema.safetensors", "optim.safetensors", "state.json"}) {
    const std::string want = read_file(dir / "ref/ckpt/step-00000012/" + std::string(file));
    EXPECT_TRUE(want == read_file(out + "/ckpt/step-00000012/" + file)) << file << " differs";
  }
}

// A scale float16 overflows at even after kMaxSkipsInARow halvings: the run stops, saying what
// happened and what to do; the checkpoints written meanwhile stay.
TEST(LossScale, ARunThatOverflowsWhateverTheScaleStopsWithAClearMessage) {
  TempDir dir;
  RunConfig cfg = fp16(std::ldexp(1.0, 90));
  cfg.train.steps = 40;
  const std::vector<std::string> errors = train_ranks(1, {cfg}, dir / "run");
  ASSERT_EQ(errors.size(), 1u);
  const std::string& e = errors[0];
  EXPECT_NE(e.find("step 32: the gradient norm is "), std::string::npos) << e;  // inf or nan
  EXPECT_NE(e.find(" in float16 for 32 steps in a row (each skipped and the loss scale halved; this step's was "
                   "5.76461e+17)"),  // 2^90 / 2^31
            std::string::npos)
      << e;
  EXPECT_NE(e.find("(--resume --set train.precision=bf16)"), std::string::npos) << e;
  EXPECT_NE(e.find("(--resume --set train.lr=0.0002 --set train.loss_scale=6.1897001964269014e+26)"),  // 2^89 exactly
            std::string::npos)
      << e;
  EXPECT_EQ(e.find("grad_clip"), std::string::npos) << e;  // the clip comes after the unscale: no help here
  EXPECT_NE(e.find("ckpt/step-00000030) is intact"), std::string::npos) << e;
  EXPECT_TRUE(fs::exists(dir / "run/ckpt/step-00000030"));
  EXPECT_FALSE(fs::exists(dir / "run/ckpt/step-00000032"));
  // Resumed as it was, the checkpoint's scale (2^60, after 30 skips) goes on, and 2 more skips stop it.
  const std::string again = train_ranks(1, {cfg}, dir / "run", /*resume=*/true)[0];
  EXPECT_NE(again.find("step 32: the gradient norm is "), std::string::npos) << again;
  // With train.loss_scale changed, the scale starts again from it, and the run ends.
  RunConfig lower = cfg;
  lower.train.loss_scale = 65536;
  ASSERT_EQ(train_ranks(1, {lower}, dir / "run", /*resume=*/true), std::vector<std::string>{""});
  const auto end = state_of(dir / "run/ckpt/step-00000040");
  EXPECT_LE(end["loss_scale"]["scale"].get<double>(), 65536.0) << end.dump();
  EXPECT_EQ(end["loss_scale"]["skips_in_a_row"], 0) << end.dump();
}

// DiLoCo: each replica steps alone between synchronizations, so each keeps its own loss scale; a
// checkpoint holds every replica's, and a resume gives each its own back (bit for bit as the
// uninterrupted run), and a replica the checkpoint does not hold one it does.
TEST(LossScale, DilocoReplicasKeepTheirOwnScalesThroughACheckpoint) {
  TempDir dir;
  RunConfig cfg = fp16();
  cfg.parallel.mode = SyncMode::kDiloco;
  cfg.diloco.inner_steps = 4;
  cfg.train.grad_accum = 1;
  cfg.train.ckpt_every = 8;
  cfg.train.steps = 16;
  ASSERT_EQ(train_ranks(2, {cfg, cfg}, dir / "a"), (std::vector<std::string>{"", ""}));
  const auto mid = state_of(dir / "a/ckpt/step-00000008");
  ASSERT_EQ(mid["diloco"]["loss_scales"].size(), 2u) << mid.dump();
  for (const auto& s : mid["diloco"]["loss_scales"]) EXPECT_LT(s["scale"].get<double>(), std::ldexp(1.0, 30)) << mid.dump();
  // Resumed from step 8: the same run, bit for bit.
  fs::copy(dir / "a", dir / "b", fs::copy_options::recursive);
  fs::remove_all(dir / "b/ckpt/step-00000016");
  ASSERT_EQ(train_ranks(2, {cfg, cfg}, dir / "b", true), (std::vector<std::string>{"", ""}));
  EXPECT_EQ(losses(dir / "b"), losses(dir / "a"));
  EXPECT_EQ(scales(dir / "b"), scales(dir / "a"));
  EXPECT_EQ(state_of(dir / "b/ckpt/step-00000016")["diloco"]["loss_scales"],
            state_of(dir / "a/ckpt/step-00000016")["diloco"]["loss_scales"]);
  EXPECT_EQ(max_weight_difference(final_weights(dir / "b"), final_weights(dir / "a")), 0.0);
  // Each replica takes its own: replica 1's scale set apart in the checkpoint (1024, below where
  // float16 overflowed, with 3 good steps) goes on from there, replica 0's from its own.
  fs::copy(dir / "a", dir / "c", fs::copy_options::recursive);
  fs::remove_all(dir / "c/ckpt/step-00000016");
  auto edited = mid;
  edited["diloco"]["loss_scales"][1] = {{"scale", 1024.0}, {"good_steps", 3}, {"skips_in_a_row", 0}, {"optimizer_step", 5}};
  write_file_atomic(dir / "c/ckpt/step-00000008/state.json", edited.dump(2) + "\n");
  ASSERT_EQ(train_ranks(2, {cfg, cfg}, dir / "c", true), (std::vector<std::string>{"", ""}));
  const auto end = state_of(dir / "c/ckpt/step-00000016")["diloco"]["loss_scales"];
  EXPECT_EQ(end[1]["scale"], 1024.0) << end.dump();
  EXPECT_EQ(end[1]["good_steps"], 3 + 8) << end.dump();
  EXPECT_EQ(end[1]["optimizer_step"], 5 + 8) << end.dump();  // each replica its own AdamW step count
  EXPECT_EQ(end[0], state_of(dir / "a/ckpt/step-00000016")["diloco"]["loss_scales"][0]) << end.dump();
  // Four replicas from a checkpoint of two: replicas 2 and 3 go on from replicas 0's and 1's state.
  fs::copy(dir / "c", dir / "d", fs::copy_options::recursive);
  fs::remove_all(dir / "d/ckpt/step-00000016");
  ASSERT_EQ(train_ranks(4, {cfg, cfg, cfg, cfg}, dir / "d", true), std::vector<std::string>(4, ""));
  const auto four = state_of(dir / "d/ckpt/step-00000016")["diloco"]["loss_scales"];
  ASSERT_EQ(four.size(), 4u) << four.dump();
  EXPECT_EQ(four[3]["scale"], 1024.0) << four.dump();
  EXPECT_EQ(four[3]["good_steps"], 3 + 8) << four.dump();
}
