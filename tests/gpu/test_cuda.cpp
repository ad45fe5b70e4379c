// GPU checks (label `gpu`): each skips, saying why, where no CUDA GPU is present (CI), and runs on
// a GPU machine (scripts/gpu-check.sh). They check that the LibTorch ddm builds against runs CUDA
// tensors: a matmul and every backbone preset's forward and backward on the GPU equal the CPU's
// within float32 rounding (TF32 off: cuBLAS and cuDNN then compute in float32, in another order).
#include <gtest/gtest.h>

#include <cstdio>

#include <torch/cuda.h>
#include <torch/torch.h>

#include "core/presets.h"
#include "model/net.h"

using namespace ddm;

namespace {
bool no_gpu() { return !torch::cuda::is_available(); }
constexpr const char* kNoGpu = "no CUDA GPU on this machine";

// Float32 arithmetic in another order: relative differences of a few ulps per accumulation, so the
// bound grows with the reduction length (here up to a few thousand terms through several layers).
void expect_close(const torch::Tensor& gpu, const torch::Tensor& cpu, double rtol, const std::string& what) {
  const auto g = gpu.cpu().to(torch::kDouble), c = cpu.to(torch::kDouble);
  const double scale = c.abs().max().item<double>() + 1e-30;
  const double diff = (g - c).abs().max().item<double>();
  EXPECT_LE(diff / scale, rtol) << what << ": max |gpu - cpu| = " << diff << " of max |cpu| = " << scale;
  std::printf("%s: max |gpu - cpu| / max |cpu| = %.2e (bound %.0e)\n", what.c_str(), diff / scale, rtol);
}
}  // namespace

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
