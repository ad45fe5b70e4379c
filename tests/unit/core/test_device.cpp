// Device selection (core/device.h) without a GPU: the rule for auto / cpu / cuda / cuda:N on
// machines of 0, 1 and 4 GPUs given as counts, and a clear error for every spelling or device the
// machine lacks; where no NVIDIA driver is present, none of LibTorch's CUDA half is loaded.
#include <cstdlib>
#include <fstream>
#include <optional>
#include <sstream>
#include <gtest/gtest.h>

#include <torch/cuda.h>

#include "core/config.h"
#include "core/cuda_module.h"
#include "core/device.h"
#include "model/ops.h"
#include "test_util.h"
#include "unit/test_dist_util.h"

namespace {

using namespace ddm;
using ddm::test::error_message;
using ddm::test::has;

TEST(Device, AutoTakesTheLocalRanksGpuOrTheCpu) {
  EXPECT_EQ(resolve_device("auto", 0, 0, "k"), torch::Device(torch::kCPU));
  EXPECT_EQ(resolve_device("auto", 3, 0, "k"), torch::Device(torch::kCPU));
  EXPECT_EQ(resolve_device("auto", 0, 1, "k"), torch::Device(torch::kCUDA, 0));
  EXPECT_EQ(resolve_device("auto", 3, 4, "k"), torch::Device(torch::kCUDA, 3));
  EXPECT_EQ(resolve_device("cuda", 2, 4, "k"), torch::Device(torch::kCUDA, 2));
  EXPECT_EQ(resolve_device("cuda:1", 3, 4, "k"), torch::Device(torch::kCUDA, 1));
  EXPECT_EQ(resolve_device("cpu", 0, 4, "k"), torch::Device(torch::kCPU));
}

TEST(Device, AGpuTheMachineLacksOrABadSpellingIsAClearError) {
  EXPECT_TRUE(has(error_message([] { resolve_device("cuda", 0, 0, "train.device"); }),
                  "train.device = cuda, but this machine has no CUDA GPU that LibTorch can use"));
  EXPECT_TRUE(has(error_message([] { resolve_device("cuda:0", 0, 0, "--device"); }), "--device = cuda:0, but this machine has no CUDA GPU"));
  EXPECT_TRUE(has(error_message([] { resolve_device("cuda:2", 0, 2, "train.device"); }),
                  "train.device = cuda:2, but this machine has 2 CUDA GPUs (cuda:0..1)"));
  const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
  const std::string saved = visible ? visible : "";
  unsetenv("CUDA_VISIBLE_DEVICES");
  EXPECT_TRUE(has(error_message([] { resolve_device("auto", 2, 1, "rank 2: train.device"); }),
                  "rank 2: train.device = auto gives each process of a node its own GPU, but this is local rank 2 on a "
                  "machine with 1 CUDA GPU: launch at most 1 process per node, or name one GPU (cuda:N)"));
  // Slurm's --gpus-per-task shows each task one GPU: the message says so and what to ask for instead.
  setenv("CUDA_VISIBLE_DEVICES", "3", 1);
  EXPECT_TRUE(has(error_message([] { resolve_device("auto", 2, 1, "rank 2: train.device"); }),
                  "local rank 2 on a machine with 1 CUDA GPU (CUDA_VISIBLE_DEVICES=3 shows this process one GPU: "
                  "Slurm's --gpus-per-task and --gpu-bind give each task its own; ask for --gpus-per-node instead"));
  EXPECT_EQ(resolve_device("auto", 0, 1, "k"), torch::Device(torch::kCUDA, 0));  // local rank 0 takes the one it sees
  if (visible) setenv("CUDA_VISIBLE_DEVICES", saved.c_str(), 1); else unsetenv("CUDA_VISIBLE_DEVICES");
  for (const char* bad : {"gpu", "CUDA", "cuda:", "cuda:x", "cuda:-1", "cuda:123456", " cpu", ""})
    EXPECT_TRUE(has(error_message([&] { check_device_spec(bad, "train.device"); }),
                    "is not one of: auto, cpu, cuda, cuda:N"))
        << bad;
  for (const char* good : {"auto", "cpu", "cuda", "cuda:0", "cuda:15"}) EXPECT_EQ(error_message([&] { check_device_spec(good, "k"); }), "");
}

TEST(Device, TheConfigKeyIsCheckedAsTheConfigIsRead) {
  EXPECT_EQ(parse_config("", "t.toml").train.device, "auto");
  EXPECT_EQ(parse_config("", "t.toml", {"train.device=cuda:1"}).train.device, "cuda:1");
  EXPECT_TRUE(has(error_message([] { validate(parse_config("[train]\ndevice = \"gpu\"\n", "t.toml")); }),
                  "train.device = \"gpu\" is not one of: auto, cpu, cuda, cuda:N"));
}

// A process on a machine without an NVIDIA driver (CI's) loads no part of LibTorch's CUDA half
// (core/cuda_module.h): not libddm_cuda.so, not libtorch_cuda. LibTorch then answers as a CPU build,
// and asking for CUDA names why.
TEST(Device, WithoutADriverNothingOfCudaIsLoaded) {
  if (cuda_loaded()) GTEST_SKIP() << "this process loaded CUDA (" << cuda_status() << ")";
  if (std::getenv("DDM_CUDA") == nullptr) {
    EXPECT_TRUE(has(cuda_status(), "not loaded: no NVIDIA driver here")) << cuda_status();
  }
  std::ifstream in("/proc/self/maps");
  std::stringstream maps;
  maps << in.rdbuf();
  EXPECT_FALSE(has(maps.str(), "libtorch_cuda.so"));
  EXPECT_FALSE(has(maps.str(), "libddm_cuda.so"));
  EXPECT_EQ(torch::cuda::device_count(), 0u);
  EXPECT_TRUE(has(error_message([] { resolve_device("cuda", 0, "train.device"); }),
                  "train.device = cuda, but this machine has no CUDA GPU that LibTorch can use (CUDA not loaded: "))
      << error_message([] { resolve_device("cuda", 0, "train.device"); });
  EXPECT_TRUE(has(error_message([] { cuda_module(); }), "CUDA is needed here, but LibTorch's CUDA libraries are not loaded"));
}

// AutocastWeightCache (a sampler's steps): a weight's bfloat16 cast, made in the first Autocast region,
// is what later regions use until the scope ends; AutocastCacheOff (a CUDA graph's capture) casts afresh.
// Seen by changing the weight in place between regions: only a fresh cast sees the change.
TEST(Device, AutocastWeightCacheKeepsAWeightsCastAcrossRegions) {
  torch::manual_seed(3);
  torch::nn::Linear lin(16, 8);
  const auto x = torch::randn({4, 16});                             // [4, 16]
  const torch::NoGradGuard no_grad;
  auto forward = [&] {
    const Autocast autocast(torch::kCPU, Precision::kBf16);
    return apply_linear(lin, x);  // [4, 8] bfloat16 (nn::Linear's own forward casts a view, W^T, every call)
  };
  auto changed_between = [&](bool cache, bool off) {
    const auto w = lin->weight.clone();
    torch::Tensor before, after;
    {
      std::optional<AutocastWeightCache> scope;
      if (cache) scope.emplace();
      std::optional<AutocastCacheOff> fresh;
      if (off) fresh.emplace();
      before = forward();
      lin->weight.add_(1.0);
      after = forward();
    }
    lin->weight.copy_(w);
    return !torch::equal(before, after);
  };
  EXPECT_TRUE(changed_between(false, false));  // each region casts the weight again
  EXPECT_FALSE(changed_between(true, false));  // the scope's first cast serves both regions
  EXPECT_TRUE(changed_between(true, true));    // the cache off: cast afresh inside the scope too
  EXPECT_TRUE(changed_between(false, false));  // the scope's end dropped its casts
}

}  // namespace
