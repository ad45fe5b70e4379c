// Training end to end on real Fashion-MNIST with a tiny model: the golden loss curve of a seeded
// run, bit-identical resume after kill -9 of a real `ddm train` process, a non-finite loss that
// stops with a clear message and leaves the last checkpoint intact, a damaged checkpoint refused
// without changing the run, and sampling from the result.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <regex>
#include <thread>

#include <nlohmann/json.hpp>
#include <torch/cuda.h>

#include "core/config.h"
#include "data/dataset.h"
#include "decentral/train_run.h"
#include "run/trainer.h"
#include "test_util.h"
#include "train/checkpoint.h"

namespace fs = std::filesystem;
using namespace ddm;

namespace {
// A model and data small enough for a step to take milliseconds.
const char* kTinyConfig = R"(
[data]
limit = 512
[model]
preset = "unet-tiny"
channels = 8
channel_mult = [1, 2]
groups = 4
[train]
steps = 20
batch_size = 16
lr = 2e-3
lr_schedule = "cosine"
warmup = 5
threads = 1
log_every = 1
ckpt_every = 5
seed = 3
)";

std::vector<std::string> loss_lines(const std::string& metrics_path) {
  std::vector<std::string> out;
  std::ifstream in(metrics_path);
  std::string line;
  while (std::getline(in, line)) {
    auto j = nlohmann::json::parse(line);
    out.push_back(std::to_string(j["step"].get<int64_t>()) + " " + j["loss"].dump());
  }
  return out;
}
}  // namespace

TEST(Train, GoldenLossCurve) {
  test::TempDir dir;
  RunConfig cfg = parse_config(kTinyConfig, "tiny");
  train_run(cfg, {dir / "run", false, false, true, nullptr});
  auto got = loss_lines(dir / "run/metrics.jsonl");
  ASSERT_EQ(got.size(), 20u);
  const std::string golden = test::source_dir() + "/tests/golden/tiny_unet_loss.txt";
  if (std::getenv("DDM_UPDATE_GOLDEN")) {
    std::ofstream out(golden);
    for (const auto& l : got) out << l << "\n";
    GTEST_SKIP() << "wrote " << golden;
  }
  std::ifstream in(golden);
  ASSERT_TRUE(in) << golden << " missing: run with DDM_UPDATE_GOLDEN=1 to create it";
  std::string line;
  size_t i = 0;
  for (; std::getline(in, line); ++i) {
    ASSERT_LT(i, got.size());
    int64_t step_want, step_got;
    double want, have;
    std::sscanf(line.c_str(), "%lld %lf", reinterpret_cast<long long*>(&step_want), &want);
    std::sscanf(got[i].c_str(), "%lld %lf", reinterpret_cast<long long*>(&step_got), &have);
    EXPECT_EQ(step_want, step_got);
    // Same build and thread count give identical losses; 0.1% leaves room for BLAS kernels that
    // differ between CPU models, far below what any change to the algorithm moves them.
    EXPECT_NEAR(have, want, 1e-3 * std::abs(want)) << "step " << step_want;
  }
  EXPECT_EQ(i, got.size());
  // The loss goes down.
  EXPECT_LT(std::stod(got.back().substr(got.back().find(' '))), std::stod(got[0].substr(got[0].find(' '))));
}

TEST(Train, ResumeAfterKillIsBitIdentical) {
  test::TempDir dir;
  test::write_text(dir / "tiny.toml", std::string(kTinyConfig) + "\n");
  const std::string cfg = dir / "tiny.toml";
  const std::string sets = " --set train.steps=200 --set train.ckpt_every=10";
  // Uninterrupted reference.
  auto ref = test::run_ddm("train --quiet --config " + cfg + sets + " --out " + (dir / "ref"));
  ASSERT_EQ(ref.exit_code, 0) << ref.output;

  // Start, kill -9 once a few checkpoints exist, resume.
  const std::string out = dir / "killed";
  auto pid_res = test::run_command(test::ddm_binary() + " train --quiet --config " + cfg + sets + " --out " + out +
                                   " >/dev/null 2>&1 & echo $!");
  const int pid = std::stoi(pid_res.output);
  for (int i = 0; i < 600 && list_checkpoints(out).size() < 2; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  test::run_command("kill -9 " + std::to_string(pid));
  test::run_command("while kill -0 " + std::to_string(pid) + " 2>/dev/null; do sleep 0.05; done");
  auto at_kill = latest_checkpoint(out);
  ASSERT_TRUE(at_kill.has_value());
  auto res = test::run_ddm("train --config " + cfg + sets + " --out " + out + " --resume");
  ASSERT_EQ(res.exit_code, 0) << res.output;
  if (*at_kill != out + "/ckpt/step-00000200") {
    EXPECT_NE(res.output.find("resuming from"), std::string::npos) << res.output;
  }

  EXPECT_EQ(loss_lines(dir / "ref/metrics.jsonl"), loss_lines(out + "/metrics.jsonl"));
  // Same config, seed and thread count: the weights, EMA and optimizer state are the same bytes.
  for (const char* file : {"model.safetensors", "ema.safetensors", "optim.safetensors"}) {
    const std::string want = test::read_text(dir / "ref/ckpt/step-00000200/" + file);
    ASSERT_FALSE(want.empty()) << file;
    EXPECT_TRUE(want == test::read_text(out + "/ckpt/step-00000200/" + file)) << file << " differs";
  }
  auto a = read_checkpoint(dir / "ref/ckpt/step-00000200"), b = read_checkpoint(out + "/ckpt/step-00000200");
  ASSERT_EQ(a.model.size(), b.model.size());
  for (const auto& [k, v] : a.model) EXPECT_TRUE(torch::equal(v, b.model.at(k))) << k;
  for (const auto& [k, v] : a.ema) EXPECT_TRUE(torch::equal(v, b.ema.at(k))) << k;
  for (const auto& [k, v] : a.optim) EXPECT_TRUE(torch::equal(v, b.optim.at(k))) << k;
}

// A resume from a checkpoint in the middle of a logging interval logs the same means as the run that
// was never interrupted: the interval's loss sum so far travels in the checkpoint (the first record
// after a resume once averaged only the steps since the resume).
TEST(Train, ResumeInsideALoggingIntervalLogsTheSameMeans) {
  test::TempDir dir;
  RunConfig cfg = parse_config(kTinyConfig, "tiny",
                               {"train.steps=10", "train.log_every=4", "train.ckpt_every=3", "train.keep_ckpts=10"});
  train_run(cfg, {dir / "ref", false, false, true, nullptr});
  const auto ref = loss_lines(dir / "ref/metrics.jsonl");
  ASSERT_EQ(ref.size(), 3u);  // steps 4, 8, 10
  for (const char* from : {"step-00000003", "step-00000006", "step-00000009"}) {
    const std::string out = dir / (std::string("from-") + from);
    fs::copy(dir / "ref", out, fs::copy_options::recursive);
    for (const auto& ck : list_checkpoints(out))
      if (ck > out + "/ckpt/" + from) fs::remove_all(ck);
    const TrainSummary s = train_run(cfg, {out, /*resume=*/true, false, true, nullptr});
    EXPECT_EQ(s.first_step, std::stoi(std::string(from).substr(5)));
    EXPECT_EQ(loss_lines(out + "/metrics.jsonl"), ref) << "resumed from " << from;
  }
}

TEST(Train, NonFiniteLossStopsAndKeepsCheckpoint) {
  test::TempDir dir;
  test::write_text(dir / "tiny.toml", kTinyConfig);
  auto res = test::run_ddm("train --quiet --config " + (dir / "tiny.toml") +
                           " --set train.lr=1e30 --set train.warmup=0 --set train.grad_clip=0 --set train.ckpt_every=1"
                           " --out " + (dir / "run"));
  EXPECT_EQ(res.exit_code, 1) << res.output;
  EXPECT_NE(res.output.find("training stopped"), std::string::npos) << res.output;
  EXPECT_NE(res.output.find("is intact"), std::string::npos) << res.output;
  auto latest = latest_checkpoint(dir / "run");
  ASSERT_TRUE(latest.has_value()) << res.output;
  EXPECT_NO_THROW(read_checkpoint(*latest));
  // The way on that the message gives: --resume with a lower learning rate or clip.
  EXPECT_NE(res.output.find("Lower train.lr (now 1e+30) or train.grad_clip (now 0; 0 is off)"), std::string::npos)
      << res.output;
  EXPECT_NE(res.output.find("--resume --set train.lr=1e+29"), std::string::npos) << res.output;
  // Which --resume takes (here from a run whose weights this learning rate has not yet ruined): the
  // change is said, recorded in config.toml, and the run goes on from its checkpoint.
  const std::string base = "train --config " + (dir / "tiny.toml") + " --set train.steps=3 --out " + (dir / "ok");
  ASSERT_EQ(test::run_ddm(base + " --quiet").exit_code, 0);
  res = test::run_ddm(base + " --set train.steps=5 --set train.lr=1e-3 --set train.grad_clip=0.5 --resume");
  ASSERT_EQ(res.exit_code, 0) << res.output;
  EXPECT_NE(res.output.find("note: --resume: train.lr changes from 0.002 to 0.001"), std::string::npos) << res.output;
  EXPECT_NE(res.output.find("note: --resume: train.grad_clip changes from 1 to 0.5"), std::string::npos) << res.output;
  EXPECT_NE(res.output.find("resuming from"), std::string::npos) << res.output;
  EXPECT_NE(test::read_text(dir / "ok/config.toml").find("lr = 0.001"), std::string::npos);
  EXPECT_TRUE(fs::exists(dir / "ok/ckpt/step-00000005"));
}

TEST(Train, SampleFromTrainedRun) {
  test::TempDir dir;
  test::write_text(dir / "tiny.toml", kTinyConfig);
  ASSERT_EQ(test::run_ddm("train --quiet --config " + (dir / "tiny.toml") + " --out " + (dir / "run")).exit_code, 0);
  auto res = test::run_ddm("sample --ckpt " + (dir / "run") + " --n 20 --steps 4 --sampler heun --out " +
                           (dir / "grid.png") + " --raw " + (dir / "s.safetensors"));
  ASSERT_EQ(res.exit_code, 0) << res.output;
  EXPECT_NE(res.output.find("NFE 7"), std::string::npos) << res.output;  // heun: 2 * 4 - 1
  const std::string png = test::read_text(dir / "grid.png");
  ASSERT_GT(png.size(), 8u);
  EXPECT_EQ(png.substr(1, 3), "PNG");
  EXPECT_TRUE(fs::exists(dir / "s.safetensors"));
}

TEST(Train, SigtermWritesCheckpointAndStops) {
  test::TempDir dir;
  test::write_text(dir / "tiny.toml", kTinyConfig);
  const std::string out = dir / "run";
  test::run_command("(" + test::ddm_binary() + " train --config " + (dir / "tiny.toml") +
                    " --set train.steps=1000000 --set train.ckpt_every=1000000 --out " + out + " > " +
                    (dir / "log.txt") + " 2>&1 & echo $! > " + (dir / "pid") + "; wait $!; echo $? > " + (dir / "rc.part") + "; mv " + (dir / "rc.part") + " " + (dir / "rc") +
                    ") > /dev/null 2>&1 &");
  for (int i = 0; i < 600 && test::read_text(dir / "pid").empty(); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  const std::string pid = std::to_string(std::stoi(test::read_text(dir / "pid")));
  // Wait until training is under way (metrics written), then ask it to stop.
  for (int i = 0; i < 600 && !fs::exists(out + "/metrics.jsonl"); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  test::run_command("kill -TERM " + pid);
  test::run_command("while kill -0 " + pid + " 2>/dev/null; do sleep 0.05; done");
  for (int i = 0; i < 600 && !fs::exists(dir / "rc"); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  const std::string log = test::read_text(dir / "log.txt");
  EXPECT_NE(log.find("stopped by signal 15"), std::string::npos) << log;
  EXPECT_EQ(test::read_text(dir / "rc"), "143\n") << "SIGTERM's exit status is 128 + 15\n" << log;
  auto latest = latest_checkpoint(out);
  ASSERT_TRUE(latest.has_value()) << log;
  const Checkpoint ck = read_checkpoint(*latest);
  EXPECT_GT(ck.step, 0);
  EXPECT_LT(ck.step, 1000000);
}

// A device this machine cannot train on is a clear error before anything is written: no GPU
// (CI), or, on a GPU machine, a GPU (the engines run on the CPU so far). A run stays resumable.
TEST(Train, ADeviceItCannotUseIsAClearErrorAndLosesNothing) {
  test::TempDir dir;
  test::write_text(dir / "tiny.toml", kTinyConfig);
  const std::string cfg = " --config " + (dir / "tiny.toml") + " --set train.steps=5";
  auto fresh = test::run_ddm("train --quiet" + cfg + " --set train.device=cuda --out " + (dir / "new"));
  const bool gpu = torch::cuda::is_available();
  if (gpu) {
    EXPECT_EQ(fresh.exit_code, 0) << fresh.output;  // it trains there
  } else {
    EXPECT_EQ(fresh.exit_code, 2) << fresh.output;  // bad input: a restart would find no GPU either
    EXPECT_NE(fresh.output.find("train.device = cuda, but this machine has no CUDA GPU that LibTorch can use"),
              std::string::npos)
        << fresh.output;
    EXPECT_FALSE(fs::exists(fs::path(dir / "new") / "config.toml"));
  }
  // A pipeline on GPUs, on a machine without one: every rank fails alone, naming itself, nothing
  // written. (Which rank reports first is a race: the launcher stops the others once one exits.)
  if (!gpu) {
    auto pipe = test::run_ddm("launch --timeout 120 --nproc 2 -- train --quiet" + cfg +
                              " --set parallel.pp=2 --set train.grad_accum=2 --set train.device=cuda --out " + (dir / "pipe"));
    EXPECT_NE(pipe.exit_code, 0) << pipe.output;
    EXPECT_TRUE(std::regex_search(pipe.output, std::regex("\\[rank [01]\\] error: train\\.device = cuda, but this "
                                                          "machine has no CUDA GPU")))
        << pipe.output;
    EXPECT_FALSE(fs::exists(fs::path(dir / "pipe") / "config.toml"));
  }
  // A run on the CPU, then a resume asking for a GPU: refused, the checkpoint intact; on the CPU it goes on.
  ASSERT_EQ(test::run_ddm("train --quiet" + cfg + " --out " + (dir / "run")).exit_code, 0);
  auto bad = test::run_ddm("train --quiet" + cfg + " --set train.steps=8 --set train.device=cuda:7 --out " + (dir / "run") + " --resume");
  EXPECT_EQ(bad.exit_code, 2) << bad.output;
  EXPECT_NE(bad.output.find("train.device = cuda:7"), std::string::npos) << bad.output;
  ASSERT_TRUE(latest_checkpoint(dir / "run").has_value());
  auto res = test::run_ddm("train --quiet" + cfg + " --set train.steps=8 --set train.device=auto --out " + (dir / "run") + " --resume");
  if (!gpu) {
    EXPECT_EQ(res.exit_code, 0) << res.output;  // auto on a machine without a GPU: the CPU
  }
  // parallel.backend = nccl carries CUDA tensors: with train.device = cpu it fails validation; with
  // auto on a machine without a GPU, every rank of a launched job fails alone, naming itself.
  auto nccl_cpu = test::run_ddm("train --quiet" + cfg + " --set parallel.backend=nccl --set train.device=cpu --out " + (dir / "nccl"));
  EXPECT_EQ(nccl_cpu.exit_code, 2) << nccl_cpu.output;  // a config it refuses: ddm's exit status for bad input
  EXPECT_NE(nccl_cpu.output.find("parallel.backend = nccl carries CUDA tensors, but train.device = cpu"), std::string::npos)
      << nccl_cpu.output;
  if (!gpu) {
    auto nccl_auto = test::run_ddm("launch --timeout 120 --nproc 2 -- train --quiet" + cfg +
                                   " --set train.device=auto --set parallel.backend=nccl --out " + (dir / "nccl2"));
    EXPECT_NE(nccl_auto.exit_code, 0) << nccl_auto.output;
    EXPECT_TRUE(std::regex_search(nccl_auto.output, std::regex("\\[rank [01]\\] error: parallel\\.backend = nccl "
                                                               "carries CUDA tensors, but this rank trains on the CPU")))
        << nccl_auto.output;
  }
  EXPECT_FALSE(fs::exists(fs::path(dir / "nccl") / "config.toml"));
  EXPECT_FALSE(fs::exists(fs::path(dir / "nccl2") / "config.toml"));
  auto spelled = test::run_ddm("train --quiet" + cfg + " --set train.device=gpu --out " + (dir / "x"));
  EXPECT_EQ(spelled.exit_code, 2);
  EXPECT_NE(spelled.output.find("train.device = \"gpu\" is not one of: auto, cpu, cuda, cuda:N"), std::string::npos)
      << spelled.output;
}

// A relative data.root is recorded as the absolute path it named, so that the run resumes (and is
// evaluated) from any directory.
TEST(Train, ARelativeDataRootIsRecordedAbsoluteSoTheRunResumesFromAnywhere) {
  test::TempDir dir;
  test::write_text(dir / "tiny.toml", kTinyConfig);
  const std::string relative = std::string(kFashionMnistRoot).substr(1);  // from /
  auto r = test::run_command("cd / && " + test::ddm_binary() + " train --quiet --config " + (dir / "tiny.toml") +
                             " --set train.steps=4 --set data.root=" + relative + " --out " + (dir / "run"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(test::read_text(dir / "run/config.toml").find("root = '" + std::string(kFashionMnistRoot) + "'"),
            std::string::npos)
      << test::read_text(dir / "run/config.toml");
  r = test::run_command("cd " + dir.path + " && " + test::ddm_binary() + " train --quiet --resume --set train.steps=6 --out run");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(fs::exists(dir / "run/ckpt/step-00000006"));
  // Data that moved (here: the same folder by another path) is resumed over, and said.
  const std::string moved = "/usr/share/datasets/../datasets/fashion-mnist";
  r = test::run_ddm("train --resume --set train.steps=8 --set data.root=" + moved + " --out " + (dir / "run"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("note: --resume: data.root changes from " + std::string(kFashionMnistRoot) + " to " + moved),
            std::string::npos) << r.output;
}

// Fewer samples than a batch (a small cluster, a router's hold-out, data.limit): the batches repeat
// samples, which the run says once before it starts.
TEST(Train, DataSmallerThanABatchIsSaid) {
  test::TempDir dir;
  test::write_text(dir / "tiny.toml", kTinyConfig);
  auto r = test::run_ddm("train --config " + (dir / "tiny.toml") + " --set train.steps=1 --set data.limit=10 --out " +
                         (dir / "run"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("note: training takes 10 samples, fewer than a batch of 16: each batch holds some of them "
                          "more than once"),
            std::string::npos)
      << r.output;
  r = test::run_ddm("train --config " + (dir / "tiny.toml") + " --set train.steps=1 --set data.limit=16 --out " +
                    (dir / "run16"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(r.output.find("fewer than a batch"), std::string::npos) << r.output;
}

// A damaged latest checkpoint: `--resume` refuses it as bad input (exit 2: a launcher does not
// restart into it), names what to do, and leaves the run's config as it was (a key changed on that
// resume is not recorded); `ddm sample` names the damage of a checkpoint directory without its
// state.json. A run already past train.steps says there is nothing more to train.
TEST(Train, ADamagedCheckpointIsRefusedAsBadInputAndChangesNothing) {
  test::TempDir dir;
  test::write_text(dir / "tiny.toml", kTinyConfig);
  const std::string train = "train --config " + (dir / "tiny.toml") + " --set train.steps=10 --out " + (dir / "run");
  ASSERT_EQ(test::run_ddm(train).exit_code, 0);
  const std::string config = test::read_text(dir / "run/config.toml");
  fs::resize_file(dir / "run/ckpt/step-00000010/model.safetensors", 0);
  auto r = test::run_ddm(train + " --set train.lr=5e-4 --resume");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("the checkpoint is damaged: delete " + (dir / "run/ckpt/step-00000010") +
                          " to resume from the previous checkpoint"),
            std::string::npos) << r.output;
  EXPECT_EQ(test::read_text(dir / "run/config.toml"), config);
  fs::remove(dir / "run/ckpt/step-00000010/state.json");
  r = test::run_ddm("sample --ckpt " + (dir / "run/ckpt/step-00000010") + " --n 2 --steps 2 --out " + (dir / "s.png"));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("state.json is missing; the checkpoint is damaged"), std::string::npos) << r.output;
  fs::remove_all(dir / "run/ckpt/step-00000010");
  r = test::run_ddm(train + " --set train.steps=5 --resume");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("note: --resume: the run is at step 5, train.steps is 5: nothing more to train"),
            std::string::npos) << r.output;
}
