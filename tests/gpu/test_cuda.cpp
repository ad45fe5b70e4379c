// GPU checks (label `gpu`): each skips, saying why, where no CUDA GPU is present (CI), and runs on
// a GPU machine (scripts/gpu-check.sh). They check that the LibTorch ddm builds against runs CUDA
// tensors: a matmul and every backbone preset's forward and backward on the GPU equal the CPU's
// within float32 rounding (TF32 off: cuBLAS and cuDNN then compute in float32, in another order);
// then that ddm trains there: the trainer on CUDA trains what it trains on the CPU, DiLoCo and a
// pipeline's stages too (and `ddm plan` profiles there), data parallelism
// over Gloo with CUDA tensors what one process trains (over NCCL too, where there are two GPUs), NCCL
// forms a group and reduces with world size 1, a run moves between the CPU and the GPU on
// resume, bf16 autocast follows fp32 (a text model's too), fp16 with loss scaling too, deterministic runs repeat bit for bit, and sampling on CUDA
// (one model, and a routed ensemble of experts) gives the CPU's images, an ensemble's experts side by side
// the bits of one after another; CUDA graphs of a training step
// (train.cuda_graphs) train what eager steps train, and sampling from graphs gives the eager images.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>
#include <torch/cuda.h>
#include <torch/torch.h>

#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include "comm/nccl.h"
#include "core/cuda_module.h"
#include "core/device.h"
#include "core/fileio.h"
#include "core/safetensors.h"
#include "core/presets.h"
#include "data/dataset.h"
#include "data/shard_loader.h"
#include "data/shard_write.h"
#include "data/shards.h"
#include "decentral/ensemble.h"
#include "diffusion/generate.h"
#include "gpu/gpu_test_util.h"
#include "model/fused_gpu.h"
#include "model/graphed_net.h"
#include "model/net.h"
#include "model/ops.h"
#include "test_util.h"
#include "train/step.h"

using namespace ddm;
using namespace ddm::test;

TEST(Gpu, MatmulOnCudaEqualsTheCpuWithinFloat32Rounding) {
  if (no_gpu()) GTEST_SKIP() << kNoGpu;
  at::globalContext().setAllowTF32CuBLAS(false);
  torch::manual_seed(0);
  const auto a = torch::randn({256, 512}), b = torch::randn({512, 128});
  const auto cpu = torch::matmul(a, b);
  const auto gpu = torch::matmul(a.cuda(), b.cuda());
  EXPECT_TRUE(gpu.is_cuda());
  expect_close(gpu, cpu, 1e-5, "matmul");
}

TEST(Gpu, EveryBackbonePresetRunsForwardAndBackwardOnCuda) {
  if (no_gpu()) GTEST_SKIP() << kNoGpu;
  at::globalContext().setAllowTF32CuBLAS(false);
  at::globalContext().setAllowTF32CuDNN(false);
  for (const std::string name : {"unet-tiny", "unet-small", "dit-tiny", "dit-small"}) {
    ModelConfig cfg;
    cfg.in_channels = 1, cfg.image_size = 28, cfg.num_classes = 10, cfg.preset = name;
    apply_preset(name, cfg);
    torch::manual_seed(1);
    Net cpu_net = make_net(cfg);
    {
      torch::NoGradGuard no_grad;  // away from the zero initializations, so outputs and gradients are not 0
      for (auto& p : cpu_net->parameters()) p.normal_(0.0, 0.05);
    }
    torch::manual_seed(1);
    Net gpu_net = make_net(cfg);
    {
      torch::NoGradGuard no_grad;
      const auto src = cpu_net->parameters(), dst = gpu_net->parameters();
      for (size_t i = 0; i < src.size(); ++i) dst[i].copy_(src[i]);
    }
    gpu_net->to(torch::kCUDA);
    const auto x = torch::randn({4, 1, 28, 28}), t = torch::rand({4});
    const auto y = torch::tensor({0, 3, 7, 10});
    const auto out_cpu = cpu_net->forward(x, t, y);
    const auto out_gpu = gpu_net->forward(x.cuda(), t.cuda(), y.cuda());
    ASSERT_TRUE(out_gpu.is_cuda()) << name;
    expect_close(out_gpu, out_cpu, 1e-4, name + " forward");
    out_cpu.square().sum().backward();
    out_gpu.square().sum().backward();
    const auto pc = cpu_net->parameters(), pg = gpu_net->parameters();
    for (size_t i = 0; i < pc.size(); ++i)
      if (pc[i].grad().defined() && pc[i].grad().abs().max().item<double>() > 0)
        expect_close(pg[i].grad(), pc[i].grad(), 1e-3, name + " gradient of parameter " + std::to_string(i));
  }
}

namespace {
RunConfig on(RunConfig cfg, const std::string& device) {
  cfg.train.device = device;
  return cfg;
}

// The job the launched tests run: 96 random 8x8 images of 3 classes in dir/data.safetensors, and
// dir/c.toml training a tiny DiT on them for 20 steps (checkpoints at 10 and 20), then `tail` (more
// [train] keys, then further sections).
void write_launched_job(const std::string& dir, const std::string& tail) {
  SafetensorsFile data;
  torch::manual_seed(1);
  data.tensors["images"] = torch::randint(0, 256, {96, 1, 8, 8}).to(torch::kUInt8);
  data.tensors["labels"] = torch::arange(96, torch::kLong).remainder(3);
  save_safetensors(dir + "/data.safetensors", data);
  write_text(dir + "/c.toml", "[data]\nsource = \"safetensors\"\nroot = \"" + dir + "/data.safetensors" +
                                  "\"\n[model]\narch = \"dit\"\nwidth = 32\ndepth = 2\nheads = 2\npatch = 2\n"
                                  "[train]\nsteps = 20\nbatch_size = 16\nwarmup = 2\nthreads = 1\nlog_every = 1\n"
                                  "ckpt_every = 10\nseed = 4\n" + tail);
}
}  // namespace

TEST(Gpu, TrainingOnCudaTrainsWhatTheCpuTrains) {
  if (no_gpu()) GTEST_SKIP() << kNoGpu;
  for (const char* arch : {"unet", "dit"}) {
    TempDir dir;
    RunConfig cfg = tiny(arch);
    if (std::string(arch) == "dit") cfg.train.self_cond = 0.5;  // the first pass too
    ASSERT_EQ(train_ranks(1, {cfg}, dir / "cpu"), std::vector<std::string>{""});
    ASSERT_EQ(train_ranks(1, {on(cfg, "cuda")}, dir / "gpu"), std::vector<std::string>{""});
    expect_same_training(dir / "gpu", dir / "cpu", std::string(arch) + " on cuda against the cpu");
  }
}

TEST(Gpu, AnAutoencoderTrainsOnCudaAsOnTheCpu) {
  if (no_gpu()) GTEST_SKIP() << kNoGpu;
  TempDir dir;
  RunConfig cfg = tiny("unet");  // its training settings; the model an autoencoder of the 8x8 images
  cfg.model.arch = "autoencoder";
  cfg.model.channels = 4;
  cfg.model.channel_mult = {1, 2, 2};
  cfg.model.latent_channels = 2;
  cfg.model.groups = 2;
  cfg.train.kl_weight = 0.01;
  ASSERT_EQ(train_ranks(1, {cfg}, dir / "cpu"), std::vector<std::string>{""});
  ASSERT_EQ(train_ranks(1, {on(cfg, "cuda")}, dir / "gpu"), std::vector<std::string>{""});
  // Its L1 reconstruction loss has the gradient sign(residual): a residual within rounding of zero
  // may flip its sign on the other device, so its losses drift apart faster than a squared error's
  // (measured 4e-5 to 5e-5 relative after 20 steps): bound 1e-3.
  expect_same_training(dir / "gpu", dir / "cpu", "autoencoder on cuda against the cpu", 1e-3);
}

// Two processes (`ddm launch --nproc 2`), both on the one GPU: Gloo reduces their CUDA gradient
// buckets through host copies. (Not ranks as threads here: a process's autograd engine runs every
// CUDA backward of one device on one thread, and a rank's gradient sync completes in its backward's
// final callback, so two ranks in one process on one GPU would wait on each other there.)
TEST(Gpu, DataParallelOverGlooWithCudaTensorsTrainsWhatOneProcessTrains) {
  if (no_gpu()) GTEST_SKIP() << kNoGpu;
  TempDir dir;
  write_launched_job(dir.path, "device = \"cuda:0\"\n");
  const CommandResult one = run_ddm("train --quiet --config " + (dir / "c.toml") + " --out " + (dir / "one"));
  ASSERT_EQ(one.exit_code, 0) << one.output;
  const CommandResult two =
      run_ddm("launch --nproc 2 -- train --quiet --config " + (dir / "c.toml") + " --out " + (dir / "two"));
  ASSERT_EQ(two.exit_code, 0) << two.output;
  expect_same_training(dir / "two", dir / "one", "dp(2) over gloo on cuda, 2 processes, against 1 process");
  // parallel.shard_optimizer on the GPU: each rank's range updated on the device and broadcast over
  // Gloo, the checkpoint assembled on rank 0 from host copies of the ranges: the unsharded run bit for
  // bit (AdamW and the EMA are elementwise).
  const CommandResult sharded = run_ddm("launch --nproc 2 -- train --quiet --config " + (dir / "c.toml") +
                                        " --set parallel.shard_optimizer=true --out " + (dir / "sharded"));
  ASSERT_EQ(sharded.exit_code, 0) << sharded.output;
  EXPECT_EQ(losses(dir / "sharded"), losses(dir / "two"));
  {
    const Checkpoint a = read_checkpoint(*latest_checkpoint(dir / "sharded")), b = read_checkpoint(*latest_checkpoint(dir / "two"));
    EXPECT_EQ(max_weight_difference(a.model, b.model), 0.0);
    EXPECT_EQ(max_weight_difference(a.ema, b.ema), 0.0);
    EXPECT_EQ(max_weight_difference(a.optim, b.optim), 0.0);
  }
  // Under parallel.backend = auto, ranks that share a GPU stay on Gloo (above); nccl is refused for
  // them, naming the reason, since NCCL cannot put two ranks on one GPU.
  const CommandResult nccl = run_ddm("launch --nproc 2 -- train --quiet --config " + (dir / "c.toml") +
                                     " --set parallel.backend=nccl --out " + (dir / "nccl"));
  EXPECT_NE(nccl.exit_code, 0) << nccl.output;
  EXPECT_NE(nccl.output.find("NCCL cannot put two ranks on one GPU"), std::string::npos) << nccl.output;
  // With a GPU per process (train.device = cuda: each LOCAL_RANK's), auto takes NCCL.
  if (torch::cuda::device_count() < 2) {
    std::printf("dp(2) over nccl: skipped, this machine has one GPU (NCCL needs a GPU per rank)\n");
    return;
  }
  const CommandResult nccl2 = run_ddm("launch --nproc 2 -- train --quiet --config " + (dir / "c.toml") +
                                      " --set train.device=cuda --out " + (dir / "nccl2"));
  ASSERT_EQ(nccl2.exit_code, 0) << nccl2.output;
  expect_same_training(dir / "nccl2", dir / "one", "dp(2) over nccl, 2 GPUs, against 1 process");
}

// NCCL with world size 1 on this GPU (what one GPU allows): the group forms, its all-reduce and
// broadcast of CUDA tensors run on NCCL's stream, and the caller's stream, ordered after them by
// wait(), reads the results.
TEST(Gpu, NcclWorldOfOneReducesAndBroadcastsCudaTensors) {
  if (no_gpu()) GTEST_SKIP() << kNoGpu;
  auto store = c10::make_intrusive<c10d::HashStore>();
  auto pg = make_nccl_group(store, 0, 1, 0, std::chrono::seconds(60));
  std::printf("nccl %s\n", nccl_version().c_str());
  for (const auto dtype : {torch::kFloat, torch::kHalf, torch::kBFloat16}) {
    auto t = torch::randn({1 << 20}, torch::TensorOptions(torch::kCUDA).dtype(dtype));
    const auto before = t.clone();
    std::vector<at::Tensor> ts{t};
    pg->allreduce(ts)->wait();
    t.mul_(2);  // on the caller's stream, after the all-reduce
    EXPECT_TRUE(torch::equal(t.cpu(), (before * 2).cpu())) << c10::toString(dtype);
    c10d::BroadcastOptions o;
    o.rootRank = 0;
    pg->broadcast(ts, o)->wait();
    EXPECT_TRUE(torch::equal(t.cpu(), (before * 2).cpu())) << c10::toString(dtype);
  }
  pg->shutdown();
}

// DiLoCo, 2 replicas (`ddm launch --nproc 2`) on the one GPU, fragments staggered and overlapped:
// the replicas train there and synchronize through the host over Gloo; the run trains what the same
// job trains on the CPU. parallel.backend = nccl is refused for DiLoCo.
TEST(Gpu, DilocoOnCudaTrainsWhatItTrainsOnTheCpu) {
  if (no_gpu()) GTEST_SKIP() << kNoGpu;
  TempDir dir;
  write_launched_job(dir.path, "[parallel]\nmode = \"diloco\"\n[diloco]\ninner_steps = 4\nfragments = 2\noverlap = 1\n");
  const std::string run = "launch --nproc 2 -- train --quiet --config " + (dir / "c.toml");
  const CommandResult cpu = run_ddm(run + " --set train.device=cpu --out " + (dir / "cpu"));
  ASSERT_EQ(cpu.exit_code, 0) << cpu.output;
  const CommandResult gpu = run_ddm(run + " --set train.device=cuda:0 --out " + (dir / "gpu"));
  ASSERT_EQ(gpu.exit_code, 0) << gpu.output;
  expect_same_training(dir / "gpu", dir / "cpu", "diloco(2) on cuda against the cpu");
  // The GPU run continues on the CPU for 10 more steps (its replicas' state moves with it).
  const CommandResult more = run_ddm(run + " --set train.device=cpu --set train.steps=30 --resume --out " + (dir / "gpu"));
  EXPECT_EQ(more.exit_code, 0) << more.output;
  const CommandResult nccl = run_ddm("train --quiet --config " + (dir / "c.toml") +
                                     " --set train.device=cuda --set parallel.backend=nccl --out " + (dir / "nccl"));
  EXPECT_NE(nccl.exit_code, 0);
  EXPECT_NE(nccl.output.find("DiLoCo (parallel.mode = diloco) synchronizes over Gloo"), std::string::npos) << nccl.output;
}

// A pipeline of 2 stages (`ddm launch --nproc 2`, parallel.pp = 2) with both processes on the one
// GPU: the stages compute there, their carries and gradients go through host memory over Gloo (the
// pipeline's wire, pipeline/wire.h), self-conditioning's first pass crosses the stages, and bubble
// filling sends prepared rows between them. It trains what the same pipeline trains on the CPU; in
// bf16 it stays within bf16 rounding of fp32 (the single-process bound below); the GPU run resumes
// on the CPU as one process.
TEST(Gpu, APipelineTrainsOnCudaAsOnTheCpu) {
  if (no_gpu()) GTEST_SKIP() << kNoGpu;
  TempDir dir;
  write_launched_job(dir.path, "grad_accum = 4\nself_cond = 0.5\n[parallel]\npp = 2\nschedule = \"zb-h1\"\n");
  const std::string run = "launch --nproc 2 -- train --quiet --config " + (dir / "c.toml");
  const CommandResult cpu = run_ddm(run + " --set train.device=cpu --out " + (dir / "cpu"));
  ASSERT_EQ(cpu.exit_code, 0) << cpu.output;
  const CommandResult gpu = run_ddm(run + " --set train.device=cuda:0 --out " + (dir / "gpu"));
  ASSERT_EQ(gpu.exit_code, 0) << gpu.output;
  expect_same_training(dir / "gpu", dir / "cpu", "pipeline(2, zb-h1, filled) on cuda against the cpu");
  const CommandResult bf16 =
      run_ddm(run + " --set train.device=cuda:0 --set train.precision=bf16 --out " + (dir / "bf16"));
  ASSERT_EQ(bf16.exit_code, 0) << bf16.output;
  const auto lb = losses(dir / "bf16"), lf = losses(dir / "gpu");
  ASSERT_EQ(lb.size(), lf.size());
  double tail_f = 0, tail_b = 0;  // the last 10 steps' mean loss, as Bf16AutocastFollowsFp32Over50Steps bounds it
  for (size_t i = lb.size() - 10; i < lb.size(); ++i) tail_f += lf[i] / 10, tail_b += lb[i] / 10;
  EXPECT_NE(lb, lf) << "bf16 trained exactly what fp32 did: autocast was not on";
  EXPECT_LE(std::abs(tail_b - tail_f) / tail_f, 2e-2);
  std::printf("pipeline(2) in bf16 on cuda: last 10 steps' mean loss within %.2e (relative) of fp32's\n",
              std::abs(tail_b - tail_f) / tail_f);
  const CommandResult more = run_ddm("train --quiet --config " + (dir / "c.toml") +
                                     " --set train.device=cpu --set parallel.pp=1 --set train.steps=30 --resume --out " +
                                     (dir / "gpu"));
  EXPECT_EQ(more.exit_code, 0) << more.output;
  EXPECT_EQ(losses(dir / "gpu").size(), 30u);
}

// `ddm plan --device cuda` profiles the units on the GPU: its times are the device's (each reading
// waits for the queued kernels), its activation bytes CUDA's allocator's, its machine the card's name.
TEST(Gpu, PlanProfilesTheUnitsOnCuda) {
  if (no_gpu()) GTEST_SKIP() << kNoGpu;
  TempDir dir;
  write_launched_job(dir.path, "");
  const CommandResult r = run_ddm("plan --config " + (dir / "c.toml") + " --device cuda --rows 1 4 --devices 2 --save-profile " +
                                  (dir / "p.json"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const nlohmann::json p = nlohmann::json::parse(read_file(dir / "p.json"));
  EXPECT_EQ(p.at("machine").get<std::string>().rfind(gpu_name(torch::Device(torch::kCUDA, 0)) + ",", 0), 0u) << p.at("machine");
  double forward = 0, activations = 0;
  for (const auto& u : p.at("units"))
    for (const auto& s : u.at("samples"))
      forward += s.at("forward_ms").get<double>(), activations += s.at("activation_bytes").get<double>();
  EXPECT_GT(forward, 0.0);
  EXPECT_GT(activations, 0.0);
  std::printf("plan on %s: %.3f ms of unit forwards, %.0f activation bytes in all\n", p.at("machine").get<std::string>().c_str(),
              forward, activations);
}

TEST(Gpu, ARunMovesBetweenTheCpuAndTheGpuOnResume) {
  if (no_gpu()) GTEST_SKIP() << kNoGpu;
  TempDir dir;
  const RunConfig cfg = tiny("unet");  // 20 steps, a checkpoint every 10
  RunConfig half = cfg;
  half.train.steps = 10;
  ASSERT_EQ(train_ranks(1, {cfg}, dir / "cpu"), std::vector<std::string>{""});
  for (const auto& [first, second] : {std::pair<std::string, std::string>{"cuda", "cpu"}, {"cpu", "cuda"}}) {
    const std::string run = dir / (first + "-then-" + second);
    ASSERT_EQ(train_ranks(1, {on(half, first)}, run), std::vector<std::string>{""});
    std::vector<TrainSummary> s;
    ASSERT_EQ(train_ranks(1, {on(cfg, second)}, run, /*resume=*/true, &s), std::vector<std::string>{""});
    EXPECT_EQ(s[0].first_step, 10);
    EXPECT_EQ(s[0].last_step, 20);
    expect_same_training(run, dir / "cpu", first + " then " + second + " against the cpu throughout");
  }
}

namespace {

// Trains `arch` for 50 steps on CUDA in fp32 and in `low` (bf16 or fp16) into dir/fp32 and dir/low:
// autocast rounds each matmul's inputs (bf16 to 8 significant bits, fp16 to 11), so the two runs take
// different paths (their losses differ after the first step, whose zero-initialized output is the
// same in both) along the same curve, the mean loss of their last 10 steps within 2%. The weights,
// gradients, AdamW state and EMA stay float32.
void expect_follows_fp32(const std::string& dir, const char* arch, Precision low) {
  RunConfig cfg = on(tiny(arch), "cuda");
  cfg.train.steps = 50;
  cfg.train.ckpt_every = 50;
  RunConfig lowered = cfg;
  lowered.train.precision = low;
  const std::string name = name_of(low);
  ASSERT_EQ(train_ranks(1, {cfg}, dir + "/fp32"), std::vector<std::string>{""});
  ASSERT_EQ(train_ranks(1, {lowered}, dir + "/low"), std::vector<std::string>{""});
  const auto lf = losses(dir + "/fp32"), ll = losses(dir + "/low");
  ASSERT_EQ(lf.size(), 50u);
  ASSERT_EQ(ll.size(), 50u);
  double tail_f = 0, tail_l = 0;
  for (size_t i = 40; i < 50; ++i) tail_f += lf[i] / 10, tail_l += ll[i] / 10;
  const double tail = std::abs(tail_l - tail_f) / tail_f;
  EXPECT_NE(ll, lf) << arch << ": " << name << " trained exactly what fp32 did: autocast was not on";
  EXPECT_LE(tail, 2e-2) << arch << " " << name;
  for (const auto& [weight, t] : final_weights(dir + "/low")) {
    EXPECT_EQ(t.scalar_type(), torch::kFloat) << weight;
    EXPECT_TRUE(torch::isfinite(t).all().item<bool>()) << weight;
  }
  std::printf("%s: %s against fp32: mean loss of the last 10 steps %.4f against %.4f (%.2e relative)\n", arch,
              name.c_str(), tail_l, tail_f, tail);
}

}  // namespace

TEST(Gpu, Bf16AutocastFollowsFp32Over50Steps) {
  if (no_gpu()) GTEST_SKIP() << kNoGpu;
  {
    Autocast autocast(torch::Device(torch::kCUDA), Precision::kBf16);
    const auto a = torch::randn({8, 8}, torch::kCUDA);
    EXPECT_EQ(torch::mm(a, a).scalar_type(), torch::kBFloat16);
  }
  EXPECT_EQ(torch::mm(torch::randn({8, 8}, torch::kCUDA), torch::randn({8, 8}, torch::kCUDA)).scalar_type(), torch::kFloat);
  for (const char* arch : {"unet", "dit"}) {
    TempDir dir;
    expect_follows_fp32(dir.path, arch, Precision::kBf16);
    if (HasFatalFailure()) return;
  }
}

// fp16 training (train/loss_scale.h) on the GPU it is for: float16 autocast with dynamic loss
// scaling follows fp32 as bf16 does; started at a scale float16 overflows at, it skips steps,
// halving the scale, and then trains.
TEST(Gpu, Fp16WithLossScalingFollowsFp32Over50Steps) {
  if (no_gpu()) GTEST_SKIP() << kNoGpu;
  for (const char* arch : {"unet", "dit"}) {
    TempDir dir;
    expect_follows_fp32(dir.path, arch, Precision::kFp16);
    if (HasFatalFailure()) return;
    RunConfig high = on(tiny(arch), "cuda");
    high.train.precision = Precision::kFp16;
    high.train.loss_scale = std::ldexp(1.0, 30);
    ASSERT_EQ(train_ranks(1, {high}, dir / "high"), std::vector<std::string>{""});
    int64_t skipped = 0;
    std::ifstream in(dir / "high/metrics.jsonl");
    for (std::string line; std::getline(in, line);) skipped += nlohmann::json::parse(line).at("skipped_steps").get<int64_t>();
    EXPECT_GE(skipped, 1) << arch;
    for (const auto& [name, t] : final_weights(dir / "high"))
      EXPECT_TRUE(torch::isfinite(t).all().item<bool>()) << name;
    std::printf("%s: fp16 on cuda from a loss scale of 2^30: %lld steps skipped\n", arch, static_cast<long long>(skipped));
  }
}

// A text model (model.text_encoder: the small sentence encoder scripts/gpu-check.sh packs, named by
// DDM_TEST_TEXT_ENCODER) on CUDA, its encoder there too, trains what it trains on the CPU; in bf16 it
// follows fp32.
TEST(Gpu, TextModelsTrainOnCudaAsOnTheCpuAndInBf16) {
  if (no_gpu()) GTEST_SKIP() << kNoGpu;
  const char* encoder = std::getenv("DDM_TEST_TEXT_ENCODER");
  if (!encoder) GTEST_SKIP() << "DDM_TEST_TEXT_ENCODER names no text encoder (scripts/gpu-check.sh packs one)";
  for (const char* arch : {"unet", "dit"}) {
    TempDir dir;
    RunConfig cfg = tiny(arch);
    cfg.model.text_encoder = encoder;
    cfg.model.text_tokens = 8;
    cfg.model.attn_levels = {1};
    cfg.train.caption_dropout = 0.3;
    cfg.data.hflip = false;
    ASSERT_EQ(train_ranks(1, {cfg}, dir / "cpu"), std::vector<std::string>{""});
    ASSERT_EQ(train_ranks(1, {on(cfg, "cuda")}, dir / "gpu"), std::vector<std::string>{""});
    expect_same_training(dir / "gpu", dir / "cpu", std::string(arch) + " text on cuda against the cpu");
    RunConfig bf16 = on(cfg, "cuda");
    bf16.train.precision = Precision::kBf16;
    ASSERT_EQ(train_ranks(1, {bf16}, dir / "bf16"), std::vector<std::string>{""});
    const auto lf = losses(dir / "gpu"), lb = losses(dir / "bf16");
    ASSERT_EQ(lb.size(), lf.size());
    EXPECT_NE(lb, lf) << arch << ": bf16 trained exactly what fp32 did: autocast was not on";
    double tail_f = 0, tail_b = 0;
    for (size_t i = lf.size() - 5; i < lf.size(); ++i) tail_f += lf[i] / 5, tail_b += lb[i] / 5;
    EXPECT_LE(std::abs(tail_b - tail_f) / tail_f, 5e-2) << arch;
    std::printf("%s text: bf16 against fp32 on cuda: mean loss of the last 5 steps %.4f against %.4f\n", arch, tail_b,
                tail_f);
  }
}

namespace {
// max |a - b| / max |b|, both taken to float64 on the host.
double rel(const torch::Tensor& a, const torch::Tensor& b) {
  const auto x = a.detach().cpu().to(torch::kDouble), y = b.detach().cpu().to(torch::kDouble);
  return (x - y).abs().max().item<double>() / (y.abs().max().item<double>() + 1e-30);
}
}  // namespace

// The kernels were built for this GPU's architecture (or one whose PTX it compiles): they load, and
// the fallback to LibTorch's ops (a GPU none of the built architectures runs on) is not taken.
TEST(Gpu, FusedKernelsLoadOnThisGpusArchitecture) {
  if (no_gpu()) GTEST_SKIP() << kNoGpu;
  for (int d = 0; d < static_cast<int>(torch::cuda::device_count()); ++d)
    EXPECT_TRUE(fused_cuda_runs_on(d)) << "cuda:" << d << ", built for " << fused_cuda_archs();
}

// The hand-written kernels of a DiT block (model/fused_gpu.h) against the same expressions in float64
// on the host, from the same inputs (rounded to bfloat16 where the kernels read bfloat16), forward and
// every gradient: in float32, and under bf16 autocast with bfloat16 modulation (the adaLN linear's
// output there), where the modulated output and the [B, W] gradients are rounded to bfloat16 (8 bits:
// 4e-3 of their largest), and with float32 modulation, which the adaLN kernel leaves to LibTorch's ops
// (it reads the modulation in its output's type). The modulation tensors are strided views of one [B, 6 W] tensor, as in a
// block; widths that are not multiples of 32, a single row, and the widest row the kernels take. The
// same inputs give the same bits twice (the reductions have a fixed order).
TEST(Gpu, FusedDiTKernelsMatchTheirExpressionsInFloat64) {
  if (no_gpu()) GTEST_SKIP() << kNoGpu;
  // The kernels are on by default (model/fused_gpu.h); forced on here, so that a caller's
  // DDM_FUSED_CUDA=0 does not skip this check, and restored after it.
  const char* was = std::getenv("DDM_FUSED_CUDA");
  const std::string before = was ? was : "";
  setenv("DDM_FUSED_CUDA", "1", 1);
  struct Restore {
    bool had;
    std::string value;
    ~Restore() { had ? setenv("DDM_FUSED_CUDA", value.c_str(), 1) : unsetenv("DDM_FUSED_CUDA"); }
  } restore{was != nullptr, before};
  torch::manual_seed(17);
  const auto cuda = torch::Device(torch::kCUDA);
  for (const auto& [bf16, mod_bf16] : {std::pair{false, false}, {true, true}, {true, false}}) {
    for (auto [B, N, W] : {std::tuple<int64_t, int64_t, int64_t>{3, 7, 20}, {2, 49, 128}, {1, 1, 5},
                           {4, 256, 768}, {2, 33, 2048}, {2, 40, 1152}}) {
      const std::string where = std::string(bf16 ? "bf16" : "fp32") + (bf16 && !mod_bf16 ? " (fp32 modulation)" : "") +
                                " B " + std::to_string(B) + " N " + std::to_string(N) + " W " + std::to_string(W);
      const auto mod_type = mod_bf16 ? torch::kBFloat16 : torch::kFloat;
      const auto out_type = bf16 && mod_bf16 ? torch::kBFloat16 : torch::kFloat;
      const auto x0 = torch::randn({B, N, W}) * 3 + 1;                       // [B, N, W] float32
      const auto ada0 = (torch::randn({B, 6 * W}) * 0.5).to(mod_type);      // [B, 6 W]
      const auto a0 = torch::randn({B, N, W}).to(mod_type);                 // a linear's output
      const auto gy0 = torch::randn({B, N, W}).to(mod_type);                // dL/d(modulated)
      const auto go0 = torch::randn({B, N, W});                             // dL/d(residual), float32
      struct Out { torch::Tensor y, o, gx, gada, ga; };
      auto run = [&] {
        auto x = x0.to(cuda).requires_grad_(true), ada = ada0.to(cuda).requires_grad_(true);
        auto a = a0.to(cuda).requires_grad_(true);
        const auto m = ada.chunk(6, -1);                                   // 6 x [B, W], row stride 6 W
        torch::Tensor y, o;
        {
          Autocast autocast(cuda, bf16 ? Precision::kBf16 : Precision::kFp32);
          EXPECT_EQ(adaln_modulate_cuda_supported(x, m[0], m[1]), bf16 == mod_bf16) << where;
          EXPECT_TRUE(gated_residual_cuda_supported(x, m[2], a)) << where;
          y = adaln_modulate(x, m[0], m[1], 1e-6);                        // ops.h's dispatch
          o = gated_residual(x, m[2], a);
        }
        EXPECT_EQ(y.scalar_type(), out_type) << where;
        EXPECT_EQ(o.scalar_type(), torch::kFloat) << where;
        torch::autograd::backward({y, o}, {gy0.to(cuda), go0.to(cuda)});
        return Out{y.detach().cpu(), o.detach().cpu(), x.grad().cpu(), ada.grad().cpu(), a.grad().cpu()};
      };
      const auto got = run();
      // The float64 reference.
      auto x = x0.to(torch::kDouble).requires_grad_(true), ada = ada0.to(torch::kDouble).requires_grad_(true);
      auto a = a0.to(torch::kDouble).requires_grad_(true);
      const auto m = ada.chunk(6, -1);
      const auto y = torch::layer_norm(x, {W}, {}, {}, 1e-6) * (1 + m[1].unsqueeze(1)) + m[0].unsqueeze(1);
      const auto o = x + m[2].unsqueeze(1) * a;
      torch::autograd::backward({y, o}, {gy0.to(torch::kDouble), go0.to(torch::kDouble)});
      const double round = bf16 ? 8e-3 : 2e-6;  // what the result's type keeps
      EXPECT_LT(rel(got.y, y), round) << where;
      EXPECT_LT(rel(got.o, o), 2e-6) << where;
      EXPECT_LT(rel(got.gx, x.grad()), 5e-5) << where;
      EXPECT_LT(rel(got.ga, a.grad()), round) << where;
      for (int i : {0, 1, 2}) {
        const auto sl = torch::indexing::Slice(i * W, (i + 1) * W);
        EXPECT_LT(rel(got.gada.index({torch::indexing::Slice(), sl}), ada.grad().index({torch::indexing::Slice(), sl})),
                  bf16 ? 8e-3 : 2e-5)
            << where << ", the gradient of modulation " << i;
      }
      std::printf("%s: out %.1e, residual %.1e, dx %.1e, da %.1e, d(shift, scale, gate) %.1e\n", where.c_str(),
                  rel(got.y, y), rel(got.o, o), rel(got.gx, x.grad()), rel(got.ga, a.grad()),
                  rel(got.gada.narrow(1, 0, 3 * W), ada.grad().narrow(1, 0, 3 * W)));
      const auto again = run();
      EXPECT_TRUE(torch::equal(again.y, got.y) && torch::equal(again.gx, got.gx) &&
                  torch::equal(again.gada, got.gada) && torch::equal(again.ga, got.ga))
          << where << ": not the same bits twice";
    }
  }
}

// The hand-written GroupNorm + modulation + SiLU kernels (model/fused_gpu.h; opt-in with
// DDM_FUSED_GROUPNORM=1 until this test has passed on a GPU) against the same expression in float64 on
// the host, forward and every gradient (x, the GroupNorm's weight and bias, scale and shift): float32;
// under bf16 autocast with bfloat16 x (a convolution's output there) and with float32 x, where the
// output and the gradients of bfloat16 tensors are rounded to bfloat16. With and without SiLU, the
// modulation and the affine weights; x contiguous and channels-last; one channel a group, one group, a
// 1x1 image, groups of 10 channels (Stable Diffusion's 320 over 32), of 192, 256 (the widest
// channels-last), 512 and 2048 (the widest), channels of 4096 elements; wider groups channels-last
// are refused. The modulation is two strided views of one [B, 2 C]
// tensor, as in a res block. The same inputs give the same bits twice.
TEST(Gpu, FusedGroupNormKernelsMatchTheirExpressionInFloat64) {
  if (no_gpu()) GTEST_SKIP() << kNoGpu;
  struct Env {  // sets a variable for the test and restores it after
    std::string name;
    bool had;
    std::string value;
    Env(const char* n, const char* v) : name(n), had(std::getenv(n) != nullptr), value(had ? std::getenv(n) : "") {
      setenv(n, v, 1);
    }
    ~Env() { had ? setenv(name.c_str(), value.c_str(), 1) : unsetenv(name.c_str()); }
  } on("DDM_FUSED_CUDA", "1"), gn("DDM_FUSED_GROUPNORM", "1");
  torch::manual_seed(23);
  const auto cuda = torch::Device(torch::kCUDA);
  enum Mode { kFp32, kBf16, kBf16FloatX };
  for (const Mode mode : {kFp32, kBf16, kBf16FloatX}) {
    for (auto [B, C, G, H, W] : {std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t>{3, 8, 2, 5, 7},
                                 {4, 64, 16, 28, 28}, {2, 128, 16, 7, 7}, {2, 320, 32, 16, 16}, {2, 40, 40, 3, 3},
                                 {3, 6, 1, 1, 1}, {1, 8, 2, 64, 64}, {2, 512, 1, 3, 3}, {1, 2048, 1, 1, 2},
                                 {2, 256, 1, 3, 5}, {2, 384, 2, 4, 4}}) {
      for (const bool nhwc : {false, true}) {
        if (nhwc && C / G > 256) {  // the kernels' bound in that order: LibTorch's ops instead
          auto wide = torch::nn::GroupNorm(torch::nn::GroupNormOptions(G, C));
          wide->to(cuda);
          const auto xl = torch::randn({B, C, H, W}).contiguous(at::MemoryFormat::ChannelsLast).to(cuda);
          EXPECT_FALSE(group_norm_act_cuda_supported(xl, wide, {}, {})) << C / G << " channels a group";
          continue;
        }
        if (nhwc && H * W == 1) continue;  // one position is both orders
        for (const int variant : {0, 1, 2, 3}) {  // 0: SiLU + modulation, 1: SiLU, 2: plain, 3: SiLU, no affine
          const bool silu = variant != 2, modulated = variant == 0, affine = variant != 3;
          const bool bf16 = mode != kFp32;
          const std::string where = std::string(mode == kFp32 ? "fp32" : mode == kBf16 ? "bf16" : "bf16 (float32 x)") +
                                    " B " + std::to_string(B) + " C " + std::to_string(C) + " G " + std::to_string(G) +
                                    " " + std::to_string(H) + "x" + std::to_string(W) + (silu ? ", silu" : "") +
                                    (modulated ? ", modulated" : "") + (affine ? "" : ", no affine") +
                                    (nhwc ? ", channels-last" : "");
          const auto x_type = mode == kBf16 ? torch::kBFloat16 : torch::kFloat;
          const auto out_type = bf16 ? torch::kBFloat16 : torch::kFloat;
          const auto x0 = (torch::randn({B, C, H, W}) * 3 + 1).to(x_type);     // [B, C, H, W]
          const auto ss0 = (torch::randn({B, 2 * C}) * 0.5).to(out_type);       // [B, 2 C]: scale, shift
          const auto gy0 = torch::randn({B, C, H, W}).to(out_type);             // dL/dout
          auto norm = torch::nn::GroupNorm(torch::nn::GroupNormOptions(G, C).eps(1e-5).affine(affine));
          if (affine) {
            torch::NoGradGuard ng;
            norm->weight.copy_(torch::randn({C}) * 0.5 + 1);
            norm->bias.copy_(torch::randn({C}) * 0.5);
          }
          const auto w0 = affine ? norm->weight.detach().clone() : torch::Tensor();
          const auto b0 = affine ? norm->bias.detach().clone() : torch::Tensor();
          norm->to(cuda);
          struct Out { torch::Tensor y, gx, gss, gw, gb; };
          auto run = [&] {
            norm->zero_grad();
            auto x = (nhwc ? x0.contiguous(at::MemoryFormat::ChannelsLast) : x0).to(cuda).requires_grad_(true);
            auto ss = ss0.to(cuda).requires_grad_(true);
            const auto scale = modulated ? ss.narrow(1, 0, C) : torch::Tensor();   // [B, C], row stride 2 C
            const auto shift = modulated ? ss.narrow(1, C, C) : torch::Tensor();   // [B, C]
            torch::Tensor y;
            {
              Autocast autocast(cuda, bf16 ? Precision::kBf16 : Precision::kFp32);
              EXPECT_TRUE(group_norm_act_cuda_supported(x, norm, scale, shift)) << where;
              y = group_norm_act(norm, x, silu, scale, shift);                     // ops.h's dispatch
            }
            EXPECT_EQ(y.scalar_type(), out_type) << where;
            EXPECT_TRUE(y.is_contiguous(nhwc ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous)) << where;
            y.backward(gy0.to(cuda));
            return Out{y.detach().cpu(), x.grad().cpu(), modulated ? ss.grad().cpu() : torch::Tensor(),
                       affine ? norm->weight.grad().cpu() : torch::Tensor(),
                       affine ? norm->bias.grad().cpu() : torch::Tensor()};
          };
          const auto got = run();
          // The float64 reference.
          auto x = x0.to(torch::kDouble).requires_grad_(true), ss = ss0.to(torch::kDouble).requires_grad_(true);
          auto w = affine ? w0.to(torch::kDouble).requires_grad_(true) : torch::Tensor();
          auto b = affine ? b0.to(torch::kDouble).requires_grad_(true) : torch::Tensor();
          auto y = torch::group_norm(x, G, w, b, 1e-5);
          if (modulated) y = y * (1 + ss.narrow(1, 0, C).view({B, C, 1, 1})) + ss.narrow(1, C, C).view({B, C, 1, 1});
          if (silu) y = torch::silu(y);
          y.backward(gy0.to(torch::kDouble));
          const double round = bf16 ? 8e-3 : 5e-6;  // what the output's type keeps
          EXPECT_LT(rel(got.y, y), round) << where;
          EXPECT_LT(rel(got.gx, x.grad()), x_type == torch::kBFloat16 ? 8e-3 : 5e-5) << where;
          if (modulated) {
            EXPECT_LT(rel(got.gss, ss.grad()), bf16 ? 8e-3 : 2e-5) << where << ", d(scale, shift)";
          }
          if (affine) {
            EXPECT_LT(rel(got.gw, w.grad()), 1e-4) << where << ", d weight";
            EXPECT_LT(rel(got.gb, b.grad()), 1e-4) << where << ", d bias";
          }
          std::printf("%s: out %.1e, dx %.1e, d(scale, shift) %.1e, d weight %.1e, d bias %.1e\n", where.c_str(),
                      rel(got.y, y), rel(got.gx, x.grad()), modulated ? rel(got.gss, ss.grad()) : 0.0,
                      affine ? rel(got.gw, w.grad()) : 0.0, affine ? rel(got.gb, b.grad()) : 0.0);
          const auto again = run();
          EXPECT_TRUE(torch::equal(again.y, got.y) && torch::equal(again.gx, got.gx) &&
                      (!modulated || torch::equal(again.gss, got.gss)) &&
                      (!affine || (torch::equal(again.gw, got.gw) && torch::equal(again.gb, got.gb))))
              << where << ": not the same bits twice";
        }
      }
    }
  }
}

TEST(Gpu, DeterministicRunsRepeatBitForBit) {
  if (no_gpu()) GTEST_SKIP() << kNoGpu;
  TempDir dir;
  RunConfig cfg = on(tiny("unet"), "cuda");
  cfg.train.deterministic = true;
  ASSERT_EQ(train_ranks(1, {cfg}, dir / "a"), std::vector<std::string>{""});
  ASSERT_EQ(train_ranks(1, {cfg}, dir / "b"), std::vector<std::string>{""});
  EXPECT_EQ(losses(dir / "a"), losses(dir / "b"));
  EXPECT_EQ(max_weight_difference(final_weights(dir / "a"), final_weights(dir / "b")), 0.0);
}

// train.cuda_graphs (train/step_graph.cpp): the step captured after two eager ones and replayed trains
// what the eager step trains (the one difference: the fused AdamW kernel reads the learning rate as
// float32), for a U-Net and a DiT, fp32 and bf16, one micro-batch and two, self-conditioning's first
// pass outside the graph, clipped steps; a batch of another shape runs eagerly and the replays go on
// after it. Then the trainer with it: the same run as without, and bit for bit again under
// train.deterministic.
TEST(Gpu, CudaGraphStepsTrainWhatEagerStepsTrain) {
  if (no_gpu()) GTEST_SKIP() << kNoGpu;
  const torch::Device cuda(torch::kCUDA);
  struct Case {
    const char* arch;
    Precision precision;
    int64_t accum;
    double self_cond;
  };
  // fp16 (train/loss_scale.h) from a loss scale of 2^22, which float16 likely overflows at for the
  // first steps (on the CPU a tiny U-Net on 8x8 images settles at 2^18: test_loss_scale.cpp): every
  // step of the graph skips where the eager one does, at the same scale.
  for (const Case& k : {Case{"unet", Precision::kFp32, 1, 0.0}, Case{"dit", Precision::kFp32, 2, 0.5},
                        Case{"unet", Precision::kBf16, 2, 0.0}, Case{"dit", Precision::kBf16, 1, 0.0},
                        Case{"unet", Precision::kFp16, 2, 0.0}, Case{"dit", Precision::kFp16, 1, 0.0}}) {
    const std::string what = std::string(k.arch) + " " + name_of(k.precision) + " x" + std::to_string(k.accum) +
                             (k.self_cond > 0 ? " self-cond" : "");
    RunConfig cfg = on(tiny(k.arch), "cuda");
    cfg.model.in_channels = 1;
    cfg.model.image_size = 8;
    cfg.model.num_classes = 3;
    cfg.train.precision = k.precision;
    cfg.train.self_cond = k.self_cond;
    cfg.train.grad_clip = 0.5;  // some steps clip
    cfg.train.loss_scale = std::ldexp(1.0, 22);
    RunConfig graphed = cfg;
    graphed.train.cuda_graphs = true;
    torch::manual_seed(7);
    Net a = make_net(cfg.model);
    torch::manual_seed(7);
    Net b = make_net(cfg.model);
    a->to(cuda);
    b->to(cuda);
    TrainStep eager(cfg, a, make_objective(cfg)), graph(graphed, b, make_objective(graphed));
    torch::manual_seed(8);
    std::vector<std::vector<Batch>> steps;
    for (int64_t i = 0; i < 8; ++i) {
      const int64_t rows = i == 5 ? 8 : 16, r = rows / k.accum;  // step 5: another shape
      const auto x = torch::rand({rows, 1, 8, 8}) * 2 - 1;
      const auto y = torch::randint(0, 3, {rows});
      std::vector<Batch> micro;
      for (int64_t m = 0; m < k.accum; ++m)
        micro.push_back(Batch{x.narrow(0, m * r, r), y.narrow(0, m * r, r), torch::Tensor(), m * r}.to(cuda));
      steps.push_back(micro);
    }
    double worst = 0;
    for (int64_t i = 0; i < 8; ++i) {
      const std::vector<Batch>& micro = steps[static_cast<size_t>(i)];
      // The graphed steps prepare the next step ahead, as the training loop has them do; the eager
      // ones at their own start.
      const StepResult ra = eager.run(micro, i),
                       rb = graph.run(micro, i, i + 1 < 8 ? steps[static_cast<size_t>(i + 1)] : std::vector<Batch>{});
      ASSERT_EQ(ra.finite, rb.finite) << what << " step " << i;
      ASSERT_EQ(ra.overflow, rb.overflow) << what << " step " << i;
      ASSERT_TRUE(ra.finite || (k.precision == Precision::kFp16 && ra.overflow)) << what << " step " << i;
      ASSERT_EQ(ra.loss_scale, rb.loss_scale) << what << " step " << i;
      worst = std::max(worst, std::abs(ra.loss - rb.loss) / std::abs(ra.loss));
      if (ra.finite) {
        EXPECT_NEAR(rb.grad_norm, ra.grad_norm, 1e-4 * ra.grad_norm) << what << " step " << i;
      }
    }
    EXPECT_EQ(graph.graph_replays(), 5) << what << ": steps 2, 3, 4, 6 and 7 replay the graph";
    EXPECT_EQ(graph.prepared_ahead(), 7) << what << ": every step after the first was prepared ahead";
    EXPECT_EQ(graph.optim().step_count(), k.precision == Precision::kFp16 ? eager.optim().step_count() : 8) << what;
    if (k.precision == Precision::kFp16)  // (which steps overflow depends on the card: compared, not fixed)
      std::printf("%s: %lld of 8 steps skipped, eager and graphed alike\n", what.c_str(),
                  static_cast<long long>(8 - eager.optim().step_count()));
    EXPECT_LE(worst, 1e-5) << what;
    expect_close(graph.optim().flat_params(), eager.optim().flat_params().cpu(), 1e-5, what + ": weights");
    expect_close(graph.optim().flat_ema(), eager.optim().flat_ema().cpu(), 1e-5, what + ": EMA");
    std::printf("%s: graphed losses within %.2e of eager's\n", what.c_str(), worst);
  }
  TempDir dir;
  RunConfig cfg = on(tiny("dit"), "cuda");
  cfg.train.deterministic = true;
  RunConfig graphed = cfg;
  graphed.train.cuda_graphs = true;
  ASSERT_EQ(train_ranks(1, {cfg}, dir / "eager"), std::vector<std::string>{""});
  ASSERT_EQ(train_ranks(1, {graphed}, dir / "a"), std::vector<std::string>{""});
  ASSERT_EQ(train_ranks(1, {graphed}, dir / "b"), std::vector<std::string>{""});
  expect_same_training(dir / "a", dir / "eager", "ddm train with train.cuda_graphs against without", 1e-5);
  EXPECT_EQ(losses(dir / "a"), losses(dir / "b"));
  EXPECT_EQ(max_weight_difference(final_weights(dir / "a"), final_weights(dir / "b")), 0.0);
}

// Sampling is a chain of network evaluations: 10 Euler steps with guidance, and 10 ancestral DDPM
// steps whose noise is drawn on the CPU and moved; the GPU's images equal the CPU's within 1e-3.
TEST(Gpu, SamplingOnCudaGivesTheCpusImages) {
  if (no_gpu()) GTEST_SKIP() << kNoGpu;
  configure_math(torch::kCUDA, /*deterministic=*/false);  // TF32 off
  for (const std::string name : {"unet-tiny", "dit-tiny"}) {
    ModelConfig m;
    m.in_channels = 1, m.image_size = 28, m.num_classes = 10, m.preset = name;
    apply_preset(name, m);
    torch::manual_seed(5);
    Net cpu = make_net(m);
    {
      torch::NoGradGuard no_grad;
      for (auto& p : cpu->parameters()) p.normal_(0.0, 0.05);
    }
    Net gpu = make_net(m);
    {
      torch::NoGradGuard no_grad;
      const auto src = cpu->parameters(), dst = gpu->parameters();
      for (size_t i = 0; i < src.size(); ++i) dst[i].copy_(src[i]);
    }
    gpu->to(torch::kCUDA);
    cpu->eval(), gpu->eval();
    DiffusionConfig d;
    for (const char* sampler : {"euler", "ddpm"}) {
      GenerateOptions g;
      g.n = 8, g.batch_size = 8, g.seed = 3, g.per_class = 1;
      g.sample.sampler = sampler, g.sample.steps = 10, g.sample.cfg = 2.0;
      const Denoiser on_cpu(cpu, make_path(d), prediction_for(d), 10), on_gpu(gpu, make_path(d), prediction_for(d), 10);
      EXPECT_EQ(on_gpu.device().type(), torch::kCUDA);
      const Generated a = generate(on_cpu, 1, 28, g), b = generate(on_gpu, 1, 28, g);
      ASSERT_TRUE(b.images.is_cpu());
      const double diff = (a.images - b.images).abs().max().item<double>();
      EXPECT_LE(diff, 1e-3) << name << " " << sampler;
      std::printf("%s, %s: max |gpu - cpu| over the images %.2e\n", name.c_str(), sampler, diff);
    }
  }
}

// A network whose forward reads a value back to the host cannot be captured (the read is illegal on
// a capturing stream): --cuda-graphs says so once and runs it eagerly, with the eager outputs, and the
// failed capture leaves the caching allocator whole (LibTorch 2.11 does not end a failed capture's
// memory pool itself; left so, emptyCache() fails an internal assertion and out-of-memory retries stop
// freeing cached blocks). The training step's capture goes through the same CapturedGraph::capture.
TEST(Gpu, ANetworkThatCannotBeCapturedRunsEagerlyAndLeavesTheAllocatorWhole) {
  if (no_gpu()) GTEST_SKIP() << kNoGpu;
  struct Syncing : NetImpl {
    torch::Tensor w;
    Syncing() { w = register_parameter("w", torch::full({1}, 0.5)); }
    torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& /*t*/, const Cond& /*c*/) override {
      const double scale = x.abs().max().item<double>() > 1e9 ? 0.0 : 1.0;  // a host synchronization
      return x * w * scale;                                                 // [B, C, H, W]
    }
  };
  const torch::Device cuda(torch::kCUDA, 0);
  auto inner = std::make_shared<Syncing>();
  inner->to(cuda);
  auto graphed = std::make_shared<GraphedNetImpl>(inner);
  torch::NoGradGuard no_grad;
  const auto x = torch::randn({4, 1, 8, 8}, cuda), t = torch::rand({4}, cuda);
  for (int call = 0; call < 4; ++call)  // warm-up, the capture that fails, then eager calls
    EXPECT_TRUE(torch::equal(graphed->forward(x, t, Cond{}), inner->forward(x, t, Cond{}))) << "call " << call;
  EXPECT_EQ(graphed->graphs(), 0);
  EXPECT_EQ(graphed->replays(), 0);
  cuda_module().empty_cache();  // LibTorch's emptyCache: asserts where a capture was left under way
  const auto big = torch::ones({64, 1024, 1024}, cuda);  // 256 MiB from the default pool afterwards
  EXPECT_EQ(big.sum().item<double>(), 64.0 * 1024 * 1024);
}

// `ddm sample --cuda-graphs` (model/graphed_net.h): the network's forward replayed from CUDA graphs
// gives the images the eager forward gives (the same kernels: within 1e-5, and in practice equal), with
// guidance (a doubled batch), a last batch of another size (its own graph), self-conditioning (the
// first evaluation without an estimate, the rest with: two graphs), bf16 and fp16 (finite), and after
// the weights changed (bf16 graphs read weight casts made once, made again then); the graphs were replayed.
TEST(Gpu, SamplingFromCudaGraphsGivesTheEagerImages) {
  if (no_gpu()) GTEST_SKIP() << kNoGpu;
  for (const std::string name : {"unet-tiny", "dit-tiny"}) {
    ModelConfig m;
    m.in_channels = 1, m.image_size = 28, m.num_classes = 10, m.preset = name;
    apply_preset(name, m);
    m.self_cond = name == "dit-tiny";
    torch::manual_seed(5);
    Net net = make_net(m);
    {
      torch::NoGradGuard no_grad;
      for (auto& p : net->parameters()) p.normal_(0.0, 0.05);
    }
    net->to(torch::kCUDA);
    net->eval();
    auto graphed = std::make_shared<GraphedNetImpl>(net);
    DiffusionConfig d;
    for (const Precision precision : {Precision::kFp32, Precision::kBf16, Precision::kFp16}) {
      GenerateOptions g;
      g.n = 12, g.batch_size = 8, g.seed = 3, g.per_class = 1;  // batches of 8 and 4
      g.sample.steps = 6, g.sample.cfg = 2.0;
      Denoiser eager(net, make_path(d), prediction_for(d), 10), replayed(graphed, make_path(d), prediction_for(d), 10);
      eager.set_precision(precision);
      replayed.set_precision(precision);
      const Generated a = generate(eager, 1, 28, g), b = generate(replayed, 1, 28, g);
      const double diff = (a.images - b.images).abs().max().item<double>();
      const std::string what = name + " " + name_of(precision);
      EXPECT_LE(diff, 1e-5) << what;
      EXPECT_TRUE(torch::isfinite(a.images).all().item<bool>()) << what;
      std::printf("%s: max |graphed - eager| over the images %.2e (%lld graphs, %lld replays)\n", what.c_str(), diff,
                  static_cast<long long>(graphed->graphs()), static_cast<long long>(graphed->replays()));
    }
    // Weights changed after the graphs were captured: bf16 graphs read their weights' casts made once
    // (HeldWeightCasts), which are made again, so they sample the new weights as eager calls do.
    {
      torch::NoGradGuard no_grad;
      for (auto& p : net->parameters()) p.mul_(1.25);
    }
    GenerateOptions g;
    g.n = 8, g.batch_size = 8, g.seed = 3, g.per_class = 1;
    g.sample.steps = 6, g.sample.cfg = 2.0;
    Denoiser eager(net, make_path(d), prediction_for(d), 10), replayed(graphed, make_path(d), prediction_for(d), 10);
    eager.set_precision(Precision::kBf16);
    replayed.set_precision(Precision::kBf16);
    const int64_t replays = graphed->replays();
    const double diff = (generate(eager, 1, 28, g).images - generate(replayed, 1, 28, g).images).abs().max().item<double>();
    EXPECT_LE(diff, 1e-5) << name << " bf16, weights changed after capture";
    EXPECT_GT(graphed->replays(), replays) << name;
    std::printf("%s bf16, weights changed after capture: max |graphed - eager| %.2e\n", name.c_str(), diff);
    EXPECT_GE(graphed->graphs(), 2) << name;
    EXPECT_GT(graphed->replays(), 0) << name;
  }
}

// Decentralized sampling on the GPU: two experts and a router (trained on the CPU, 600 images of
// Fashion-MNIST), assembled; the routed ensemble on CUDA gives the CPU's samples within 1e-3 under
// `full` routing (mixture weights continuous in the router's probabilities; top-1 could flip a
// near-tie) and under the exact posterior (`oracle`, its [B, N] product on the GPU); with --cuda-graphs
// (padded expert groups) it gives the eager images; bf16 stays close;
// a student distilled from it on CUDA trains what it trains on the CPU.
TEST(Gpu, ARoutedEnsembleSamplesOnCudaAsOnTheCpu) {
  if (no_gpu()) GTEST_SKIP() << kNoGpu;
  TempDir dir;
  // Fashion-MNIST where scripts/gpu-check.sh carried it (DDM_FASHION_MNIST), else Debian's.
  const char* carried = std::getenv("DDM_FASHION_MNIST");
  const std::string root = carried && *carried ? carried : kFashionMnistRoot;
  write_text(dir / "tiny.toml",
             "[data]\nlimit = 600\nroot = \"" + root + "\"\n[model]\nchannels = 8\nchannel_mult = [1, 2]\ngroups = 4\n"
             "[train]\nsteps = 6\nbatch_size = 16\nthreads = 1\nlog_every = 2\nckpt_every = 6\n");
  ASSERT_EQ(run_ddm("partition --limit 600 --k 2 --fine 20 --data-root " + root + " --out " + (dir / "p")).exit_code, 0);
  const std::string cfg = " --config " + (dir / "tiny.toml") + " --partition " + (dir / "p");
  for (const char* k : {"0", "1"})
    ASSERT_EQ(run_ddm("train --quiet" + cfg + " --expert " + k + " --out " + (dir / "e") + k).exit_code, 0);
  CommandResult r = run_ddm("train-router --quiet" + cfg + " --preset router-conv-tiny --holdout 100 --set "
                            "train.steps=20 --out " + (dir / "r"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = run_ddm("ensemble --out " + (dir / "ens") + " --partition " + (dir / "p") + " --router " + (dir / "r") +
              " --expert " + (dir / "e0") + " --expert " + (dir / "e1"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto samples = [&](const std::string& name, const std::string& flags) {
    const CommandResult s = run_ddm("sample --ensemble " + (dir / "ens") + " --n 20 --steps 4 --cfg 2 " + flags +
                                    " --out " + (dir / (name + ".png")) + " --raw " + (dir / (name + ".safetensors")));
    EXPECT_EQ(s.exit_code, 0) << s.output;
    return load_safetensors(dir / (name + ".safetensors")).tensors.at("samples");
  };
  for (const char* routing : {"full", "oracle"}) {
    const auto cpu = samples(std::string("cpu-") + routing, std::string("--device cpu --routing ") + routing);
    const auto gpu = samples(std::string("gpu-") + routing, std::string("--device cuda --routing ") + routing);
    const double diff = (cpu - gpu).abs().max().item<double>();
    EXPECT_LE(diff, 1e-3) << routing;
    std::printf("ensemble, routing %s: max |gpu - cpu| over the samples %.2e\n", routing, diff);
  }
  // The experts and the router replayed from CUDA graphs, each expert's group padded to a multiple of
  // batch / 4K rows (graphed_group_quantum): the eager images within float32 rounding (another batch size can pick
  // another cuBLAS kernel), under top-1 (groups that change size from step to step) and full routing.
  // Under top-1 a near-tie in the router's choice may flip on such rounding and change that one
  // sample: at least 18 of the 20 within 1e-3.
  for (const char* routing : {"top1", "full"}) {
    const auto eager = samples(std::string("gpu-") + routing + "-eager", std::string("--device cuda --routing ") + routing);
    const auto graphed =
        samples(std::string("gpu-") + routing + "-graphs", std::string("--device cuda --cuda-graphs --routing ") + routing);
    const torch::Tensor per_sample = (eager - graphed).abs().flatten(1).amax(1);  // [20]
    const int64_t close = per_sample.le(1e-3).sum().item<int64_t>();
    EXPECT_GE(close, std::string(routing) == "top1" ? 18 : 20) << routing;
    std::printf("ensemble, routing %s, --cuda-graphs: max |graphed - eager| per sample: median %.2e, max %.2e; %lld of "
                "20 within 1e-3\n",
                routing, per_sample.median().item<double>(), per_sample.max().item<double>(), static_cast<long long>(close));
  }
  // Experts on Stable Diffusion's discrete schedule (eps) under the router trained on the flow path:
  // each step's times are matched between the two paths on the host (a loop over them), and the
  // results sent back to the GPU.
  for (const char* k : {"0", "1"})
    ASSERT_EQ(run_ddm("train --quiet" + cfg + " --expert " + k + " --set diffusion.objective=eps --set "
                      "diffusion.schedule=discrete --out " + (dir / "d") + k).exit_code, 0);
  r = run_ddm("ensemble --out " + (dir / "ens-discrete") + " --partition " + (dir / "p") + " --router " + (dir / "r") +
              " --expert " + (dir / "d0") + " --expert " + (dir / "d1"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  {
    auto discrete = [&](const std::string& device) {
      const std::string name = "discrete-" + device;
      const CommandResult s = run_ddm("sample --ensemble " + (dir / "ens-discrete") + " --n 20 --steps 4 --cfg 2 --routing "
                                      "full --device " + device + " --out " + (dir / (name + ".png")) + " --raw " +
                                      (dir / (name + ".safetensors")));
      EXPECT_EQ(s.exit_code, 0) << s.output;
      return load_safetensors(dir / (name + ".safetensors")).tensors.at("samples");
    };
    const double diff = (discrete("cpu") - discrete("cuda")).abs().max().item<double>();
    EXPECT_LE(diff, 1e-3);
    std::printf("ensemble of discrete-schedule experts under a flow router: max |gpu - cpu| %.2e\n", diff);
  }
  const auto fp32 = samples("gpu-full-fp32", "--device cuda --routing full");
  const auto bf16 = samples("gpu-full-bf16", "--device cuda --routing full --precision bf16");
  const double mean = (fp32 - bf16).abs().mean().item<double>();
  EXPECT_TRUE(torch::isfinite(bf16).all().item<bool>());
  EXPECT_GT(mean, 0.0) << "bf16 sampled exactly what fp32 did: autocast was not on";
  EXPECT_LE(mean, 5e-2);
  std::printf("ensemble in bf16 against fp32 on cuda: mean |difference| %.2e\n", mean);
  // Distillation with this ensemble as the teacher: a student on CUDA (its teacher moved there at
  // the first step) trains what it trains on the CPU.
  const std::string distill = "distill --quiet --ensemble " + (dir / "ens") + " --set train.steps=6 --set train.log_every=1 ";
  r = run_ddm(distill + "--set train.device=cpu --out " + (dir / "s-cpu"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = run_ddm(distill + "--set train.device=cuda --out " + (dir / "s-gpu"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  expect_same_training(dir / "s-gpu", dir / "s-cpu", "distillation on cuda against the cpu");
}

namespace {
// A unet-tiny expert for 28 x 28 grey images of 10 classes, random (N(0, 0.05) weights from `seed`),
// on the GPU in eval mode.
Net random_unet_tiny_on_cuda(uint64_t seed) {
  ModelConfig m;
  m.in_channels = 1, m.image_size = 28, m.num_classes = 10, m.preset = "unet-tiny";
  apply_preset("unet-tiny", m);
  torch::manual_seed(seed);
  Net net = make_net(m);
  {
    torch::NoGradGuard no_grad;
    for (auto& p : net->parameters()) p.normal_(0.0, 0.05);
  }
  net->to(torch::kCUDA);
  net->eval();
  return net;
}

// A router over k experts whose probabilities a fixed random projection of x_t (from `seed`) tilts,
// so that samples spread over the experts and their groups change from step to step.
RouterFn tilted_router(int64_t k, uint64_t seed) {
  torch::manual_seed(seed);
  const torch::Tensor proj = (3.0 * torch::randn({28 * 28, k})).to(torch::kCUDA);  // [HW, K]
  return [proj](const torch::Tensor& x, const torch::Tensor&, const Cond&) {
    return torch::softmax(torch::mm(x.flatten(1).to(torch::kFloat), proj), 1);  // [B, K]
  };
}
}  // namespace

// Experts side by side (Ensemble::set_side_by_side: each expert's group on a CUDA stream of its own,
// the weighted estimates added on the caller's stream in the experts' order) give the bits of the
// experts run one after another: eager and from CUDA graphs (each run with graphs of its own, captured
// in that mode: side by side first), fp32 and bf16, under top-1 routing (disjoint groups whose sizes
// change from step to step) and top-2 (each row in two groups), with guidance. Three random unet-tiny
// experts on 96 images, a router that a fixed random projection of x_t tilts. cuDNN's benchmark mode
// is off here so that every run takes the same convolution algorithms.
TEST(Gpu, EnsembleExpertsSideBySideGiveTheBitsOfOneAfterAnother) {
  if (no_gpu()) GTEST_SKIP() << kNoGpu;
  configure_math(torch::kCUDA, /*deterministic=*/false);  // TF32 off, as `ddm sample`
  struct BenchmarkOff {
    bool was = at::globalContext().benchmarkCuDNN();
    BenchmarkOff() { at::globalContext().setBenchmarkCuDNN(false); }
    ~BenchmarkOff() { at::globalContext().setBenchmarkCuDNN(was); }
  } benchmark_off;
  const int64_t k = 3, n = 96;
  std::vector<Net> nets;
  for (int64_t e = 0; e < k; ++e) nets.push_back(random_unet_tiny_on_cuda(static_cast<uint64_t>(10 + e)));
  const RouterFn router = tilted_router(k, 99);
  DiffusionConfig d;
  for (const bool graphs : {false, true}) {
    for (const Precision precision : {Precision::kFp32, Precision::kBf16}) {
      for (const char* routing : {"top1", "topk:2"}) {
        const std::string what = std::string(graphs ? "graphs " : "eager ") +
                                 (precision == Precision::kBf16 ? "bf16 " : "fp32 ") + routing;
        auto sample = [&](bool side) {
          std::vector<std::optional<Denoiser>> experts;
          std::vector<std::shared_ptr<GraphedNetImpl>> graphed;
          for (const Net& net : nets) {
            Net run_net = net;
            if (graphs) run_net = graphed.emplace_back(std::make_shared<GraphedNetImpl>(net, graphed_expert_graphs(k)));
            experts.emplace_back(Denoiser(run_net, make_path(d), prediction_for(d), 10));
            experts.back()->set_precision(precision);
          }
          Ensemble ens(std::move(experts), std::vector<double>(k, 1.0), router, 0.0, make_path(d), 10,
                       parse_routing(routing), 0, torch::kCUDA);
          if (graphs) ens.set_group_quantum(graphed_group_quantum(n, k));
          ens.set_side_by_side(side);
          GenerateOptions g;
          g.n = n, g.batch_size = n, g.seed = 4, g.per_class = 10;
          g.sample.steps = 6, g.sample.cfg = 2.0;
          const Denoiser den = ens.denoiser();
          const torch::Tensor first = generate(den, 1, 28, g).images;
          const torch::Tensor second = generate(den, 1, 28, g).images;  // graphs replay what the first captured
          EXPECT_TRUE(torch::equal(first, second)) << what << (side ? " side by side" : " one after another")
                                                   << ": two runs differ by " << (first - second).abs().max().item<double>();
          int64_t replays = 0;
          for (const auto& gn : graphed) replays += gn->replays();
          if (graphs) {
            EXPECT_GT(replays, 0) << what << ": no expert was replayed from a graph";
          }
          return std::make_pair(first, ens.usage().expert_evals);
        };
        const auto [side, side_evals] = sample(true);  // first: its graphs captured side by side
        const auto [apart, apart_evals] = sample(false);
        EXPECT_EQ(side_evals, apart_evals) << what;
        int used = 0;
        for (int64_t evals : side_evals) used += evals > 0;
        EXPECT_GE(used, 2) << what << ": the router sent the samples to fewer than two experts";
        const bool same = torch::equal(side, apart);
        EXPECT_TRUE(same) << what << ": max |side by side - one after another| " << (side - apart).abs().max().item<double>();
        std::printf("ensemble %s: side by side and one after another %s (expert evaluations %s)\n", what.c_str(),
                    same ? "equal bit for bit" : "DIFFER", c10::str(side_evals).c_str());
      }
    }
  }
}

// An ensemble whose experts run out of GPU memory side by side goes on one expert at a time (said
// once on stderr) and gives the images of one at a time from the start, with the same usage counts:
// two bf16 unet-tiny experts, the second of which throws c10::OutOfMemoryError, as the caching
// allocator does, whenever it is called on a stream other than the test's (that is, side by side),
// after the first has run there (its counts and weight casts made side by side, then dropped or read
// on the test's stream).
TEST(Gpu, AnEnsembleOutOfMemorySideBySideGoesOnOneExpertAtATime) {
  if (no_gpu()) GTEST_SKIP() << kNoGpu;
  configure_math(torch::kCUDA, /*deterministic=*/false);
  DiffusionConfig d;
  void* const main_stream = cuda_module().current_stream(0);
  std::vector<Denoiser> inner;
  for (int64_t e = 0; e < 2; ++e) {
    inner.emplace_back(random_unet_tiny_on_cuda(static_cast<uint64_t>(20 + e)), make_path(d), prediction_for(d), 10);
    inner.back().set_precision(Precision::kBf16);
  }
  const RouterFn router = tilted_router(2, 98);
  auto sample = [&](bool side) {
    std::vector<std::optional<Denoiser>> experts;
    for (size_t e = 0; e < inner.size(); ++e) {
      const Denoiser den = inner[e];
      experts.emplace_back(Denoiser(
          [den, e, main_stream](const torch::Tensor& x, const torch::Tensor& t, const Cond& y, double w,
                                const torch::Tensor&) {
            TORCH_CHECK_WITH(OutOfMemoryError, e == 0 || cuda_module().current_stream(0) == main_stream,
                             "CUDA out of memory (the test's expert 1, called side by side)");
            return den.estimate(x, t, y, w);
          },
          den.path(), 10, torch::kCUDA));
    }
    Ensemble ens(std::move(experts), {1.0, 1.0}, router, 0.0, make_path(d), 10, parse_routing("top1"), 0, torch::kCUDA);
    ens.set_side_by_side(side);
    GenerateOptions g;
    g.n = 40, g.batch_size = 40, g.seed = 6, g.per_class = 4;
    g.sample.steps = 4, g.sample.cfg = 2.0;
    testing::internal::CaptureStderr();
    torch::Tensor images;
    try {
      images = generate(ens.denoiser(), 1, 28, g).images;
    } catch (...) {
      std::fprintf(stdout, "%s", testing::internal::GetCapturedStderr().c_str());
      throw;
    }
    const std::string err = testing::internal::GetCapturedStderr();
    return std::make_tuple(images, ens.usage().expert_evals, ens.usage().calls, err);
  };
  const auto [fell_back, fell_back_evals, fell_back_calls, fell_back_err] = sample(true);
  const auto [in_turn, in_turn_evals, in_turn_calls, in_turn_err] = sample(false);
  EXPECT_TRUE(torch::equal(fell_back, in_turn)) << (fell_back - in_turn).abs().max().item<double>();
  EXPECT_EQ(fell_back_evals, in_turn_evals);
  ASSERT_EQ(in_turn_evals.size(), 2u);
  EXPECT_GT(in_turn_evals[0], 0) << "the router sent no sample to expert 0";
  EXPECT_GT(in_turn_evals[1], 0) << "the router sent no sample to expert 1";
  EXPECT_EQ(fell_back_calls, in_turn_calls);
  const std::string said = "out of GPU memory with the experts side by side";
  const size_t at = fell_back_err.find(said);
  EXPECT_NE(at, std::string::npos) << fell_back_err;
  EXPECT_EQ(fell_back_err.find(said, at + 1), std::string::npos) << "said more than once: " << fell_back_err;
  EXPECT_EQ(in_turn_err.find(said), std::string::npos) << in_turn_err;
  std::printf("ensemble out of memory side by side: went on one at a time, images equal to one at a time: %s\n",
              torch::equal(fell_back, in_turn) ? "yes" : "NO");
}

// Evaluation with the feature network on the GPU: 500 training images scored against the test
// split (reference features cached by the CPU run) give the CPU's FD-fmnist and KID within float32
// rounding of the features; `ddm partition --device cuda` with feature-network features runs there.
TEST(Gpu, EvaluationAndPartitionFeaturesOnCuda) {
  if (no_gpu()) GTEST_SKIP() << kNoGpu;
  TempDir dir;
  const char* carried = std::getenv("DDM_FASHION_MNIST");
  const std::string root = carried && *carried ? carried : kFashionMnistRoot;
  const std::string eval = "eval --anchor train --n 500 --data-root " + root + " --cache-dir " + (dir / "cache");
  const CommandResult cpu = run_ddm(eval + " --device cpu --out " + (dir / "cpu"));
  ASSERT_EQ(cpu.exit_code, 0) << cpu.output;
  const CommandResult gpu = run_ddm(eval + " --device cuda --out " + (dir / "gpu"));
  ASSERT_EQ(gpu.exit_code, 0) << gpu.output;
  const auto json_in = [](const std::string& d) {
    for (const auto& e : std::filesystem::directory_iterator(d))
      if (e.path().extension() == ".json") return read_text(e.path().string());
    return std::string();
  };
  const auto number = [](const std::string& text, const std::string& key) {
    const size_t at = text.find("\"" + key + "\":");
    EXPECT_NE(at, std::string::npos) << key << " in " << text;
    return at == std::string::npos ? 0.0 : std::stod(text.substr(at + key.size() + 3));
  };
  const std::string a = json_in(dir / "cpu"), b = json_in(dir / "gpu");
  // FD within 1e-3 of itself. KID is a difference of kernel means that are each >= 1 (the kernel is
  // (x.y/d + 1)^3 on non-negative features) and nearly cancel (KID ~ 2e-4 here), so the features'
  // float32 rounding moves it relative to those means, not to KID: within 1e-4 absolute (an H100
  // gave 8e-6, FD 1.6e-4 relative).
  for (const char* key : {"fd_fmnist", "kid_mean"}) {
    const double x = number(a, key), y = number(b, key);
    const double tolerance = std::string(key) == "kid_mean" ? 1e-4 : 1e-3 * std::abs(x);
    EXPECT_LE(std::abs(x - y), tolerance) << key << ": cpu " << x << ", gpu " << y;
    std::printf("eval, %s: cpu %.6g, gpu %.6g\n", key, x, y);
  }
  const CommandResult part = run_ddm("partition --limit 2000 --k 4 --fine 32 --features feature-net --device cuda "
                                     "--data-root " + root + " --out " + (dir / "p"));
  ASSERT_EQ(part.exit_code, 0) << part.output;
  EXPECT_TRUE(std::filesystem::exists(dir / "p/partition.safetensors"));
}

// Training on CUDA from shards: the loader writes its batches in page-locked memory, so the copy to
// the device is asynchronous (an H100 waited 5% of each dit-small step for pageable staging copies).
// The pinned batches (images, labels and a router's clusters) hold what the pageable ones hold, in
// the same order, and arrive on the device intact.
TEST(Gpu, ShardBatchesArePinnedForCudaAndHoldTheSameSamples) {
  if (no_gpu()) GTEST_SKIP() << kNoGpu;
  test::TempDir dir;
  torch::manual_seed(5);
  Dataset data;
  data.images = torch::randint(0, 256, {29, 3, 10, 12}, torch::kUInt8);
  data.labels = torch::arange(29, torch::kInt64).remainder(7);
  data.num_classes = 7;
  const ShardsWritten w = write_shards(data, dir.path, 6, "s");
  const auto index = std::make_shared<const ShardIndex>(scan_shards(expand_shards(w.pattern, "data.root"), false, 2, "data.root"));
  ShardOrder order;
  order.seed = 4, order.shuffle_buffer = 5;
  ShardLoaderOptions o;
  o.batch = 8, o.resolution = 8, o.channels = 3, o.hflip = true, o.threads = 2;
  auto clusters = std::make_shared<std::vector<int64_t>>();  // a router's targets, by position
  for (int64_t i = 0; i < 29; ++i) clusters->push_back(i % 3);
  o.clusters = clusters;
  ShardLoader pageable(index, order, o);
  o.pin = true;
  ShardLoader pinned(index, order, o);
  for (int i = 0; i < 9; ++i) {  // over two epochs
    const Batch a = pageable.next(), b = pinned.next();
    EXPECT_FALSE(a.x.is_pinned());
    ASSERT_TRUE(b.x.is_pinned() && b.y.is_pinned() && b.k.is_pinned()) << "batch " << i;
    EXPECT_TRUE(torch::equal(a.x, b.x)) << "batch " << i;
    EXPECT_TRUE(torch::equal(a.y, b.y)) << "batch " << i;
    EXPECT_TRUE(torch::equal(a.k, b.k)) << "batch " << i;
    const Batch on = b.to(torch::Device(torch::kCUDA));
    EXPECT_TRUE(on.x.is_cuda() && on.k.is_cuda());
    EXPECT_TRUE(torch::equal(on.x.cpu(), a.x)) << "batch " << i;
    EXPECT_TRUE(torch::equal(on.y.cpu(), a.y)) << "batch " << i;
    EXPECT_TRUE(torch::equal(on.k.cpu(), a.k)) << "batch " << i;
  }
}
