// Data-parallel training through the real trainer, with ranks as threads of this process sharing a
// c10d HashStore (Gloo over loopback): 2 ranks x b samples train what 1 rank x 2b samples trains
// (losses and final weights within float32 rounding, U-Net and DiT, 20 steps), with gradient
// accumulation too; only rank 0 writes the run directory; ranks that disagree on the config, and a
// global batch that does not split, are clear errors on every rank; a sharded optimizer
// (parallel.shard_optimizer) trains, samples and checkpoints what an unsharded one does, and resumes
// from either at another world size.
#include <gtest/gtest.h>

#include <filesystem>

#include "test_util.h"
#include "unit/run/train_test_util.h"

using namespace ddm;
using namespace ddm::test;
namespace fs = std::filesystem;

// Tolerance: the two runs compute the same sums in another order (each rank's half-batch gradient,
// halved and added, against the whole batch's), so their gradients differ by float32 rounding. The
// losses then agree to 1e-4 relative (measured: 1.5e-7). The weights agree less well, because AdamW
// divides each gradient element by its running RMS: an element whose gradient is within rounding of
// zero can take a different step of up to lr (1 - beta1) / sqrt(1 - beta2) ~ 3 lr. Allowed: 1e-3,
// half a step at lr 2e-3 (measured: 8e-7 for the U-Net, 4e-5 for the DiT). A real difference in the
// data seen (1 x b instead of 1 x 2b) moves losses by > 1e-2 relative and weights by > 1e-2, which
// the test checks too.
TEST(DataParallel, TwoRanksTrainWhatOneRankWithTheWholeBatchTrains) {
  for (const char* arch : {"unet", "dit"}) {
    test::TempDir dir;
    const RunConfig cfg = tiny(arch);
    ASSERT_EQ(train_ranks(1, {cfg}, dir / "one"), std::vector<std::string>{""});
    ASSERT_EQ(train_ranks(2, {cfg, cfg}, dir / "two"), (std::vector<std::string>{"", ""}));
    RunConfig accum = cfg;
    accum.train.grad_accum = 2;
    ASSERT_EQ(train_ranks(2, {accum, accum}, dir / "two-accum"), (std::vector<std::string>{"", ""}));
    RunConfig half = cfg;
    half.train.batch_size = 8;
    ASSERT_EQ(train_ranks(1, {half}, dir / "half"), std::vector<std::string>{""});

    const auto l1 = losses(dir / "one"), l2 = losses(dir / "two"), la = losses(dir / "two-accum"),
               lh = losses(dir / "half");
    ASSERT_EQ(l1.size(), 20u);
    ASSERT_EQ(l2.size(), 20u);
    ASSERT_EQ(la.size(), 20u);
    double worst = 0, real = 0;
    for (size_t i = 0; i < l1.size(); ++i) {
      worst = std::max({worst, std::abs(l2[i] - l1[i]) / l1[i], std::abs(la[i] - l1[i]) / l1[i]});
      real = std::max(real, std::abs(lh[i] - l1[i]) / l1[i]);
    }
    EXPECT_LE(worst, 1e-4) << arch;
    EXPECT_GT(real, 1e-2) << arch;
    const TensorMap w1 = final_weights(dir / "one");
    EXPECT_LE(max_weight_difference(final_weights(dir / "two"), w1), 1e-3) << arch;
    EXPECT_LE(max_weight_difference(final_weights(dir / "two-accum"), w1), 1e-3) << arch;
    EXPECT_GT(max_weight_difference(final_weights(dir / "half"), w1), 1e-2) << arch;
    std::printf("%s: losses within %.2e (relative), weights within %.2e; 1 x b instead: %.2e, %.2e\n", arch, worst,
                max_weight_difference(final_weights(dir / "two"), w1), real,
                max_weight_difference(final_weights(dir / "half"), w1));
  }
}

TEST(DataParallel, SameWorldSizeIsBitIdentical) {
  test::TempDir dir;
  const RunConfig cfg = tiny("unet");
  ASSERT_EQ(train_ranks(2, {cfg, cfg}, dir / "a"), (std::vector<std::string>{"", ""}));
  ASSERT_EQ(train_ranks(2, {cfg, cfg}, dir / "b"), (std::vector<std::string>{"", ""}));
  EXPECT_EQ(losses(dir / "a"), losses(dir / "b"));
  EXPECT_EQ(max_weight_difference(final_weights(dir / "a"), final_weights(dir / "b")), 0.0);
  // Only rank 0 wrote: one metrics file, one set of checkpoints, and nothing else anywhere.
  EXPECT_EQ(list_checkpoints(dir / "a").size(), 2u);
  EXPECT_EQ(losses(dir / "a").size(), 20u);
  EXPECT_EQ(nlohmann::json::parse(test::read_text(*latest_checkpoint(dir / "a") + "/state.json"))["world_size"], 2);
}

TEST(DataParallel, RanksWithDifferentConfigsAreRefused) {
  test::TempDir dir;
  RunConfig a = tiny("unet"), b = a;
  b.train.lr = 1e-3;
  const auto errors = train_ranks(2, {a, b}, dir / "run");
  for (const auto& e : errors) {
    EXPECT_NE(e.find("train.lr"), std::string::npos) << e;
    EXPECT_NE(e.find("rank 1"), std::string::npos) << e;
  }
  EXPECT_FALSE(fs::exists(dir / "run/config.toml"));
}

TEST(DataParallel, AGlobalBatchThatDoesNotSplitIsAClearError) {
  test::TempDir dir;
  RunConfig cfg = tiny("unet");
  cfg.train.batch_size = 10;
  cfg.train.grad_accum = 2;
  const auto errors = train_ranks(2, {cfg, cfg}, dir / "run");
  for (const auto& e : errors) EXPECT_NE(e.find("train.batch_size = 10 does not split into 2 ranks x 2"), std::string::npos) << e;
  cfg.train.batch_size = 16;
  cfg.parallel.dp = 4;
  for (const auto& e : train_ranks(2, {cfg, cfg}, dir / "run"))
    EXPECT_NE(e.find("parallel.dp = 4 but the job has 2 processes"), std::string::npos) << e;
  EXPECT_FALSE(fs::exists(dir / "run"));
}

// parallel.shard_optimizer (ZeRO-1, train/shard.h): every rank updates its range of the parameters
// with the same elementwise AdamW and EMA and then receives the others' ranges, so the run is the
// unsharded one bit for bit: losses, weights, the EMA and the moments in both checkpoints (assembled
// on rank 0 from both ranks' ranges, by name), and the grid sampled from the EMA assembled on rank 0.
// Killed after step 10, it resumes from its own checkpoint and from an unsharded run's, and with 4
// ranks sharding the same state differently (agreement within the first test's tolerance, as any
// change of world size).
TEST(DataParallel, AShardedOptimizerTrainsSamplesAndCheckpointsWhatAnUnshardedOneDoes) {
  test::TempDir dir;
  RunConfig plain = tiny("unet");
  plain.train.sample_every = 10;
  plain.train.sample_n = 4;
  RunConfig sharded = plain;
  sharded.parallel.shard_optimizer = true;
  ASSERT_EQ(train_ranks(2, {plain, plain}, dir / "plain"), (std::vector<std::string>{"", ""}));
  ASSERT_EQ(train_ranks(2, {sharded, sharded}, dir / "sharded"), (std::vector<std::string>{"", ""}));
  EXPECT_EQ(losses(dir / "plain"), losses(dir / "sharded"));
  const auto ckpts = list_checkpoints(dir / "sharded");
  ASSERT_EQ(ckpts.size(), 2u);
  for (const std::string step : {"step-00000010", "step-00000020"}) {
    const Checkpoint a = read_checkpoint(dir / ("plain/ckpt/" + step));
    const Checkpoint b = read_checkpoint(dir / ("sharded/ckpt/" + step));
    ASSERT_EQ(a.ema.size(), b.ema.size()) << step;
    ASSERT_EQ(a.optim.size(), b.optim.size()) << step;
    EXPECT_EQ(max_weight_difference(a.model, b.model), 0.0) << step;
    EXPECT_EQ(max_weight_difference(a.ema, b.ema), 0.0) << step;
    EXPECT_EQ(max_weight_difference(a.optim, b.optim), 0.0) << step;
    EXPECT_GT(max_weight_difference(a.ema, a.model), 0.0) << step << ": the EMA is not the weights";
    EXPECT_EQ(test::read_text(dir / ("plain/grids/" + step + ".png")),
              test::read_text(dir / ("sharded/grids/" + step + ".png")))
        << step;
  }
  // Killed after step 10's checkpoint: resumed from it, and from the unsharded run's.
  for (const std::string from : {"sharded", "plain"}) {
    const std::string run = dir / ("resumed-from-" + from);
    fs::copy(dir / from, run, fs::copy_options::recursive);
    fs::remove_all(run + "/ckpt/step-00000020");
    std::vector<TrainSummary> sums;
    ASSERT_EQ(train_ranks(2, {sharded, sharded}, run, true, &sums), (std::vector<std::string>{"", ""})) << from;
    EXPECT_EQ(sums[1].first_step, 10) << from;
    EXPECT_EQ(losses(run), losses(dir / "plain")) << from;
    const Checkpoint a = read_checkpoint(*latest_checkpoint(dir / "plain")), b = read_checkpoint(*latest_checkpoint(run));
    EXPECT_EQ(max_weight_difference(a.model, b.model), 0.0) << from;
    EXPECT_EQ(max_weight_difference(a.ema, b.ema), 0.0) << from;
    EXPECT_EQ(max_weight_difference(a.optim, b.optim), 0.0) << from;
  }
  const std::string four = dir / "four";
  fs::copy(dir / "sharded", four, fs::copy_options::recursive);
  fs::remove_all(four + "/ckpt/step-00000020");
  ASSERT_EQ(train_ranks(4, {sharded, sharded, sharded, sharded}, four, true),
            (std::vector<std::string>(4, "")));
  EXPECT_EQ(losses(four).size(), 20u);
  const Checkpoint a = read_checkpoint(*latest_checkpoint(dir / "plain")), c = read_checkpoint(*latest_checkpoint(four));
  EXPECT_LE(max_weight_difference(a.model, c.model), 1e-3);
  EXPECT_LE(max_weight_difference(a.ema, c.ema), 1e-3);
}
