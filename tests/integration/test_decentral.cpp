// The decentralized pipeline through the ddm binary: partition, expert training, router, ensemble,
// routed sampling, distillation, islands (with a kill -9 of one island) and the quickstart. Each
// step on real Fashion-MNIST (a few thousand images; all of it for the quickstart), and each bad
// input exits non-zero with a clear message.
#include <gtest/gtest.h>

#include <signal.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <thread>

#include <nlohmann/json.hpp>
#include <stb_image_write.h>

#include <torch/cuda.h>

#include "decentral/partition.h"
#include "test_util.h"

namespace fs = std::filesystem;
using namespace ddm;

namespace {
using test::expect_error;
}  // namespace

TEST(DecentralCli, PartitionWritesBalancedClustersAndRefusesBadInput) {
  const test::TempDir dir;
  const std::string base = "partition --limit 2000 --k 4 --fine 64 --threads 2 ";
  auto r = test::run_ddm(base + "--out " + (dir / "p"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("pixels PCA 64 of 784"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("sizes 500 to 500"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("NMI"), std::string::npos) << r.output;
  const Partition p = load_partition(dir / "p");
  EXPECT_EQ(p.n, 2000);
  EXPECT_EQ(p.k, 4);
  EXPECT_EQ(p.settings["features"], "pixels:64");
  const auto summary = nlohmann::json::parse(test::read_text(dir / "p/summary.json"));
  EXPECT_EQ(summary["sizes"].get<std::vector<int64_t>>(), (std::vector<int64_t>{500, 500, 500, 500}));
  EXPECT_GT(summary["nmi"].get<double>(), 0.2);  // pixel clusters follow the garment classes somewhat
  const std::string png = test::read_text(dir / "p/clusters.png");
  ASSERT_GT(png.size(), 8u);
  EXPECT_EQ(png.substr(1, 3), "PNG");

  // The same command twice gives the same partition; an existing --out is kept without --force.
  const std::string before = test::read_text(dir / "p/partition.safetensors");
  expect_error(test::run_ddm(base + "--out " + (dir / "p")), "already exists");
  ASSERT_EQ(test::run_ddm(base + "--out " + (dir / "p") + " --force").exit_code, 0);
  EXPECT_EQ(test::read_text(dir / "p/partition.safetensors"), before);
  // --force replaces a partition, never another directory (a run, an islands directory).
  fs::create_directories(dir / "run/ckpt");
  test::write_text(dir / "run/config.toml", "");
  expect_error(test::run_ddm("partition --limit 100 --k 2 --force --out " + (dir / "run")),
               "holds no partition.safetensors, and --force replaces a partition only, never another directory");
  EXPECT_TRUE(fs::exists(dir / "run/config.toml"));

  // Random and unbalanced modes.
  r = test::run_ddm("partition --limit 1000 --k 3 --method random --out " + (dir / "r/"));  // a trailing slash, too
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(fs::is_regular_file(dir / "r/partition.safetensors"));
  EXPECT_NE(r.output.find("sizes 333 to 334"), std::string::npos) << r.output;
  r = test::run_ddm(base + "--unbalanced --features pixels:16 --out " + (dir / "u"));
  ASSERT_EQ(r.exit_code, 0) << r.output;

  expect_error(test::run_ddm("partition --limit 100 --k 101 --out " + (dir / "x")), "larger than the data");
  // With --config its [data] names the data: flags that would describe other data are refused.
  test::write_text(dir / "c.toml", "[data]\nlimit = 100\n");
  expect_error(test::run_ddm("partition --config " + (dir / "c.toml") + " --data-root /elsewhere --k 2 --out " +
                             (dir / "x")),
               "--config excludes --data-root");
  // K = 1 would make a partition that no router can take: refused at the source.
  // Said before any feature is computed, as bad input (exit 2: `ddm islands` and launchers do not
  // retry it), as every refusal of the commands below.
  auto refused = test::run_ddm("partition --limit 100 --k 1 --out " + (dir / "x"));
  expect_error(refused, "at least 2 clusters");
  EXPECT_EQ(refused.exit_code, 2) << refused.output;
  EXPECT_EQ(refused.output.find("partitioning"), std::string::npos) << refused.output;
  expect_error(test::run_ddm("partition --limit 100 --k 4 --features dino --out " + (dir / "x")),
               "is not a feature source");
  expect_error(test::run_ddm("partition --limit 100 --k 4 --features file:" + (dir / "none.npy") + " --out " +
                             (dir / "x")),
               "does not exist");
  expect_error(test::run_ddm("partition --limit 100 --k 8 --fine 4 --out " + (dir / "x")), "--fine 4 must be at least");
  expect_error(test::run_ddm("partition --limit 100 --k 4 --device gpu --out " + (dir / "x")),
               "--device = \"gpu\" is not one of: auto, cpu, cuda, cuda:N");
  if (!torch::cuda::is_available())
    expect_error(test::run_ddm("partition --limit 100 --k 4 --features feature-net --device cuda --out " + (dir / "x")),
                 "--device = cuda, but this machine has no CUDA GPU");
  expect_error(test::run_ddm("partition --k 4 --data-root " + (dir / "nowhere") + " --out " + (dir / "x")),
               "nowhere");
  EXPECT_FALSE(fs::exists(dir / "x"));
}

TEST(DecentralCli, ExpertsTrainOnTheirClusterResumeExactlyAndRefuseForeignPartitions) {
  const test::TempDir dir;
  test::write_text(dir / "tiny.toml",
                   "[data]\nlimit = 600\n[model]\nchannels = 8\nchannel_mult = [1, 2]\ngroups = 4\n"
                   "[train]\nsteps = 8\nbatch_size = 16\nthreads = 1\nlog_every = 2\nckpt_every = 4\n");
  ASSERT_EQ(test::run_ddm("partition --limit 600 --k 3 --fine 30 --out " + (dir / "p")).exit_code, 0);
  const std::string base = "train --quiet --config " + (dir / "tiny.toml") + " --partition " + (dir / "p");
  auto r = test::run_ddm(base + " --expert 1 --budget split-steps --set train.steps=9 --out " + (dir / "e1"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto rec = nlohmann::json::parse(test::read_text(dir / "e1/expert.json"));
  EXPECT_EQ(rec["images"], 200);
  EXPECT_EQ(rec["steps"], 3);  // 9 global steps / 3 experts
  EXPECT_TRUE(fs::exists(dir / "e1/ckpt/step-00000003"));
  EXPECT_NE(test::read_text(dir / "e1/config.toml").find("steps = 9"), std::string::npos);  // the global budget

  // split-batch: interrupted at step 4 and resumed == uninterrupted (same EMA bytes).
  const std::string sb = base + " --expert 0 --budget split-batch --set train.batch_size=15";
  ASSERT_EQ(test::run_ddm(sb + " --out " + (dir / "full")).exit_code, 0);
  ASSERT_EQ(test::run_ddm(sb + " --set train.steps=4 --out " + (dir / "half")).exit_code, 0);
  r = test::run_ddm(sb + " --resume --out " + (dir / "half"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(test::read_text(dir / "half/ckpt/step-00000008/ema.safetensors"),
            test::read_text(dir / "full/ckpt/step-00000008/ema.safetensors"));

  expect_error(test::run_ddm(base + " --expert 3 --out " + (dir / "x")), "clusters 0..2");
  expect_error(test::run_ddm(base + " --out " + (dir / "x")), "pass --expert");
  expect_error(test::run_ddm("train --quiet --config " + (dir / "tiny.toml") + " --expert 0 --out " + (dir / "x")),
               "pass --partition");
  expect_error(test::run_ddm(base + " --expert 0 --budget split-batch --out " + (dir / "x")),
               "not divisible by K = 3");
  expect_error(test::run_ddm(base + " --expert 0 --set data.limit=500 --out " + (dir / "x")),
               "has 500 images");
  expect_error(test::run_ddm(base + " --expert 0 --set data.split=\"test\" --set data.limit=600 --out " + (dir / "x")),
               "other images");
  // A partition replaced under a running expert: resume refuses, the checkpoints stay.
  ASSERT_EQ(test::run_ddm("partition --limit 600 --k 3 --fine 30 --seed 5 --force --out " + (dir / "p")).exit_code, 0);
  expect_error(test::run_ddm(sb + " --resume --set train.steps=12 --out " + (dir / "half")), "changed since");
  EXPECT_TRUE(fs::exists(dir / "half/ckpt/step-00000008/ema.safetensors"));
}

// The decentralized pipeline on a folder of the user's own grayscale images (ordered by class, as
// every folder is). One-channel images were once read from freed memory, so the same folder hashed
// differently in each process and every expert refused the partition made on it; the router's
// hold-out was the last N images, one class; ddm eval scored such a model against Fashion-MNIST.
TEST(DecentralCli, GrayscaleFolderPartitionExpertsRouterAndNoFashionMnistEval) {
  const test::TempDir dir;
  for (int c = 0; c < 2; ++c) {
    fs::create_directories(dir / ("imgs/class" + std::to_string(c)));
    for (int i = 0; i < 30; ++i) {
      std::vector<uint8_t> px(8 * 8);
      for (size_t j = 0; j < px.size(); ++j) px[j] = static_cast<uint8_t>((c ? 200 : 20) + (j * 7 + i * 13) % 50);
      const std::string path = dir / ("imgs/class" + std::to_string(c) + "/" + std::to_string(100 + i) + ".png");
      ASSERT_NE(stbi_write_png(path.c_str(), 8, 8, 1, px.data(), 8), 0) << path;
    }
  }
  test::write_text(dir / "folder.toml", "[data]\nsource = \"folder\"\nroot = \"" + (dir / "imgs") +
                                            "\"\n[model]\nchannels = 8\nchannel_mult = [1, 2]\ngroups = 4\n"
                                            "[train]\nsteps = 3\nbatch_size = 8\nthreads = 1\nlog_every = 1\n");
  const std::string cfg = " --config " + (dir / "folder.toml");
  auto r = test::run_ddm("partition" + cfg + " --k 2 --fine 8 --features pixels:8 --out " + (dir / "p"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (const char* k : {"0", "1"}) {
    r = test::run_ddm("train --quiet" + cfg + " --partition " + (dir / "p") + " --expert " + k + " --out " + (dir / "e") + k);
    ASSERT_EQ(r.exit_code, 0) << r.output;  // the partition matches the images this process read
  }
  r = test::run_ddm("train-router" + cfg + " --partition " + (dir / "p") + " --preset router-conv-tiny --holdout 12 --set "
                    "train.steps=3 --buckets 2 --out " + (dir / "r"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("12 held out at random"), std::string::npos) << r.output;
  expect_error(test::run_ddm("eval --ckpt " + (dir / "e0") + " --n 20 --steps 2 --cache-dir " + (dir / "cache")),
               "was trained on data from \"folder\", not Fashion-MNIST");
  // Its raw samples carry the data source, so `eval --samples` refuses them too.
  r = test::run_ddm("sample --ckpt " + (dir / "e0") + " --n 4 --steps 2 --out " + (dir / "g.png") + " --raw " +
                    (dir / "g.safetensors"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  expect_error(test::run_ddm("eval --samples " + (dir / "g.safetensors") + " --cache-dir " + (dir / "cache")),
               "not Fashion-MNIST");
  EXPECT_FALSE(fs::exists(dir / "cache"));
}

TEST(DecentralCli, RouterEnsembleAndRoutedSamplingRefuseMismatchedParts) {
  const test::TempDir dir;
  test::write_text(dir / "tiny.toml",
                   "[data]\nlimit = 600\n[model]\nchannels = 8\nchannel_mult = [1, 2]\ngroups = 4\n"
                   "[train]\nsteps = 6\nbatch_size = 16\nthreads = 1\nlog_every = 2\nckpt_every = 6\n");
  ASSERT_EQ(test::run_ddm("partition --limit 600 --k 2 --fine 20 --out " + (dir / "p")).exit_code, 0);
  const std::string cfg = " --config " + (dir / "tiny.toml") + " --partition " + (dir / "p");
  for (const char* k : {"0", "1"})
    ASSERT_EQ(test::run_ddm("train --quiet" + cfg + " --expert " + k + " --out " + (dir / "e") + k).exit_code, 0);

  // The router trains on all 500 non-held-out images and reports per noise level.
  auto r = test::run_ddm("train-router --quiet" + cfg + " --preset router-conv-tiny --holdout 100 --set "
                         "train.steps=20 --buckets 4 --out " + (dir / "r"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("router accuracy by noise level (100 held-out images"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("\n[0.25, 0.5)  "), std::string::npos) << r.output;  // the edges as they are
  const auto report = nlohmann::json::parse(test::read_text(dir / "r/router_eval.json"));
  ASSERT_EQ(report["buckets"].size(), 4u);
  EXPECT_EQ(report["k"], 2);
  for (const auto& b : report["buckets"]) {
    EXPECT_GE(b["accuracy"].get<double>(), 0.0);
    EXPECT_LE(b["ece"].get<double>(), 1.0);
  }
  EXPECT_NE(test::read_text(dir / "r/config.toml").find("num_experts = 2"), std::string::npos);
  EXPECT_EQ(nlohmann::json::parse(test::read_text(dir / "r/router.json"))["holdout"], 100);

  const std::string experts = " --expert " + (dir / "e0") + " --expert " + (dir / "e1");
  r = test::run_ddm("ensemble --out " + (dir / "ens") + " --partition " + (dir / "p") + " --router " + (dir / "r") +
                    experts);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto manifest = nlohmann::json::parse(test::read_text(dir / "ens/ensemble.json"));
  EXPECT_EQ(manifest["k"], 2);
  EXPECT_EQ(manifest["routing"], "top1");

  const std::string sample = "sample --ensemble " + (dir / "ens") + " --n 20 --steps 3 --threads 1 ";
  r = test::run_ddm(sample + "--out " + (dir / "g.png") + " --raw " + (dir / "g.safetensors"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("routing top1"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("experts per sample-step 1.00"), std::string::npos) << r.output;
  EXPECT_TRUE(fs::exists(dir / "g.png"));
  r = test::run_ddm(sample + "--routing full --out " + (dir / "f.png"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("experts per sample-step 2.00"), std::string::npos) << r.output;
  // Same seed, same samples (--one-expert-at-a-time changes only how a GPU schedules the experts).
  ASSERT_EQ(test::run_ddm(sample + "--one-expert-at-a-time --out " + (dir / "g2.png") + " --raw " + (dir / "g2.safetensors"))
                .exit_code,
            0);
  EXPECT_EQ(test::read_text(dir / "g.png"), test::read_text(dir / "g2.png"));
  // bf16 (autocast around the experts and the router, on the CPU here): other arithmetic, other bytes.
  r = test::run_ddm(sample + "--precision bf16 --out " + (dir / "b.png") + " --raw " + (dir / "b.safetensors"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("on cpu in bf16"), std::string::npos) << r.output;
  EXPECT_NE(test::read_text(dir / "g.safetensors"), test::read_text(dir / "b.safetensors"));

  // Distillation: the student (expert 0's config on all 600 images) learns each image's own expert;
  // it resumes bit for bit on the same teacher and refuses another.
  const std::string distill = "distill --quiet --ensemble " + (dir / "ens") + " --set train.ckpt_every=3 ";
  r = test::run_ddm(distill + "--out " + (dir / "s"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("next: ddm sample --ckpt"), std::string::npos) << r.output;
  const auto record = nlohmann::json::parse(test::read_text(dir / "s/distill.json"));
  EXPECT_EQ(record["k"], 2);
  EXPECT_EQ(record["ensemble_sha256"].get<std::string>().size(), 64u);
  const std::string student_cfg = test::read_text(dir / "s/config.toml");
  EXPECT_NE(student_cfg.find("teacher = "), std::string::npos) << student_cfg;
  EXPECT_EQ(student_cfg.find("expert = 0"), std::string::npos) << student_cfg;
  ASSERT_EQ(test::run_ddm(distill + "--set train.steps=3 --out " + (dir / "s3")).exit_code, 0);
  ASSERT_EQ(test::run_ddm(distill + "--resume --out " + (dir / "s3")).exit_code, 0);
  EXPECT_EQ(test::read_text(dir / "s/ckpt/step-00000006/ema.safetensors"),
            test::read_text(dir / "s3/ckpt/step-00000006/ema.safetensors"));
  r = test::run_ddm("sample --ckpt " + (dir / "s") + " --n 10 --steps 2 --threads 1 --out " + (dir / "s.png"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  expect_error(test::run_ddm(distill + "--preset router-conv-tiny --out " + (dir / "x")), "is a router");
  expect_error(test::run_ddm(distill + "--set data.limit=500 --out " + (dir / "x")), "has 500 images");
  expect_error(test::run_ddm("distill --ensemble " + (dir / "e0") + " --out " + (dir / "x")),
               "is not an ensemble directory");
  expect_error(test::run_ddm("train --quiet --config " + (dir / "tiny.toml") + " --partition " + (dir / "p") +
                             " --expert 0 --set \"train.teacher='" + (dir / "ens") + "'\" --out " + (dir / "x")),
               "remove data.partition");
  const std::string assemble = "ensemble --force --out " + (dir / "ens") + " --partition " + (dir / "p") +
                               " --router " + (dir / "r") + experts;
  // Re-assembled with another default routing: the same teacher (distillation routes top-1), so the
  // student resumes; with an expert trained on, it is another teacher and the student is refused.
  ASSERT_EQ(test::run_ddm(assemble + " --routing full").exit_code, 0);
  r = test::run_ddm(distill + "--resume --set train.steps=8 --out " + (dir / "s"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  fs::copy(dir / "e1", dir / "e1b", fs::copy_options::recursive);
  ASSERT_EQ(test::run_ddm("train --quiet --resume --set train.steps=8 --out " + (dir / "e1b")).exit_code, 0);
  ASSERT_EQ(test::run_ddm("ensemble --force --out " + (dir / "ens") + " --partition " + (dir / "p") + " --router " +
                          (dir / "r") + " --expert " + (dir / "e0") + " --expert " + (dir / "e1b"))
                .exit_code,
            0);
  expect_error(test::run_ddm(distill + "--resume --set train.steps=9 --out " + (dir / "s")),
               "holds other models than when this student started");
  // The ensemble pins the checkpoints it holds (their runs' rotation keeps them), and lets go of e1's.
  EXPECT_EQ(test::read_text(dir / "e1b/ckpt/step-00000008/pinned.txt"), dir / "ens" + "\n");
  EXPECT_FALSE(fs::exists(dir / "e1/ckpt/step-00000006/pinned.txt"));
  EXPECT_EQ(test::read_text(dir / "e0/ckpt/step-00000006/pinned.txt"), dir / "ens" + "\n");
  ASSERT_EQ(test::run_ddm(assemble).exit_code, 0);
  // The partition made again (another seed) under the ensemble: oracle routing and distillation,
  // which route by its clusters, refuse it (once they took the new clusters without a word).
  fs::copy(dir / "p", dir / "p.kept", fs::copy_options::recursive);
  ASSERT_EQ(test::run_ddm("partition --limit 600 --k 2 --fine 20 --seed 7 --force --out " + (dir / "p")).exit_code, 0);
  for (const std::string& cmd : {sample + "--routing oracle --out " + (dir / "o.png"), distill + "--out " + (dir / "s9")}) {
    r = test::run_ddm(cmd);
    expect_error(r, "changed since the ensemble " + (dir / "ens") + " was assembled");
    EXPECT_EQ(r.exit_code, 2) << r.output;
  }
  fs::remove_all(dir / "p");
  fs::rename(dir / "p.kept", dir / "p");
  ASSERT_EQ(test::run_ddm(sample + "--routing oracle --out " + (dir / "o.png")).exit_code, 0);

  // Mismatched parts.
  const std::string ens = "ensemble --out " + (dir / "x") + " --partition " + (dir / "p");
  auto out_of_order = test::run_ddm(ens + " --router " + (dir / "r") + " --expert " + (dir / "e1") + " --expert " + (dir / "e0"));
  expect_error(out_of_order, "list the experts in cluster order");
  EXPECT_EQ(out_of_order.exit_code, 2) << out_of_order.output;
  auto bogus = test::run_ddm(sample + "--routing bogus --out " + (dir / "x.png"));
  EXPECT_EQ(bogus.exit_code, 2) << bogus.output;
  auto too_many = test::run_ddm(sample + "--routing topk:3 --out " + (dir / "x.png"));
  expect_error(too_many, "the ensemble has only K = 2 experts");
  EXPECT_EQ(too_many.exit_code, 2) << too_many.output;
  expect_error(test::run_ddm(ens + " --router " + (dir / "r") + " --expert " + (dir / "e0")),
               "1 experts given, but the partition");
  expect_error(test::run_ddm(ens + " --router " + (dir / "e0") + experts), "has no router.json");
  auto no_text = test::run_ddm(ens + " --router " + (dir / "r") + experts + " --text-encoder " + (dir / "p"));
  expect_error(no_text, "--text-encoder: the experts (" + (dir / "e0") + ", ...) are not conditioned on text");
  EXPECT_EQ(no_text.exit_code, 2) << no_text.output;
  expect_error(test::run_ddm("train-router --quiet" + cfg + " --preset unet-tiny --out " + (dir / "x")),
               "not a router preset");
  expect_error(test::run_ddm("train-router --quiet" + cfg + " --set data.limit=500 --out " + (dir / "x")),
               "has 500 images");
  expect_error(test::run_ddm("sample --ckpt " + (dir / "r") + " --out " + (dir / "x.png")), "holds a router");
  expect_error(test::run_ddm(sample + "--routing top2 --out " + (dir / "x.png")), "--routing top2");
  // topk:K with more experts than the ensemble has once silently used them all.
  expect_error(test::run_ddm(sample + "--routing topk:3 --out " + (dir / "x.png")),
               "routing topk:3: the ensemble has only K = 2 experts");
  expect_error(test::run_ddm(assemble + " --routing topk:5"), "routing topk:5: the ensemble has only K = 2 experts");
  expect_error(test::run_ddm("sample --ckpt " + (dir / "e0") + " --routing full --out " + (dir / "x.png")),
               "apply only to --ensemble");
  r = test::run_ddm("sample --ckpt " + (dir / "e0") + " --one-expert-at-a-time --out " + (dir / "x.png"));
  expect_error(r, "apply only to --ensemble");
  EXPECT_EQ(r.exit_code, 2);  // a flag that does not apply is bad input, as a bad flag is
  expect_error(test::run_ddm("sample --ensemble " + (dir / "e0") + " --out " + (dir / "x.png")),
               "is not an ensemble directory");
  EXPECT_FALSE(fs::exists(dir / "x"));

  // Experts listed out of cluster order in a hand-edited manifest (their hashes still right): refused,
  // as the router's output k weighs entry k.
  {
    const std::string kept = test::read_text(dir / "ens/ensemble.json");
    auto swapped = manifest;
    std::swap(swapped["experts"][0], swapped["experts"][1]);
    test::write_text(dir / "ens/ensemble.json", swapped.dump(2));
    expect_error(test::run_ddm(sample + "--out " + (dir / "x.png")),
                 "trained on cluster 1: the experts are listed out of cluster order");
    test::write_text(dir / "ens/ensemble.json", kept);
  }
  // A missing expert: a clear error, or with --allow-missing the other expert takes all samples.
  fs::rename(dir / "e1/ckpt", dir / "e1/ckpt.away");
  expect_error(test::run_ddm(sample + "--out " + (dir / "x.png")), "expert 1 is missing");
  r = test::run_ddm(sample + "--allow-missing --out " + (dir / "m.png"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("warning: expert 1 is missing"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("1: 0.0% (missing)"), std::string::npos) << r.output;
  fs::rename(dir / "e1/ckpt.away", dir / "e1/ckpt");
  // A damaged checkpoint (a file that no longer matches its own state.json) is named as damaged;
  // another checkpoint in its place as changed since assembly.
  fs::copy_file(dir / "e0/ckpt/step-00000006/ema.safetensors", dir / "e1/ckpt/step-00000006/ema.safetensors",
                fs::copy_options::overwrite_existing);
  expect_error(test::run_ddm(sample + "--out " + (dir / "x.png")),
               "expert 1's checkpoint " + (dir / "e1/ckpt/step-00000006") + " is damaged: its ema.safetensors");
  for (const char* file : {"model.safetensors", "state.json"})
    fs::copy_file(dir / (std::string("e0/ckpt/step-00000006/") + file), dir / (std::string("e1/ckpt/step-00000006/") + file),
                  fs::copy_options::overwrite_existing);
  expect_error(test::run_ddm(sample + "--out " + (dir / "x.png")), "changed since the ensemble was assembled");
}

TEST(DecentralCli, IslandsSurviveAKilledIslandAndWriteASlurmArray) {
  const test::TempDir dir;
  test::write_text(dir / "tiny.toml",
                   "[data]\nlimit = 600\n[model]\nchannels = 8\nchannel_mult = [1, 2]\ngroups = 4\n"
                   "[train]\nsteps = 120\nbatch_size = 32\nlog_every = 20\nckpt_every = 20\n");
  const std::string islands = "out = \"runs/k2\"\nconfig = \"tiny.toml\"\n"
                              "[partition]\npath = \"parts/k2\"\nk = 2\nfeatures = \"pixels:16\"\n"
                              "[experts]\nbudget = \"full\"\n"
                              "[router]\npreset = \"router-conv-tiny\"\nholdout = 100\nset = [\"train.steps=40\"]\n"
                              "[run]\nconcurrency = 2\nretries = 2\nthreads = 1\n";
  test::write_text(dir / "isl.toml", islands);
  const std::string cd = "cd " + dir.path + " && ";
  // Run in the background; kill -9 expert 0 once it has written its step-20 checkpoint.
  test::run_command(cd + "(" + test::ddm_binary() + " islands run isl.toml > run.log 2>&1; echo $? > rc.part; mv rc.part rc) > /dev/null 2>&1 &");
  const fs::path ckpt = dir / "runs/k2/experts/0/ckpt/step-00000020";
  for (int i = 0; i < 3000 && !fs::exists(ckpt); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  ASSERT_TRUE(fs::exists(ckpt)) << test::read_text(dir / "run.log");
  const auto running = nlohmann::json::parse(test::read_text(dir / "runs/k2/islands.json"));
  ASSERT_EQ(running[0]["state"], "running");
  ASSERT_EQ(kill(running[0]["pid"].get<pid_t>(), SIGKILL), 0);
  for (int i = 0; i < 3000 && !fs::exists(dir / "rc"); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  const std::string log = test::read_text(dir / "run.log");
  ASSERT_EQ(test::read_text(dir / "rc"), "0\n") << log;
  EXPECT_NE(log.find("expert 0: killed by signal 9"), std::string::npos) << log;
  EXPECT_NE(log.find("wrote runs/k2/ensemble.json"), std::string::npos) << log;
  const auto done = nlohmann::json::parse(test::read_text(dir / "runs/k2/islands.json"));
  EXPECT_EQ(done[0]["attempts"], 2);
  EXPECT_EQ(done[1]["attempts"], 1);
  for (const auto& island : done) EXPECT_EQ(island["state"], "done") << island.dump();
  // Nothing was lost: the killed expert ends exactly where an uninterrupted run ends.
  ASSERT_EQ(test::run_ddm("train --quiet --config " + (dir / "tiny.toml") + " --partition " + (dir / "parts/k2") +
                          " --expert 0 --budget full --set train.threads=1 --out " + (dir / "ref"))
                .exit_code,
            0);
  EXPECT_EQ(test::read_text(dir / "ref/ckpt/step-00000120/ema.safetensors"),
            test::read_text(dir / "runs/k2/experts/0/ckpt/step-00000120/ema.safetensors"));
  auto r = test::run_command(cd + test::ddm_binary() + " islands status isl.toml");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("expert 0   done         120/120         2"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("ensemble: runs/k2/ensemble.json"), std::string::npos) << r.output;
  // Running again skips the finished islands.
  const std::string ensemble_before = test::read_text(dir / "runs/k2/ensemble.json");
  r = test::run_command(cd + test::ddm_binary() + " islands run isl.toml");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("3 already done, 0 to run"), std::string::npos) << r.output;
  EXPECT_EQ(nlohmann::json::parse(test::read_text(dir / "runs/k2/islands.json"))[0]["attempts"], 2);  // kept
  // A file whose experts are other than the finished ones (once they counted as done, whatever
  // trained them, and were assembled): refused before anything starts, naming the key; the
  // ensemble is kept as it was.
  test::write_text(dir / "other.toml", std::string(islands).replace(islands.find("[experts]\n"), 10,
                                                                    "[experts]\nset = [\"model.channels=16\"]\n"));
  r = test::run_command(cd + test::ddm_binary() + " islands run other.toml");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("expert 0 in runs/k2/experts/0 finished with other settings than other.toml asks for: "
                          "[model] channels = 8  (runs/k2/experts/0)  vs  channels = 16  (other.toml)"),
            std::string::npos) << r.output;
  EXPECT_EQ(r.output.find(": started (attempt"), std::string::npos) << r.output;
  EXPECT_EQ(test::read_text(dir / "runs/k2/ensemble.json"), ensemble_before);
  r = test::run_command(cd + test::ddm_binary() + " islands status other.toml");  // says so too
  EXPECT_NE(r.output.find("not as other.toml asks: [model] channels = 8"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("ensemble: `ddm islands run other.toml` refuses expert 0, expert 1"), std::string::npos)
      << r.output;
  // The partition made again under the finished islands: refused before anything starts.
  fs::copy(dir / "parts/k2", dir / "parts/k2.kept", fs::copy_options::recursive);
  ASSERT_EQ(test::run_command(cd + test::ddm_binary() + " partition --config tiny.toml --k 2 --features pixels:16 "
                              "--seed 7 --force --out parts/k2").exit_code,
            0);
  r = test::run_command(cd + test::ddm_binary() + " islands run isl.toml");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("expert 0 in runs/k2/experts/0 finished with other settings than isl.toml asks for: it "
                          "trained on another partition"),
            std::string::npos) << r.output;
  fs::remove_all(dir / "parts/k2");
  fs::rename(dir / "parts/k2.kept", dir / "parts/k2");
  // More steps than the experts trained: they train on (the router, done, is kept).
  test::write_text(dir / "more.toml", std::string(islands).replace(islands.find("[experts]\n"), 10,
                                                                   "[experts]\nset = [\"train.steps=140\"]\n"));
  r = test::run_command(cd + test::ddm_binary() + " islands run more.toml");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("1 already done, 2 to run"), std::string::npos) << r.output;
  EXPECT_TRUE(fs::exists(dir / "runs/k2/experts/1/ckpt/step-00000140"));
  EXPECT_EQ(nlohmann::json::parse(test::read_text(dir / "runs/k2/experts/1/expert.json"))["steps"], 140);
  r = test::run_command(cd + test::ddm_binary() + " islands run more.toml");
  EXPECT_NE(r.output.find("3 already done, 0 to run"), std::string::npos) << r.output;
  // run.threads = 0 divides the cores among the islands that run at once: two experts deleted, two
  // at a time; then one deleted, which runs alone on every core.
  test::write_text(dir / "isl0.toml", std::string(islands).replace(islands.find("threads = 1"), 11, "threads = 0"));
  fs::remove_all(dir / "runs/k2/experts/0");
  fs::remove_all(dir / "runs/k2/experts/1");
  r = test::run_command(cd + test::ddm_binary() + " islands run isl0.toml");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto share = std::max(1u, std::thread::hardware_concurrency() / 2);
  EXPECT_NE(r.output.find("1 already done, 2 to run, 2 at a time, up to 2 restarts each, " + std::to_string(share) +
                          (share == 1 ? " thread each" : " threads each")),
            std::string::npos) << r.output;
  fs::remove_all(dir / "runs/k2/experts/1");
  // The status says the ensemble no longer holds what the islands hold.
  r = test::run_command(cd + test::ddm_binary() + " islands status isl0.toml");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("ensemble: runs/k2/ensemble.json is out of date: expert 1 not done; `ddm islands run isl0.toml` "
                          "trains it and assembles it again"),
            std::string::npos) << r.output;
  r = test::run_command(cd + test::ddm_binary() + " islands run isl0.toml");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("2 already done, 1 to run, 2 at a time, up to 2 restarts each, all cores each"),
            std::string::npos) << r.output;
  r = test::run_command(cd + test::ddm_binary() + " islands status isl0.toml");
  EXPECT_NE(r.output.find("ensemble: runs/k2/ensemble.json\n"), std::string::npos) << r.output;
  {  // an expert whose weights are not those ensemble.json records
    auto manifest = nlohmann::json::parse(test::read_text(dir / "runs/k2/ensemble.json"));
    const std::string kept = test::read_text(dir / "runs/k2/ensemble.json");
    manifest["experts"][0]["weights_sha256"]["ema"] = std::string(64, '0');
    test::write_text(dir / "runs/k2/ensemble.json", manifest.dump(2));
    r = test::run_command(cd + test::ddm_binary() + " islands status isl0.toml");
    EXPECT_NE(r.output.find("is out of date: expert 0 changed since it was assembled"), std::string::npos) << r.output;
    // A damaged manifest is said to be damaged (it was called "changed"), a damaged islands.json too.
    test::write_text(dir / "runs/k2/ensemble.json", kept.substr(0, kept.size() / 2));
    const std::string record = test::read_text(dir / "runs/k2/islands.json");
    test::write_text(dir / "runs/k2/islands.json", "[{");
    r = test::run_command(cd + test::ddm_binary() + " islands status isl0.toml");
    EXPECT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("ensemble.json is damaged ("), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("islands.json is damaged ("), std::string::npos) << r.output;
    test::write_text(dir / "runs/k2/islands.json", record);
    test::write_text(dir / "runs/k2/ensemble.json", kept);
  }

  // A runner killed with -9 takes its islands down with it (each writes a checkpoint and stops), so
  // the next runner resumes them alone; the result is still exactly the uninterrupted one.
  test::write_text(dir / "isl2.toml", std::string(islands).replace(islands.find("runs/k2"), 7, "runs/k2b"));
  test::run_command(cd + "(" + test::ddm_binary() + " islands run isl2.toml > run2.log 2>&1 & echo $! > runner.pid)");
  const fs::path ckpt2 = dir / "runs/k2b/experts/0/ckpt/step-00000020";
  for (int i = 0; i < 3000 && !fs::exists(ckpt2); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  ASSERT_TRUE(fs::exists(ckpt2)) << test::read_text(dir / "run2.log");
  const auto islands2 = nlohmann::json::parse(test::read_text(dir / "runs/k2b/islands.json"));
  std::vector<pid_t> children;
  for (const auto& island : islands2)
    if (island["state"] == "running") children.push_back(island["pid"].get<pid_t>());
  ASSERT_FALSE(children.empty());
  ASSERT_EQ(kill(std::stoi(test::read_text(dir / "runner.pid")), SIGKILL), 0);
  auto alive = [](pid_t pid) {  // a zombie counts as gone: nobody may be left to reap it here
    std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
    std::string line;
    return std::getline(stat, line) && line.find(") Z ") == std::string::npos;
  };
  for (pid_t pid : children) {
    for (int i = 0; i < 1500 && alive(pid); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(20));
    EXPECT_FALSE(alive(pid)) << "island " << pid << " outlived its runner";
  }
  EXPECT_FALSE(fs::exists(dir / "runs/k2b/experts/0/ckpt/step-00000120")) << "expert 0 trained on without its runner";
  EXPECT_NE(test::read_text(dir / "runs/k2b/logs/expert0.log").find("stopped by signal 15"), std::string::npos);
  r = test::run_command(cd + test::ddm_binary() + " islands run isl2.toml");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(test::read_text(dir / "ref/ckpt/step-00000120/ema.safetensors"),
            test::read_text(dir / "runs/k2b/experts/0/ckpt/step-00000120/ema.safetensors"));

  // SIGTERM (or Ctrl-C) to a runner with islands still waiting: the running one writes a checkpoint
  // and stops, the waiting ones stay pending, and the runner exits 143 (128 + SIGTERM) instead of waiting on them.
  std::string one_at_a_time = std::string(islands).replace(islands.find("runs/k2"), 7, "runs/k2c");
  test::write_text(dir / "isl3.toml", one_at_a_time.replace(one_at_a_time.find("concurrency = 2"), 15, "concurrency = 1"));
  test::run_command(cd + "(" + test::ddm_binary() + " islands run isl3.toml > run3.log 2>&1 & echo $! > runner3.pid; wait $!; " +
                    "echo $? > rc3.part; mv rc3.part rc3) > /dev/null 2>&1 &");
  const fs::path ckpt3 = dir / "runs/k2c/experts/0/ckpt/step-00000020";
  for (int i = 0; i < 3000 && !fs::exists(ckpt3); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  ASSERT_TRUE(fs::exists(ckpt3)) << test::read_text(dir / "run3.log");
  ASSERT_EQ(kill(std::stoi(test::read_text(dir / "runner3.pid")), SIGTERM), 0);
  for (int i = 0; i < 1500 && !fs::exists(dir / "rc3"); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  ASSERT_TRUE(fs::exists(dir / "rc3")) << "the runner did not exit after SIGTERM:\n" << test::read_text(dir / "run3.log");
  EXPECT_EQ(test::read_text(dir / "rc3"), "143\n") << test::read_text(dir / "run3.log");
  EXPECT_NE(test::read_text(dir / "run3.log").find("stopped as asked; run the same command again to go on"),
            std::string::npos)
      << test::read_text(dir / "run3.log");
  const auto stopped = nlohmann::json::parse(test::read_text(dir / "runs/k2c/islands.json"));
  EXPECT_EQ(stopped[0]["state"], "stopped") << stopped.dump();
  EXPECT_EQ(stopped[1]["state"], "pending") << stopped.dump();
  EXPECT_EQ(stopped[2]["state"], "pending") << stopped.dump();

  // Slurm: one array task per island; a task runs locally with SLURM_ARRAY_TASK_ID set.
  r = test::run_command(cd + test::ddm_binary() + " islands slurm isl.toml --script job.sbatch");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::string script = test::read_text(dir / "job.sbatch");
  EXPECT_NE(script.find("#SBATCH --array=0-2"), std::string::npos) << script;
  EXPECT_EQ(test::run_command("bash -n " + (dir / "job.sbatch")).exit_code, 0);
  fs::remove_all(dir / "runs/k2/experts/1");
  r = test::run_command("SLURM_ARRAY_TASK_ID=1 bash " + (dir / "job.sbatch"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(fs::exists(dir / "runs/k2/experts/1/ckpt/step-00000120"));
  EXPECT_EQ(test::read_text(dir / "runs/k2/experts/1/expert.json").find("\"expert\": 1") != std::string::npos, true);
  r = test::run_command("SLURM_ARRAY_TASK_ID=7 bash " + (dir / "job.sbatch"));
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.output.find("no island for array task 7"), std::string::npos) << r.output;
  r = test::run_command("env -u SLURM_ARRAY_TASK_ID bash " + (dir / "job.sbatch"));
  expect_error(r, "run this script with sbatch");

  // Bad islands files name the key, and are bad input (exit 2: running again fails alike).
  auto expect_bad_input = [&](const std::string& args, const std::string& needle) {
    const auto res = test::run_command(cd + test::ddm_binary() + " " + args);
    EXPECT_EQ(res.exit_code, 2) << args << "\n" << res.output;
    EXPECT_NE(res.output.find(needle), std::string::npos) << args << "\n" << res.output;
  };
  test::write_text(dir / "bad.toml", "config = \"tiny.toml\"\n[partition]\npath = \"p\"\n");
  expect_bad_input("islands run bad.toml", "'out' is required");
  test::write_text(dir / "bad.toml", islands + "speed = 3\n");
  expect_bad_input("islands run bad.toml", "unknown key 'run.speed'");
  expect_bad_input("islands slurm bad.toml", "unknown key 'run.speed'");
  test::write_text(dir / "bad.toml", islands.substr(0, islands.find("[run]")) + "[run]\nconcurrency = 0\n");
  expect_bad_input("islands run bad.toml", "'run.concurrency' must be >= 1");
  test::write_text(dir / "bad.toml", "config = \"tiny.toml\"\n[partition\n");
  expect_bad_input("islands run bad.toml", "bad.toml:2");
  expect_bad_input("islands run nowhere.toml", "does not exist");
  expect_bad_input("islands slurm nowhere.toml", "does not exist");
  expect_bad_input("islands status nowhere.toml", "does not exist");
}

TEST(DecentralCli, QuickstartRunsTheWholeDecentralizedPipeline) {
  // The main command at a few steps: partition of all 60000 images into 4, four experts and a router
  // as islands, the assembled ensemble, and a top-1 grid (of 4 solver steps rather than 20: the grid
  // was most of this test's time); a re-run continues (here: nothing left).
  const test::TempDir dir;
  const std::string qs = "quickstart --train-steps 4 --sample-steps 4 --threads 1 --out " + (dir / "qs");
  auto r = test::run_ddm(qs);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("routing top1): euler, 4 steps"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("quickstart took"), std::string::npos) << r.output;
  EXPECT_TRUE(fs::exists(dir / "qs/samples.png"));
  const auto manifest = nlohmann::json::parse(test::read_text(dir / "qs/ensemble.json"));
  EXPECT_EQ(manifest["k"], 4);
  for (const auto& e : manifest["experts"]) EXPECT_EQ(e["step"], 4);
  EXPECT_EQ(manifest["router"]["step"], 2);
  const auto expert = nlohmann::json::parse(test::read_text(dir / "qs/experts/2/expert.json"));
  EXPECT_EQ(expert["batch_size"], 32);  // the quickstart's batch of 128, split four ways
  EXPECT_EQ(expert["images"], 15000);

  r = test::run_ddm(qs);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("5 already done, 0 to run"), std::string::npos) << r.output;
  r = test::run_ddm("islands status " + (dir / "qs/islands.toml"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("ensemble: "), std::string::npos) << r.output;
  expect_error(test::run_ddm(qs + " --monolith"), "holds a decentralized quickstart");
  fs::create_directories(dir / "single");
  test::write_text(dir / "single/config.toml", "[train]\nsteps = 4\n");
  expect_error(test::run_ddm("quickstart --out " + (dir / "single")), "holds a single-model quickstart");
}
